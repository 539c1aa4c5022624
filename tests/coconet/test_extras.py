"""What a light install says when a function needs an extra (coconet.extras)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import tomllib

import coconet
from coconet.errors import CoconetError, MissingDependency
from coconet.extras import EXTRAS, extra_for, missing

ROOT = Path(__file__).resolve().parents[2]


def test_each_extra_installs_what_it_is_said_to():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, modules in EXTRAS.items():
        names = {r.split("[")[0].split(">")[0].split("=")[0].strip().replace("-", "_") for r in declared[extra]}
        assert {m for m in modules} <= names | {"psycopg"}, (extra, modules, names)
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not any(r.startswith(m) for r in core for mods in EXTRAS.values() for m in mods)


def test_a_module_is_named_with_its_extra_and_the_command():
    assert extra_for("ray.util.placement_group") == "tune" and extra_for("fastapi") == "server"
    assert extra_for("torch") is None and extra_for(None) is None
    e = missing("psycopg.pq", "the store")
    assert e.extra == "postgres" and e.module == "psycopg"
    assert str(e) == (
        "the store needs psycopg[binary], which coconet[postgres] installs: pip install 'coconet[postgres]'"
    )
    again = pickle.loads(pickle.dumps(e))
    assert isinstance(again, CoconetError) and again.extra == "postgres" and str(again) == str(e)


@pytest.mark.parametrize(
    "blocked, call, extra",
    [
        ("ray", lambda: coconet.tune("adam", "N=1024"), "tune"),
        ("sqlalchemy", lambda: coconet.best("adam", "N=1024"), "tune"),
        ("sqlalchemy", lambda: coconet.sweep("paper", simulate=True), "tune"),
    ],
)
def test_the_python_api_names_the_extra_before_any_work(monkeypatch, blocked, call, extra):
    monkeypatch.setitem(__import__("sys").modules, blocked, None)
    with pytest.raises(MissingDependency, match=rf"needs {blocked}, which coconet\[{extra}\] installs"):
        call()
