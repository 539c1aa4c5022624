"""The runtime as generated modules use it: which names of ``coconet.kernels`` a module imports (bound as
``_<name>``, apart from the program's own names), the runtime's files, and a module written with a copy of
them next to it (``standalone``), so that it runs with torch alone.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import re
import shutil
from pathlib import Path

import coconet.kernels
from coconet.codegen import backends

PACKAGE = "coconet.kernels"
STANDALONE_PACKAGE = "coconet_kernels"  # the folder a standalone module's copy of the runtime goes into

_COLLECTIVES = (
    "allreduce",
    "allreduced",
    "broadcast",
    "reduce_scatter",
    "all_gather",
    "bucket_allreduce",
    "bucket_reduce_scatter",
    "bucket_all_gather",
    "reduce_scatter_chunks",
    "Gather",
)
_COMMON = {
    "context": ("Ctx", "Chunk"),
    "compiled": ("kernel",),
    "dropout": ("dropout", "dropout_rows"),
    "ops": ("matmul", "conv", "norm", "int64", "size"),
}
# per backend: module of coconet.kernels -> the names generated code may call from it. The shm backend's
# collectives have the names and signatures of torch.distributed's, so that one lowering serves both
_IMPORTS = {
    "torch": {**_COMMON, "collectives": _COLLECTIVES},
    "shm": {
        **_COMMON,
        "segments": ("Shm",),
        "copier": ("native",),
        "shm": _COLLECTIVES
        + ("scatter_parts", "reduce_scatter_parts", "reduce_all", "end_collective", "gather_into", "into_peers"),
    },
}


def _table(backend: str) -> dict[str, tuple[str, ...]]:
    return _IMPORTS[backends.get(backend).runtime]


def names() -> frozenset[str]:
    """Every name a generated module may bind from the runtime, whatever its backend."""
    return frozenset(f"_{n}" for table in _IMPORTS.values() for ns in table.values() for n in ns)


def imports(code: str, backend: str, package: str = PACKAGE) -> list[str]:
    """The import lines for what ``code`` calls of the runtime on ``backend``, from ``package``."""
    words = set(re.findall(r"\w+", code))
    lines = []
    for module, ns in sorted(_table(backend).items()):
        used = [f"{n} as _{n}" for n in ns if f"_{n}" in words]
        if not used:
            continue
        line = f"from {package}.{module} import {', '.join(used)}"
        if len(line) > 120:  # one name a line, as a formatter would
            line = f"from {package}.{module} import (\n" + "".join(f"    {u},\n" for u in used) + ")"
        lines.append(line)
    return lines


def folder() -> Path:
    """Where the runtime's files are."""
    return Path(coconet.kernels.__file__).parent


@functools.cache
def files(backend: str) -> tuple[Path, ...]:
    """The runtime's files a module on ``backend`` needs: those it imports, those they import (relatively,
    within the package), and the package's ``__init__.py``."""
    root = folder()
    todo, seen = list(_table(backend)), set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for node in ast.walk(ast.parse((root / f"{module}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                todo.append(node.module)
    return (root / "__init__.py",) + tuple(root / f"{m}.py" for m in sorted(seen))


@functools.cache
def digest(backend: str) -> str:
    """A hash of the runtime's files on ``backend``: a module cached on disk is keyed by it too, so that a
    cache never hands out a module written for another runtime (names it imports may have changed)."""
    h = hashlib.sha256()
    for path in files(backend):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def standalone_source(source: str) -> str:
    """A generated module's text, importing the runtime from a copy next to it rather than from coconet."""
    return re.sub(rf"^from {re.escape(PACKAGE)}\.", f"from {STANDALONE_PACKAGE}.", source, flags=re.M)


def write(source: str, backend: str, path: Path, standalone: bool = False) -> Path:
    """Writes a generated module to ``path``; ``standalone``: with the runtime's files it needs copied whole
    into ``coconet_kernels/`` beside it, which it imports instead of coconet (torch is all it then needs)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if standalone:
        into = path.parent / STANDALONE_PACKAGE
        into.mkdir(exist_ok=True)
        for f in files(backend):
            shutil.copyfile(f, into / f.name)
        source = standalone_source(source)
    path.write_text(source)
    return path
