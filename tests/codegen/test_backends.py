"""Backends are objects (``coconet.codegen.backends``): one per module, found by name, and what the lowering
writes and the tuner asks of the machine come from them. A registry with one more backend is chosen from and
read topology files with no other change; no code outside the package decides by a backend's name."""

import ast
import runpy
from dataclasses import replace
from pathlib import Path

import pytest

from coconet.codegen import backends
from coconet.codegen.backends import Machine
from coconet.codegen.lower import lower
from coconet.errors import BackendError, TopologyError
from coconet.schedules.schedule import Schedule
from coconet.tuner.cluster import ONE_NODE
from coconet.tuner.topology import ALGORITHMS, from_dict
from coconet.tuner.tune import local_backends

ROOT = Path(__file__).parents[2]


def test_every_backend_is_found_by_its_name_and_an_unknown_one_is_refused_naming_them():
    assert backends.BACKENDS == ("gloo", "nccl", "shm")
    for name in backends.BACKENDS:
        assert backends.get(name).name == name
    with pytest.raises(BackendError, match=r"unknown backend 'mpi' \(use gloo, nccl, shm\)"):
        backends.get("mpi")


@pytest.mark.parametrize("name", backends.BACKENDS)
def test_a_module_says_what_its_backend_runs_on_and_where_its_tensors_are(name):
    b = backends.get(name)
    program = runpy.run_path(str(ROOT / "examples" / "adam.py"))["program"].ir
    src = lower(Schedule.parse("split(ar0); reorder(ag0); fuse_collective(rs0)", program), name).source
    assert f"for {b.doc}." in src and f"_c = _Ctx(group, {b.device})" in src
    assert all(line in src for line in b.notes)
    assert ("_Shm.of(group" in src) == b.shared_memory
    assert ("from coconet.kernels.shm import" in src) == (b.runtime == "shm")


def test_what_a_backend_needs_of_the_machine():
    assert ONE_NODE == {b for b in backends.BACKENDS if backends.get(b).one_node} == {"shm"}
    assert backends.get("nccl").device_type == "cuda" and backends.get("shm").process_group == "gloo"
    assert backends.get("shm").transport == "gloo" and backends.get("nccl").transport == "nccl"


# A backend no module ships: ranks sharing one node of a RISC-V machine, otherwise gloo. A registry with it is
# built, not registered: the shipped one (backends.REGISTRY) is a value no test changes.
TOY = replace(backends.get("gloo"), name="toy", one_node=True, architectures=frozenset({"riscv64"}))
WITH_TOY = backends.REGISTRY.adding(TOY)


def test_a_registry_with_a_new_backend_leaves_the_shipped_one_as_it_is():
    assert WITH_TOY.names == ("gloo", "nccl", "shm", "toy") and backends.REGISTRY.names == backends.BACKENDS
    assert WITH_TOY.get("toy") is TOY and WITH_TOY.on("cpu") == ("gloo", "shm", "toy")
    with pytest.raises(BackendError, match="unknown backend 'toy'"):
        backends.get("toy")
    with pytest.raises(BackendError, match="backend gloo registered twice"):
        backends.REGISTRY.adding(backends.get("gloo"))


@pytest.mark.parametrize(
    ("machine", "world", "shipped", "with_toy"),
    [
        (Machine("x86_64"), 2, ("gloo", "shm"), ("gloo", "shm")),
        (Machine("riscv64"), 2, ("gloo",), ("gloo", "toy")),  # shm's barriers need x86's memory order
        (Machine("x86_64", gpus=4), 4, ("nccl",), ("nccl",)),  # a GPU per rank: CPU tensors would leave them idle
        (Machine("riscv64", gpus=2), 4, ("gloo",), ("gloo", "toy")),  # too few GPUs: the CPU backends
    ],
)
def test_the_backends_this_machine_runs_are_chosen_by_their_facts(machine, world, shipped, with_toy):
    assert local_backends(world, machine) == shipped
    assert local_backends(world, machine, WITH_TOY) == with_toy


def test_a_new_gpu_backend_is_chosen_beside_nccl():
    fused = replace(backends.get("nccl"), name="fused")
    assert local_backends(8, Machine("aarch64", gpus=8), backends.REGISTRY.adding(fused)) == ("nccl", "fused")


def topology(backends_named, **over):
    doc = {
        "name": "t",
        "device": "cpu",
        "nodes": 1,
        "ranks_per_node": 2,
        "backends": backends_named,
        "links": {"intra": {"alpha_s": 1e-5, "bandwidth_GBps": 2}, "inter": {"alpha_s": 1e-5, "bandwidth_GBps": 1}},
        "memory_bandwidth_GBps": 10,
        "matmul_TFLOPS": {"float32": 0.1},
    }
    return {**doc, **over}


def test_a_topology_file_may_name_a_backend_of_the_registry_it_is_read_with():
    doc = topology(["gloo", "toy"], measured={"toy": {"allreduce": {"alpha_s": 1e-5, "beta_s_per_byte": 1e-9}}})
    assert from_dict(doc, "t.yaml", WITH_TOY).backends == ("gloo", "toy")
    with pytest.raises(TopologyError, match=r"t.yaml: backends\[1\]: must be 'gloo', 'nccl' or 'shm', got 'toy'"):
        from_dict(doc, "t.yaml")
    with pytest.raises(TopologyError, match="measured.toy: must be 'gloo', 'nccl' or 'shm', got 'toy'"):
        from_dict({**doc, "backends": ["gloo"]}, "t.yaml")


@pytest.mark.parametrize(
    ("named", "over", "refusal"),
    [
        (["toy"], {"nodes": 2}, "toy runs within one node only"),
        (["shm"], {"nodes": 2}, "shm runs within one node only"),
        (["gloo", "toy"], {"device": "cuda"}, "gloo and toy run on cpu tensors \\(device cpu\\), not cuda"),
        (["nccl"], {}, "nccl runs on cuda tensors \\(device cuda\\), not cpu"),
    ],
)
def test_a_topology_is_checked_against_what_its_backends_need(named, over, refusal):
    with pytest.raises(TopologyError, match=f"backends: {refusal}"):
        from_dict(topology(named, **over), "t.yaml", WITH_TOY)


def test_every_backend_runs_each_collective_as_an_algorithm_the_cost_model_prices():
    for name in backends.BACKENDS:
        algorithms = backends.get(name).algorithms
        assert set(algorithms) == set(ALGORITHMS)
        assert all(algs and set(algs) <= set(ALGORITHMS[op]) for op, algs in algorithms.items())


# modules that name the transports they measure, each in its own way: a calibration of gloo and of shm
MEASURE_BY_NAME = {"tuner/calibrate.py", "tuner/calibrate_rank.py", "tuner/calibrate_cluster.py"}


def _names_in(tree: ast.AST) -> list[tuple[int, int]]:
    """Where (line, column) a backend's name is compared, listed in a tuple, list or set, or a subscript's key."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            held = [node.left, *node.comparators]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            held = node.elts
        elif isinstance(node, ast.Subscript):
            held = [node.slice]
        else:
            continue
        for part in held:
            for leaf in ast.walk(part):
                if isinstance(leaf, ast.Constant) and leaf.value in backends.BACKENDS:
                    found.add((leaf.lineno, leaf.col_offset))
    return sorted(found)


def test_no_code_outside_the_backends_decides_by_a_backend_name():
    """Adding a backend is one module of codegen/backends: code elsewhere asks the registry, never a name."""
    found = []
    for folder in ("schedules", "codegen", "kernels", "tuner", "server", "coconet"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("codegen/backends/") or rel in MEASURE_BY_NAME:
                continue
            found += [f"{rel}:{line}" for line, _ in _names_in(ast.parse(path.read_text()))]
    assert found == []


def test_the_check_for_names_finds_one():
    assert _names_in(ast.parse('if b == "shm" or b in ("nccl",): pass\nx = f["gloo"]')) == [(1, 8), (1, 23), (2, 6)]
