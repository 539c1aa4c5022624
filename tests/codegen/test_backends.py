"""Backends are objects (``coconet.codegen.backends``): one per module, found by name, and what the lowering
writes and the tuner asks of the machine come from them."""

import runpy
from pathlib import Path

import pytest

from coconet.codegen import backends
from coconet.codegen.lower import lower
from coconet.errors import BackendError
from coconet.schedules.schedule import Schedule
from coconet.tuner.cluster import ONE_NODE

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
