"""Reductions along a dim, softmaxes and the norms on the backends: every schedule of programs using them on
gloo and shm (uneven rows, and a rank with none), the code each op lowers to, and fused row kernels compiled."""

import math
import runpy
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import coconet as cc
from coconet import Local, Replicated, Sliced
from coconet.codegen.lower import lower
from coconet.codegen.plan import LoweringPlan
from coconet.schedules.schedule import Schedule
from coconet.schedules.space import generate
from coconet.tuner import cost
from coconet.tuner.launch import Options, run_schedules
from coconet.tuner.topology import list_topologies, load_topology
from tests.codegen.test_nccl import _only_the_device_differs
from tests.tuner.test_launch import assert_all_ok, rank_processes

pytestmark = pytest.mark.usefixtures("temp_code_cache")
ROOT = Path(__file__).parents[2]
LN = "fuse(add0, mean0, sub0, mul0, mean1, add1, rsqrt0, mul1, mul2)"


def normalised_state():
    """LayerNorm of reduce_scattered rows written into Replicated state (an implied all_gather), and a softmax
    along the sliced rows (max and sum of exponentials through allreduces)."""
    p = cc.Program("normalised_state", dims=("S", "H"))
    x = p.tensor("x", ("S", "H"), layout=Local)
    w = p.tensor("w", ("S", "H"), layout=Replicated)
    g = p.tensor("g", ("H",), layout=Replicated)
    h = cc.reduce_scatter(x) + w
    p.update(w, cc.layer_norm(h, g))
    p.output("sm", cc.all_gather(cc.softmax(h, 0)))
    return p.ir


def every_reduction():
    p = cc.Program("every_reduction", dims=("S", "H"))
    x = p.tensor("x", ("S", "H"), layout=Sliced(0))
    z = p.tensor("z", ("S", "H"), layout=Sliced(1))
    r = p.tensor("r", ("S", "H"), layout=Replicated)
    p.output("mx", cc.max(x, 0))
    p.output("mn", cc.min(x * 2.0))
    p.output("mean", cc.mean(x, 0, keepdim=True))
    p.output("rows", cc.sum(x, 1))
    p.output("cols", cc.sum(z * z, 0))  # Sliced(1) over dim 0: Sliced(0)
    p.output("ls", cc.log_softmax(x, -1))
    p.output("rms", cc.rms_norm(r, eps=1e-6))
    p.output("lsr", cc.all_gather(cc.log_softmax(z, 1)))
    return p.ir


def tensor_parallel_layer():
    """Megatron-LM's tensor-parallel epilogue with a LayerNorm and a softmax along the sequence: split + reorder
    turn it into the sequence-parallel shape (the LayerNorm on slices, the softmax through allreduces)."""
    p = cc.Program("tensor_parallel_layer", dims=("S", "B", "H"))
    x = p.tensor("x", ("S", "B", "4*H"), layout=Sliced(-1))
    w = p.tensor("w", ("4*H", "H"), layout=Sliced(0))
    b = p.tensor("b", ("H",), layout=Replicated)
    r = p.tensor("r", ("S", "B", "H"), layout=Replicated)
    g = p.tensor("g", ("H",), layout=Replicated)
    seed = p.scalar("seed", dtype="int64")
    h = cc.dropout(cc.allreduce(cc.matmul(x, w)) + b, 0.1, seed) + r
    p.output("out", cc.layer_norm(h, g))
    p.output("sm", cc.softmax(h, 0))
    return p.ir


def sharded_state_norms():
    """Readers along a dim of updated state: as_slice keeps the state sliced and the rows' norms on their ranks,
    the column max through partials (split then turns their allreduce into reduce_scatter + all_gather)."""
    p = cc.Program("sharded_state_norms", dims=("S", "H"))
    g = p.tensor("g", ("S", "H"), layout=Local)
    w = p.tensor("w", ("S", "H"), layout=Replicated)
    lr = p.scalar("lr")
    w1 = w - lr * cc.allreduce(g)
    p.update(w, w1)
    p.output("ln", cc.layer_norm(w1))
    p.output("colmax", cc.max(w1, 0))
    p.output("ls", cc.log_softmax(w1, 0))
    return p.ir


def gpt_layer_sp():
    """examples/gpt_layer_sp.py: Megatron's sequence-parallel epilogue, its LayerNorm inside the fused collective."""
    return runpy.run_path(str(ROOT / "examples" / "gpt_layer_sp.py"))["program"].ir


PROGRAMS = [normalised_state, every_reduction, tensor_parallel_layer, sharded_state_norms, gpt_layer_sp]
# uneven rows at 2 and 3 ranks for the programs of the sequence-parallel kind; at 3 for the rest (time)
WORLDS = [
    (normalised_state, 2),
    (normalised_state, 3),
    (every_reduction, 3),
    (tensor_parallel_layer, 2),
    (tensor_parallel_layer, 3),
    (sharded_state_norms, 3),
    (gpt_layer_sp, 2),
    (gpt_layer_sp, 3),
]
SIZES = {"S": 5, "H": 3, "B": 2}


def opts(world, backend, kernels="eager", prog=None):
    sizes = {d: SIZES[d] for d in (prog.dims if prog is not None else ("S", "H"))}
    return Options(world=world, sizes=sizes, backend=backend, kernels=kernels, time=False, timeout_s=120)


@pytest.mark.parametrize("backend", ["gloo", "shm"])
@pytest.mark.parametrize("make,world", WORLDS, ids=lambda x: getattr(x, "__name__", str(x)))
def test_every_schedule_on_uneven_rows(make, world, backend):
    prog = make()
    assert_all_ok(run_schedules(list(generate(prog)), opts(world, backend, prog=prog)))
    assert not rank_processes()


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_a_rank_without_rows_reduces_to_the_identity(backend):
    """5 rows over 4 ranks are 2, 2, 1 and none: the last rank's max is -inf, which the allreduce passes over."""
    for make in PROGRAMS:
        prog = make()
        picked = [s for s in generate(prog) if s.text == "baseline" or s.text.startswith("fuse(")]
        assert_all_ok(run_schedules(picked, opts(4, backend, prog=prog)))


def test_each_op_lowers_to_one_torch_call():
    src = lower(Schedule(every_reduction()), "gloo").source.split("def step")[1]
    # a rank's share of a max over its rows, the identity where it holds none; a mean's share over the whole dim
    assert "pmax0 = (x.amax(0, keepdim=False) if x.shape[0] else x.new_full((d_H, ), float('-inf')))" in src
    assert "pmean0 = x.sum(0, keepdim=True) / ((d_S))" in src
    assert "pmin0 = (mul0.amin() if mul0.numel() else mul0.new_full((), float('inf')))" in src
    assert "sum0 = x.sum(1, keepdim=False)" in src and "mean0 = mul2.mean(1, keepdim=True)" in src
    assert "log_softmax0 = torch.log_softmax(x, 1)" in src
    assert "_allreduce(_c, ar0, 'max')" in src and "_allreduce(_c, ar1, 'min')" in src


@pytest.mark.parametrize("make", PROGRAMS, ids=lambda f: f.__name__)
def test_the_nccl_module_is_the_gloo_module_on_the_gpu(make):
    for s in generate(make()):
        for kernels in ("compiled", "eager"):
            differ = _only_the_device_differs(lower(s, "gloo", kernels).source, lower(s, "nccl", kernels).source)
            assert not differ, (s.text, kernels, differ)


def test_split_and_reorder_make_the_tensor_parallel_layer_sequence_parallel():
    sched = Schedule.parse("split(ar0); reorder(ag0)", tensor_parallel_layer())
    p = sched.scheduled
    assert p["mean0"].type.layout == Sliced(0) and p["mean0"].attr("dim") == 2  # each rank's rows' means
    assert [p[u].op for u in p.users["add1"]].count("partial_reduce") == 1  # the softmax's max along the rows
    assert [s.attr("op") for s in p.stmts if s.op == "allreduce"] == ["max", "sum"]
    assert "softmax" not in p.of_op


def test_a_layer_norm_fuses_into_one_kernel_that_c_leaves_to_inductor():
    """The LayerNorm's means and its pointwise statements are one compiled function; on shm the group writes its
    rows into every peer's copy of the state, the case the C chunk kernel takes for pointwise groups, which
    computes flat elements and so leaves a row's mean to Inductor."""
    sched = Schedule.parse(LN, normalised_state())
    for backend in ("gloo", "shm"):
        src = lower(sched, backend).source
        fused = src.split("def _fuse0(")[1].split("\ndef ")[0]
        assert "mean0 = add0.mean(1, keepdim=True)" in fused and "rsqrt0 = torch.rsqrt(add1)" in fused
        assert "_fuse0 = _kernel(_fuse0)" in src
    shm = lower(sched, "shm").source
    assert "_into_peers(" in shm and "_native(" not in shm


def test_cost_model_prices_every_schedule():
    """Finite and positive; a fused LayerNorm reads and writes fewer bytes than its statements one by one."""
    for topo in (load_topology(n) for n in list_topologies()):
        for backend in topo.backends:
            for make in PROGRAMS:
                for s in generate(make()):
                    p = cost.predict(s, {"S": 4096, "H": 4096, "B": 2}, topo, backend, world=4)
                    assert math.isfinite(p.seconds) and p.seconds > 0, (topo.name, backend, s.text)
            state = normalised_state()
            alone = cost.predict(Schedule(state), {"S": 4096, "H": 4096}, topo, backend, world=4)
            fused = cost.predict(Schedule.parse(LN, state), {"S": 4096, "H": 4096}, topo, backend, world=4)
            assert fused.memory_s < alone.memory_s, (topo.name, backend)


def test_fused_row_kernels_compiled():
    """Inductor's kernels on shm: the sequence-parallel LayerNorm fused with dropout and the residual (in a fuse
    kernel, and in the fused collective's chunk kernel), and a
    LayerNorm written into every peer's copy of the state beside a softmax's exponentials. (gloo runs the same
    function of the group; test_a_layer_norm_fuses_into_one_kernel_that_c_leaves_to_inductor reads both.)"""
    gpt = gpt_layer_sp()
    fused = [s for s in generate(gpt) if s.text.startswith(("fuse(", "fuse_collective(")) and "overlap" not in s.text]
    assert len(fused) == 2 and all("mean0" in s.text or s.text.startswith("fuse_collective(") for s in fused)
    assert_all_ok(run_schedules(fused, opts(3, "shm", "compiled", gpt)))
    picked = [Schedule.parse(f"{LN}; fuse(sub1, exp0)", normalised_state())]
    assert_all_ok(run_schedules(picked, opts(3, "shm", "compiled")))


@st.composite
def rowwise_programs(draw):
    """A random epilogue after a collective: pointwise work, reductions along a dim broadcast back, softmaxes
    and norms, an update of Replicated state and a reduced output; what split, reorder, as_slice and fuse
    then make of it is checked on the backends."""
    p = cc.Program("randrow", dims=("N", "M"))
    g = p.tensor("g", ("N", "M"), layout=Local)
    s = p.tensor("s", ("N", "M"), layout=Replicated)
    wv = p.tensor("wv", ("M",), layout=Replicated)
    a = p.scalar("a")
    pool = [cc.allreduce(g, op=draw(st.sampled_from(["sum", "avg", "max"]))), s]
    for _ in range(draw(st.integers(1, 5))):
        x, y = draw(st.sampled_from(pool)), draw(st.sampled_from(pool))
        dim = draw(st.sampled_from([0, 1, -1]))
        kind = draw(st.sampled_from(["bin", "scal", "reduce", "softmax", "norm"]))
        if kind == "bin":
            e = draw(st.sampled_from([lambda u, v: u + v, lambda u, v: u * v]))(x, y)
        elif kind == "scal":
            e = a * x + 0.5
        elif kind == "reduce":
            e = x - draw(st.sampled_from([cc.sum, cc.mean, cc.max, cc.min]))(y, dim, keepdim=True)
        elif kind == "softmax":
            e = draw(st.sampled_from([cc.softmax, cc.log_softmax]))(x, dim)
        else:
            e = cc.layer_norm(x, wv) if draw(st.booleans()) else cc.rms_norm(x, wv)
        pool.append(e)
    p.update(s, draw(st.sampled_from(pool[2:])))
    if draw(st.booleans()):
        reduced = draw(st.sampled_from([cc.sum, cc.max]))
        p.output("out", reduced(draw(st.sampled_from(pool)), draw(st.sampled_from([0, 1]))))
    return p


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
@given(rowwise_programs(), st.sampled_from([2, 3]), st.sampled_from(["gloo", "shm"]))
def test_unseen_rowwise_programs(p, world, backend):
    prog = p.ir
    picked = list(generate(prog, depth=4))[:24]
    assert_all_ok(
        run_schedules(
            picked,
            Options(world=world, sizes={"N": 5, "M": 3}, backend=backend, kernels="eager", time=False, timeout_s=120),
        )
    )


def test_the_fused_collective_computes_the_layer_norm_in_its_chunk_kernel():
    """The plan takes the LayerNorm's means into each chunk's compiled kernel; C computes flat elements, so on
    shm Inductor's kernel serves; the cost model prices the one kernel per chunk the plan decided."""
    sched = Schedule.parse("fuse_collective(rs0)", gpt_layer_sp())
    for backend in ("gloo", "shm"):
        (fc,) = LoweringPlan.of(sched, backend).fused_collectives.values()
        assert fc.compiles and {"mean0", "mean1", "add3"} <= set(fc.compute) and fc.gathers == ("ag0",)
        src = lower(sched, backend).source
        chunk = src.split("def _chunk0(")[1].split("\ndef ")[0]
        assert "mean0 = add1.mean(2, keepdim=True)" in chunk and "mean1 = mul0.mean(2, keepdim=True)" in chunk
        assert "_native(" not in src and "def _fuse0(" not in src  # no LayerNorm kernel of its own after the collective
        priced = cost.plan(sched, backend)
        (unit,) = [u for u in priced.units if u.what.startswith("fused_collective(")]
        assert [k.what for k in unit.kernels].count(f"{unit.what} kernel") == 1
        assert not [u for u in priced.units if u.what.startswith("fuse(")]
    eager = lower(sched, "gloo", "eager").source
    assert "mean0 = add1.mean(2, keepdim=True)" in eager.split("def _fused_collective0(")[1]
