"""Build-time check of the GPU worker image: what Inductor and Triton need to build kernels is there.

Run by Dockerfile.worker after the install (no GPU is needed or used):

    python worker_check.py

Triton compiles a small C launcher per kernel signature against Python's headers, and Inductor compiles
C++ for any part of a graph that stays on the host; both find the compiler as ``cc``/``gcc``/``g++`` on
PATH. torch's CUDA wheel pins the one Triton it was built with (``Requires-Dist: triton==X``); a second
Triton (another version, or the ``pytorch-triton`` nightly name) shadows it and fails at kernel load.
Each problem is one line on stderr, and the exit status is the number of problems (0: the image is fit).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from importlib import metadata

TRITON_NAMES = ("triton", "pytorch-triton")


def pinned_triton(requires: list[str] | None) -> str | None:
    """The Triton version a torch distribution's ``Requires-Dist`` lines pin on Linux, or None."""
    for req in requires or ():
        m = re.match(r"^\s*triton\s*==\s*([\w.+-]+)\s*(;.*)?$", req)
        if m and (m.group(2) is None or "Linux" in m.group(2)):
            return m.group(1)
    return None


def triton_problems(torch_requires: list[str] | None, installed: dict[str, str]) -> list[str]:
    """What is wrong with the Triton(s) ``installed`` ({distribution: version}) for this torch."""
    want = pinned_triton(torch_requires)
    found = {name: v for name, v in installed.items() if name in TRITON_NAMES}
    if want is None:
        return ["torch pins no Triton: it is not a CUDA build (install torch's CUDA wheel)"]
    if len(found) > 1:
        return [
            f"two Tritons installed ({', '.join(f'{n}=={v}' for n, v in sorted(found.items()))}); "
            f"torch needs triton=={want} alone"
        ]
    if not found:
        return [f"Triton is not installed; torch needs triton=={want}"]
    ((name, version),) = found.items()
    if name != "triton" or version != want:
        return [f"{name}=={version} installed, torch needs triton=={want}"]
    return []


def compiler_problems(cc: str | None, include: str) -> list[str]:
    """A C compiler that builds a file including Python.h, as Triton's launcher does."""
    if cc is None:
        return ["no C compiler on PATH (cc, gcc): Triton cannot build its kernel launchers"]
    if not os.path.isfile(os.path.join(include, "Python.h")):
        return [f"no Python.h in {include} (install python3-dev): Triton's launchers include it"]
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "probe.c")
        with open(src, "w") as f:
            f.write("#include <Python.h>\nint probe(void) { return PY_MAJOR_VERSION; }\n")
        proc = subprocess.run(
            [cc, "-fPIC", "-c", src, "-I", include, "-o", os.path.join(d, "probe.o")],
            capture_output=True,
            text=True,
            timeout=120,
        )
    if proc.returncode:
        return [f"{cc} cannot compile against Python.h: {proc.stderr.strip().splitlines()[-1:]}"]
    return []


def main() -> int:
    problems: list[str] = []
    try:
        torch_requires = metadata.requires("torch")
    except metadata.PackageNotFoundError:
        torch_requires = None
        problems.append("torch is not installed")
    installed = {}
    for name in TRITON_NAMES:
        try:
            installed[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    if torch_requires is not None:
        problems += triton_problems(torch_requires, installed)
    cc = shutil.which("cc") or shutil.which("gcc")
    problems += compiler_problems(cc, sysconfig.get_paths()["include"])
    if shutil.which("g++") is None and shutil.which("c++") is None:
        problems.append("no C++ compiler on PATH (g++): Inductor compiles host-side kernels with it")
    for p in problems:
        print(f"worker_check: {p}", file=sys.stderr)
    if not problems:
        print(
            f"worker_check: ok (triton {installed.get('triton')}, cc {cc}, Python.h in "
            f"{sysconfig.get_paths()['include']})"
        )
    return len(problems)


if __name__ == "__main__":
    sys.exit(main())
