"""The options and checks the commands share: the program argument, sizes, schedules picked by text or id,
paths the command will write, JSON on stdout."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Iterable, List, Optional

import typer

from coconet.codegen.backends import BACKENDS, REGISTRY
from coconet.errors import CoconetError
from coconet.loader import named_example
from coconet.schedules.space import pick

JSON_OPT = typer.Option(False, "--json", help="Answer in JSON on stdout.")
SIZE_OPT = typer.Option(None, "--size", help="Size bindings, e.g. N=2^20 or B=8,S=1024,H=3072 (repeatable).")

BACKEND_METAVAR = f"[{'|'.join(BACKENDS)}]"


def spoken(words: Iterable[str], last: str = "or") -> str:
    """``a, b or c``."""
    said = list(words)
    return said[0] if len(said) == 1 else f"{', '.join(said[:-1])} {last} {said[-1]}"


# each backend with what it runs on: "gloo (CPU tensors), nccl (CUDA tensors) or shm (...)"
BACKENDS_HELP = spoken(f"{b.name} ({b.summary})" if b.summary else b.name for b in REGISTRY.backends) + "."
# the backends a tuning tries where none is named, by device: "gloo and shm on CPU, nccl on GPUs"
LOCAL_BACKENDS_HELP = f"{spoken(REGISTRY.on('cpu'), 'and')} on CPU, {spoken(REGISTRY.on('cuda'), 'and')} on GPUs"

PROGRAM_HELP = "The program: a .py file defining `program`, its JSON IR, or the name of an example (adam, sgd, ...)."


def program_path(value: Path) -> Path:
    """A program argument as a path: a bare name that is no file here is the example of that name."""
    return Path(named_example(str(value)))


SHARDABLE_HELP = (
    "State a schedule may leave sharded (as_slice, ZeRO-style: after the step each rank holds only "
    "its rows): names, repeatable or joined by commas; `all` for any. Default: what the program's "
    "baseline caller never reads (Adam: m, v), else none."
)


def echo_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def writable(path: Optional[Path], option: str, *, folder: bool = False) -> Optional[Path]:
    """A file (or with ``folder``, a folder) the command will write, checked before the work whose answer it
    holds: a bench measures for minutes, and a path it cannot write would lose them. Missing folders are
    made when it writes; a path under a file, or where this user cannot write, is refused now."""
    if path is None:
        return None
    if path.exists() and path.is_dir() != folder:
        raise CoconetError(
            f"{option} {path} is a {'file' if folder else 'folder'}: name "
            f"{'a folder' if folder else 'the file to write'}"
        )
    there = path.parent
    while not there.exists():
        there = there.parent
    if not there.is_dir():
        raise CoconetError(f"{option} {path}: {there} is a file, not a folder")
    if not os.access(there, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise CoconetError(f"{option} {path}: this user cannot write there")
    return path


def require_sizes(prog: Any, size: Optional[List[str]]) -> List[str]:
    """The --size values given; an error naming the program's dims where there are none."""
    if not size:
        raise CoconetError(
            f"--size is required: bind {', '.join(prog.dims)} (e.g. --size {prog.dims[0]}=2^20)"
            if prog.dims
            else "--size is required"
        )
    return size


def pick_schedules(prog: Any, picks: List[str], depth: int) -> list:
    """The schedules ``picks`` name, the baseline first (``coconet.schedules.space.pick``), for a command that
    reads no store: ``best`` is refused."""
    return pick(prog, picks, depth, best=_no_store)


def _no_store() -> Any:
    raise CoconetError("--schedule best is for coconet run (it reads the results store)")
