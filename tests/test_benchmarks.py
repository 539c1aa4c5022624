"""The benchmark scripts' own claims that can be checked without timing anything."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("program", ["rmsprop", "amsgrad", "adagrad"])
def test_the_unseen_optimizers_are_the_updates_torch_optim_makes(program):
    # the baseline they are timed against is torch.optim's: the same update, or the comparison means nothing
    assert _script("unseen_optimizers").check_semantics(program, world=3, n=257) < 1e-5
