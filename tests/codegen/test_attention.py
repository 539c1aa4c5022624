"""Batched matmul, tensordot and transpose on the backends: the attention example's every schedule on gloo and
shm at 2 and 3 ranks (uneven heads, and a rank with none), the code they lower to, the runtime's matmul on a
batch, the cost model's flops, and the hand-written Megatron-LM baseline."""

import math
import runpy
from pathlib import Path

import numpy as np
import pytest
import torch

import coconet as cc
from coconet import Replicated, Sliced
from coconet.codegen.baselines import BASELINES, baseline_for
from coconet.codegen.lower import lower
from coconet.kernels.ops import matmul
from coconet.schedules.schedule import Schedule
from coconet.schedules.space import generate
from coconet.tuner import cost, roofline
from coconet.tuner.launch import Options, run_schedules
from coconet.tuner.topology import list_topologies, load_topology
from tests.tuner.test_launch import assert_all_ok, rank_processes

pytestmark = pytest.mark.usefixtures("temp_code_cache", "one_thread")
ROOT = Path(__file__).parents[2]
SIZES = {"A": 5, "S": 3, "D": 3, "H": 4}  # 5 heads: 3 and 2 at 2 ranks, 2, 2 and 1 at 3


def example(name):
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"))["program"].ir


def opts(world, backend, sizes):
    return Options(world=world, sizes=sizes, backend=backend, kernels="eager", time=False, timeout_s=120)


def test_each_op_lowers_to_one_torch_call_on_the_pieces():
    src = lower(Schedule(example("attention_out")), "gloo", "eager").source.split("def step")[1]
    assert "tr0 = k.transpose(1, 2)" in src
    assert "mm0 = torch.matmul(q, tr0)" in src and "mm1 = torch.matmul(drop0, v)" in src
    assert "td0 = torch.tensordot(mm1, w, dims=([0, 2], [0, 1]))" in src
    assert "_c.cut(" not in src


@pytest.mark.parametrize("backend", ["gloo", "shm"])
@pytest.mark.parametrize("world", [2, 3])
def test_every_schedule_of_the_example(world, backend):
    prog = example("attention_out")
    space = list(generate(prog))
    assert len(space) > 10
    assert_all_ok(run_schedules(space, opts(world, backend, SIZES)))
    assert not rank_processes()


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_a_rank_without_heads(backend):
    """2 heads over 3 ranks: the last holds none, its context is empty and its share of the projection zeros."""
    prog = example("attention_out")
    picked = [s for s in generate(prog) if s.text in ("baseline", "split(ar0); reorder(ag0)")]
    picked += [Schedule.parse(f"overlap(td0, ar0); chunks={n}", prog) for n in (4, 16)]  # 16: more than S's rows
    assert_all_ok(run_schedules(picked, opts(3, backend, {"A": 2, "S": 4, "D": 2, "H": 3})))


def square():
    """A product by a square Replicated matrix whose extent is the result's sliced one: an operand cut as a
    pointwise operand of a Sliced result is would have a shape torch takes and compute something else."""
    p = cc.Program("square", dims=("H",))
    x = p.tensor("x", ("H", "H"), layout=Sliced(0))
    xr = p.tensor("xr", ("H", "H"), layout=Replicated)
    w = p.tensor("w", ("H", "H"), layout=Replicated)
    wc = p.tensor("wc", ("H", "H"), layout=Sliced(1))
    p.output("rows", cc.all_gather(cc.matmul(x, w)))
    p.output("columns", cc.all_gather(cc.matmul(xr, wc)))
    return p.ir


def test_a_product_reads_its_replicated_operand_whole():
    src = lower(Schedule(square()), "gloo", "eager").source.split("def step")[1]
    assert "mm0 = torch.matmul(x, w)" in src and "mm1 = torch.matmul(xr, wc)" in src
    assert_all_ok(run_schedules([Schedule(square())], opts(2, "gloo", {"H": 3})))


def test_overlap_code_contracts_bands_of_the_sequence():
    src = lower(Schedule.parse("overlap(td0, ar0)", example("attention_out")), "gloo", "eager").source
    assert "for _ak in torch.tensor_split(mm1, 4, dim=1):" in src
    assert "_yk = torch.tensordot(_ak, w, dims=([0, 2], [0, 1]))" in src
    assert "_works.append(_allreduce(_c, _yk, 'sum', async_op=True))" in src and "ar0 = torch.cat(_parts)" in src


def test_runtime_matmul_takes_a_batch():
    a, b = torch.rand(3, 4, 5), torch.rand(3, 5, 2)
    torch.testing.assert_close(matmul(a, b), torch.matmul(a, b))
    torch.testing.assert_close(matmul(a, b[0]), torch.matmul(a, b[0]))
    assert matmul(torch.rand(0, 4, 5), torch.rand(0, 5, 2)).shape == (0, 4, 2)


def test_cost_model_prices_the_products_flops():
    prog = example("attention_out")
    topo = load_topology("cpu-25gbe")
    sizes = {"A": 16, "S": 512, "D": 64, "H": 1024}
    for world in (2, 4):
        heads = math.ceil(16 / world)
        units = {name: d for name, _, d in cost.explain(Schedule(prog), sizes, topo, "gloo", world=world)}
        flops = {
            "mm0": 2 * heads * 512 * 512 * 64,  # each head's scores
            "mm1": 2 * heads * 512 * 64 * 512,  # each head's context
            "td0": 2 * 512 * 1024 * heads * 64,  # this rank's heads of the projection
        }
        for name, f in flops.items():
            assert units[name]["compute"] == pytest.approx(f / (topo.matmul_TFLOPS["float32"] * 1e12)), name
        overlapped = Schedule.parse("overlap(td0, ar0)", prog)
        (unit,) = [d for name, _, d in cost.explain(overlapped, sizes, topo, "gloo", world=world) if "td0" in name]
        assert unit["compute"] == pytest.approx(flops["td0"] / (topo.matmul_TFLOPS["float32"] * 1e12))
        # in bands of a's rows: a launch a band, each reading all of w again, as the overlap's loop does
        bands = {}
        for chunks in (1, 4):
            plan = cost.plan(overlapped.with_knobs(chunks=chunks), "gloo")
            (k,) = [k for u in plan.units for k in u.kernels if k.what == "td0"]
            bands[chunks] = k
        assert (bands[1].launches, bands[4].launches) == (1, 4)
        assert len(bands[4].read) == len(bands[1].read) + 1
        assert roofline.matmul_flops_per_rank(prog, sizes, world) == sum(flops.values())
    for topo in (load_topology(n) for n in list_topologies()):
        for backend in topo.backends:
            for s in generate(prog):
                p = cost.predict(s, sizes, topo, backend, world=4)
                assert math.isfinite(p.seconds) and p.seconds > 0, (topo.name, backend, s.text)


def attention_out(p_drop):
    """examples/attention_out.py with another dropout probability (0: no mask, so torch's step can be checked)."""
    p = cc.Program("attention_out", dims=("A", "S", "D", "H"))
    q = p.tensor("q", ("A", "S", "D"), layout=Sliced(0))
    k = p.tensor("k", ("A", "S", "D"), layout=Sliced(0))
    v = p.tensor("v", ("A", "S", "D"), layout=Sliced(0))
    w = p.tensor("w", ("A", "D", "H"), layout=Sliced(0))
    b = p.tensor("b", ("H",), layout=Replicated)
    r = p.tensor("r", ("S", "H"), layout=Replicated)
    scale = p.scalar("scale")
    seed = p.scalar("seed", dtype="int64")
    attn_seed = p.scalar("attn_seed", dtype="int64")
    probs = cc.dropout(cc.softmax(cc.matmul(q, cc.transpose(k, 1, 2)) * scale, -1), p_drop, attn_seed)
    y = cc.allreduce(cc.tensordot(cc.matmul(probs, v), w, ([0, 2], [0, 1])))
    p.output("out", cc.dropout(y + b, p_drop, seed) + r)
    return p.ir


def _rank(rank, world, store, sizes):
    import torch.distributed as dist

    from coconet.codegen.baselines import AttentionOutStep
    from coconet.schedules import interp

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        prog = attention_out(0.0)
        given = interp.rank_inputs(prog, world, sizes, rank)
        scalars = {n: given.pop(n) for n in ("scale", "seed", "attn_seed")}
        tensors = {n: torch.tensor(x, dtype=torch.float32) for n, x in given.items()}
        out = AttentionOutStep(0.0)(tensors, scalars)["outputs"]
        want = interp.run(prog, world, sizes).stages[-1].outputs["out"][rank]
        np.testing.assert_allclose(out["out"].numpy(), want, rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()


def test_hand_written_baseline_computes_the_program(tmp_path):
    """Megatron-LM's attention by hand, against the interpreter where dropout keeps every element: 5 heads over
    2 ranks, 2 over 3 (the last rank holds none)."""
    import torch.multiprocessing as mp  # forkserver: ranks forked from a fresh process, never from this one, whose
    # OpenMP workers (left by any earlier test's parallel region) a forked child would wait on for ever

    assert attention_out(0.1).hash == example("attention_out").hash  # the example, as the test writes it
    assert baseline_for(example("attention_out")) is BASELINES["attention_out"]
    for world, heads in ((2, 5), (3, 2)):
        store = tmp_path / f"store{world}"
        sizes = {"A": heads, "S": 3, "D": 2, "H": 4}
        mp.start_processes(_rank, args=(world, store, sizes), nprocs=world, start_method="forkserver")


def test_baseline_runs_unchecked_in_a_launch():
    torch_row, ours = run_schedules(
        [Schedule(example("attention_out"))],
        Options(world=2, sizes=SIZES, kernels="eager", warmup=0, repeats=2),
        baselines=[BASELINES["attention_out"]],
    )
    assert torch_row.status == "ok" and torch_row.correct is None and torch_row.median_s > 0
    assert ours.status == "ok" and ours.correct
