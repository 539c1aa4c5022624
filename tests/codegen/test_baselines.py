import runpy
from pathlib import Path

import pytest

from coconet.codegen.baselines import BASELINES
from coconet.codegen.launch import Options, run_schedules
from coconet.errors import CoconetError
from coconet.schedules.schedule import Schedule

ROOT = Path(__file__).parents[2]


def example(name):
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"))["program"].ir


def test_torch_adam_baseline_computes_the_program():
    """torch.optim.Adam(fused=True) after a summing all_reduce updates w, m, v as the program says."""
    prog = example("adam")
    for world in (2, 3):
        torch_row, ours = run_schedules([Schedule(prog)], Options(world=world, sizes={"N": 7}, kernels="eager",
                                                                  warmup=1, repeats=2),
                                        baselines=[BASELINES["adam"]])
        assert torch_row.schedule.startswith("torch: ") and torch_row.status == "ok" and torch_row.correct
        assert ours.status == "ok" and ours.correct and len(torch_row.samples) == 2


def test_eager_megatron_baseline_runs_unchecked():
    prog = example("megatron_mlp")
    torch_row, _ = run_schedules([Schedule(prog)], Options(world=2, sizes={"B": 2, "S": 3, "H": 5},
                                                           kernels="eager", warmup=0, repeats=2),
                                 baselines=[BASELINES["megatron_mlp"]])
    assert torch_row.status == "ok" and torch_row.correct is None  # torch's dropout mask is its own
    assert torch_row.median_s > 0


def test_a_baseline_of_another_program_is_refused():
    with pytest.raises(CoconetError, match="computes adam, not sgd"):
        run_schedules([Schedule(example("sgd"))], Options(world=2, sizes={"N": 4}), baselines=[BASELINES["adam"]])
