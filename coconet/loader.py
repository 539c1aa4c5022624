"""Reading a program from a file: ``.py`` (defines ``program``) or ``.json`` (the IR).

Running a ``.py`` file executes the user's Python: the CLI does that on the
user's own machine; the server never does (it accepts JSON only).
"""

from __future__ import annotations

import contextlib
import os
import re
import runpy
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

from coconet.errors import CoconetError, ProgramError
from coconet.schedules.dsl import Program as DSLProgram
from coconet.schedules.ir import Program
from coconet.schedules.serialize import MAX_JSON_BYTES
from coconet.schedules.serialize import load as load_ir


def load_file(path: str | os.PathLike, ops: Any = None) -> Program:
    p = Path(path)
    if not p.is_file():
        if len(p.parts) == 1 and not p.suffix:
            raise ProgramError(f"{path}: no such file, nor an example of that name ({', '.join(example_names())})")
        raise ProgramError(f"{path}: no such file")
    if p.suffix == ".json":
        if p.stat().st_size > MAX_JSON_BYTES:
            raise ProgramError(f"{path}: larger than {MAX_JSON_BYTES} bytes")
        try:
            return load_ir(p.read_bytes(), ops=ops)
        except ProgramError as err:
            err.location = err.location or str(path)
            raise
    if p.suffix != ".py":
        raise ProgramError(f"{path}: a program file is .py (defining `program`) or .json (exported IR)")
    return _run_python(p)


def _run_python(p: Path) -> Program:
    before = set(threading.enumerate())
    try:
        with contextlib.redirect_stdout(sys.stderr):  # what the file prints must not mix with a --json answer
            namespace = runpy.run_path(str(p), run_name="__coconet_program__")
    except CoconetError:
        raise
    except SyntaxError as e:
        where = f"{p}:{e.lineno}" if e.lineno else str(p)  # none for a NUL byte or a bad encoding
        raise ProgramError(f"{where}: syntax error: {e.msg}") from None
    except SystemExit as e:  # not ours to end the process: a program file defines, it does not run
        raise ProgramError(f"{_user_frame(e, p)}: the file called sys.exit({e.code!r}) while being loaded") from None
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # the user's code failed (GeneratorExit and BaseException too): where, no traceback
        raise ProgramError(f"{_user_frame(e, p)}: {type(e).__name__}{_message(e)}") from None
    left = [t for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon]
    if left:  # the interpreter would wait for it at exit: the command would never end
        raise ProgramError(
            f"{p}: started thread {left[0].name!r}, still running after the file was loaded: a "
            "program file defines, it does not run (a daemon thread would not hold the process)"
        )
    if "program" not in namespace:
        raise ProgramError(f"{p}: defines no `program` (end the file with `program = p`)")
    prog = namespace["program"]
    if isinstance(prog, DSLProgram):
        return prog.ir
    if isinstance(prog, Program):
        return prog
    raise ProgramError(f"{p}: `program` is a {type(prog).__name__}, not a coconet Program")


def _message(e: BaseException) -> str:
    try:
        text = str(e)
    except Exception as inner:  # the user's __str__ failed as well
        return f" (its message could not be read: {type(inner).__name__})"
    return f": {text}" if text else ""


def _user_frame(e: BaseException, p: Path) -> str:
    target = os.path.abspath(p)
    line = None
    for frame in traceback.extract_tb(e.__traceback__):
        if os.path.abspath(frame.filename) == target:
            line = frame.lineno
    return f"{p}:{line}" if line else str(p)


def examples_dir() -> Path:
    """The seed workloads: ``coconet/examples`` where coconet is installed from its wheel, ``examples/`` beside
    the packages in a source tree."""
    here = Path(__file__).resolve().parent
    installed = here / "examples"
    return installed if installed.is_dir() else here.parent / "examples"


def example_names(folder: str = "") -> list[str]:
    """The names of the examples shipped with coconet (``examples/<folder>``), sorted."""
    return sorted(e.stem for e in (examples_dir() / folder).glob("*.py"))


def named_example(source: Any, folder: str = "") -> Any:
    """``source`` itself, or, where it is a bare name (no suffix, no folder) of no file here, the path of the
    example of that name shipped with coconet (``examples/<folder>/<name>.py``): ``"adamw"`` for an optimizer
    works as well from a wheel as from a source tree."""
    if not isinstance(source, str) or not re.fullmatch(r"[A-Za-z_]\w*", source) or Path(source).exists():
        return source
    candidate = examples_dir() / folder / f"{source}.py"
    return candidate if candidate.is_file() else source


_FILE_SUFFIXES = (".py", ".json")


def load(source: Any, ops: Any = None) -> Program:
    """A verified program (``coconet.schedules.ir.Program``) from a ``.py`` or ``.json`` file, an example's name
    (``"adam"``), JSON text or bytes, a mapping of the IR, or a ``coconet.Program`` built with the DSL."""
    if isinstance(source, Program):
        return source
    if isinstance(source, DSLProgram):
        return source.ir
    source = named_example(source)
    if isinstance(source, os.PathLike) or (isinstance(source, str) and source.endswith(_FILE_SUFFIXES)):
        return load_file(source, ops=ops)
    return load_ir(source, ops=ops)
