"""The built wheel, installed into a fresh virtual environment, outside the source tree: the examples and the
sweep coconet ships come with it, and commands that name them run.

The environment takes its dependencies (torch, ray, ...) from the one running the tests through a path file,
so that no download is needed; coconet itself comes only from the wheel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("wheel")
    # a copy of what the wheel is built from, so that the build leaves nothing in the checkout
    src = work / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".venv", ".git", "__pycache__", "build", "*.egg-info", "tests", "benchmarks", "docs", "docker", ".ci"
        ),
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(work / "dist"), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = (work / "dist").glob("coconet-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (purelib / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COCONET_", "PYTHON"))}
    env.update(COCONET_CACHE_DIR=str(work / "cache"), COCONET_DATA_DIR=str(work / "data"))
    out = work / "elsewhere"  # no examples/ or configs/ here
    out.mkdir()
    return {"python": python, "bin": venv / "bin", "env": env, "cwd": out, "purelib": purelib}


def _run(installed: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(installed["bin"] / "coconet"), *args],
        capture_output=True,
        text=True,
        cwd=installed["cwd"],
        env=installed["env"],
        timeout=timeout,
    )


def test_coconet_comes_from_the_wheel_with_its_examples_and_sweep(installed: dict) -> None:
    code = (
        "import coconet, coconet.loader as l, coconet.tuner.sweep as s; "
        "print(coconet.__file__); print(l.examples_dir()); "
        "c = s.SweepConfig.load('paper'); print(sorted({e.program.name for e in c.entries}))"
    )
    proc = subprocess.run(
        [str(installed["python"]), "-c", code],
        capture_output=True,
        text=True,
        cwd=installed["cwd"],
        env=installed["env"],
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    where, examples, names = proc.stdout.strip().splitlines()
    assert Path(where).is_relative_to(installed["purelib"]) and not Path(where).is_relative_to(ROOT)
    assert Path(examples) == installed["purelib"] / "coconet" / "examples"
    assert {"adam", "sgd", "lamb"} <= set(json.loads(names.replace("'", '"')))
    assert (installed["purelib"] / "coconet" / "examples" / "optim" / "adamw.py").is_file()


def test_commands_name_the_shipped_examples(installed: dict) -> None:
    assert _run(installed, "--version").returncode == 0
    listed = _run(installed, "schedules", "sgd")
    assert listed.returncode == 0 and listed.stdout.startswith("sgd (program "), listed.stderr
    ran = _run(installed, "run", "adam", "--world", "2", "--size", "N=2^10", "--kernels", "eager", "--json")
    assert ran.returncode == 0, ran.stderr
    [row] = json.loads(ran.stdout)["results"]
    assert row["status"] == "ok"
    missing = _run(installed, "schedules", "adan")
    assert missing.returncode == 2 and "adan: no such file, nor an example of that name (adam, " in missing.stderr


def test_the_core_runs_without_the_extras_and_a_command_names_the_one_it_needs(installed: dict, tmp_path) -> None:
    """`pip install coconet` without extras: the DSL, schedules and `coconet run` work; tuning, the store and
    the service say which extra to install. The extras' packages are made unimportable (None in sys.modules,
    from a sitecustomize) in the wheel's environment, which otherwise shares the test environment's."""
    from coconet.extras import EXTRAS

    blocked = sorted({m for mods in EXTRAS.values() for m in mods})
    (tmp_path / "sitecustomize.py").write_text(f"import sys\nfor m in {blocked!r}:\n    sys.modules[m] = None\n")
    light = {**installed, "env": {**installed["env"], "PYTHONPATH": str(tmp_path)}}
    probe = subprocess.run(
        [str(installed["python"]), "-c", "import ray"], capture_output=True, text=True, env=light["env"], timeout=60
    )
    assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr  # the block holds
    ran = _run(light, "run", "adam", "--world", "2", "--size", "N=2^10", "--kernels", "eager", "--json")
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["results"][0]["status"] == "ok"
    assert _run(light, "schedules", "adam").returncode == 0
    for args, extra in (
        (("tune", "adam", "--size", "N=2^10"), "tune"),
        (("results", "adam"), "tune"),
        (("serve", "--port", "0"), "server"),
    ):
        proc = _run(light, *args)
        assert proc.returncode == 2 and f"pip install 'coconet[{extra}]'" in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr
