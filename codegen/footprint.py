"""What a local launch must hold in memory at the least, refused up front when the machine cannot.

Sizes up to 2^40 parse; at N=2^40 a float32 vector is 4 TiB. Without this check such a launch spends its
time spawning ranks and ends in numpy's allocation error, or worse, in the kernel's OOM killer taking
whatever process on the machine it picks. The bound counts only what cannot be avoided: each rank's
pieces of the inputs at their dtype, and, when results are checked, the reference's inputs in float64
(a Local input once per rank). Temporaries, outputs and the step's own buffers come on top, so a
launch this lets through can still run out; one it refuses cannot fit.
"""

from __future__ import annotations

import math
import os
from typing import Mapping

from coconet.errors import SizeError
from coconet.schedules import interp
from coconet.schedules.dims import format_sizes
from coconet.schedules.ir import Program
from coconet.schedules.types import ITEMSIZE, Local, Sliced


def least_bytes(program: Program, sizes: Mapping[str, int], world: int, *, check: bool) -> int:
    total = 0
    for s in program.inputs:
        if s.op != "input":
            continue
        n = math.prod(interp.concrete_shape(s.type, sizes))
        itemsize = ITEMSIZE.get(s.type.dtype or "float32", 4)
        total += n * itemsize * (1 if isinstance(s.type.layout, Sliced) else world)
        if check:
            total += n * 8 * (world if isinstance(s.type.layout, Local) else 1)
    return total


def machine_bytes() -> int | None:
    """Physical memory, or the cgroup's limit where that is lower; None where neither can be read."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit)) if total else int(limit)
    except OSError:
        pass
    return total


def _gib(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def require_fits(
    program: Program, sizes: Mapping[str, int], world: int, *, check: bool, available: int | None = None
) -> None:
    have = machine_bytes() if available is None else available
    if not have:
        return
    need = least_bytes(program, sizes, world, check=check)
    if need > have:
        raise SizeError(
            f"at {format_sizes(sizes)} the inputs of {program.name} on {world} rank(s) take at least {_gib(need)}"
            + (" with the reference check's float64 copies" if check else "")
            + f"; this machine has {_gib(have)} of memory"
        )
