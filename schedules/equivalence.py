"""Does a schedule compute what its program computes? The reference check.

Both run under the interpreter on the same seeded inputs; every observable
value (updated state, outputs, what each pipeline stage sends) is compared as
a global value. The oracle computes in float64, so two interpreter runs agree
to rounding; ``TOLERANCE`` is what a backend computing in a dtype is held to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from coconet.schedules import interp
from coconet.schedules.ir import Program
from coconet.schedules.schedule import Schedule

# relative tolerance of a value computed in a dtype, against the float64 oracle
TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}
ORACLE_TOLERANCE = 1e-9


@dataclass(frozen=True)
class Mismatch:
    key: str
    max_rel_err: float

    def __str__(self) -> str:
        return f"{self.key} differs (max relative error {self.max_rel_err:.3g})"


def small_sizes(program: Program) -> dict[str, int]:
    """Sizes that exercise uneven and empty slices for worlds of 1-4 ranks."""
    return {d: 3 + 2 * i for i, d in enumerate(program.dims)}


# elements compared at a time: rel_err widens to float64 and takes four temporaries of its block, which
# for a whole 2^25-element state would be 1 GB on top of the values compared
_BLOCK = 1 << 20


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return float("inf")
    got, want = got.reshape(-1), want.reshape(-1)
    return max((_block_err(got[i : i + _BLOCK], want[i : i + _BLOCK]) for i in range(0, got.size, _BLOCK)), default=0.0)


def _block_err(got: np.ndarray, want: np.ndarray) -> float:
    got, want = got.astype(np.float64), want.astype(np.float64)
    both_nan = np.isnan(got) & np.isnan(want)
    same_inf = np.isinf(got) & np.isinf(want) & (np.sign(got) == np.sign(want))
    with np.errstate(invalid="ignore"):  # inf - inf and inf / inf: NaN, told apart below
        err = np.abs(got - want) / np.maximum(np.abs(want), 1.0)
    err[both_nan | same_inf] = 0.0
    # what is left as NaN had a NaN or an infinity on one side only: as wrong as a result can be
    err[np.isnan(err)] = np.inf
    return float(err.max(initial=0.0))


def compare(ref: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray], tol: float) -> list[Mismatch]:
    out = []
    for key in sorted(set(ref) | set(got)):
        if key not in ref or key not in got:
            out.append(Mismatch(key, float("inf")))
            continue
        e = rel_err(got[key], ref[key])
        if not e <= tol:
            out.append(Mismatch(key, e))
    return out


def check(
    schedule: Schedule, world: int, sizes: Mapping[str, int] | None = None, *, stages: int | None = None, seed: int = 0
) -> list[Mismatch]:
    """Mismatches of ``schedule`` against its program on ``world`` simulated ranks (empty: equivalent)."""
    prog = schedule.program
    sizes = dict(sizes or small_sizes(prog))
    stages = stages or (2 if prog.is_pipeline else 1)
    ref = interp.run(prog, world, sizes, seed=seed, stages=stages).observable()
    got = interp.run(schedule.scheduled, world, sizes, seed=seed, stages=stages).observable()
    return compare(ref, got, ORACLE_TOLERANCE)


# how much further than the program's own step in its dtypes a schedule may lie from the float64 values,
# where that step misses them by more than its dtype's tolerance: a schedule rounds the same operations in
# another order, so on an ill-conditioned element its error is of the program's own order, not below it
CONDITIONING = 10.0


class Reference(Mapping[str, np.ndarray]):
    """The float64 values of a program's step that every backend's are checked against, by observable key;
    and, asked for when a result misses its dtype's tolerance, how far the program's own step lies from them
    when every statement rounds to its dtype (``interp.run(..., precision="declared")``). Where that is
    beyond the tolerance the program is ill-conditioned on the inputs (a difference of two close values
    divided into another, as centered RMSprop's ``sq - mg * mg`` on random moments): no schedule in that
    dtype can do better, and it is held to ``CONDITIONING`` times that instead."""

    def __init__(self, program, world: int, sizes: Mapping[str, int], *, seed: int = 0, stages: int = 1):
        self._run = dict(program=program, world=world, sizes=dict(sizes), seed=seed, stages=stages)
        self._values = interp.run(**self._run).observable()
        self._own: dict[str, float] | None = None

    def __getitem__(self, key: str) -> np.ndarray:
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def program_error(self, key: str) -> float:
        """The relative error of the program's own step in its dtypes at ``key`` (computed once, for every
        key, the first time one is asked for: then only its numbers are kept)."""
        if self._own is None:
            declared = interp.run(**self._run, precision="declared").observable()
            self._own = {k: rel_err(declared[k], v) for k, v in self._values.items()}
        return self._own[key]
