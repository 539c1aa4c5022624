"""The shm backend on real worlds of ranks: every schedule correct, and no segment left behind."""

import inspect
import multiprocessing
import os
import re
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coconet.codegen.lower import lower
from coconet.kernels import chunk as chunk_table
from coconet.kernels import copier
from coconet.kernels import segments as shm_segments
from coconet.schedules.schedule import Schedule
from coconet.schedules.space import generate
from coconet.tuner.launch import Options, free_port, run_schedules
from tests.codegen import faulty, warm_rank
from tests.codegen.shared_state import SCHEDULE as ZERO1
from tests.codegen.test_lower import factored
from tests.strategies import collective_programs
from tests.tuner.test_launch import (
    BENCH_PROGRAMS,
    BENCH_SIZES,
    EXAMPLES,
    RANKS,
    SIZES,
    assert_all_ok,
    example,
    of_this_run,
    rank_processes,
)


def shm_only(world, sizes, kernels="eager", **kw):
    return Options(world=world, sizes=sizes, backend="shm", time=False, timeout_s=60, kernels=kernels, **kw)


def segments() -> list[Path]:
    """Segments left by this test run: a segment is named for the pid of the rank that made it, and one whose
    maker still lives outside this run belongs to a coconet job running beside the tests."""
    return [
        p
        for p in Path("/dev/shm").glob("coconet-*")
        if not Path(f"/proc/{p.name.split('-')[1]}").exists() or of_this_run(p.name.split("-")[1])
    ]


def bench_program(name: str):
    """The IR of benchmarks/programs/<name>.py."""
    return runpy.run_path(str(Path(__file__).parents[2] / f"benchmarks/programs/{name}.py"))["program"].ir


def assert_right_on_shm(schedules, worlds=((2, 1001), (3, 37))):
    """Each schedule compiled at one chunk and four, on shm at each (world, N): every rank ends with the
    reference's state, and nothing is left in /dev/shm."""
    for world, n in worlds:
        assert_all_ok(
            run_schedules(
                [s.with_knobs(fc_chunks=k) for s in schedules for k in (1, 4)],
                Options(world=world, sizes={"N": n}, backend="shm", warmup=1, repeats=2),
            )
        )
    assert not segments()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", EXAMPLES)
def test_every_schedule_of_every_example_on_shm(name, world):
    prog = example(name)
    sizes = {d: SIZES[d] for d in prog.dims}
    assert_all_ok(run_schedules(list(generate(prog)), shm_only(world, sizes, stages=2)))
    assert not segments() and not rank_processes()


@pytest.mark.parametrize("name", ["adam", "megatron_mlp"])
def test_four_ranks(name):
    prog = example(name)
    sizes = {d: SIZES[d] for d in prog.dims}
    assert_all_ok(run_schedules(list(generate(prog)), shm_only(4, sizes)))


def test_knob_values_on_shm():
    """More chunks than rows, bucket caps that split a bucket into several launches."""
    adam = example("adam")
    scheds = [
        s.with_knobs(**{k: v})
        for s in generate(adam)
        if s.knob_values
        for k, (_, domain) in s.knob_domains.items()
        for v in domain
    ]
    assert_all_ok(run_schedules(scheds, shm_only(3, {"N": 7})))
    megatron = example("megatron_mlp")
    scheds = [s.with_knobs(chunks=c) for s in generate(megatron) if "chunks" in s.knob_values for c in (2, 16)]
    assert_all_ok(run_schedules(scheds, shm_only(2, {"B": 3, "S": 2, "H": 5})))


@settings(max_examples=3, **RANKS)
@given(collective_programs(), st.sampled_from([2, 3]), st.sampled_from(["eager", "compiled"]))
def test_unseen_collective_programs_on_shm(p, world, kernels):
    # compiled: chunk kernels that compute each rank's rows from its inputs before they are summed
    assert_all_ok(run_schedules(list(generate(p.ir, depth=4)), shm_only(world, {"N": 5, "M": 7}, kernels=kernels)))


def test_compiled_kernels_and_timing_on_shm():
    adam = example("adam")
    fused = [s for s in generate(adam) if "fuse" in s.text and "as_slice(w)" in s.text]
    results = run_schedules(fused, Options(world=2, sizes={"N": 1001}, backend="shm", warmup=1, repeats=3))
    assert_all_ok(results)
    assert all(len(r.samples) == 3 for r in results)


def test_compiled_fused_collective_gathers_straight_into_the_state(monkeypatch, tmp_path):
    """ZeRO-1 Adam: each chunk's kernel writes its rows of w in place and into the peers' w (eager: a push
    after each chunk copies them there); no gathered temporary, no slot, no copy into w after. R = 2 and 3,
    uneven rows, one, two and more chunks than a rank has rows (each checked at a first step and at a
    steady one). The kernel is C (coconet.kernels.native), built into the cache by the ranks."""
    monkeypatch.setenv("COCONET_CACHE_DIR", str(tmp_path))
    zero1 = Schedule.parse("split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0)", example("adam"))
    source = lower(zero1, "shm").source
    step = source[source.index("def step(") :]
    assert "_ag3 = _Gather(_rank, 0, d_N, w, 'w', 0)" in step and "_ag3.into(w)" in step
    assert "_chunk0(_ag3.peer_rows(_c), " in step and ".push(" not in step
    assert "    for _peer in w_peers:\n        _peer.copy_(sub4)\n" in source
    assert '_chunk0 = _native(_kernel(_chunk0), \'ptttlssssssss\', r"""' in source
    assert "w.copy_(" not in step and "_ag3.add(" not in step
    eager = lower(zero1, "shm", kernels="eager").source
    assert "_ag3.push(_c)" in eager and ".peer_rows(" not in eager[eager.index("def step(") :]
    for world, n in ((2, 1001), (3, 7)):
        results = run_schedules(
            [zero1.with_knobs(fc_chunks=k) for k in (1, 2, 8)],
            Options(world=world, sizes={"N": n}, backend="shm", warmup=1, repeats=2),
        )
        assert_all_ok(results)
    assert len(list((tmp_path / "kernels").glob("chunk_*.so"))) == 1


@pytest.mark.parametrize(
    "name,tag,letters,worlds",
    [("adam_bf16_params", "bf16", "buh", ((2, 1001), (3, 37))), ("adam_fp16_params", "f16", "yxk", ((3, 37),))],
)
def test_the_half_precision_copy_of_the_weights_is_written_by_the_c_chunk(name, tag, letters, worlds):
    """Mixed-precision Adam (benchmarks/programs/adam_bf16_params.py, adam_fp16_params.py): the fused
    collective's chunk kernel rounds the new weights to the half dtype and stores them into this rank's rows
    and the peers' copies in C, beside the float32 state (a cast to bfloat16 had kept Inductor's kernel for the
    whole chunk, whose ordinary stores into the peers' copies read each line first). The copy every rank ends
    with is the reference's, moments whole and sharded, uneven rows, one chunk and several."""
    prog = bench_program(name)
    fused = [s for s in generate(prog) if "fuse_collective" in s.text]
    assert any("as_slice(m)" in s.text for s in fused) and any("as_slice" not in s.text for s in fused)
    whole = [s for s in fused if "as_slice(w16)" not in s.text]  # a copy left sharded goes to no peer
    assert whole
    for s in whole:
        source = lower(s, "shm").source
        kinds = re.search(r"_chunk0 = _native\(_kernel\(_chunk0\), '(\w+)'", source)
        assert kinds and set(letters) <= set(kinds.group(1)), s.text  # w16's peers and rows, g's half parts
        assert f"st_{tag}(p_w16_k + i, p_cast1);" in source and f"st_{tag}(d, x[" in source
    assert_right_on_shm(fused, worlds)


def test_moments_kept_in_bfloat16_are_widened_and_written_back_by_the_c_chunk(monkeypatch, tmp_path):
    """Adam with bfloat16 moments (benchmarks/programs/adam_bf16_states.py): the fused collective's C chunk loads
    the moments' bfloat16 rows through their casts to float32 and stores the new ones, rounded, into this rank's
    rows and the peers' copies (a bfloat16 state read had kept Inductor's kernel for the whole chunk). Each
    schedule whose chunk is C (the moments whole, their casts in the chunk or in a fuse kernel before it) ends
    with the reference's state: uneven rows, one chunk and several. (The every-schedule test runs the rest.)"""
    prog = bench_program("adam_bf16_states")
    whole = Schedule.parse("split(ar0); reorder(ag0); fuse_collective(rs0)", prog)
    source = lower(whole, "shm").source
    kinds = re.search(r"_chunk0 = _native\(_kernel\(_chunk0\), '(\w+)'", source)
    assert kinds and kinds.group(1).count("u") == 2 and kinds.group(1).count("b") == 2  # m, v: rows and peers
    assert "ld_bf16(p_m_k + i)" in source and "ld_bf16(p_v_k + i)" in source and "st_bf16(p_m_k + i, " in source
    in_c = [s for s in generate(prog) if "fuse_collective" in s.text and "= _native(" in lower(s, "shm").source]
    assert whole in in_c and len(in_c) >= 8
    # the moments' all_gathers bucketed: the chunk writes the new bfloat16 rows into the bucket's buffers, whose
    # rows it takes as bfloat16 (it had taken them as float32 and kept Inductor's kernel)
    bucketed = [s for s in in_c if "bucket(" in s.text]
    assert len(bucketed) == 4
    for s in bucketed:
        source = lower(s, "shm").source
        assert "st_bf16(p__cast2_k + i, p_cast2);" in source, s.text
        _, runs = c_chunk_and_python(source, monkeypatch, tmp_path)
        for got, want in runs:
            assert_same_bits([({x: got[x] for x in got if x.startswith("_cast")}, want)])
    assert_right_on_shm(in_c, worlds=((3, 37),))


def test_a_float16_gradient_averaged_in_float16_is_summed_by_the_c_chunk(monkeypatch, tmp_path):
    """Adam on a float16 gradient reduced in float16 (benchmarks/programs/adam_fp16_grads.py, DeepSpeed's fp16
    default): the fused collective's C chunk widens the peers' float16 rows and rounds every partial sum and the
    average to float16 as torch's half add and divide do (the chunk had stayed Inductor's, which sums in float32
    and rounds once). The moments, which only add and multiply, have the Python chunk's bits over three ranks'
    rows; every schedule ends with the reference's state, R = 2 and 3, uneven rows, one chunk and several."""
    prog = bench_program("adam_fp16_grads")
    fused = [s for s in generate(prog) if "fuse_collective" in s.text]
    in_c = [s for s in fused if "= _native(" in lower(s, "shm").source]
    assert [s for s in fused if "as_slice(w16)" not in s.text] == in_c
    for s in in_c:
        source = lower(s, "shm").source
        assert "p_rs0 = vround_f16((p_rs0 + ld_f16(a->p_rs0_parts[r] + i)));" in source, s.text
        assert "p_rs0 = vround_f16(p_rs0 / (float)a->n_rs0_parts);" in source, s.text
        _, runs = c_chunk_and_python(source, monkeypatch, tmp_path)
        for got, want in runs:
            moments = [x for x in got if x.startswith(("m_", "v_"))]  # their rows, and peers' copies if whole
            assert {"m_k", "v_k"} <= set(moments), s.text
            assert_same_bits([({x: got[x] for x in moments}, want)])
    assert_right_on_shm(fused)


def test_arithmetic_kept_in_bfloat16_stays_in_inductors_chunk():
    """Pure-bf16 Adam (benchmarks/programs/adam_bf16.py: no float32 master copy): torch keeps every op of the
    update in bfloat16, rounding each result, and so would C; measured, that rounding made the C chunk 3.4x the
    step of Inductor's at world 2 (benchmarks/results/interleaved_adam_bf16_rounded_w2.json), so such a chunk
    stays Inductor's. Every fused schedule, compiled, ends with the reference's state: R = 2 and 3, uneven rows."""
    prog = bench_program("adam_bf16")
    fused = [s for s in generate(prog) if "fuse_collective" in s.text]
    assert fused and not any("= _native(" in lower(s, "shm").source for s in fused)
    assert_right_on_shm(fused)


def test_a_reduced_gradient_kept_as_state_is_stored_by_the_c_chunk(monkeypatch, tmp_path):
    """Adan (benchmarks/programs/adan.py) keeps the reduced gradient as next step's previous one (``p.update(gp,
    grad)``). Where the fused collective reduces before its kernel (gp sliced, no reorder), the kernel is given the
    reduced rows and stores them into gp as they are, in C (it had kept Inductor's kernel). The state the kernel
    writes has the Python chunk's bits (the new weights aside: they pass through a square root); every such
    schedule ends with the reference's state, R = 2 and 3, uneven rows, one chunk and several."""
    prog = bench_program("adan")
    stored = [
        s
        for s in generate(prog)
        if "fuse_collective" in s.text and "st(p_gp_k + i, ld(p_rs0 + i));" in lower(s, "shm").source
    ]
    assert len(stored) >= 2
    for s in stored:
        _, runs = c_chunk_and_python(lower(s, "shm").source, monkeypatch, tmp_path)
        for got, want in runs:
            assert "gp_k" in got, s.text
            assert_same_bits([({x: got[x] for x in got if x.startswith(("gp_", "d_", "n_"))}, want)])
    assert_right_on_shm(stored)


def test_a_gather_outside_a_fused_collective_writes_straight_into_the_state():
    """An all_gather that is the new value of a Replicated state, outside any fused collective (Adam's m, v and w
    after ``split; reorder``, LAMB's w after its fused collective, read by ``norm(w)`` before): each rank writes its
    rows into its own copy and the peers', with no gathered temporary, no slot and no copy into the state at the
    end. R = 2 and 3, uneven rows, the first step (state moved into shared memory) and a steady one."""
    cases = {
        "adam": ("split(ar0); reorder(ag0)", ("m", "v", "w")),
        "lamb": ("split(ar0); reorder(ag0); fuse_collective(rs0)", ("w",)),
    }
    scheds = {}
    for name, (text, states) in cases.items():
        sched = Schedule.parse(text, example(name))
        step = lower(sched, "shm").source.split("def step(")[1]
        for state in states:
            assert re.search(rf"_gather_into\(_c, \w+, 0, d_N, {state}, '{state}'\)", step), step
            assert f"{state}.copy_(" not in step
        assert "_all_gather(" not in step
        assert "_gather_into(" not in lower(sched, "gloo").source
        scheds[name] = [sched]
    zero1 = Schedule.parse("split(ar0); reorder(ag0); as_slice(m); as_slice(v)", example("adam"))
    step = lower(zero1, "shm").source.split("def step(")[1]
    assert "_gather_into(_c, sub4, 0, d_N, w, 'w')" in step and "m.copy_(add0)" in step
    scheds["adam"].append(zero1)
    for world, n in ((2, 1001), (3, 7)):
        for same_program in scheds.values():
            assert_all_ok(
                run_schedules(same_program, Options(world=world, sizes={"N": n}, backend="shm", warmup=1, repeats=2))
            )


def test_a_fused_kernel_writes_its_rows_into_every_copy_of_the_state_it_gathers_into():
    """LAMB's step in two passes around its trust ratio: the fused collective sums ``u * u`` chunk by chunk as it
    computes ``u`` (no ``u * u`` written out), and the kernel of ``w - lr * trust * u`` writes each new row into
    this rank's w and every peer's as it computes it (no temporary, no gather after; C, with streamed stores).
    Compiled, w gathered
    whole or m and v sharded too, R = 2 and 3, uneven rows, one chunk and more chunks than rows, the first step
    (state moved into shared memory) and a steady one. Eager, the kernel leaves the gather to _gather_into."""
    texts = [
        "split(ar0); reorder(ag0); fuse(mul7, sub4); fuse_collective(rs0)",
        "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse(mul7, sub4); fuse_collective(rs0)",
    ]
    scheds = [Schedule.parse(text, example("lamb")) for text in texts]
    for sched in scheds:
        src = lower(sched, "shm").source
        step = src.split("def step(")[1]
        assert "psum0 = torch.stack(_psum0).sum()" in step and "mul8" not in step
        # the rows it reads and writes cut at the call: C runs it, streaming its rows into the peers' copies
        assert re.search(
            r"\(_ag3,\), \(w_peers,\) = _into_peers\(_c, \(0, d_N, w, 'w'\)\)\n"
            r"    _fuse(\d)\(w_peers, _c\.cut\(w, 0, d_N\), .*\)\n    _ag3.into\(w\)\n",
            step,
        ), step
        assert "    for _peer in w_peers:\n        _peer.copy_(sub4)" in src and "_gather_into(" not in step
        assert re.search(r"_fuse\d = _native\(_kernel\(_fuse\d\), 'ptst', ", src)
        assert "_gather_into(_c, sub4, 0, d_N, w, 'w')" in lower(sched, "shm", kernels="eager").source
    # Adam with every state whole: m, v and w written by one kernel, their copies mapped at one barrier before
    # it and whole at one barrier after it
    adam = Schedule.parse(
        "split(ar0); reorder(ag0); fuse(mul1, add0, mul3, mul4, add1, div0, div1, mul5, sqrt0, add2, div2, sub4)",
        example("adam"),
    )
    step = lower(adam, "shm").source.split("def step(")[1]
    assert (
        "(_ag1, _ag2, _ag3), (m_peers, v_peers, w_peers) = _into_peers(_c, (0, d_N, m, 'm'), (0, d_N, v, 'v'), "
        "(0, d_N, w, 'w'))"
    ) in step
    assert "_ag1.into(m)\n    _ag2.into(v, end=False)\n    _ag3.into(w, end=False)" in step
    for world, n in ((2, 1001), (3, 7)):
        options = Options(world=world, sizes={"N": n}, backend="shm", warmup=1, repeats=2)
        assert_all_ok(run_schedules([s.with_knobs(fc_chunks=k) for s in scheds for k in (1, 8)], options))
        assert_all_ok(run_schedules([adam], options))
    assert not segments()


def test_a_c_chunk_kernel_returns_its_partial_sums():
    """SGD on an unscaled gradient that also counts its large elements (GradScaler's found_inf, made to count):
    the fused collective's chunk runs as C (the comparison, the where, w's rows streamed into the peers' copies)
    and returns its share of the count. buf whole and sharded, R = 2 and 3, uneven rows, one chunk and more
    chunks than rows."""
    import coconet as cc

    p = cc.Program("count_sgd", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    w, buf = p.tensor("w", ("N",), layout=cc.Replicated), p.tensor("buf", ("N",), layout=cc.Replicated)
    lr, momentum, scale = p.scalars("lr momentum scale")
    grad = cc.allreduce(g) / scale
    p.output("large", cc.sum(cc.where(cc.abs(grad) <= 0.5, 0.0, 1.0)))
    b1 = momentum * buf + grad
    p.update(buf, b1)
    p.update(w, w - lr * (grad + momentum * b1))
    scheds = [
        Schedule.parse(f"split(ar0); reorder(ag0); {x}fuse_collective(rs0)", p.ir) for x in ("", "as_slice(buf); ")
    ]
    for sched in scheds:
        src = lower(sched, "shm").source
        assert re.search(r"_chunk0 = _native\(_kernel\(_chunk0\), '\w+', r\"\"\"", src) and '""", sums=1)' in src
        assert re.search(r"const v8i p_le0 = \(p_abs0 <= p_c\d\);", src) and "vsel(p_le0, " in src
        assert "psum0, = _chunk0(" in src.split("def step(")[1]
    for world, n in ((2, 1001), (3, 7)):  # compiled: the C kernel runs
        options = Options(world=world, sizes={"N": n}, backend="shm", warmup=1, repeats=2)
        assert_all_ok(run_schedules([s.with_knobs(fc_chunks=k) for s in scheds for k in (1, 8)], options))
    assert not segments()


def predivided_adam():
    import coconet as cc

    p = cc.Program("adam_predivide", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    w, m, v = (p.tensor(x, ("N",), layout=cc.Replicated) for x in "wmv")
    lr, pre = p.scalars("lr pre")
    avg = cc.allreduce(g / pre) * (pre / 2.0)
    m1, v1 = 0.9 * m + 0.1 * avg, 0.999 * v + 0.001 * avg * avg
    p.update(m, m1)
    p.update(v, v1)
    p.update(w, w - lr * m1 / (cc.sqrt(v1) + 1e-8))
    return p.ir


def bf16_unscaled_sgd():
    import coconet as cc

    p = cc.Program("bf16_sgd", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local, dtype="bfloat16")
    w, buf = p.tensor("w", ("N",), layout=cc.Replicated), p.tensor("buf", ("N",), layout=cc.Replicated)
    inv = p.scalar("inv_scale")
    grad = cc.allreduce(cc.cast(g, "float32") * inv, op="avg")
    b1 = 0.9 * buf + grad
    p.update(buf, b1)
    p.update(w, w - 0.01 * b1)
    return p.ir


def test_the_chunk_kernel_computes_each_ranks_gradient_before_it_sums_them():
    """Adam on a gradient predivided before its allreduce (apex's gradient_predivide_factor) and momentum SGD
    on a bf16 gradient cast to float32 and unscaled: the fused collective's chunk kernel computes each rank's
    rows of the value reduced from that rank's rows of g, read where they lie, and sums those; nothing
    computes the whole value or publishes it (it was written out, published and read back: the predivided
    Adam's step took 1.7x as long). Both in C, the bf16 rows widened as they are loaded. Compiled, R = 2 and 3,
    uneven rows, one chunk and more chunks than rows."""
    adam = Schedule.parse("split(ar0); reorder(ag0); fuse_collective(rs0)", predivided_adam())
    sgd = Schedule.parse("split(ar0); reorder(ag0); fuse_collective(rs0)", bf16_unscaled_sgd())
    src = lower(adam, "shm").source
    step = src[src.index("def step(") :]
    assert " / pre" not in step and "_reduce_scatter_parts(_rank, g, 0, d_N, 4, 'g', 3)" in step
    assert "    for g in rs0_parts:\n        div0 = g / pre\n" in src
    assert re.search(r"_chunk0 = _native\(_kernel\(_chunk0\), '\w+', r\"\"\"", src)
    assert "for (long r = 0; r < a->n_rs0_parts; r++) {" in src and "const v8 p_div0 = (p_g / p_pre);" in src
    src = lower(sgd, "shm").source
    step = src[src.index("def step(") :]
    assert ".to(torch.bfloat16)" not in step and ".to(torch.float32)" not in step
    assert "_reduce_scatter_parts(_rank, g, 0, d_N, 4, 'g', 2)" in step
    assert "    for g in rs0_parts:\n        cast0 = _t(g).to(torch.float32)\n" in src
    assert re.search(r"_chunk0 = _native\(_kernel\(_chunk0\), 'p+t+hs+', r\"\"\"", src)
    assert "const v8 p_g = ld_bf16(a->p_rs0_parts[r] + i);" in src and "const v8 p_cast0 = p_g;" in src
    for sched in (adam, sgd):
        for world, n in ((2, 1001), (3, 7)):
            options = Options(world=world, sizes={"N": n}, backend="shm", warmup=1, repeats=2)
            assert_all_ok(run_schedules([sched.with_knobs(fc_chunks=k) for k in (1, 8)], options))
    assert not segments()


def weighted_sgd():
    """Each rank weights its gradient by its own token count before the sum (a Local number, as an input),
    then divides by the total; weights w."""
    import coconet as cc

    p = cc.Program("weighted_sgd", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    n = p.tensor("n", (), layout=cc.Local)
    w, buf = p.tensor("w", ("N",), layout=cc.Replicated), p.tensor("buf", ("N",), layout=cc.Replicated)
    grad = cc.allreduce(g * n) / cc.allreduce(n)
    b1 = 0.9 * buf + grad
    p.update(buf, b1)
    p.update(w, w - 0.01 * b1)
    return p.ir


def locally_clipped_momentum():
    """Each rank clips its gradient by its own norm before the sum (a Local number computed in the step),
    and the momentum is returned as well as kept."""
    import coconet as cc

    p = cc.Program("preclip", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    w, mom = p.tensor("w", ("N",), layout=cc.Replicated), p.tensor("mom", ("N",), layout=cc.Replicated)
    scale = cc.minimum(1.0 / (cc.norm(g) + 1e-6), 1.0)
    a = cc.allreduce(g * scale)
    m1 = 0.9 * mom + a
    p.update(mom, m1)
    p.update(w, w - 0.01 * (a + 0.9 * m1))
    p.output("m", m1)
    return p.ir


def test_numbers_each_rank_holds_its_own_of_are_posted_for_the_chunk_kernel():
    """A gradient weighted by the rank's token count, or clipped by its own norm, before its allreduce: every
    rank posts its number at the barrier that begins the fused collective, and the chunk kernel computes each
    rank's rows with that rank's number (in C where it streams the state into the peers' copies); the
    weighted gradient is never written out and published. Compiled, R = 2 and 3, uneven rows, one chunk and
    more chunks than rows, the first step and a steady one."""
    weighted = Schedule.parse("split(ar0); reorder(ag0); fuse_collective(rs0)", weighted_sgd())
    clipped = Schedule.parse("split(ar0); reorder(ag0); fuse_collective(rs0)", locally_clipped_momentum())
    src = lower(weighted, "shm").source
    step = src[src.index("def step(") :]
    assert " * n" not in step
    assert "for _c, rs0_parts, n_ranks in _reduce_scatter_parts(_rank, g, 0, d_N, 4, 'g', 2, numbers=(n, )):" in step
    assert "    for g, n in zip(rs0_parts, n_ranks):\n        mul0 = g * n\n" in src
    assert re.search(r"_chunk0 = _native\(_kernel\(_chunk0\), 'p+t+lq[st]*', r\"\"\"", src)
    assert "const v8 p_n = splat(a->p_n_ranks[r]);" in src and "const float p_n = a->p_n_ranks[r];" in src
    src = lower(clipped, "shm").source
    step = src[src.index("def step(") :]
    assert "numbers=(minimum0, )):" in step and " * minimum0" not in step
    for sched in (weighted, clipped):
        for world, n in ((2, 1001), (3, 7)):
            options = Options(world=world, sizes={"N": n}, backend="shm", warmup=1, repeats=2)
            assert_all_ok(run_schedules([sched.with_knobs(fc_chunks=k) for k in (1, 8)], options))
    assert not segments()


def keep_masks():
    """A product over ranks of each rank's keep-mask (1 where its gradient is finite) and a minimum over
    ranks of its clipped gradient, both of values each rank computes from its own gradient; SGD where every
    rank kept the element."""
    import coconet as cc

    p = cc.Program("keep_masks", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    w = p.tensor("w", ("N",), layout=cc.Replicated)
    keep = cc.allreduce(cc.where(cc.abs(g) < 1e30, 1.0, 0.0), op="prod")
    low = cc.allreduce(cc.minimum(g * 0.5, 1.0), op="min")
    p.update(w, cc.where(keep > 0.5, w - 0.01 * low, w))
    return p.ir


def test_a_max_min_or_product_over_ranks_is_taken_as_the_kernel_reads_the_rows():
    """An amax (the maximum over ranks of each rank's |g|), a product of keep-masks and a minimum of clipped
    gradients: the chunk kernel computes each rank's value from its rows of g, read where they lie, and
    reduces them as it reads them, as it sums them for a sum; nothing computes |g| whole or publishes it.
    R = 2 and 3, uneven rows, one chunk and more chunks than rows."""
    amax = Schedule.parse(
        "split(ar0); split(ar1); reorder(ag0); reorder(ag1); fuse_collective(rs0)", bench_program("amax_scale")
    )
    src = lower(amax, "shm").source
    step = src[src.index("def step(") :]
    assert "abs" not in step and "_reduce_scatter_parts(_rank, g, 0, d_N, 4, 'g', 0):" in step
    assert "    for g in rs0_parts:\n        abs0 = torch.abs(g)\n        _abs0.append(abs0)\n" in src
    assert "    rs0 = _reduce_all(_abs0, 'max')\n" in src
    masks = Schedule.parse(
        "split(ar0); split(ar1); reorder(ag0); reorder(ag1); fuse_collective(rs0); fuse_collective(rs1)", keep_masks()
    )
    src = lower(masks, "shm").source
    assert "_reduce_all(_where0, 'prod')" in src and "_reduce_all(_minimum0, 'min')" in src
    step = src[src.index("def step(") :]
    assert "torch.where" not in step and "torch.minimum" not in step
    for sched in (amax, masks):
        for world, n in ((2, 1001), (3, 7)):
            options = Options(world=world, sizes={"N": n}, backend="shm", warmup=1, repeats=2)
            assert_all_ok(run_schedules([sched.with_knobs(fc_chunks=k) for k in (1, 8)], options))
    assert not segments()


def test_factors_broadcast_to_the_rows_a_rank_computes():
    """Every schedule of a step from (M, 1) by (1, K) factors and a (K,) rate, which the ranks compute on their
    rows (test_lower's factored), and of the same step returning the factors' product whole: R = 2 and 3, rows
    uneven, compiled and eager (each program each way once, at the other world the other way)."""
    two, three = (2, {"M": 7, "K": 5}), (3, {"M": 8, "K": 3})
    for p, ways in (
        (factored(), ((two, "compiled"), (three, "eager"))),
        (factored(output=True), ((three, "compiled"), (two, "eager"))),
    ):
        for (world, sizes), kernels in ways:
            assert_all_ok(run_schedules(list(generate(p)), shm_only(world, sizes, kernels)))
    assert not segments()


def test_without_a_chunk_kernel_the_gradient_is_computed_whole_and_published(monkeypatch):
    """Where no compiled kernel can take the chunk, the statements it would have computed on every rank's rows
    run in the fused collective before it, on this rank's whole gradient, and that is published."""
    from coconet.codegen import render_collective

    monkeypatch.setattr(render_collective, "chunk_kernel", lambda *a, **k: None)
    adam = Schedule.parse("split(ar0); reorder(ag0); fuse_collective(rs0); fc_chunks=4", predivided_adam())
    src = lower(adam, "shm").source
    fc = src[src.index("def _fused_collective0(") : src.index("    g = tensors['g']")]
    assert "        div0 = g / pre\n" in fc and "_reduce_scatter_chunks(_rank, div0, 0, d_N, 4, 'sum'):" in fc
    assert "published once" in fc
    for world, n in ((2, 1001), (3, 7)):
        options = Options(world=world, sizes={"N": n}, backend="shm", warmup=1, repeats=2)
        assert_all_ok(run_schedules([adam], options))
    assert not segments()


def test_a_norm_of_state_from_its_rows_in_the_c_kernel_that_writes_the_state():
    """Adam that also reports the norm of the weights it starts from, the norm from each rank's rows
    (slice_reduce): the fused collective's C chunk reads each row of w once, for the update and the norm, and
    streams the new row into the peers' copies; the partial sum comes back with it. Compiled, R = 2 and 3,
    uneven rows, one chunk and more chunks than rows, the first step and a steady one."""
    import coconet as cc

    p = cc.Program("adam_wnorm", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    w, m, v = (p.tensor(x, ("N",), layout=cc.Replicated) for x in "wmv")
    lr, beta1, beta2, eps = p.scalars("lr beta1 beta2 eps")
    avg = cc.allreduce(g)
    m1, v1 = beta1 * m + (1 - beta1) * avg, beta2 * v + (1 - beta2) * avg * avg
    p.update(m, m1)
    p.update(v, v1)
    p.update(w, w - lr * m1 / (cc.sqrt(v1) + eps))
    p.output("wnorm", cc.norm(w))
    sched = Schedule.parse(
        "split(ar0); reorder(ag0); as_slice(m); as_slice(v); slice_reduce(norm0); fuse_collective(rs0)", p.ir
    )
    assert "sl0" in sched.scheduled.groups[0].members
    src = lower(sched, "shm").source
    assert re.search(r"_chunk0 = _native\(_kernel\(_chunk0\), '\w+', r\"\"\"", src) and '""", sums=1)' in src
    assert "const v8 p_sl0 = ld(p_w_k + i);" in src and "_norm(" not in src.split("def step(")[1]
    for world, n in ((2, 1001), (3, 7)):
        options = Options(world=world, sizes={"N": n}, backend="shm", warmup=1, repeats=2)
        assert_all_ok(run_schedules([sched.with_knobs(fc_chunks=k) for k in (1, 8)], options))
    assert not segments()


def test_powers_by_constants_in_the_c_kernel_that_writes_the_state():
    """Adam as people also write it (``avg ** 2``, ``v ** 0.5``, ``(…) ** -1``): the powers stay in the C chunk
    that streams w into the peers' copies, as the products, root and quotient torch computes for them; a power
    C has no translation for (``** 1.5``) keeps Inductor's kernel. Compiled, R = 2 and 3, uneven rows, one
    chunk and more chunks than rows."""
    import coconet as cc

    def adam(power):
        p = cc.Program("adam_pow", dims=("N",))
        g = p.tensor("g", ("N",), layout=cc.Local)
        w, m, v = (p.tensor(x, ("N",), layout=cc.Replicated) for x in "wmv")
        lr, beta1, beta2, eps = p.scalars("lr beta1 beta2 eps")
        avg = cc.allreduce(g)
        m1, v1 = beta1 * m + (1 - beta1) * avg, beta2 * v + (1 - beta2) * avg**2
        p.update(m, m1)
        p.update(v, v1)
        p.update(w, w - lr * m1 * (v1**power + eps) ** -1)
        return Schedule.parse("split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0)", p.ir)

    src = lower(adam(1.5), "shm").source
    assert "_chunk0 = _kernel(_chunk0)" in src and "_native(" not in src
    sched = adam(0.5)
    src = lower(sched, "shm").source
    assert re.search(r"_chunk0 = _native\(_kernel\(_chunk0\), '\w+', r\"\"\"", src)
    assert all(x in src for x in ("p_pow0 = (p_rs0 * p_rs0);", "p_pow1 = vsqrt(p_add1);", "p_pow2 = (1.0f / p_add2);"))
    for world, n in ((2, 1001), (3, 7)):
        options = Options(world=world, sizes={"N": n}, backend="shm", warmup=1, repeats=2)
        assert_all_ok(run_schedules([sched.with_knobs(fc_chunks=k) for k in (1, 8)], options))
    assert not segments()


def test_the_c_chunk_divides_a_number_by_a_tensor_as_torch_does(monkeypatch, tmp_path):
    """``3.0 / x`` in torch is x's reciprocal times 3 (Tensor.__rtruediv__, eager and compiled), an ulp from
    the quotient for a quarter of the values; the chunk's constants reach its kernel as Python numbers. The C
    chunk of a fused collective computes the bits of the Python kernel it stands in for, the generated
    module's own, called on the same rows; ``lr / x`` (lr a one-element tensor) stays a quotient."""
    import coconet as cc

    p = cc.Program("rdiv", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    w, m = (p.tensor(x, ("N",), layout=cc.Replicated) for x in "wm")
    lr = p.scalar("lr")
    avg = cc.allreduce(g)
    m1 = 0.9 * m + 0.1 * avg
    p.update(m, m1)
    p.update(w, w - 3.0 / (cc.sqrt(m1 * m1) + 1.0) - lr / (avg * avg + 0.5))
    source = lower(Schedule.parse("split(ar0); reorder(ag0); as_slice(m); fuse_collective(rs0)", p.ir), "shm").source
    c, runs = c_chunk_and_python(source, monkeypatch, tmp_path)
    assert_same_bits(runs)
    assert "((1.0f / p_add1) * p_c" in c and re.search(r"p_div1 = \(p_lr / p_add\d\);", c)


def c_chunk_and_python(source: str, monkeypatch, tmp_path) -> tuple[str, list[tuple[dict, dict]]]:
    """Runs the C of a generated module's chunk kernel, with any hand-off to Python an error, and the module's
    own Python chunk (eager torch) on the same random rows, 4096 and 37: the C source, and for each
    length every parameter's values after the C and after the Python (rows, peers' copies, slots)."""
    call = re.search(r'\n(_chunk\d+) = _native\(_kernel\(\1\), \'(\w+)\', r"""(.*?)"""\)', source, re.S)
    assert call, "the chunk has no C kernel"
    chunk, kinds, c = call.groups()
    python = {}
    exec(compile(source[: call.start()], "chunk", "exec"), python)  # the module up to its kernel's C
    params = list(inspect.signature(python[chunk]).parameters)
    numbers = dict(re.findall(r"^ +(c\d+) = (\S+)$", source, re.M))
    gen = torch.Generator().manual_seed(0)

    def args(rows):
        out = []
        for name, letter in zip(params, kinds, strict=True):
            kind = next(k for k, x in chunk_table.KINDS.items() if x == letter)
            dtype = (
                getattr(torch, chunk_table.DTYPE[chunk_table.half(kind)]) if chunk_table.half(kind) else torch.float32
            )
            if chunk_table.unhalved(kind) == "peers":
                out.append([torch.zeros(rows, dtype=dtype) for _ in range(2)])
            elif chunk_table.unhalved(kind) == "parts":
                out.append([torch.randn(rows, generator=gen).to(dtype) for _ in range(3)])
            elif chunk_table.unhalved(kind) == "rows":  # magnitudes: a second moment's square root is a number
                out.append(torch.randn(rows, generator=gen).abs().to(dtype))
            else:
                out.append(float(numbers[name]) if name in numbers else torch.tensor(0.01))
        return out

    def fallback(*_):
        raise AssertionError("the C kernel handed the call to the Python kernel")

    monkeypatch.setenv("COCONET_CACHE_DIR", str(tmp_path))
    kernel = copier.native(fallback, kinds, c)
    runs = []
    for rows in (4096, 37):
        want = args(rows)
        got = [
            [x.clone() for x in a] if isinstance(a, list) else a.clone() if isinstance(a, torch.Tensor) else a
            for a in want
        ]
        python[chunk](*want)
        kernel(*got)
        runs.append((dict(zip(params, got)), dict(zip(params, want))))
    return c, runs


def assert_same_bits(runs):
    for got, want in runs:
        for name in got:
            x, y = got[name], want[name]
            for u, v in zip(*((x, y) if isinstance(x, list) else ([x], [y]))):
                assert torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v, name


def test_a_gathered_output_is_written_into_its_slot_by_the_chunk_kernel(monkeypatch, tmp_path):
    """Adam with an average of the weights, the new weights returned in bfloat16 (benchmarks/programs/
    adam_ema.py), and a float32 output beside it: the fused collective's chunk kernel writes each gathered
    output's rows into this rank's slot of its gather, from which every rank copies them out, and is C with
    the state whole or sliced (it had returned them, to be copied in, and kept the chunk in Inductor's
    kernel). The bits are the Python kernel's; every rank's outputs the reference's, R = 2 and 3, uneven
    rows, one chunk and several."""
    import coconet as cc

    prog = bench_program("adam_ema")
    p = cc.Program("two_outputs", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    w = p.tensor("w", ("N",), layout=cc.Replicated)
    w1 = w - 0.01 * cc.allreduce(g)
    p.update(w, w1)
    p.output("w16", cc.cast(w1, "bfloat16"))
    p.output("step", (w1 - w) * 3.0)
    cases = [
        (s, f32)
        for f32, q in ((False, prog), (True, p.ir))
        for s in generate(q)
        if "fuse_collective" in s.text and "bucket" not in s.text
    ]
    assert any("as_slice(ema)" in s.text for s, _ in cases) and any("as_slice" not in s.text for s, _ in cases)
    for s, f32 in cases:
        source = lower(s, "shm").source
        step = source[source.index("def step(") :]
        assert ".own(_c, torch.bfloat16, (d_N, ))" in step and ".add(_c" not in step, s.text
        assert "st_bf16(p_cast0_slot + i, " in source, s.text
        assert (".own(_c, torch.float32, (d_N, ))" in step) == f32, s.text
        _, runs = c_chunk_and_python(source, monkeypatch, tmp_path)
        if f32:
            assert_same_bits(runs)
        else:  # eager torch's square root is at times an ulp from the correctly rounded one, C's and Inductor's
            for got, want in runs:  # the slot holds the new weights C wrote, rounded
                assert torch.equal(got["cast0_slot"], got["w_k"].to(torch.bfloat16)), s.text
                torch.testing.assert_close(got["w_k"], want["w_k"], rtol=1e-6, atol=0)  # an ulp, carried on
                torch.testing.assert_close(got["cast0_slot"].float(), want["cast0_slot"].float(), rtol=2**-7, atol=0)
    for world, n in ((2, 1001), (3, 37)):
        for f32 in (False, True):
            assert_all_ok(
                run_schedules(
                    [s.with_knobs(fc_chunks=k) for s, x in cases if x == f32 for k in (1, 4)],
                    Options(world=world, sizes={"N": n}, backend="shm", warmup=1, repeats=2),
                )
            )
    assert not segments()


def test_a_state_read_after_its_gather_is_gathered_through_a_slot():
    """``v`` reads the old ``w`` after the gather that gives ``w`` its new value has run: writing the peers' copies
    then would hand ``v`` the new rows, so that gather goes through a slot and ``w`` is written at the end."""
    import coconet as cc

    p = cc.Program("late_reader", dims=("N",))
    g, h = p.tensor("g", ("N",), layout=cc.Local), p.tensor("h", ("N",), layout=cc.Local)
    w, v = p.tensor("w", ("N",), layout=cc.Replicated), p.tensor("v", ("N",), layout=cc.Replicated)
    a, b = cc.allreduce(g), cc.allreduce(h)
    p.update(w, a)
    p.update(v, b + w)
    sched = Schedule.parse("split(ar0)", p.ir)
    step = lower(sched, "shm").source.split("def step(")[1]
    assert "_gather_into(" not in step and "_all_gather(_c, rs0, 0, d_N)" in step and "w.copy_(ag0)" in step
    assert_all_ok(run_schedules([sched], shm_only(3, {"N": 7})))


@pytest.mark.parametrize("kernels", ["eager", "compiled"])
def test_a_step_whose_only_collective_gathers_into_state_maps_no_slot(kernels):
    """The one collective of the step is an all_gather giving a Replicated state its new value: the group's
    segments carry the barrier's header alone (no slot to size), the state is whole on every rank after the
    first step (state moved into shared memory) and a steady one, R = 2 and 3 with uneven rows, and no
    segment outlives the ranks."""
    import coconet as cc

    p = cc.Program("gather_only", dims=("N",))
    x = p.tensor("x", ("N",), layout=cc.Sliced(0))
    w = p.tensor("w", ("N",), layout=cc.Replicated)
    p.update(w, cc.all_gather(x * p.scalar("lr")))
    sched = Schedule.parse("", p.ir)
    step = lower(sched, "shm").source.split("def step(")[1]
    assert "_Shm.of(group, 2, 64)" in step and "_gather_into(_c, mul0, 0, d_N, w, 'w')" in step
    before = set(segments())
    for world, n in ((2, 1001), (3, 7)):
        assert_all_ok(
            run_schedules(
                [sched],
                Options(
                    world=world,
                    sizes={"N": n},
                    backend="shm",
                    kernels=kernels,
                    time=False,
                    timeout_s=60,
                    warmup=1,
                    repeats=1,
                ),
            )
        )
    assert set(segments()) <= before


def test_a_state_gathered_along_its_second_dim_is_written_column_by_column():
    """``split(ar0, dim=1)`` on a 2-D state: the chunk's kernel writes each chunk's columns of w into the
    peers' w (not contiguous), R = 3 with uneven columns, first and steady step both checked."""
    import coconet as cc

    p = cc.Program("cols", dims=("M", "N"))
    g = p.tensor("g", ("M", "N"), layout=cc.Local)
    w = p.tensor("w", ("M", "N"), layout=cc.Replicated)
    p.update(w, w - p.scalar("lr") * cc.allreduce(g, op="avg"))
    sched = Schedule.parse("split(ar0, dim=1); reorder(ag0); fuse_collective(rs0)", p.ir)
    assert "_Gather(_rank, 1, d_N, w, 'w', 0)" in lower(sched, "shm").source
    results = run_schedules(
        [sched.with_knobs(fc_chunks=k) for k in (1, 2)],
        Options(world=3, sizes={"M": 5, "N": 7}, backend="shm", warmup=1, repeats=1),
    )
    assert_all_ok(results)


@pytest.mark.parametrize(
    "world, kernels, schedule, sharing",
    [
        (2, "compiled", ZERO1, "share"),
        (3, "eager", ZERO1, "share"),
        (3, "compiled", "split(ar0); reorder(ag0); as_slice(m); as_slice(v)", "share"),  # w gathered outside one
        (2, "eager", ZERO1, "private"),
    ],
)
def test_state_in_shared_memory_whatever_tensor_the_caller_passes(world, kernels, schedule, sharing):
    """Steps of ZeRO-1 Adam on shm where the caller passes the moved w again, a new w on one rank only, a flat
    buffer whose views stand for a model's parameters (made shared memory where it is, the views seeing every
    step; shadowed where torch cannot: ``private``), a view into a larger buffer and a strided column
    (shadowed, the memory around them untouched): each step's w is the reference's on every rank
    (tests/codegen/shared_state.py), and no segment file is left."""
    run_ranks("tests.codegen.shared_state", world, kernels, schedule, sharing)
    assert not segments()


def run_ranks(module: str, world: int, *args: str) -> None:
    """``python -m module RANK WORLD PORT *args`` for every rank of a world, each to print ``ok`` last: forked
    from a warm interpreter (tests/codegen/warm_rank.py), as a launch's ranks are."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(warm_rank.PRELOAD)  # read when the server starts: the first call's
    port = free_port()
    with tempfile.TemporaryDirectory() as logs:
        paths = [os.path.join(logs, f"rank{r}.log") for r in range(world)]
        procs = [
            ctx.Process(target=warm_rank.main, args=(module, [str(r), str(world), str(port), *args], path))
            for r, path in enumerate(paths)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 300
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.exitcode is None:
                p.kill()
                p.join()
        outs = [Path(path).read_text(errors="replace") for path in paths]
    # every failing rank's words: the one that failed first, and those left waiting for it at a barrier
    failed = [
        f"rank {r} (exit {p.exitcode}):\n{out[-1500:]}"
        for r, (p, out) in enumerate(zip(procs, outs))
        if p.exitcode != 0 or not out.rstrip().endswith("ok")
    ]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_compiled_fused_collective_computes_replicated_operands_on_its_chunks_rows(backend):
    """SGD's weight decay ``wd * w`` and Adam's ``beta1 * m`` on replicated state: computed per chunk on the
    chunk's rows inside the kernel, not as a full pass before it. R = 3, uneven rows, 1 and 8 chunks."""
    cases = [
        ("sgd", "split(ar0); reorder(ag0); as_slice(buf); fuse_collective(rs0)", "mul0 = weight_decay * w_k"),
        ("adam", "split(ar0); reorder(ag0); fuse_collective(rs0)", "mul0 = beta1 * m_k"),
    ]
    for name, text, line in cases:
        sched = Schedule.parse(text, example(name))
        assert line in lower(sched, backend).source
        results = run_schedules(
            [sched.with_knobs(fc_chunks=k) for k in (1, 8)],
            Options(world=3, sizes={"N": 1001}, backend=backend, warmup=1, repeats=1),
        )
        assert_all_ok(results)


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_compiled_fused_collective_writes_its_sliced_outputs_into_one_tensor(backend):
    """LAMB's fused collective hands ``u`` on to the update after it, and the partial sum of ``u * u`` to the norm:
    compiled, the chunk's kernel writes its rows of ``u`` into one tensor of this rank's rows, made before the
    first chunk (no ``torch.cat`` of the chunks after the last), and returns its share of the sum; eager
    statements still concatenate theirs. R = 3, uneven rows, one chunk and more chunks than a rank has rows."""
    sched = Schedule.parse("split(ar0); reorder(ag0); fuse_collective(rs0)", example("lamb"))
    step = lower(sched, backend).source.split("def step(")[1]
    assert "_add3 = torch.empty(" in step and re.search(r"psum0,? = _chunk0\(", step) and "_c.local(_add3, 0)" in step
    assert "torch.cat(" not in step and "add3 = _add3" in step and "_mul8" not in step
    assert "psum0 = torch.stack(_psum0).sum()" in step
    eager = lower(sched, backend, kernels="eager").source
    assert "add3 = torch.cat(_add3, dim=0)" in eager and "_psum0.append(psum0)" in eager
    assert_all_ok(
        run_schedules(
            [sched.with_knobs(fc_chunks=k) for k in (1, 8)],
            Options(world=3, sizes={"N": 7}, backend=backend, warmup=1, repeats=1),
        )
    )


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_compiled_fused_collective_with_dropout(backend):
    """One compiled kernel per chunk, dropout's counters from the chunk's first row: the same mask as the
    reference interpreter at R = 3 with uneven rows, for one, two and more chunks than rows."""
    base = Schedule.parse("split(ar0); reorder(ag0); fuse_collective(rs0)", example("megatron_mlp"))
    schedules = [base.with_knobs(fc_chunks=k) for k in (1, 2, 8)]
    results = run_schedules(
        schedules,
        Options(world=3, sizes={"B": 5, "S": 3, "H": 7}, backend=backend, warmup=1, repeats=1, seed=2**64 - 5),
    )
    assert_all_ok(results)


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_compiled_chunk_kernel_takes_the_rows_of_another_collective(backend):
    """``w + (max - min) / 2`` with both allreduces split, one of them fused: the chunk's kernel reads the
    other reduce_scatter's rows as an argument (once a free name, which Dynamo could not resolve)."""
    import coconet as cc

    p = cc.Program("spread", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    w = p.tensor("w", ("N",), layout=cc.Replicated)
    p.update(w, w + (cc.allreduce(g, op="max") - cc.allreduce(g, op="min")) * 0.5)
    texts = [
        "split(ar0); split(ar1); reorder(ag0); fuse_collective(rs1)",
        "split(ar0); split(ar1); reorder(ag1); fuse_collective(rs0)",
    ]
    schedules = [Schedule.parse(t, p.ir) for t in texts]
    assert re.search(r"def _chunk0\([^)]*\brs1\):", lower(schedules[0], backend).source)
    results = run_schedules(schedules, Options(world=3, sizes={"N": 1001}, backend=backend, warmup=1, repeats=1))
    assert_all_ok(results)


def test_a_dying_rank_on_shm_is_reported_and_leaves_nothing():
    (res,) = run_schedules([Schedule(faulty.program(faulty.die))], shm_only(2, {"N": 6}))
    assert res.status == "runtime_error" and "rank 1 died (exit code 3)" in res.error
    assert not segments() and not rank_processes()


def test_shm_module_reduces_in_shared_memory():
    adam = example("adam")
    src = lower(Schedule.parse("split(ar0); reorder(ag0); fuse_collective(rs0)", adam), "shm").source
    assert "for the shm backend" in src
    # w, m and v are gathered straight into the peers' state: no slot of theirs is live while chunks are reduced
    assert "_c.shm = _Shm.of(group, 2, 4 * (d_N))" in src and src.count(".peer_rows(_c)") == 3
    megatron = lower(Schedule.parse("split(ar0); reorder(ag0); fuse_collective(rs0)", example("megatron_mlp")), "shm")
    assert "_Shm.of(group, 3, " in megatron.source  # its output's gather is live while chunks are reduced
    assert "dist.all_reduce(" not in src and "_RS(" not in src and "_AG(" not in src


@pytest.mark.parametrize("name", ["adam", "megatron_mlp"])
def test_every_schedule_with_streaming_copies(name, monkeypatch, tmp_path):
    """Every copy of the collectives made with non-temporal stores (the threshold down to one byte), at
    R = 3 with uneven rows and slots whose pieces start off a cache line; compiled once into the cache."""
    monkeypatch.setenv("COCONET_SHM_STREAM_BYTES", "1")
    monkeypatch.setenv("COCONET_CACHE_DIR", str(tmp_path))
    prog = example(name)
    sizes = {"N": 1001} if name == "adam" else {"B": 5, "S": 3, "H": 7}
    assert_all_ok(run_schedules(list(generate(prog)), shm_only(3, sizes)))
    assert (
        [p.name for p in (tmp_path / "kernels").iterdir()]
        == [p.name for p in (tmp_path / "kernels").glob("stream_copy_*.so")]
        != []
    )


def test_streaming_copy_matches_torch_at_every_alignment(monkeypatch, tmp_path):
    monkeypatch.setenv("COCONET_CACHE_DIR", str(tmp_path))
    copy = copier.stream_copier()
    src = torch.randn(4096)
    for n in (0, 1, 15, 16, 63, 64, 65, 1000):
        for offset in (0, 1, 3, 17):
            dst = torch.zeros(n + 40)
            copy(dst[offset:].data_ptr(), src[5:].data_ptr(), n * 4)
            expected = torch.zeros(n + 40)
            expected[offset : offset + n] = src[5 : 5 + n]
            assert torch.equal(dst, expected), (n, offset)


def test_a_compiler_that_fails_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("COCONET_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="false could not compile its copy kernel"):
        copier.stream_copier()
    assert not list((tmp_path / "kernels").iterdir())  # nothing half-built left in the cache


def test_without_a_c_compiler_torch_copies_every_size(monkeypatch):
    looked = []
    monkeypatch.setattr(shm_segments, "stream_copier", lambda: looked.append(1))  # finds no compiler: None
    s = shm_segments.Shm.__new__(shm_segments.Shm)  # the copy needs no process group
    s.stream_min, s.stream = 1, None
    src = torch.randn(100)
    for stream in (None, True, None):
        dst = torch.zeros(100)
        assert s.copy(dst, src, stream=stream) is dst and torch.equal(dst, src)
    assert s.stream is False and looked == [1]  # looked for once


def test_a_segment_dev_shm_cannot_hold_is_refused_when_made(monkeypatch, tmp_path):
    """tmpfs takes a page only at its first touch: unless a segment is known to fit when made, a rank whose
    /dev/shm is too small (docker's 64 MiB) dies of SIGBUS mid-step. Made, it fails with the sizes and leaves
    no file behind."""

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm_segments.os, "posix_fallocate", full)
    path = tmp_path / "coconet-segment"
    with pytest.raises(
        RuntimeError,
        match=r"cannot hold a segment of 3\.0 MiB \(No space left on device; .* MiB "
        r"free of .* MiB\)",
    ):
        shm_segments.segment(str(path), 3 << 20, new=True)
    assert not path.exists()
    monkeypatch.undo()
    seg = shm_segments.segment(str(path), 4096, new=True)
    assert seg.numel() == 4096 and path.stat().st_size == 4096 and path.stat().st_blocks * 512 >= 4096  # taken
    path.unlink()
    # slots, of which a rank writes only some rows, take no pages when made: they are checked for room instead
    free = shutil.disk_usage(tmp_path).free
    slots = shm_segments.segment(str(path), 1 << 20, new=True, ranks=2)
    assert slots.numel() == 1 << 20 and path.stat().st_blocks * 512 <= 1 << 16  # a page or so, not 1 MiB
    path.unlink()
    with pytest.raises(RuntimeError, match=r"cannot hold a segment of .* MiB \(one for each of 3 ranks; "):
        shm_segments.segment(str(path), free // 2, new=True, ranks=3)
    assert not path.exists()


def test_a_buffer_other_tensors_view_is_made_shared_where_it_is(monkeypatch):
    """A flat buffer under views (a model's parameters) cannot move without leaving them behind: its storage's
    memory becomes a file of /dev/shm in place, the views follow, and a second mapping of the linked file from
    the offset found sees what they write. Refused, with the sizes, where /dev/shm has no room for it, the
    buffer untouched; left private where sharing it would cut off another process or gains nothing."""
    flat = torch.arange(1000, dtype=torch.float32)
    views = [flat[:10], flat[500:].view(25, 20)]
    assert not shm_segments._movable(flat) and shm_segments._whole(flat)
    path = f"/dev/shm/coconet-{os.getpid()}-test-share"
    offset = shm_segments._share_storage(flat, path)
    try:
        assert offset is not None and offset % 64 == 0
        assert flat.untyped_storage().is_shared() and views[0].data_ptr() == flat.data_ptr()
        assert torch.equal(flat, torch.arange(1000, dtype=torch.float32))  # values kept, the mark undone
        peer = shm_segments._state_segment(path, (1000,), torch.float32, offset=offset)
        views[1][0, 3] = -5.0
        peer[7] = 42.0
        assert float(peer[503]) == -5.0 and float(views[0][7]) == 42.0
    finally:
        os.unlink(path)
    assert shm_segments._share_storage(flat, path) is None and not os.path.exists(path)  # already shared: left as it is
    tiny = torch.zeros(8)
    assert shm_segments._share_storage(tiny, path) is None and not tiny.untyped_storage().is_shared()

    class Full:
        f_bavail, f_frsize, f_blocks = 10, 4096, 100

    other = torch.zeros(1 << 16)
    monkeypatch.setattr(shm_segments.os, "statvfs", lambda folder: Full)
    with pytest.raises(
        RuntimeError,
        match=r"cannot hold a segment of 0\.2 MiB \(for a buffer that other tensors "
        r"view; 0\.0 MiB free of 0\.4 MiB\)",
    ):
        shm_segments._share_storage(other, path)
    assert not other.untyped_storage().is_shared() and not os.path.exists(path)


def _small_dev_shm(megabytes: int) -> list[str] | None:
    """A command prefix that runs its command with a /dev/shm of its own, ``megabytes`` large (a tmpfs in a
    mount namespace: root only), or None where this machine does not allow one."""
    prefix = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size={megabytes}m tmpfs /dev/shm && exec "$@"', "sh"]
    try:
        ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return None
    return prefix if ok else None


def test_too_small_dev_shm_is_a_clear_error_not_sigbus():
    prefix = _small_dev_shm(4)
    if prefix is None:
        pytest.skip("needs a mount namespace of its own (unshare -m, as root) to give the ranks a small /dev/shm")
    zero1 = "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0)"
    proc = subprocess.run(
        [
            *prefix,
            sys.executable,
            "-m",
            "coconet",
            "run",
            "examples/adam.py",
            "--world",
            "2",
            "--size",
            "N=2^20",
            "--backend",
            "shm",
            "--schedule",
            zero1,
            "--repeats",
            "1",
        ],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert "SIGBUS" not in out and "Traceback" not in out, out[-3000:]
    assert re.search(
        r"shm backend: /dev/shm cannot hold a segment of [\d.]+ MiB \(one for each of 2 ranks; [\d.]+ "
        r"MiB free of 4\.0 MiB\)",
        out,
    ), out[-3000:]


@pytest.mark.parametrize(
    "world, kernels, schedule, sharing",
    [
        (2, "compiled", "zero1", "share"),
        (3, "eager", "zero1", "share"),
        (3, "compiled", "sliced", "share"),
        (2, "eager", "sliced", "share"),
        (2, "eager", "zero1", "private"),
    ],
)
def test_a_gradient_is_read_where_it_lies_whatever_tensor_the_caller_passes(world, kernels, schedule, sharing):
    """Steps of Adam's fused collective on shm (ZeRO-1's, and one that leaves w sliced and so gathers nothing)
    where the caller writes each gradient into the same tensor, passes a new one on one rank, a view that
    cannot move, a new one after the moved one is gone, a new one every step, and a flat buffer that .grad
    views write into (made shared memory where it is; published where torch cannot: ``private``): each
    step's w is the reference's for that step's gradients on every rank, and a rank publishes its gradient
    exactly where its peers cannot read it in place (tests/codegen/shared_input.py)."""
    run_ranks("tests.codegen.shared_input", world, kernels, schedule, sharing)
    assert not segments()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("path", BENCH_PROGRAMS, ids=lambda p: p.stem)
def test_every_schedule_of_every_benchmark_program_on_shm(path, world):
    """The programs written against the DSL for the benchmarks, none of them an example (a column-parallel
    matmul, powers, exp and log, counts, norms of slices): their numbers stand on these being right."""
    prog = runpy.run_path(str(path))["program"].ir
    sizes = {d: BENCH_SIZES[d] for d in prog.dims}
    assert_all_ok(run_schedules(list(generate(prog)), shm_only(world, sizes)))
    assert not segments() and not rank_processes()


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_a_gathered_value_read_again_after_the_fused_collective(backend):
    """h = allreduce(g) + x, gathered whole for a matmul and read again on this rank's rows after it
    (out = h @ w + h): the compiled chunk kernel writes h's rows into the tensor the rest of the step reads,
    and the gather sends those rows (it had named a value the kernel never bound: every such schedule
    failed with an UnboundLocalError)."""
    from coconet import Local, Program, Replicated, allreduce, matmul

    p = Program("gathered_and_kept", dims=("B", "H"))
    g = p.tensor("g", ("B", "H"), layout=Local)
    x = p.tensor("x", ("B", "H"), layout=Replicated)
    w = p.tensor("w", ("H", "H"), layout=Replicated)
    h = allreduce(g) + x
    p.output("out", matmul(h, w) + h)
    fused = [s.with_knobs(fc_chunks=k) for s in generate(p.ir) if "fuse_collective" in s.text for k in (1, 4)]
    assert fused
    for world in (2, 3):
        gen = lower(fused[0], backend, "compiled")
        assert "_c.local(_add0, 0)" in gen.source  # the case at hand: the kernel fills a holder of h's rows
        assert_all_ok(
            run_schedules(
                fused, Options(world=world, sizes={"B": 5, "H": 3}, backend=backend, time=False, timeout_s=120)
            )
        )


def test_a_fuse_kernel_that_sums_its_mask_steps_as_the_program_does():
    """A loss scaler's overflow count summed in the kernel that computes the mask (fuse_reduced), before
    Adam that skips the step where any rank overflowed (in C, the fused collective's chunk): correct on shm
    and gloo, R = 2 and 3, uneven rows, with the update fused into the collective or not."""
    prog = bench_program("adam_amp_skip")
    scheds = [
        Schedule.parse(f"{x}fuse(abs0, gt0, where0)", prog)
        for x in ("", "split(ar1); reorder(ag0); fuse_collective(rs0); ")
    ]
    # the skip a bool the step computed before the collective: the chunk still runs as C
    src = lower(scheds[1], "shm").source
    assert re.search(r"_chunk1 = _native\(_kernel\(_chunk1\), '\w+', r\"\"\"", src)
    assert "const v8 p_where1 = (a->p_lt0 != 0.0f) ? p_add0 : ld(p_m_k + i);" in src
    for backend in ("shm", "gloo"):
        for world, n in ((2, 1001), (3, 7)):
            options = Options(world=world, sizes={"N": n}, backend=backend, warmup=1, repeats=2)
            assert_all_ok(run_schedules(scheds, options))
    assert not segments()


def test_a_held_buffer_is_the_same_tensor_every_step_until_its_shape_changes():
    box = types.SimpleNamespace(kept={})
    a = shm_segments.Shm.held(box, "add0", (5,), torch.float32)
    assert shm_segments.Shm.held(box, "add0", (5,), torch.float32) is a
    b = shm_segments.Shm.held(box, "add0", (6,), torch.float32)
    assert b is not a and b.shape == (6,)
    assert shm_segments.Shm.held(box, "add0", (6,), torch.bfloat16).dtype == torch.bfloat16


def test_a_kernel_computes_what_a_fused_collective_reduces_where_the_peers_read_it():
    """Error feedback: the compressed gradient the fused collective reduces is a fuse kernel's output. The
    kernel stores it into the buffer the step keeps (_Shm.held), which the peers read where it lies, and
    writes the residual into its state; nothing is returned to be published. Correct at R = 2, 3, uneven
    rows, compiled and eager, on both steps the check runs; gloo has no buffer to store it into."""
    prog = bench_program("ef_sign")
    sched = Schedule.parse(
        "split(ar0); reorder(ag0); fuse_collective(rs0); fuse(add0, abs0, ge0); fuse(where0, sub0)", prog
    )
    for kernels in ("compiled", "eager"):
        src = lower(sched, "shm", kernels).source
        kernel = src[src.index("def _fuse1(") :]
        kernel = kernel[: kernel.index("\n\n")]
        assert kernel.endswith("    e.copy_(sub0)\n    _where0_held.copy_(where0)") and "return" not in kernel
        assert "    _where0_held = _c.shm.held('where0', (d_N, ), torch.float32)\n" in src
        assert re.search(r"in _reduce_scatter_(parts|chunks)\(_rank, where0, 0, d_N, 4, ('avg', )?'where0', \d\):", src)
    assert "_held" not in lower(sched, "gloo").source
    for world, n in ((2, 1001), (3, 7)):
        for kernels in ("compiled", "eager"):
            options = Options(world=world, sizes={"N": n}, backend="shm", warmup=1, repeats=2, kernels=kernels)
            assert_all_ok(run_schedules([sched.with_knobs(fc_chunks=k) for k in (1, 4)], options))
    assert not segments()


def test_a_sum_of_values_of_each_ranks_own_is_reduced_where_the_peers_read_them():
    """Gradient accumulation: the fused collective reduces acc + g, which is no input but a statement of two,
    cleared state one of them. Compiled, the chunk kernel adds every rank's rows of acc and g as it reads them
    where they lie (in C), so acc + g is never written out: 2N words a step fewer per rank than computing it
    into a buffer the peers read. Eager, the step computes it into a buffer it keeps (_Shm.held), which moves
    into a segment of its own as an input does. Nothing is published, on the first step or any after, but a
    tensor that cannot move (tests/codegen/held_input.py counts). Correct at R = 2, 3, uneven rows, 1 and 4
    chunks, compiled and eager, on both steps the check runs; gloo computes it as before."""
    prog = bench_program("adam_accumulate")
    sched = Schedule.parse("split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0)", prog)
    src = lower(sched, "shm", "compiled").source
    step = src[src.index("def step(") :]
    assert "held" not in step and "add0" not in step
    assert "_reduce_scatter_parts(_rank, (g, acc), 0, d_N, 4, ('g', 'acc'), 1):" in step
    assert "_c.shm = _Shm.of(group, 2, max(4 * (d_N) + 64 + 4 * (d_N) + 64, 4 * (d_N)))" in step
    assert "    for g, acc in zip(g_parts, acc_parts):\n        add0 = acc + g\n" in src
    assert "const v8 p_acc = ld(a->p_acc_parts[r] + i);" in src and "const v8 p_add0 = (p_acc + p_g);" in src
    src = lower(sched, "shm", "eager").source
    assert "    add0 = torch.add(acc, g, out=_c.shm.held('add0', (d_N, ), torch.float32))\n" in src
    assert "in _reduce_scatter_chunks(_rank, add0, 0, d_N, 4, 'avg', 'add0', 1):" in src
    assert "read where it lies once moved into a segment" in src
    assert "    add0 = acc + g\n" in lower(sched, "gloo").source
    for world, n in ((2, 1001), (3, 7)):
        for kernels in ("compiled", "eager"):
            options = Options(world=world, sizes={"N": n}, backend="shm", warmup=1, repeats=2, kernels=kernels)
            assert_all_ok(run_schedules([sched.with_knobs(fc_chunks=k) for k in (1, 4)], options))
    run_ranks("tests.codegen.held_input", 3, "compiled")
    run_ranks("tests.codegen.held_input", 2, "eager")
    assert not segments()


def test_the_runtime_reads_each_chunk_parameter_as_the_kind_native_gives_it():
    """The runtime's native (coconet.kernels.copier) does not import chunk.KINDS, the C writer's table: its letters
    for lists and for half precision are kept by hand, and a letter missed there would pass a half tensor to C as
    float32."""
    source = inspect.getsource(copier)
    lists = re.search(r'xs = x if kind in "(\w+)"', source).group(1)
    assert f'if kind in "{lists}":' in source
    widths = dict(re.findall(r'torch\.(bfloat16|float16) if kind in "(\w+)"', source))
    letters = chunk_table.KINDS
    assert set(lists) == {letters[k] for k in letters if chunk_table.unhalved(k) in ("parts", "peers")}
    for dtype, tag in chunk_table.HALF.items():
        assert set(widths[dtype]) == {letters[k] for k in letters if chunk_table.half(k) == tag}
    single = {letters[k] for k in letters if chunk_table.unhalved(k) == "rows"}
    factors = re.search(r'if kind in "(\w+)":\n\s+if \(\s*x\.dtype != torch\.float32', source).group(1)
    assert set(factors) == {letters[k] for k in chunk_table.FACTORS}
    # beside factors, every tensor of the rows must be as wide as the column factor
    rows = re.search(r"tensors = \[\s*t for kind, x in zip\(kinds, args\) if kind in \"(\w+)\"", source).group(1)
    assert set(rows) == set(lists) | single
    assert set(letters.values()) == {"d", "s", "q"} | set(lists) | single | set(factors)


def test_adafactors_update_reads_its_factors_in_the_c_kernel(monkeypatch, tmp_path):
    """Adafactor's update on this rank's rows, ``w - lr·g · rsqrt(r·c / mean)`` with r an (M, 1) and c a (1, K)
    factor, written into every rank's copy of w: a C kernel that reads each factor a row at a time (it had kept
    Inductor's, whose stores into the peers' copies read every line first), with the bits of the module's own
    Python kernel at widths on and off the 16-float lines; every schedule whose kernel is so ends with the
    reference's state, R = 2 and 3, uneven rows."""
    prog = bench_program("adafactor")
    kinds_of = re.compile(r'\n(_fuse\d+) = _native\(_kernel\(\1\), \'(\w+)\', r"""(.*?)"""\)', re.S)
    in_c = [
        s for s in generate(prog) if any(set(m.group(2)) & set("rc") for m in kinds_of.finditer(lower(s, "shm").source))
    ]
    winner = Schedule.parse(
        "split(ar0); reorder(ag0); split(ar0, dim=1); reorder(ag0); fuse_collective(rs0); "
        "fuse(mul2, mul3, add1); fuse(mul5, mul6, add2); fuse(mul7, div0, rsqrt0, mul10, sub1)",
        prog,
    )
    assert winner in in_c and len(in_c) >= 20
    source = lower(winner, "shm").source
    call = kinds_of.search(source)
    fuse, kinds, c = call.groups()
    # w's peers and rows, r's and c's new factors (each rank's rows of r), the mean, lr·g's rows
    assert kinds == "ptrcst" and "(splat(a->p_add1[a->q]) * ld(a->p_ag3 + (i - a->c0)))" in c
    python = {}
    exec(compile(source[: call.start()], "fuse", "exec"), python)  # the module up to the kernel's C: eager torch
    monkeypatch.setenv("COCONET_CACHE_DIR", str(tmp_path))

    def fallback(*_):
        raise AssertionError("the C kernel handed the call to the Python kernel")

    kernel = copier.native(fallback, kinds, c)
    gen = torch.Generator().manual_seed(0)
    for m, k in ((29, 37), (8, 4096), (3, 5)):
        want = [
            [torch.zeros(m, k), torch.zeros(m, k)],
            torch.randn(m, k, generator=gen),
            torch.rand(m, 1, generator=gen) + 0.5,
            torch.rand(1, k, generator=gen) + 0.5,
            torch.tensor(0.7),
            torch.randn(m, k, generator=gen) * 1e-3,
        ]
        got = [[x.clone() for x in a] if isinstance(a, list) else a.clone() for a in want]
        python[fuse](*want)
        kernel(*got)
        for x, y in zip([*got[0], got[1]], [*want[0], want[1]]):
            assert torch.equal(x, y), (m, k)
    for world, sizes in ((2, {"M": 29, "K": 37}), (3, {"M": 7, "K": 5})):
        assert_all_ok(run_schedules(in_c, Options(world=world, sizes=sizes, backend="shm", warmup=1, repeats=2)))
    assert not segments()
