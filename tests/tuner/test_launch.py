"""Generated code on real worlds of gloo ranks, checked against the reference interpreter."""

import dataclasses
import os
import re
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from coconet.schedules.schedule import Schedule
from coconet.schedules.space import generate
from coconet.tuner.forkserver import RANK_NAME
from coconet.tuner.launch import STARTUP_S, Options, run_schedules
from tests.codegen import faulty
from tests.conftest import RUN_MARK
from tests.ports import hold_port
from tests.strategies import collective_programs, programs

pytestmark = pytest.mark.usefixtures("temp_code_cache")  # generated modules in a throwaway cache

ROOT = Path(__file__).parents[2]
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))
# not divisible by 2 or 3: every slice of every rank is uneven somewhere
SIZES = {"N": 7, "M": 5, "B": 2, "S": 3, "H": 5, "K": 3, "C": 5, "W": 7, "A": 5, "D": 3}


def example(name):
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"))["program"].ir


def check_only(world, sizes, **kw):
    # eager kernels: what is checked is the lowering; compiled kernels have a test of their own
    return Options(world=world, sizes=sizes, time=False, timeout_s=60, kernels="eager", **kw)


def of_this_run(pid: int | str) -> bool:
    """Whether a live process was started by this test run (it carries the run's mark in its environment)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"{RUN_MARK}={os.environ[RUN_MARK]}".encode() in env


def rank_processes() -> list[int]:
    """Live rank processes of any launch of this test run (a zombie is already gone)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            comm = (d / "comm").read_text()
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if not of_this_run(d.name):
            continue
        # a fresh interpreter, or forked by the fork server, which names it
        if (b"coconet.tuner.rank" in cmd or comm.startswith(RANK_NAME)) and state != "Z":
            pids.append(int(d.name))
    return pids


def assert_all_ok(results):
    bad = [(r.schedule, r.status, r.error) for r in results if r.status != "ok" or not r.correct]
    assert not bad, bad


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", EXAMPLES)
def test_every_schedule_of_every_example(name, world):
    prog = example(name)
    sizes = {d: SIZES[d] for d in prog.dims}
    results = run_schedules(list(generate(prog)), check_only(world, sizes, stages=2))
    assert_all_ok(results)
    assert not rank_processes()


BENCH_PROGRAMS = sorted((ROOT / "benchmarks" / "programs").glob("*.py"))
BENCH_SIZES = {**SIZES, "F": 7}  # and the MLP blocks' F


@pytest.mark.parametrize("path", BENCH_PROGRAMS, ids=lambda p: p.stem)
def test_every_schedule_of_every_benchmark_program_on_gloo(path):
    # uneven rows at world 3; with tests/codegen/test_nccl.py's module comparison, what stands for these programs'
    # NCCL modules where no GPU has run them
    prog = runpy.run_path(str(path))["program"].ir
    sizes = {d: BENCH_SIZES[d] for d in prog.dims}
    assert_all_ok(run_schedules(list(generate(prog)), check_only(3, sizes)))
    assert not rank_processes()


def test_knob_values_run_correctly():
    """Other chunk counts and bucket caps than the defaults: more chunks than rows, one-row chunks."""
    adam, megatron = example("adam"), example("megatron_mlp")
    scheds = [
        s.with_knobs(**{k: v})
        for s in generate(adam)
        if s.knob_values
        for k, (_, domain) in s.knob_domains.items()
        for v in domain
    ]
    results = run_schedules(scheds, check_only(3, {"N": 7}))
    assert_all_ok(results)
    scheds = [s.with_knobs(chunks=c) for s in generate(megatron) if "chunks" in s.knob_values for c in (2, 16)]
    assert_all_ok(run_schedules(scheds, check_only(2, {"B": 3, "S": 2, "H": 5})))


HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
# each example launches ranks (seconds): no shrinking, and the same examples on every run
RANKS = dict(deadline=None, suppress_health_check=HEALTH, derandomize=True, phases=[Phase.explicit, Phase.generate])


@settings(max_examples=4, **RANKS)
@given(collective_programs(), st.sampled_from([2, 3]))
def test_unseen_collective_programs(p, world):
    prog = p.ir
    assert_all_ok(run_schedules(list(generate(prog, depth=4)), check_only(world, {"N": 5, "M": 7})))


@settings(max_examples=3, **RANKS)
@given(programs(max_ops=8, dtypes=False), st.sampled_from([2, 3]))
def test_unseen_programs(p, world):
    prog = p.ir
    assert_all_ok(run_schedules(list(generate(prog, depth=3))[:12], check_only(world, {"N": 5, "M": 7})))


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_int_scalars_reach_torch_functions_and_outputs_as_tensors(backend):
    """int64 scalars are Python ints in the step (a new seed compiles nothing again): an expression of them
    alone is a number, which torch.where, sqrt or exp do not take, and which an output must not be."""
    import coconet as cc

    p = cc.Program("warmup", dims=("N",))
    g, w = p.tensor("g", ("N",), layout=cc.Local), p.tensor("w", ("N",), layout=cc.Replicated)
    lr = p.scalar("lr")
    step, warm = p.scalar("step", dtype="int64"), p.scalar("warm", dtype="int64")
    lr_eff = cc.where(step < warm, lr * step / warm, lr) * cc.exp(-step / warm) * cc.sqrt(step + 1)
    p.update(w, w - lr_eff * cc.allreduce(g))
    p.output("ratio", (1 + step) / (warm + step))
    p.output("power", step**2 - warm)
    prog = p.ir
    picked = [Schedule(prog)] + [s for s in generate(prog) if "fuse_collective" in s.text][:1]
    assert len(picked) == 2
    opts = dataclasses.replace(check_only(2, {"N": 7}), kernels="compiled", backend=backend)
    assert_all_ok(run_schedules(picked, opts))


def test_compiled_kernels_are_correct_and_write_state_in_place():
    """Inductor-compiled fused groups: Adam's update written into w, m, v; dropout's RNG inside the kernel,
    its seed a runtime value."""
    adam, megatron = example("adam"), example("megatron_mlp")
    fused = [s for s in generate(adam) if "fuse" in s.text and "as_slice(w)" in s.text]
    results = run_schedules(fused, Options(world=2, sizes={"N": 1001}, warmup=1, repeats=2))
    assert_all_ok(results)
    fused = [s for s in generate(megatron) if s.text.startswith("fuse(")]
    assert_all_ok(
        run_schedules(fused, Options(world=3, sizes={"B": 2, "S": 5, "H": 7}, warmup=1, repeats=2, seed=2**64 - 5))
    )


def test_timing_samples_and_statistics():
    prog = example("sgd")
    (res,) = run_schedules([Schedule(prog)], Options(world=2, sizes={"N": 1000}, warmup=1, repeats=5))
    assert res.status == "ok" and res.correct
    assert len(res.samples) == 5 and all(s > 0 for s in res.samples)
    lo, hi = res.ci95_s
    assert lo <= res.median_s <= hi
    out = res.to_json()
    assert out["samples"] == 5 and out["ci95_s"] == [lo, hi]


def test_a_raising_rank_names_rank_and_statement_and_the_rest_still_run(tmp_path, monkeypatch):
    monkeypatch.setenv("COCONET_TEST_ONCE", str(tmp_path / "once"))
    prog = faulty.program(faulty.boom)
    first, second = Schedule(prog), Schedule.parse("split(ar0)", prog)
    bad, good = run_schedules([first, second], check_only(2, {"N": 6}))
    assert bad.status == "runtime_error" and bad.correct is None
    assert "rank 1 in statement boom0 (boom)" in bad.error and "boom on purpose" in bad.error
    assert good.status == "ok" and good.correct
    assert not rank_processes()


@pytest.mark.parametrize("server", ["1", "0"])
def test_a_rank_keeps_what_it_imported_out_of_its_garbage_collections(server, monkeypatch):
    # forked from the server (frozen there) or a fresh interpreter (frozen once its group formed)
    monkeypatch.setenv("COCONET_FORKSERVER", server)
    (res,) = run_schedules([Schedule(faulty.program(faulty.frozen))], check_only(2, {"N": 6}))
    assert res.status == "runtime_error", res.error
    assert int(re.search(r"(\d+) objects frozen", res.error).group(1)) > 100_000  # torch's modules and tables


def test_a_hanging_rank_is_stopped_and_located():
    prog = faulty.program(faulty.hang)
    t0 = time.monotonic()
    (res,) = run_schedules([Schedule(prog)], Options(world=2, sizes={"N": 6}, time=False, timeout_s=3))
    elapsed = time.monotonic() - t0
    assert res.status == "timeout"
    assert "no result within 3 s" in res.error
    assert "rank 1 in statement hang0 (hang)" in res.error
    assert elapsed < 3 + STARTUP_S + 20
    assert not rank_processes()


def test_a_dying_rank_is_reported_with_its_exit_code():
    prog = faulty.program(faulty.die)
    (res,) = run_schedules([Schedule(prog)], check_only(2, {"N": 6}))
    assert res.status == "runtime_error" and "rank 1 died (exit code 3)" in res.error
    assert not rank_processes()


def test_wrong_results_are_caught(monkeypatch):
    """A backend bug must show up as wrong_result: break the generated code on purpose."""
    import coconet.tuner.launch as launch

    real = launch.lower

    def broken(sched, backend, kernels):
        gen = real(sched, backend, kernels)
        source = gen.source.replace("torch.sub(w, mul2, out=w)", "torch.sub(w, mul2 * 1.5, out=w)")
        return dataclasses.replace(gen, source=source)

    monkeypatch.setattr(launch, "lower", broken)
    (res,) = run_schedules([Schedule(example("sgd"))], check_only(2, {"N": 7}))
    assert res.status == "wrong_result" and res.correct is False
    assert "stage0.state.w" in res.error and res.max_rel_err > 0.1


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_a_rank_holding_none_of_the_contraction_dim(backend):
    """4*H = 4 columns of x sliced over 3 ranks: 2, 2 and none. The empty rank's partial product is zeros, and
    every schedule, the chunked matmuls too, must still run and be right."""
    prog = example("megatron_mlp")
    results = run_schedules(list(generate(prog)), check_only(3, {"B": 1, "S": 2, "H": 1}, backend=backend))
    assert_all_ok(results)
    assert any("overlap(mm0, ar0)" in r.schedule for r in results)


def test_a_step_that_writes_into_an_input_is_wrong(monkeypatch):
    """The gradient allreduced in place on the caller's tensor: every updated value is right, and the
    caller's g is gone. The schedule must not pass."""
    import coconet.tuner.launch as launch

    real = launch.lower

    def in_place(sched, backend, kernels):
        gen = real(sched, backend, kernels)
        source = gen.source.replace("ar0 = _allreduced(_c, g, 'sum')", "ar0 = g.copy_(_allreduced(_c, g, 'sum'))")
        assert source != gen.source
        return dataclasses.replace(gen, source=source)

    monkeypatch.setattr(launch, "lower", in_place)
    for backend in ("gloo", "shm"):
        (res,) = run_schedules([Schedule(example("sgd"))], check_only(2, {"N": 7}, backend=backend))
        assert res.status == "wrong_result" and res.correct is False, res.error
        assert "the step wrote into input g, which the program does not update" in res.error


def test_a_value_computed_in_bfloat16_is_held_to_bfloat16s_tolerance():
    """SGD from a bfloat16 gradient allreduce into float32 weights: the sum of three bfloat16 gradients is
    rounded like any bfloat16 value (about 1e-2 here), and every schedule, the program as written too,
    once failed float32's 1e-4. A float32 program keeps float32's."""
    import coconet as cc
    from coconet.schedules.equivalence import TOLERANCE
    from coconet.tuner.check import Check

    p = cc.Program("bf16_sgd", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local, dtype="bfloat16")
    w = p.tensor("w", ("N",), layout=cc.Replicated)
    (lr,) = p.scalars("lr")
    p.update(w, w - lr * cc.cast(cc.allreduce(g), "float32"))
    opts = check_only(3, {"N": 1001})
    assert Check(p.ir, opts, {})._tolerance("stage0.state.w") == TOLERANCE["bfloat16"]
    assert Check(example("adam"), opts, {})._tolerance("stage0.state.w") == TOLERANCE["float32"]
    results = run_schedules(list(generate(p.ir)), opts)
    assert_all_ok(results)
    assert max(r.max_rel_err for r in results) > TOLERANCE["float32"]  # the rounding is there to allow for


def test_nccl_without_a_device_per_rank_is_refused_before_any_rank_starts():
    import torch

    from coconet.errors import BackendError

    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    expected = "needs a CUDA device per rank" if devices else "this machine has no CUDA device"
    with pytest.raises(BackendError, match=expected):
        run_schedules([Schedule(example("sgd"))], check_only(devices + 1, {"N": 7}, backend="nccl"))
    assert not rank_processes()


def _wait_for_ranks(n, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(rank_processes()) >= n:
            return
        time.sleep(0.2)
    raise AssertionError("the ranks never started")


def _default_sigint():
    # A suite run as a background job of a shell inherits SIGINT ignored, and so would the CLI, where Python
    # then installs no KeyboardInterrupt handler: give it the disposition a terminal's Ctrl-C meets.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cli(tmp_path, *args):
    # a killed parent cannot remove its work directory: keep it in the test's
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    return subprocess.Popen(
        [sys.executable, "-m", "coconet", "run", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=_default_sigint,
    )


def test_ctrl_c_stops_every_rank(tmp_path):
    proc = _cli(tmp_path, "examples/adam.py", "--world", "2", "--size", "N=2^16", "--repeats", "100000")
    _wait_for_ranks(2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "error: interrupted" in err and "Traceback" not in err
    assert not rank_processes()
    assert not list(tmp_path.glob("coconet-run-*"))  # the interrupted parent cleaned up


def test_ranks_die_with_a_killed_parent(tmp_path):
    proc = _cli(tmp_path, "examples/adam.py", "--world", "2", "--size", "N=2^16", "--repeats", "100000")
    _wait_for_ranks(2)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 20
    while rank_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not rank_processes()


def test_every_rank_s_copy_of_a_replicated_result_is_checked():
    import numpy as np

    from coconet.schedules import interp
    from coconet.tuner.check import compare

    prog = example("adam")
    opts = Options(world=3, sizes={"N": 10})
    ref = interp.run(prog, 3, {"N": 10}, seed=opts.seed)
    observable = ref.observable()
    reports = {r: {k: np.array(v) for k, v in observable.items()} for r in range(3)}
    assert compare(prog, reports, opts, observable) == (0.0, None)
    reports[2]["stage0.state.w"][7] += 1.0  # the last rank missed part of the gather
    err, bad = compare(prog, reports, opts, observable)
    assert err > 0.1 and bad.startswith("stage0.state.w on rank 2 (relative error")


def test_a_second_step_is_checked_as_the_first():
    """The ranks report a step and a steady second one on the same inputs; a value wrong only at the second,
    or missing there, fails the check and says so."""
    import numpy as np

    from coconet.schedules import interp
    from coconet.tuner.check import compare
    from coconet.tuner.rank import AGAIN

    prog = example("adam")
    opts = Options(world=2, sizes={"N": 10})
    observable = interp.run(prog, 2, {"N": 10}, seed=opts.seed).observable()

    def reports():
        return {r: {k + tail: np.array(v) for k, v in observable.items() for tail in ("", AGAIN)} for r in range(2)}

    assert compare(prog, reports(), opts, observable, again=True) == (0.0, None)
    wrong = reports()
    wrong[1]["stage0.state.w" + AGAIN][3] += 1.0
    err, bad = compare(prog, wrong, opts, observable, again=True)
    assert err > 0.1 and bad.startswith(
        "stage0.state.w on rank 1 after a second step on the same inputs (relative error"
    ), bad
    lacking = reports()
    for r in lacking:
        del lacking[r]["stage0.state.m" + AGAIN]
    assert compare(prog, lacking, opts, observable, again=True)[1] == f"stage0.state.m{AGAIN} is missing from the ranks"


def test_a_rank_killed_by_a_signal_is_named_by_it():
    from coconet.tuner.launch import _died

    assert _died(3) == "died (exit code 3)"
    assert _died(-signal.SIGSEGV) == "was killed by SIGSEGV"
    assert _died(-signal.SIGKILL).startswith("was killed by SIGKILL (the kernel's OOM killer")
    assert _died(-signal.SIGBUS).startswith("was killed by SIGBUS (a store into shared memory past what /dev/shm")


def test_reports_are_checked_as_they_come_whatever_their_order():
    """A replicated value is scored when its rank reports and not kept; a sharded one waits for its pieces."""
    import numpy as np

    from coconet.schedules import interp
    from coconet.tuner.check import Check

    prog = Schedule.parse("split(ar0); reorder(ag0); as_slice(m); as_slice(v)", example("adam")).scheduled
    opts = Options(world=3, sizes={"N": 10})
    observable = interp.run(prog, 3, {"N": 10}, seed=opts.seed).observable()

    def report(rank):
        out = {}
        for key, value in observable.items():
            t = prog[key.rsplit(".", 1)[1]].type
            out[key] = np.array(interp.distribute(t, value, value.shape, 3)[rank])
        return out

    reports = {r: report(r) for r in range(3)}
    reports[0]["stage0.state.m"][1] += 1.0
    reports[2]["stage0.state.w"][0] += 1.0
    for order in ([0, 1, 2], [2, 1, 0]):
        check = Check(prog, opts, observable)
        for r in order:
            for key, value in reports[r].items():  # as a rank sends them: one value a message
                check.take(r, key, value)
            assert set(check.pieces) == {"stage0.state.m", "stage0.state.v"}  # w, replicated, is not held
            assert r not in check.ranks
            check.add(r, {})
        err, bad = check.result()
        assert err > 0.1 and bad.startswith("stage0.state.m (relative error"), bad
    check = Check(prog, opts, observable)
    for r in (0, 2):
        check.add(r, reports[r])
    assert check.result()[1].startswith("stage0.state.m is missing from rank 1")


def test_a_float16_overflow_is_named_as_the_cause():
    """x·1000 squared passes float16's largest value (65504), so a step computing in float16 reports inf
    where the float64 reference has 1000: the check says so instead of a bare relative error of inf."""
    import numpy as np

    import coconet as cc
    from coconet.schedules import interp
    from coconet.tuner.check import compare

    p = cc.Program("fp16", dims=("N",))
    x = p.tensor("x", ("N",), layout=cc.Replicated, dtype="float16")
    big = x * 1000.0
    p.output("y", cc.sqrt(big * big))
    opts = Options(world=2, sizes={"N": 6})
    observable = interp.run(p.ir, 2, {"N": 6}, seed=opts.seed).observable()
    reports = {r: {k: np.array(v, dtype=np.float16) for k, v in observable.items()} for r in range(2)}
    assert compare(p.ir, reports, opts, observable)[1] is None
    reports[1]["stage0.output.y"][2:4] = np.inf
    err, bad = compare(p.ir, reports, opts, observable)
    assert err == float("inf")
    assert (
        "2 elements inf or NaN where the reference's are finite: computed in float16, whose largest finite "
        "value is 65504" in bad
    ), bad
    reports[1]["stage0.output.y"][2:4] = 1.0  # wrong but finite: no word of overflow
    assert "inf or NaN" not in compare(p.ir, reports, opts, observable)[1]


def centered_rmsprop():
    """Ill-conditioned on the random inputs of a check: independent moments put ``sq - mg * mg`` near 0 at
    some elements, which the update divides by."""
    import coconet as cc

    p = cc.Program("centered_rmsprop", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    w, sq, mg = (p.tensor(n, ("N",), layout=cc.Replicated) for n in ("w", "sq", "mg"))
    lr, alpha = p.scalars("lr alpha")
    a = cc.allreduce(g) * 0.25
    s1 = alpha * sq + (1 - alpha) * a * a
    g1 = alpha * mg + (1 - alpha) * a
    p.update(sq, s1)
    p.update(mg, g1)
    p.update(w, w - lr * a / (cc.sqrt(s1 - g1 * g1) + 1e-8))
    return p.ir


def test_an_ill_conditioned_program_is_held_to_its_own_error_in_its_dtype():
    """The step computed in float32 statement by statement misses the float64 values by more than float32's
    tolerance here: a schedule doing as well passes, told against 10x the program's own error; one further
    off fails, and the message says why the bound is what it is."""
    import numpy as np

    from coconet.schedules import interp
    from coconet.schedules.equivalence import CONDITIONING, TOLERANCE, Reference, rel_err
    from coconet.tuner.check import compare

    prog = centered_rmsprop()
    opts = Options(world=3, sizes={"N": 2000})
    reference = Reference(prog, 3, opts.sizes, seed=opts.seed)
    declared = interp.run(prog, 3, opts.sizes, seed=opts.seed, precision="declared").observable()
    own = rel_err(declared["stage0.state.w"], reference["stage0.state.w"])
    assert own > TOLERANCE["float32"]  # else the program is not what this test is about
    assert reference.program_error("stage0.state.w") == own
    reports = {r: {k: v.astype(np.float32) for k, v in declared.items()} for r in range(3)}
    assert compare(prog, reports, opts, dict(reference))[1].startswith("stage0.state.w on rank 0")  # float32's 1e-4
    assert compare(prog, reports, opts, reference) == (own, None)
    bad = {r: {k: np.array(v) for k, v in rep.items()} for r, rep in reports.items()}
    # where the error is measured against 1 (and not NaN on both sides: the square root of a negative)
    i = int(np.nanargmin(np.abs(reference["stage0.state.w"])))
    bad[1]["stage0.state.w"][i] += 2 * CONDITIONING * own
    err, why = compare(prog, bad, opts, reference)
    assert why.startswith("stage0.state.w on rank 1 (relative error"), why
    assert (
        f"{CONDITIONING:g}x the {own:.3g} of the program itself computed in float32 statement by statement: "
        "ill-conditioned on these inputs" in why
    ), why


def test_a_group_whose_port_was_taken_is_launched_again_on_another(monkeypatch):
    # the port is free when chosen, and another process takes it before rank 0 listens on it
    from coconet.tuner import launch

    held, chosen = [], []
    real = launch.free_port

    def port():
        chosen.append(hold_port(held) if len(chosen) < launch.PORT_TRIES - 1 else real())
        return chosen[-1]

    monkeypatch.setattr(launch, "free_port", port)
    try:
        (res,) = run_schedules([Schedule(example("adam"))], check_only(2, SIZES))
    finally:
        for s in held:
            s.close()
    assert res.status == "ok" and res.correct
    assert len(chosen) == launch.PORT_TRIES and len(set(chosen)) == len(chosen)


def test_a_port_taken_every_time_fails_the_launch_naming_the_cause(monkeypatch):
    from coconet.tuner import launch

    held = []
    monkeypatch.setattr(launch, "free_port", lambda: hold_port(held))
    try:
        results = run_schedules([Schedule(example("adam")), Schedule(example("adam"))], check_only(2, SIZES))
    finally:
        for s in held:
            s.close()
    assert len(held) == launch.PORT_TRIES
    assert all(r.status == "runtime_error" and "EADDRINUSE" in r.error for r in results)
    assert not rank_processes()
