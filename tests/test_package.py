import importlib
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import coconet
from coconet import errors

ROOT = Path(__file__).resolve().parents[1]

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


def _lower_bounds() -> dict[str, str]:
    """Each direct dependency pyproject.toml declares (core and the installable extras), with its lower bound."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # test and bench are tools to run the suite and the benchmarks with, not what coconet needs
    extras = [deps for name, deps in project["optional-dependencies"].items() if name not in ("test", "bench")]
    bounds: dict[str, str] = {}
    for line in project["dependencies"] + [d for deps in extras for d in deps]:
        req = Requirement(line)
        if req.name == "coconet":
            continue
        lower = [s.version for s in req.specifier if s.operator == ">="]
        assert len(lower) == 1, f"{line!r} declares no lower bound (>=)"
        assert bounds.setdefault(req.name.lower(), lower[0]) == lower[0], f"{req.name}: two lower bounds"
    return bounds


def _oldest_pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / ".ci" / "oldest-constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and name.strip() not in pins, f"not one exact pin per package: {line!r}"
            pins[name.strip().lower()] = version.strip()
    return pins


def test_the_oldest_ci_resolution_is_the_declared_lower_bounds():
    """.ci/oldest tests coconet with every direct dependency at its lower bound: the pins it installs are
    exactly the bounds pyproject.toml declares, one per direct dependency."""
    from packaging.version import Version

    bounds, pins = _lower_bounds(), _oldest_pins()
    assert set(pins) == set(bounds), set(pins) ^ set(bounds)
    for name, lower in bounds.items():
        assert Version(pins[name]) == Version(lower), f"{name}: pyproject says >={lower}, CI tests {pins[name]}"
