import importlib
import pickle
import subprocess
import sys

import pytest

import coconet
from coconet import errors

DSL_NAMES = [
    "Program",
    "Local",
    "Replicated",
    "Sliced",
    "sqrt",
    "rsqrt",
    "exp",
    "log",
    "abs",
    "maximum",
    "minimum",
    "where",
    "cast",
    "norm",
    "sum",
    "matmul",
    "dropout",
    "allreduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "send",
    "recv",
    "NEXT_STAGE",
    "PREV_STAGE",
]


@pytest.mark.parametrize(
    "name",
    [
        "coconet",
        "coconet.schedules",
        "coconet.schedules.transforms",
        "coconet.codegen",
        "coconet.kernels",
        "coconet.tuner",
        "coconet.server",
        "coconet.cli",
    ],
)
def test_namespace(name):
    importlib.import_module(name)


def test_public_dsl():
    for name in DSL_NAMES:
        assert hasattr(coconet, name), name
    assert set(DSL_NAMES) <= set(coconet.__all__)


def test_import_is_light_and_side_effect_free():
    code = (
        "import sys, coconet; import coconet.schedules.interp; "
        "print(','.join(m for m in ('torch', 'ray', 'optuna', 'typer') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "" and out.stderr == ""


@pytest.mark.parametrize(
    "err",
    [
        errors.ProgramError("bad", statement="s", op="add", rule="r", location="f.py:1"),
        errors.IllegalTransform("no", transform="split(ar0)"),
        errors.SizeError("size"),
        errors.BackendError("boom", kind="timeout", rank=3),
        errors.NotAvailable("later"),
    ],
)
def test_errors_pickle(err):
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is type(err) and str(again) == str(err) and vars(again) == vars(err)
    assert isinstance(again, errors.CoconetError)
