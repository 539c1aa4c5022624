import ast
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from coconet import __version__
from coconet.codegen import runtime
from coconet.codegen.cache import module_path
from coconet.codegen.lower import lower
from coconet.errors import BackendError
from coconet.schedules.schedule import Schedule
from coconet.schedules.space import generate
from coconet.tuner import cost
from tests.codegen import faulty

ROOT = Path(__file__).parents[2]
GOLDEN = Path(__file__).parent / "golden"
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))


def _names_imported(source):
    """The names a module binds by its imports of the runtime."""
    return {
        a.asname
        for node in ast.parse(source).body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("coconet.kernels.")
        for a in node.names
    }


def example(name):
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"))["program"].ir


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_schedule_lowers_for_both_backends(name):
    prog = example(name)
    for sched in generate(prog):
        for backend in ("gloo", "nccl"):
            gen = lower(sched, backend)
            assert f"schedule: {sched.text}" in gen.source
            assert f"program:  {prog.name} (hash {prog.hash})" in gen.source
            assert f"coconet {__version__}" in gen.source
            compile(gen.source, "<test>", "exec")
            imports = [x for x in gen.source.split("\n") if x.startswith(("import ", "from "))]
            # torch, and the runtime's names the module calls, each bound as _<name>
            assert imports[:2] == ["import torch", "import torch.distributed as dist"], imports
            assert all(x.startswith("from coconet.kernels.") for x in imports[2:]), imports
            assert "_Ctx" in _names_imported(gen.source)
            # every statement is implemented on lines of its own or of its group
            mapped = set(gen.line_map.values())
            scheduled = sched.scheduled
            for s in scheduled.stmts:
                group = scheduled.group_of.get(s.name)
                members = group.members if group else (s.name,)
                if s.op not in ("input", "scalar", "update"):
                    assert mapped & set(members), (sched.text, s.name)


def test_backend_device_and_unknown_backend():
    sched = Schedule(example("adam"))
    assert "torch.device('cuda'" in lower(sched, "nccl").source
    assert "torch.device('cpu')" in lower(sched, "gloo").source
    with pytest.raises(BackendError, match="unknown backend 'mpi'"):
        lower(sched, "mpi")


def test_custom_op_without_torch_code_is_refused_up_front():
    with pytest.raises(BackendError, match="custom op twice has no torch implementation") as e:
        lower(Schedule(faulty.reference_only()), "gloo")
    assert e.value.kind == "compile_error"


def test_line_map_points_at_statements():
    sched = Schedule.parse("split(ar0); reorder(ag0); fuse_collective(rs0)", example("adam"))
    gen = lower(sched)
    lines = gen.source.split("\n")
    at = {gen.statement_at(i + 1) for i, line in enumerate(lines) if "in _reduce_scatter_chunks(" in line}
    assert at == {"rs0"}
    assert gen.statement_at(1) is None


def test_fused_collective_chunks_knob():
    prog = example("adam")
    base = Schedule.parse("split(ar0); reorder(ag0); as_slice(w); as_slice(m); as_slice(v); fuse_collective(rs0)", prog)
    assert base.knob_values["fc_chunks"] == 4
    assert "_reduce_scatter_chunks(_rank, g, 0, d_N, 4, 'sum')" in lower(base).source
    one = lower(base.with_knobs(fc_chunks=1)).source
    assert "_reduce_scatter_chunks(_rank, g, 0, d_N, 1, 'sum')" in one


def test_fused_collective_kernel_absorbs_sharded_state_and_writes_it_in_place():
    """Adam on sharded state: beta1 * m joins the chunk kernel, which writes m, v, w in place; on shm the
    kernel also sums the chunk's rows of every rank (no reduced copy is written)."""
    sched = Schedule.parse(
        "split(ar0); reorder(ag0); as_slice(w); as_slice(m); as_slice(v); fuse_collective(rs0)", example("adam")
    )
    gloo = lower(sched, "gloo").source
    assert "def _chunk0(m_k, v_k, w_k, beta1, beta2, sub0, rs0," in gloo and "    mul0 = beta1 * m_k" in gloo
    assert "m_k.copy_(add0)" in gloo and "m.copy_(" not in gloo.split("def step")[1]
    assert "_chunk0(_c.local(m, 0), _c.local(v, 0), _c.local(w, 0), beta1" in gloo
    step = gloo.split("def step")[1]
    assert "mul0 = beta1 * m" not in step  # no full pass of its own
    shm = lower(sched, "shm").source
    assert "    rs0 = _reduce_all(rs0_parts, 'sum')" in shm
    assert "in _reduce_scatter_parts(_rank, g, 0, d_N, 4, 'g', 0):" in shm
    # nothing gathered: the peers' reads of g where it lies end at the collective's own barrier
    assert "        _end_collective(_rank)\n" in shm.split("def step")[1]
    eager = lower(sched, "shm", kernels="eager").source
    assert "_chunk0" not in eager and "mul0 = beta1 * m" in eager.split("def step")[1]


def test_fused_collective_kernel_takes_dropout_with_the_chunks_first_row():
    """Megatron's bias + dropout + residual in one kernel per chunk: the mask's counters start at the chunk's
    first row, passed as a tensor so that every chunk runs the same compiled code."""
    sched = Schedule.parse("split(ar0); reorder(ag0); fuse_collective(rs0)", example("megatron_mlp"))
    for backend in ("gloo", "shm"):
        src = lower(sched, backend).source
        assert "drop0 = _dropout_rows(add0, 0.1, seed, (d_B, d_S, d_H, ), 0, row0_k)" in src
        # on shm the kernel writes the chunk's rows of the output into this rank's slot of its gather
        slot = "_ag1.own(_c, torch.float32, (d_B, d_S, d_H, )), " if backend == "shm" else ""
        assert f"_chunk0(d_B, d_S, d_H, _int64(_c.rows(d_B)[0]), {slot}_c.cut(r, 0, d_B)," in src
        assert "_dropout(_c," not in src.split("def step")[1]
    eager = lower(sched, "gloo", kernels="eager").source
    assert "_chunk0" not in eager and "drop0 = _dropout(_c, add0, 0.1, seed" in eager


def test_a_number_over_a_tensor_computed_into_a_buffer_has_the_bits_of_the_operator():
    """``3.0 / x`` computed straight into the state it updates (or into a held buffer) is x's reciprocal times 3,
    as torch's operator computes it (Tensor.__rtruediv__): ``torch.div(3.0, x, out=)``, the quotient, is an ulp
    from it for a quarter of the values, so a schedule that computes it into a buffer stepped other bits than
    one that does not."""
    import re

    import torch

    import coconet as cc

    p = cc.Program("rdiv_into", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    u = p.tensor("u", ("N",), layout=cc.Replicated)
    p.update(u, 3.0 / (cc.allreduce(g) + 1.0))
    step = lower(Schedule(p.ir), "gloo", "eager").source.split("def step(")[1]
    line = re.search(r"^ +(torch\.\w+\(.*out=u\))$", step, re.M)
    assert line, "u is not computed into in place"
    x = torch.rand(1 << 16, generator=torch.Generator().manual_seed(0)) + 0.5
    ns = {"torch": torch, "add0": x, "u": torch.empty_like(x), "c1": 3.0}
    assert "c1 = 3.0" in step and "add0 = " in step
    eval(line.group(1), ns)
    assert torch.equal(ns["u"], 3.0 / x)
    assert not torch.equal(torch.div(3.0, x), 3.0 / x)  # what the check tells apart


def test_fused_kernel_writes_state_in_place_and_compiles():
    prog = example("adam")
    fuse = next(s for s in generate(prog) if s.text.startswith("fuse("))
    src = lower(fuse).source
    assert "_fuse0 = _kernel(_fuse0)" in src
    kernel = src[src.index("def _fuse0(") : src.index("_fuse0 = _kernel")]
    for state in ("w", "m", "v"):
        assert f"    {state}.copy_(" in kernel  # inside the kernel, not after it
    step = src[src.index("def step(") :]
    assert ".copy_(" not in step and "_fuse0(_c, " in step
    eager = lower(fuse, kernels="eager").source
    assert "_kernel(" not in eager and "torch.compile" not in eager
    with pytest.raises(BackendError, match="unknown kernels"):
        lower(fuse, kernels="fast")


def test_a_fuse_kernel_computes_the_sums_and_norms_of_its_members():
    """A loss scaler's count of non-finite elements, ``sum(where(abs(g) > t, 1, 0))``, after a group fusing the
    mask: the group's kernel sums the mask and hands on the count, the mask never written out; a norm of a
    member read elsewhere too is computed beside it. Eager kernels keep the statements as they are."""
    prog = golden_program("benchmarks/programs/adam_amp_skip.py")
    sched = Schedule.parse("split(ar1); reorder(ag0); fuse(abs0, gt0, where0); fuse_collective(rs0)", prog)
    src = lower(sched, "shm").source
    kernel = src[src.index("def _fuse0(") : src.index("_fuse0 = _kernel")]
    assert "    sum0 = where0.sum()\n    return sum0,\n" in kernel
    step = src[src.index("def step(") :]
    assert "sum0, = _fuse0(_c, g, " in step and ".sum()" not in step
    assert "sum0 = where0.sum()" in lower(sched, "shm", kernels="eager").source.split("def step(")[1]
    import coconet as cc

    p = cc.Program("norm_of_member", dims=("N",))
    x = p.tensor("x", ("N",), layout=cc.Replicated)
    y = x * 2.0 + 1.0
    p.output("y", y)
    p.output("n", cc.norm(y))
    src = lower(Schedule.parse("fuse(mul0, add0)", p.ir)).source
    assert "    norm0 = _norm(add0)\n    return add0, norm0\n" in src
    assert "add0, norm0 = _fuse0(_c, x, " in src.split("def step(")[1]


def test_int_scalars_reach_compiled_kernels_as_tensors():
    sched = Schedule.parse("fuse(add0, drop0, add1)", example("megatron_mlp"))
    assert "_fuse0(_c, d_B, d_S, d_H, ar0, b, _int64(seed), r)" in lower(sched).source
    assert "_fuse0(_c, d_B, d_S, d_H, ar0, b, seed, r)" in lower(sched, kernels="eager").source


def test_bucket_is_one_coalesced_launch_per_cap():
    sched = Schedule.parse("split(ar0); reorder(ag0); bucket(ag1, ag2, ag3)", example("adam"))
    src = lower(sched.with_knobs(bucket_bytes=2**20)).source
    assert "ag1, ag2, ag3 = _bucket_all_gather(_c, [add0, add1, sub4], [0, 0, 0], [d_N, d_N, d_N], 1048576)" in src
    assert "torch.cat([x.reshape(-1)" not in src  # no flattening copy in the generated code


def test_module_cache_is_keyed_by_schedule_and_backend(tmp_path, monkeypatch):
    monkeypatch.setenv("COCONET_CACHE_DIR", str(tmp_path))
    prog = example("sgd")
    a, b = lower(Schedule(prog), "gloo"), lower(Schedule.parse("split(ar0)", prog), "gloo")
    pa, pb = module_path(a), module_path(b)
    assert pa != pb and pa.parent == pb.parent == tmp_path / "codegen"
    assert pa.read_text() == a.source and module_path(a) == pa
    assert module_path(lower(Schedule(prog), "nccl")) != pa


ADAM_FC = "split(ar0); reorder(ag0); as_slice(w); as_slice(m); as_slice(v); fuse_collective(rs0)"
GOLDENS = {  # name: (example, schedule, backend, lower's keywords)
    "adam_baseline": ("adam", "baseline", "gloo", {}),
    "adam_fused_collective": ("adam", ADAM_FC, "gloo", {}),
    "megatron_overlap": ("megatron_mlp", "split(ar0); overlap(mm0, rs0)", "gloo", {}),
    "adam_fused_collective_shm": ("adam", ADAM_FC, "shm", {}),
    "megatron_fused_collective_shm": ("megatron_mlp", "split(ar0); reorder(ag0); fuse_collective(rs0)", "shm", {}),
    # ZeRO-1: moments sharded, the updated w gathered straight into w
    "adam_zero1_fused_collective_shm": (
        "adam",
        "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0)",
        "shm",
        {},
    ),
    # ZeRO-1 without a fused collective: the updated w's all_gather written straight into every rank's w
    "adam_zero1_gather_into_shm": ("adam", "split(ar0); reorder(ag0); as_slice(m); as_slice(v)", "shm", {}),
    # LAMB around its trust ratio: the norm's partial sum inside the fused collective, and the update's kernel
    # writing its rows into every rank's w
    "lamb_zero1_norm_shm": (
        "lamb",
        "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse(mul7, sub4); fuse_collective(rs0)",
        "shm",
        {},
    ),
    # the same with norm(w) from each rank's slice: its partial sum in the same chunk kernel, beside norm(u)'s
    "lamb_zero1_sliced_norms_shm": (
        "lamb",
        "split(ar0); reorder(ag0); as_slice(m); as_slice(v); "
        "slice_reduce(norm0); fuse(mul7, sub4); fuse_collective(rs0)",
        "shm",
        {},
    ),
    # the eager PyTorch baseline of a program without a hand-written one
    "megatron_eager_torch_dropout": ("megatron_mlp", "baseline", "gloo", {"kernels": "eager", "dropout": "torch"}),
    # the gradient divided before its allreduce: each rank's rows divided in the chunk kernel as it sums them
    "adam_predivide_zero1_shm": (
        "benchmarks/programs/adam_predivide.py",
        ("split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0)"),
        "shm",
        {},
    ),
    # each rank's gradient weighted by its own token count: every rank's count posted at the barrier, each
    # rank's rows weighted by its count in the chunk kernel as it sums them
    "adam_token_weighted_zero1_shm": (
        "benchmarks/programs/adam_token_weighted.py",
        ("split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0)"),
        "shm",
        {},
    ),
    # float16 mixed precision, state whole: each rank's float16 gradient widened as the chunk kernel sums it,
    # and the float16 copy of the new weights rounded and streamed, 32 rows a line, into every rank's copy (C)
    "adam_fp16_params_fused_collective_shm": (
        "benchmarks/programs/adam_fp16_params.py",
        "split(ar0); reorder(ag0); fuse_collective(rs0)",
        "shm",
        {},
    ),
    # Adafactor's sums on this rank's rows: the row sums a gemv of its rows, the column sums partial products of
    # its columns of the ones by its rows, scattered along the columns in chunks of rows as they are multiplied
    "adafactor_row_products_overlap": (
        "benchmarks/programs/adafactor.py",
        "split(ar0); reorder(ag0); split(ar0, dim=1); overlap(mm2, rs1)",
        "gloo",
        {},
    ),
    # the channel-parallel convolution in chunks of the batch, each chunk's allreduce in flight
    "conv_block_overlap": ("conv_block", "overlap(conv0, ar0)", "gloo", {}),
    # scattered along the batch: chunks of the filters, the block's epilogue on each rank's batch rows
    "conv_block_overlap_scatter_shm": ("conv_block", "split(ar0); reorder(ag0); overlap(conv0, rs0)", "shm", {}),
    # Megatron's sequence-parallel epilogue: dropout, the residual and the LayerNorm's means on each chunk of
    # the scattered rows in one compiled kernel, the normalised rows gathered as the next chunk computes
    "gpt_layer_sp_fused_collective": ("gpt_layer_sp", "fuse_collective(rs0)", "gloo", {}),
    # on shm: the kernel sums every rank's rows of the chunk, then normalises them into this rank's slot
    "gpt_layer_sp_fused_collective_shm": ("gpt_layer_sp", "fuse_collective(rs0)", "shm", {}),
    # Megatron's tensor-parallel attention on each rank's heads: the scaled scores, softmax and dropout in one
    # compiled kernel, the heads' context contracted with the projection's rows as one GEMM, then the
    # epilogue on each rank's rows of the scattered sum, the output gathered
    "attention_out_fused_collective": (
        "attention_out",
        "split(ar0); reorder(ag0); fuse(mul0, softmax0, drop0); fuse_collective(rs0)",
        "gloo",
        {},
    ),
}


def golden_program(name):
    """An example by name, or a program file by its path from the repository's root."""
    if name.endswith(".py"):
        return runpy.run_path(str(ROOT / name))["program"].ir
    return example(name)


@pytest.mark.parametrize("golden", sorted(GOLDENS))
def test_generated_code_golden(golden):
    name, text, backend, kw = GOLDENS[golden]
    source = lower(Schedule.parse(text, golden_program(name)), backend, **kw).source.replace(__version__, "VERSION")
    path = GOLDEN / f"{golden}.py"
    if os.environ.get("COCONET_UPDATE_GOLDEN"):
        path.write_text(source)
    assert source == path.read_text(), (
        f"generated code for {golden} changed; review and regenerate with COCONET_UPDATE_GOLDEN=1"
    )


def test_torch_dropout_only_in_eager_unfused_code():
    prog = example("megatron_mlp")
    gen = lower(Schedule(prog), "gloo", "eager", dropout="torch")
    assert "torch.nn.functional.dropout(add0, p=0.1, training=True)" in gen.source
    assert "_dropout(" not in gen.source and "philox" not in gen.source
    assert gen.key != lower(Schedule(prog), "gloo", "eager").key
    fused = Schedule.parse("split(ar0); reorder(ag0); fuse_collective(rs0)", prog)
    for sched, kernels in ((fused, "eager"), (Schedule(prog), "compiled")):
        with pytest.raises(BackendError, match="only an eager, unfused program"):
            lower(sched, "gloo", kernels, dropout="torch")
    with pytest.raises(BackendError, match="unknown dropout 'numpy'"):
        lower(Schedule(prog), "gloo", "eager", dropout="numpy")


PEAK = """
import sys
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

ns = {}
exec(compile(sys.stdin.read(), "generated", "exec"), ns)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
n = 1 << 16
tensors = {k: torch.rand(n) for k in "gwmv"}
scalars = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, t=3)
ns["step"](tensors, scalars)
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    ns["step"](tensors, scalars)
live = peak = 0
for e in sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start):
    live += e.self_cpu_memory_usage
    peak = max(peak, live)
print(peak / (4 * n))
"""


def peak_arrays(source: str) -> float:
    """The most bytes the step's own allocations hold at once, in arrays of N floats (world 1, gloo)."""
    done = subprocess.run([sys.executable, "-c", PEAK], input=source, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return float(done.stdout.split()[-1])


def test_an_eager_step_lets_each_temporary_go_after_its_last_reader():
    """Adam as written: ar0 and the new m and v (the state is written at the end) and at most two temporaries
    are live at once, where holding every temporary to the end takes 15 arrays."""
    source = lower(Schedule(example("adam")), kernels="eager").source
    assert "    del mul0, mul1\n" in source
    # 5 here, but one CI run measured 6 and it did not come back in 50 runs, loaded or not. The peak is read off
    # the profiler's events by time: an allocation carries its op's start, a free its own stamp, a few us apart,
    # so a free sorted after the next allocation counts one array twice. Holding temporaries shows as 14.
    assert peak_arrays(source) <= 6.01
    held = "\n".join(x for x in source.split("\n") if not x.lstrip().startswith("del "))
    assert peak_arrays(held) >= 14


def test_replicated_statements_read_only_on_a_slice_compute_that_slice_alone():
    """After reorder(ag0), beta1 * m feeds only add0 on this rank's rows: it is computed on those rows."""
    sched = Schedule.parse("split(ar0); reorder(ag0)", example("adam"))
    step = lower(sched, kernels="eager").source.split("def step(")[1]
    assert "    mul0 = beta1 * _c.cut(m, 0, d_N)\n" in step and "    add0 = mul0 + mul1\n" in step
    assert "    sub4 = _c.cut(w, 0, d_N) - div2\n" in step  # an input is still cut where it is read
    written = lower(Schedule(example("adam")), kernels="eager").source
    assert "    mul0 = beta1 * m\n" in written  # the program as written: add0 needs every row


def test_replicated_statements_read_only_by_a_fused_kernel_on_a_slice_run_inside_it_on_that_slice():
    """After reorder(ag0) with m and v whole, beta1 * m and beta2 * v feed only the fused kernel's slice: the
    kernel computes them on this rank's rows, no pass of their own before it (nor in the cost model's plan)."""
    fuse = "fuse(mul1, add0, mul3, mul4, add1, div0, div1, mul5, sqrt0, add2, div2, sub4)"
    sched = Schedule.parse(f"split(ar0); reorder(ag0); {fuse}", example("adam"))
    for backend, kernels in (("gloo", "compiled"), ("shm", "compiled"), ("shm", "eager")):
        source = lower(sched, backend, kernels).source
        kernel, step = source.split("def _fuse0(")[1].split("\n\n\n")[0], source.split("def step(")[1]
        if (backend, kernels) == ("shm", "compiled"):  # it writes m, v and w into the peers': rows cut at the call
            assert "    mul0 = beta1 * m_k\n    mul2 = beta2 * v_k\n" in kernel
            assert "_fuse0(m_peers, v_peers, w_peers, _c.cut(m, 0, d_N), _c.cut(v, 0, d_N), " in step
        else:
            assert "    mul0 = beta1 * _c.cut(m, 0, d_N)\n    mul2 = beta2 * _c.cut(v, 0, d_N)\n" in kernel
        assert "mul0 =" not in step and "mul2 =" not in step
    priced = [k.what for u in cost.plan(sched, "shm").units for k in u.kernels]
    assert any(w.startswith("fuse(") for w in priced) and "mul0" not in priced and "mul2" not in priced


def factored(output=False):
    """A step size from Adafactor-style factors of a matrix: an (M, 1) row factor times a (1, K) column factor,
    and a (K,) per-column rate; every one broadcast to the (M, K) update. ``output``: the step returns the
    whole of rsqrt(r * c + 1) too."""
    import coconet as cc

    p = cc.Program("factored", dims=("M", "K"))
    g = p.tensor("g", ("M", "K"), layout=cc.Local)
    w = p.tensor("w", ("M", "K"), layout=cc.Replicated)
    r = p.tensor("r", ("M", 1), layout=cc.Replicated)
    c = p.tensor("c", (1, "K"), layout=cc.Replicated)
    s = p.tensor("s", ("K",), layout=cc.Replicated)
    lr = p.scalar("lr")
    rate = lr * s
    step = cc.rsqrt(r * c + 1.0)
    p.update(w, w - rate * step * cc.allreduce(g, op="avg"))
    if output:
        p.output("step", step)
    return p.ir


def test_a_product_of_row_and_column_factors_read_on_a_slice_is_computed_on_that_slice():
    """r * c is (M, K) from an (M, 1) and a (1, K): each row of it needs the same row of r and all of c. Read
    only on this rank's rows, it is computed on those rows (r cut, c whole), not whole on every rank; inside a
    fused collective, on the chunk's rows. lr * s, a (K,) vector, has no rows to cut and stays whole."""
    p = factored()
    rows = Schedule.parse("split(ar0); reorder(ag0)", p)
    for backend, kernels in (("gloo", "eager"), ("shm", "compiled")):
        step = lower(rows, backend, kernels).source.split("def step(")[1]
        assert "    mul0 = lr * s\n    mul1 = _c.cut(r, 0, d_M) * c\n" in step
    fc = Schedule.parse("split(ar0); reorder(ag0); fuse_collective(rs0); fc_chunks=2", p)
    source = lower(fc, "shm", "compiled").source
    kernel, step = source.split("def _chunk0(")[1].split("\n\n\n")[0], source.split("def step(")[1]
    assert "    mul1 = r_k * c\n" in kernel and "mul1 =" not in step and "    mul0 = lr * s\n" in step
    assert "_chunk0(_ag1.peer_rows(_c), _c.cut(r, 0, d_M), _c.cut(w, 0, d_M), rs0_parts, c, " in step
    # C reads every operand row for row; a broadcast one leaves the chunk to Inductor
    assert "_chunk0 = _kernel(_chunk0)\n" in source and "_native(" not in source.split("def step(")[0]
    # priced as the lowering runs them: mul1 writes this rank's rows alone (M/2 x K of 64 x 32), or nothing
    plan = cost.plan(rows, "shm")
    mul1 = next(k for u in plan.units for k in u.kernels if k.what == "mul1")
    elems = cost._elems(plan, {"M": 64, "K": 32}, 2)
    assert cost._value(mul1.write, elems, 2) == 4 * 32 * 32
    assert cost._value(mul1.read, elems, 2) == 4 * (32 + 32)  # r's rows, all of c
    assert "mul1" not in [k.what for u in cost.plan(fc, "shm").units for k in u.kernels]
    # fused, the same statements make a kernel of their own that computes this rank's rows alone
    grouped = Schedule.parse("split(ar0); reorder(ag0); fuse(mul1, add0, rsqrt0, mul2); fuse(mul3, sub0)", p)
    for backend, kernels in (("gloo", "eager"), ("shm", "compiled")):
        kernel = lower(grouped, backend, kernels).source.split("def _fuse0(")[1].split("\n\n\n")[0]
        assert "    mul1 = _c.cut(r, 0, d_M) * c\n" in kernel
    plan = cost.plan(grouped, "shm")
    k = next(k for u in plan.units for k in u.kernels if k.what == "fuse(mul1, add0, rsqrt0, mul2)")
    elems = cost._elems(plan, {"M": 64, "K": 32}, 2)
    assert cost._value(k.write, elems, 2) == 4 * 32 * 32 and cost._value(k.read, elems, 2) == 4 * (32 + 32 + 32)
    # a member read whole elsewhere (an output) keeps the group whole
    whole = factored(output=True)
    step = (
        lower(Schedule.parse("split(ar0); reorder(ag0); fuse(mul1, add0, rsqrt0, mul2)", whole), "gloo", "eager")
        .source.split("def _fuse0(")[1]
        .split("\n\n\n")[0]
    )
    assert "    mul1 = r * c\n" in step


STANDALONE = r"""
import importlib.util
import sys

sys.modules["coconet"] = None  # importing coconet now fails: the module must do without it
import torch
import torch.distributed as dist

path, rank, port, sliced = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
spec = importlib.util.spec_from_file_location("generated", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
n = 1001
gen = torch.Generator().manual_seed(7)
g = [torch.randn(n, generator=gen) for _ in range(2)]
w, m, v = torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.rand(n, generator=gen)
s = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "t": 3.0}
avg = g[0] + g[1]
m1 = s["beta1"] * m + (1 - s["beta1"]) * avg
v1 = s["beta2"] * v + (1 - s["beta2"]) * avg * avg
w1 = w - s["lr"] * (m1 / (1 - s["beta1"] ** s["t"])) / ((v1 / (1 - s["beta2"] ** s["t"])).sqrt() + s["eps"])
rows = slice(0, 501) if rank == 0 else slice(501, n)  # Sliced(0): rank r holds rows [r * ceil(n / 2), ...)
mine = {"g": g[rank].clone(), "w": w.clone(), "m": (m[rows] if sliced else m).clone(),
        "v": (v[rows] if sliced else v).clone()}
module.step(mine, s)
torch.testing.assert_close(mine["w"], w1, rtol=1e-5, atol=1e-6)
torch.testing.assert_close(mine["m"], m1[rows] if sliced else m1, rtol=1e-5, atol=1e-6)
torch.testing.assert_close(mine["v"], v1[rows] if sliced else v1, rtol=1e-5, atol=1e-6)
assert torch.equal(mine["g"], g[rank])
dist.destroy_process_group()
print("ok")
"""


@pytest.mark.parametrize(
    "text,backend",
    [
        ("", "gloo"),
        ("split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0); fc_chunks=4", "shm"),
        ("split(ar0); reorder(ag0); fuse_collective(rs0)", "shm"),
    ],
    ids=["baseline-gloo", "zero1-shm", "fused-collective-shm"],
)
def test_generated_code_runs_where_coconet_cannot_be_imported(tmp_path, text, backend):
    prog = example("adam")
    sched = Schedule.parse(text, prog) if text else Schedule(prog)
    module = tmp_path / "adam_step.py"
    runtime.write(lower(sched, backend, "eager").source, backend, module, standalone=True)
    assert "from coconet_kernels." in module.read_text() and "from coconet.kernels" not in module.read_text()
    assert (tmp_path / "coconet_kernels" / "context.py").is_file()
    driver = tmp_path / "driver.py"
    driver.write_text(STANDALONE)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sliced = "1" if sched.sharded else "0"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(driver), str(module), str(r), str(port), sliced],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in ranks]
    for p, (out, err) in zip(ranks, outs):
        assert p.returncode == 0 and out.strip() == "ok", err[-2000:]


def test_a_chunk_c_cannot_translate_keeps_inductors_kernel():
    """ZeRO-1 of an update with exp in it: the chunk's kernel stays Inductor's alone; the same update without
    exp gets the C kernel, streaming the peers' rows."""
    from coconet import Local, Program, Replicated, allreduce, exp

    def program(with_exp):
        p = Program("decay", dims=("N",))
        g = p.tensor("g", ("N",), layout=Local)
        w = p.tensor("w", ("N",), layout=Replicated)
        m = p.tensor("m", ("N",), layout=Replicated)
        lr = p.scalar("lr")
        s = allreduce(g)
        m1 = m * 0.5 + s
        p.update(m, m1)
        p.update(w, w - lr * (exp(m1) if with_exp else m1))
        return p.ir

    for with_exp in (True, False):
        prog = program(with_exp)
        sched = Schedule.parse("split(ar0); reorder(ag0); as_slice(m); fuse_collective(rs0)", prog)
        source = lower(sched, "shm").source
        assert ("_chunk0 = _kernel(_chunk0)" in source) == with_exp
        assert ("_chunk0 = _native(_kernel(_chunk0), " in source) != with_exp
        assert ("void coconet_chunk(" in source) != with_exp


def test_a_fuse_kernel_writes_into_the_peers_state_only_where_no_other_reader_runs_while_it_does():
    """The peers write their rows into this rank's w while its kernel runs: LAMB's ``norm(w)``, which reads all
    of w, must come before the kernel."""
    from coconet.codegen.analysis import (
        absorbed_by_collective,
        fuse_absorbed,
        fuse_gathers_into,
        gathers_into_state,
        step_units,
    )

    p = Schedule.parse(
        "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse(mul7, sub4); fuse_collective(rs0)", example("lamb")
    ).scheduled
    units = step_units(p)
    absorbed = absorbed_by_collective(p)
    into = gathers_into_state(p, units, absorbed)
    (fuse,) = [g for g in p.groups if g.kind == "fuse"]
    assert fuse_gathers_into(p, units, into, absorbed, fuse_absorbed(p)) == {fuse: {"ag3": "sub4"}}
    norm = next(s.name for s in p.stmts if s.op == "norm")
    late = [u for u in units if u != norm]
    late.insert(late.index(fuse) + 1, norm)  # norm(w) after the kernel: it would read rows the peers wrote
    assert fuse_gathers_into(p, late, into, absorbed, fuse_absorbed(p)) == {}


def test_an_update_by_one_pointwise_statement_is_computed_into_the_state():
    """An update whose value is one pointwise statement nothing else reads is computed at the end straight
    into the state (no new tensor, no copy), after the copies into the others; one that reads another state
    is copied as before, since that state may be written by then. Each schedule's values are checked
    against the reference interpreter on gloo and shm (a swap of two states among them)."""
    from coconet import Local, Program, Replicated, allreduce, where
    from coconet.tuner.launch import Options, run_schedules
    from tests.tuner.test_launch import assert_all_ok

    p = Program("swapped", dims=("N",))
    g = p.tensor("g", ("N",), layout=Local)
    a, b, c, d = (p.tensor(x, ("N",), layout=Replicated) for x in "abcd")
    s = allreduce(g)
    p.update(a, b * 2.0)
    p.update(b, a + s)
    p.update(c, c - s * 0.5)
    p.update(d, where(c > 0.5, d * 0.5, d))  # the mask from c before c is written
    src = lower(Schedule(p.ir), "gloo").source
    body = src[src.index("def step(") :]
    assert (
        body.index("    a.copy_(mul0)\n")
        < body.index("    b.copy_(add0)\n")
        < body.index("    torch.sub(c, mul1, out=c)\n    torch.where(gt0, mul2, d, out=d)\n")
    )
    assert "sub0 =" not in body and "where0 =" not in body
    acc = runpy.run_path(str(ROOT / "benchmarks/programs/adam_accumulate.py"))["program"].ir
    body = lower(Schedule(acc), "gloo").source
    assert "    torch.mul(acc, c1, out=acc)\n    torch.sub(w, div1, out=w)\n    return" in body
    assert "    m.copy_(add1)\n" in body  # read again after it is computed: a tensor of its own
    for backend in ("gloo", "shm"):
        opts = Options(world=2, sizes={"N": 1001}, backend=backend, time=False, timeout_s=120, kernels="eager")
        assert_all_ok(run_schedules(list(generate(p.ir)), opts))


def test_a_cast_of_a_state_to_its_own_dtype_is_a_copy():
    """torch's ``.to`` of a tensor's own dtype is the tensor itself: a state cast to its own dtype and
    returned, or kept as another state's new value, had been the state the step then overwrites (an output
    or a state of the value after the step: a wrong result in every schedule, 14 of 26 for the update)."""
    from coconet import Local, Program, Replicated, allreduce, cast
    from coconet.tuner.launch import Options, run_schedules
    from tests.tuner.test_launch import assert_all_ok

    p = Program("cast_kept", dims=("N",))
    g = p.tensor("g", ("N",), layout=Local)
    w = p.tensor("w", ("N",), layout=Replicated)
    prev = p.tensor("prev", ("N",), layout=Replicated)
    p.output("old_w", cast(w, "float32"))
    p.update(w, w - allreduce(g) * 0.1 + 0.01 * prev)
    p.update(prev, cast(w, "float32"))
    p.output("twice", cast(w, "float32") * 2.0)
    assert "    cast0 = _t(w).to(torch.float32).clone()\n" in lower(Schedule(p.ir), "gloo").source
    scheds = list(generate(p.ir))
    for backend, kernels in (("gloo", "eager"), ("shm", "compiled")):
        opts = Options(world=3, sizes={"N": 101}, backend=backend, time=False, timeout_s=120, kernels=kernels)
        assert_all_ok(run_schedules(scheds, opts))


def test_a_kernel_writes_a_state_in_place_when_its_other_readers_ran_before_it():
    """A fuse group's value that updates a state is written into the state by the kernel where every reader
    of the state outside the group runs before the kernel, into a tensor of its own (the error-feedback
    residual: ``g + e`` in the kernel before); one reader after the kernel, or a cast of the state (to its
    own dtype, the state itself) read after it, and the state is copied at the step's end as before. Every
    schedule is checked on gloo (eager) and shm (compiled)."""
    from coconet import Local, Program, Replicated, allreduce, cast
    from coconet.tuner.launch import Options, run_schedules
    from tests.tuner.test_launch import assert_all_ok

    ef = runpy.run_path(str(ROOT / "benchmarks/programs/ef_sign.py"))["program"].ir
    sched = Schedule.parse("fuse(add0, abs0, ge0); fuse(where0, sub0)", ef)
    for backend in ("gloo", "shm"):
        src = lower(sched, backend).source
        kernel = src[src.index("def _fuse1(") : src.index("_fuse1 = _kernel(_fuse1)")]
        assert "    e.copy_(sub0)\n" in kernel and "e.copy_" not in src[src.index("def step(") :]

    def program(late: bool, view: bool):
        p = Program("late_reader", dims=("N",))
        g, e = p.tensor("g", ("N",), layout=Local), p.tensor("e", ("N",), layout=Local)
        w = p.tensor("w", ("N",), layout=Replicated)
        c = g + e
        q = c * 0.5
        early = cast(e, "float32") if view else e * 2.0  # a cast to its own dtype is the state itself
        p.update(e, (c - q) * 0.9)
        later = e * 3.0 if late else early
        p.update(w, w - allreduce(q))
        p.output("r", later)
        return p.ir

    for late, view in ((False, False), (True, False), (False, True)):
        p = program(late, view)
        v = p.updates["e"]
        sched = Schedule.parse(f"fuse(add0, mul0); fuse({p[v].args[0]}, {v})", p)
        src = lower(sched, "gloo").source
        step = src[src.index("def step(") :]
        assert (f"    e.copy_({v})\n" in step) == (late or view), (late, view)
        for backend, kernels in (("gloo", "eager"), ("shm", "compiled")):
            opts = Options(world=2, sizes={"N": 101}, backend=backend, time=False, timeout_s=120, kernels=kernels)
            assert_all_ok(run_schedules(list(generate(p)), opts))


def test_a_state_returned_as_it_was_before_the_step_is_a_copy():
    """p.output of a state's own value, which the step then updates: the output is the value before the
    update (the reference's), not the tensor the end of the step overwrites (every schedule of it was a
    wrong result, on every backend). Checked on gloo and shm, the fused kernels compiled on shm."""
    from coconet import Local, Program, Replicated, allreduce
    from coconet.tuner.launch import Options, run_schedules
    from tests.tuner.test_launch import assert_all_ok

    p = Program("returns_old_state", dims=("N",))
    g = p.tensor("g", ("N",), layout=Local)
    w = p.tensor("w", ("N",), layout=Replicated)
    t = p.tensor("t", (), layout=Replicated)  # a 0-d state: the ranks had been given it as shape (1,)
    p.output("old_w", w)
    p.output("half", w * 0.5)
    p.output("old_t", t)
    p.update(t, t + 1.0)
    p.update(w, w - allreduce(g) * 0.1 * t)
    assert "    _outputs['old_w'] = w.clone()\n" in lower(Schedule(p.ir), "gloo").source
    scheds = list(generate(p.ir))
    for backend, kernels in (("gloo", "eager"), ("shm", "eager"), ("shm", "compiled")):
        opts = Options(world=2, sizes={"N": 101}, backend=backend, time=False, timeout_s=120, kernels=kernels)
        assert_all_ok(run_schedules(scheds, opts))


def test_states_swapped_are_copied_before_a_kernel_writes_one():
    """a <- b, b <- a + s, with b written in place by a fused collective's kernel: a gets b as it was before
    the step, copied as the step begins under a name of its own (it had been copied after the kernel wrote b,
    and rebound the name b, so that b's own update went into the copy: every schedule was wrong)."""
    from coconet import Local, Program, Sliced, reduce_scatter
    from coconet.tuner.launch import Options, run_schedules
    from tests.tuner.test_launch import assert_all_ok

    p = Program("swapped_sliced", dims=("N",))
    g = p.tensor("g", ("N",), layout=Local)
    w, a, b = (p.tensor(x, ("N",), layout=Sliced(0)) for x in "wab")
    s = reduce_scatter(g)
    p.output("w_rows_before", w)
    p.update(w, w - s * 0.5)
    p.update(a, b)
    p.update(b, a + s)
    src = lower(Schedule(p.ir), "gloo").source
    assert "    b = tensors['b']\n    _b_before = b.clone()\n" in src and "    a.copy_(_b_before)\n" in src
    scheds = list(generate(p.ir))
    assert any("fuse_collective" in x.text for x in scheds)
    for backend, kernels in (("gloo", "eager"), ("shm", "eager"), ("shm", "compiled")):
        opts = Options(world=3, sizes={"N": 101}, backend=backend, time=False, timeout_s=120, kernels=kernels)
        assert_all_ok(run_schedules(scheds, opts))


def test_a_state_only_a_fused_collective_writes_is_bound_before_it():
    """s1 and s2 are read by nothing but their updates, which a fused collective gathers into them, and s0
    is updated to s2 as it was: every input is bound, and s2 copied, before the collective runs (they had
    come after it: a NameError in the collective, found by the strategy's states updated from states)."""
    from coconet import Local, Program, Replicated, allreduce, dropout
    from coconet.tuner.launch import Options, run_schedules
    from tests.tuner.test_launch import assert_all_ok

    p = Program("gathered_unread", dims=("N",))
    g = p.tensor("g", ("N",), layout=Local)
    r = allreduce(g)  # before the states are declared: the collective's unit came before them
    s0, s1, s2 = (p.tensor(x, ("N",), layout=Replicated) for x in ("s0", "s1", "s2"))
    p.update(s0, s2)
    p.update(s1, dropout(r, 0.3, 7))
    p.update(s2, r / s0)
    sched = Schedule.parse("split(ar0); reorder(ag0); fuse_collective(rs0)", p.ir)
    src = lower(sched, "shm", "eager").source
    body = src[src.index("    g = tensors['g']") :]
    assert body.index("_s2_before = s2.clone()") < body.index("_fused_collective0(_c")
    for backend in ("gloo", "shm"):
        opts = Options(world=2, sizes={"N": 11}, backend=backend, time=False, timeout_s=120, kernels="eager")
        assert_all_ok(run_schedules(list(generate(p.ir)), opts))
