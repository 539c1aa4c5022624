"""The NCCL backend on CUDA tensors: one rank per GPU of this machine."""

import runpy
from pathlib import Path

import pytest
import torch

from coconet.schedules.space import generate
from coconet.tuner.launch import Options, run_schedules

ROOT = Path(__file__).parents[2]
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))
BENCH_PROGRAMS = sorted((ROOT / "benchmarks" / "programs").glob("*.py"))
# the sizes benchmarks/every_schedule.py runs on a machine on loan: what passes here passes there
SIZES = runpy.run_path(str(ROOT / "benchmarks" / "every_schedule.py"), run_name="every_schedule")["SIZES"]


def assert_every_schedule_ok_on_nccl(path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    world = torch.cuda.device_count()
    prog = runpy.run_path(str(path))["program"].ir
    if prog.is_pipeline and world < 2:
        # NCCL refuses two ranks on one GPU in a group, and a pipeline needs a rank per stage
        world, stages = 1, 1
    else:
        stages = 2
    sizes = {d: SIZES[d] for d in prog.dims}
    results = run_schedules(
        list(generate(prog)),
        Options(world=world, sizes=sizes, backend="nccl", stages=stages, warmup=2, repeats=5, timeout_s=120),
    )
    bad = [(r.schedule, r.status, r.error) for r in results if r.status != "ok" or not r.correct]
    assert not bad, bad
    assert all(r.median_s > 0 for r in results)


@pytest.mark.gpu
@pytest.mark.parametrize("name", EXAMPLES)
def test_every_schedule_of_every_example_on_nccl(name):
    assert_every_schedule_ok_on_nccl(ROOT / "examples" / f"{name}.py")


@pytest.mark.gpu
@pytest.mark.parametrize("path", BENCH_PROGRAMS, ids=lambda p: p.stem)
def test_every_schedule_of_every_benchmark_program_on_nccl(path):
    """Products taken onto rows or columns (Adafactor's factors, the MLP's column-parallel matmul), counts,
    powers, norms of slices: the programs behind the CPU benchmarks, on CUDA tensors."""
    assert_every_schedule_ok_on_nccl(path)


def _only_the_device_differs(gloo: str, nccl: str) -> list[str]:
    """The lines of the NCCL module that are not the gloo module's, but for the backend's name and the device."""
    expected = {
        ("torch.distributed (gloo)", "torch.distributed (nccl)"),
        ("torch.device('cpu')", "torch.device('cuda', torch.cuda.current_device())"),
    }
    a, b = gloo.splitlines(), nccl.splitlines()
    if len(a) != len(b):
        return [f"{len(a)} lines against {len(b)}"]
    return [y for x, y in zip(a, b) if x != y and not any(x.replace(g, n) == y for g, n in expected)]


@pytest.mark.parametrize(
    "path", [*(ROOT / "examples" / f"{n}.py" for n in EXAMPLES), *BENCH_PROGRAMS], ids=lambda p: p.stem
)
def test_the_nccl_module_is_the_gloo_module_on_the_gpu(path):
    # what the CPU tests establish of a schedule on gloo holds of its NCCL module but for CUDA itself (its kernels,
    # its collectives), for every program, those never run on a GPU among them
    from coconet.codegen.lower import lower

    prog = runpy.run_path(str(path))["program"].ir
    for s in generate(prog):
        for kernels in ("compiled", "eager"):
            differ = _only_the_device_differs(lower(s, "gloo", kernels).source, lower(s, "nccl", kernels).source)
            assert not differ, (s.text, kernels, differ)
