"""Multi-rank generated code on CUDA tensors without several GPUs: every schedule of every example and
benchmark program at world 2 and 3, all ranks on one GPU, gloo as the transport (it moves CUDA tensors
through host staging), each rank's results checked against the reference interpreter.

NCCL cannot run two ranks of a group on one GPU, so ``coconet run --backend nccl`` only runs world 1 on a
one-GPU machine. The NCCL module differs from the gloo module only in the device it puts tensors on
(tests/codegen/test_nccl.py), so the NCCL module run over a gloo group on CUDA tensors exercises what
multi-rank NCCL runs would, but for NCCL itself: the slicing, the collectives' shapes and the kernels on
CUDA with R > 1. The harness here starts its own ranks (the launcher picks the CPU for gloo).

    COCONET_CUDA_GLOO_KERNELS=eager|compiled  (default eager: every schedule; compiled compiles each
    schedule's Triton kernels in every rank, minutes per program)
"""

from __future__ import annotations

import os
import queue
import runpy
import traceback
from datetime import timedelta
from pathlib import Path

import pytest

from coconet.tuner import check, launch
from coconet.tuner import rank as rank_process

ROOT = Path(__file__).parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
BENCH_PROGRAMS = sorted((ROOT / "benchmarks" / "programs").glob("*.py"))
SIZES = runpy.run_path(str(ROOT / "benchmarks" / "every_schedule.py"), run_name="every_schedule")["SIZES"]
KERNELS = os.environ.get("COCONET_CUDA_GLOO_KERNELS", "eager")
RANK_TIMEOUT_S = 600


def _program(path: Path):
    return runpy.run_path(str(path))["program"].ir


def _rank_main(rank: int, path: str, world: int, stages: int, port: int, device: str, sources, out) -> None:
    """One rank: a gloo group over world × stages ranks, every rank's tensors on ``device`` (cuda: the one
    GPU, cuda:0), each schedule's module run twice on the seeded inputs (coconet's checked_steps)."""
    import torch
    import torch.distributed as dist

    from coconet.schedules.space import generate

    if device == "cuda":
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
    else:
        dev = torch.device("cpu")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world * stages,
        timeout=timedelta(seconds=120),
    )
    groups = [dist.new_group(list(range(s * world, (s + 1) * world))) for s in range(stages)]
    stage = rank // world
    prog = _program(Path(path))
    custom = {k: op.torch for k, op in prog.custom_ops.items() if op.torch is not None}
    space = generate(prog)
    for i, source in sources:
        sched = space[i].scheduled
        ns = {"__name__": f"coconet_generated_cuda_gloo_{i}"}
        try:
            exec(compile(source, f"<{Path(path).stem} schedule {i}>", "exec"), ns)
            kwargs = dict(
                group=groups[stage], stage=stage, stages=stages, sizes=dict(SIZES_OF(prog)), custom_ops=custom
            )
            opts = _options(prog, world, stages)
            tensors, scalars = rank_process.inputs(sched, opts, stage, rank % world, dev)
            assert all(t.device.type == dev.type for t in tensors.values())
            report = {}
            for r in rank_process.checked_steps(ns["step"], sched, tensors, scalars, kwargs, stage):
                report.update({k: v.copy() for k, v in r.items()})
            out.put((i, rank, report, None))
        except Exception as e:  # reported, and this rank stops: its peers would wait on it in a collective
            out.put((i, rank, None, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"))
            break
    dist.destroy_process_group()


def SIZES_OF(prog) -> dict[str, int]:
    return {d: SIZES[d] for d in prog.dims}


def _options(prog, world: int, stages: int):
    return launch.Options(world=world, sizes=SIZES_OF(prog), backend="gloo", stages=stages)


def run_every_schedule(
    path: Path, world: int, device: str, kernels: str = KERNELS, limit: int | None = None
) -> list[tuple[str, str]]:
    """(schedule, what went wrong) for each schedule of the program at ``path`` that failed its check with
    ``world`` ranks a stage, all on ``device``; [] when every one passed."""
    import torch.multiprocessing as mp

    from coconet.codegen.lower import lower
    from coconet.schedules.equivalence import Reference
    from coconet.schedules.space import generate

    prog = _program(path)
    stages = 2 if prog.is_pipeline else 1
    space = generate(prog)[:limit]
    # the NCCL module on CUDA (its device line is CUDA's), the gloo module on the CPU (the harness's own check)
    backend = "nccl" if device == "cuda" else "gloo"
    sources = [(i, lower(s, backend, kernels).source) for i, s in enumerate(space)]
    opts = _options(prog, world, stages)
    reference = Reference(prog, world, opts.sizes, seed=opts.seed, stages=stages)
    ctx = mp.get_context("spawn")  # a CUDA context does not survive fork
    out = ctx.Queue()
    port = launch.free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, str(path), world, stages, port, device, sources, out), daemon=True)
        for r in range(world * stages)
    ]
    for p in procs:
        p.start()
    reports: dict[int, dict[int, dict]] = {}
    errors: dict[int, str] = {}
    expected = len(sources) * world * stages
    got = 0
    try:
        while got < expected:
            try:
                i, rank, report, error = out.get(timeout=RANK_TIMEOUT_S)
            except queue.Empty:
                break
            got += 1
            if error is not None:
                errors.setdefault(i, f"rank {rank}: {error}")
                if any(not p.is_alive() for p in procs):
                    break
            else:
                reports.setdefault(i, {})[rank] = report
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    bad = []
    for i, s in enumerate(space):
        if i in errors:
            bad.append((s.text, errors[i]))
            continue
        ranks = reports.get(i, {})
        if len(ranks) != world * stages:
            bad.append(
                (s.text, f"{world * stages - len(ranks)} ranks did not report (an earlier failure stopped them)")
            )
            continue
        _, wrong = check.compare(s.scheduled, ranks, opts, reference, again=True)
        if wrong is not None:
            bad.append((s.text, wrong))
    return bad


def test_the_harness_checks_every_rank_on_the_cpu():
    """What can be checked without a GPU: the harness runs the gloo module at world 2 and 3 on CPU tensors and
    finds every schedule of the Adam example correct."""
    for world in (2, 3):
        assert run_every_schedule(ROOT / "examples" / "adam.py", world, "cpu", kernels="eager", limit=4) == []


def test_the_harness_catches_a_wrong_schedule(monkeypatch):
    from coconet.codegen import lower as lower_mod

    real = lower_mod.lower

    def broken(s, backend="gloo", kernels="compiled", **kw):
        gen = real(s, backend, kernels, **kw)
        # the update of w written as its negation on every rank: the interpreter's w differs
        src = gen.source.replace("def step(", "def _step(", 1) + (
            "\n\ndef step(tensors, scalars, **kw):\n    out = _step(tensors, scalars, **kw)\n"
            "    tensors['w'].neg_()\n    return out\n"
        )
        return type("G", (), {"source": src})()

    monkeypatch.setattr(lower_mod, "lower", broken)
    bad = run_every_schedule(ROOT / "examples" / "adam.py", 2, "cpu", kernels="eager", limit=1)
    assert len(bad) == 1 and "w" in bad[0][1]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 3], ids=["w2", "w3"])
@pytest.mark.parametrize("path", [*EXAMPLES, *BENCH_PROGRAMS], ids=lambda p: p.stem)
def test_every_schedule_on_cuda_tensors_over_gloo(path, world):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    bad = run_every_schedule(path, world, "cuda")
    assert not bad, bad


NCCL_ACROSS_GPUS = (
    "python -m pytest -m gpu tests/codegen/test_nccl.py tests/codegen/test_cuda_gloo.py -k 'on_nccl or across_gpus'"
)


@pytest.mark.gpu
@pytest.mark.parametrize("path", [*EXAMPLES, *BENCH_PROGRAMS], ids=lambda p: p.stem)
def test_every_schedule_on_nccl_across_gpus(path):
    """NCCL itself with more than one rank: one rank per GPU, world = the device count. A one-GPU machine
    cannot run it (NCCL refuses two ranks of a group on one device); the owner of a multi-GPU machine runs
    the command in the skip reason."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        pytest.skip(f"needs 2 or more CUDA devices, this machine has {n}; on one that has them run: {NCCL_ACROSS_GPUS}")
    from tests.codegen.test_nccl import assert_every_schedule_ok_on_nccl

    assert_every_schedule_ok_on_nccl(path)
