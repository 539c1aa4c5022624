"""The console examples of the README and docs/: every ``$ coconet …`` line is parsed by the CLI itself (its
command, options, choices and values exist as written), and the ones that answer in seconds run for real, in
a page's order, in a scratch directory beside the examples, and must exit 0.

What is parsed but not run here, and where it runs instead: ``tune``, ``run``, ``bench`` and ``calibrate`` time
real ranks for minutes at the sizes the pages show (tests/coconet/test_cli.py runs each at small sizes);
``sweep`` of the paper's config predicts 315 keys (about 2.5 minutes; tests/tuner/test_sweep.py runs small
configs); ``best`` answers after a ``tune``; ``serve`` and ``submit`` need a server (tests/server,
tests/coconet/test_submit.py); ``curl`` and ``python benchmarks/…`` lines are not coconet's CLI.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from coconet.cli import app

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = ("check", "export", "schedules", "results")  # the commands that answer in seconds


def _commands(page: Path) -> list[list[str]]:
    """The ``$ coconet …`` lines of a page's console blocks, continuation lines joined, comments and leading
    environment assignments dropped."""
    out, block, pending = [], False, ""
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            block = line.strip() == "```console"
            continue
        if not block:
            continue
        if pending:
            line, pending = pending + " " + line.strip(), ""
        elif not line.startswith("$ "):
            continue
        else:
            line = line[2:]
        if line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]
        if words and words[0] == "coconet":
            out.append(words[1:])
    return out


def _files(page: Path) -> dict[str, str]:
    """The files a page has the reader write: its ``python`` blocks whose first line names one (``# NAME.py``)."""
    blocks = re.findall(r"^```python\n# ([\w.-]+\.py)\n(.*?)^```", page.read_text(), flags=re.M | re.S)
    return {name: body for name, body in blocks}


ALL = [(p.name, args) for p in PAGES for args in _commands(p)]


def test_the_pages_have_console_examples():
    assert len(ALL) >= 20
    assert {args[0] for _, args in ALL} >= {"check", "schedules", "run", "tune", "best", "results", "sweep"}


def _parse(args: list[str]) -> None:
    """Parse ``coconet ARGS`` as the CLI would, running nothing: a wrong command, option or value raises."""
    group = typer.main.get_command(app)
    ctx = group.make_context("coconet", list(args))
    name, command, rest = group.resolve_command(ctx, list(args))
    assert command is not None and name is not None
    with command.make_context(name, rest, parent=ctx):
        pass


def test_a_wrong_option_or_value_does_not_parse():
    _parse(["tune", "examples/adam.py", "--world", "2"])
    for wrong in (
        ["tune", "examples/adam.py", "--wrld", "2"],
        ["run", "adam", "--world"],
        ["tune", "adam", "--world", "two"],
        ["tun", "adam"],
    ):
        with pytest.raises(Exception, match="No such|requires an argument|valid integer"):
            _parse(wrong)


@pytest.mark.parametrize("page, args", ALL, ids=[f"{p}:{' '.join(a)[:40]}" for p, a in ALL])
def test_every_example_parses(page, args):
    _parse(args)


@pytest.mark.parametrize("page", [p for p in PAGES if any(a[0] in RUN for a in _commands(p))], ids=lambda p: p.name)
def test_the_quick_examples_run(page, tmp_path):
    for name in ("examples", "configs"):
        (tmp_path / name).symlink_to(ROOT / name)
    for name, body in _files(page).items():
        (tmp_path / name).write_text(body)
    env = {**os.environ, "COCONET_DATA_DIR": os.environ.get("COCONET_DATA_DIR", str(tmp_path / "data"))}
    for args in _commands(page):
        if args[0] not in RUN:
            continue
        proc = subprocess.run(
            [sys.executable, "-m", "coconet", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, f"{page.name}: coconet {' '.join(args)}\n{proc.stderr[-2000:]}"
        written = args[args.index("-o") + 1] if "-o" in args else None
        assert (tmp_path / written).stat().st_size if written else proc.stdout.strip(), (
            f"{page.name}: coconet {' '.join(args)} gave nothing"
        )


def test_the_tutorial_writes_its_program_and_runs_it():
    """The tutorial's program is a file the reader saves; its console lines run on that file."""
    page = ROOT / "docs" / "tutorial.md"
    assert "sgd_clip.py" in _files(page)
    ran = [a for a in _commands(page) if a[0] in RUN]
    assert ["check", "sgd_clip.py"] in ran and ["schedules", "sgd_clip.py"] in ran


def test_the_python_api_page_covers_the_public_api():
    """Every function of the Python API, and every public method of the REST client, is on its page."""
    import coconet
    from coconet.client import Client

    text = (ROOT / "docs" / "python-api.md").read_text()
    for name in ("load", "export", "schedules", "run", "tune", "best", "sweep", "compile"):
        assert callable(getattr(coconet, name)) and f"coconet.{name}(" in text, name
    assert "coconet.optim.from_program(" in text
    methods = [m for m in vars(Client) if not m.startswith("_") and callable(getattr(Client, m))]
    assert len(methods) >= 7
    for m in methods:
        assert f"{m}(" in text, m
