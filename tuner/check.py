"""A schedule's values checked against the reference interpreter's: each rank's report taken as it comes (a
Replicated value checked on every rank, the pieces of anything else assembled), the largest relative error,
and what differs beyond its dtype's tolerance."""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from coconet.schedules import interp
from coconet.schedules.equivalence import CONDITIONING, TOLERANCE, Reference, rel_err
from coconet.schedules.types import Replicated
from coconet.tuner.rank import AGAIN


def compare(
    prog, reports: Mapping[int, dict], opts: Any, reference, *, again: bool = False
) -> tuple[float, str | None]:
    """The largest relative error of what the ranks reported (rank → observed values) against the
    reference interpreter's, and what differs beyond its dtype's tolerance (None when nothing does);
    ``again``: the reports hold a second step's values too (``coconet.tuner.rank.checked_steps``)."""
    check = Check(prog, opts, reference, again=again)
    for rank in sorted(reports):
        check.add(rank, reports[rank])
    return check.result()


class Check:
    """The ranks' reports of one schedule checked as they come: a Replicated value once per rank as it
    arrives (every rank must hold it whole: a gather that missed one rank shows there only) and then let
    go, anything else kept until its pieces are all in and assembled. The parent then holds one rank's
    copy of the replicated state at a time, not the world's: 1.5 GB of Adam's at N=2^25, world 4."""

    def __init__(self, prog, opts: Any, reference, *, score: bool = True, again: bool = False):
        self.prog, self.opts, self.reference, self.score = prog, opts, reference, score
        # the keys the ranks must report: the reference's, and with ``again`` each once more for a second step
        self.expected = set(reference) | ({k + AGAIN for k in reference} if again else set())
        self.worst = 0.0
        self.failures: list[tuple[str, int, str]] = []  # (key, rank, what): the first in that order is told
        self.seen: set[str] = set()
        self.pieces: dict[str, dict[int, np.ndarray]] = {}
        self.ranks: set[int] = set()

    def add(self, rank: int, report: Mapping[str, np.ndarray]) -> None:
        """The rest of ``rank``'s report: after this, nothing more of it comes."""
        for key, value in report.items():
            self.take(rank, key, value)
        self.ranks.add(rank)

    def take(self, rank: int, key: str, value: np.ndarray) -> None:
        if not self.score:
            return
        self.seen.add(key)
        if isinstance(self._type(key).layout, Replicated) and self.opts.world > 1:
            self._score(key, rank, f" on rank {rank}", value)
        else:
            self.pieces.setdefault(key, {})[rank % self.opts.world] = value

    def result(self) -> tuple[float, str | None]:
        for key in sorted(self.pieces):
            pieces = self.pieces.pop(key)
            stage = int(key.split(".", 1)[0].removeprefix("stage"))
            lacking = [stage * self.opts.world + r for r in range(self.opts.world) if r not in pieces]
            if lacking:
                self.worst = math.inf
                self.failures.append((key, lacking[0], f"{key} is missing from rank {lacking[0]}"))
                continue
            self._score(key, 0, "", interp.assemble(self._type(key), [pieces[r] for r in range(self.opts.world)]))
        for key in self.expected ^ self.seen:
            side = "the ranks" if key not in self.seen else "the reference"
            self.worst = math.inf
            self.failures.append((key, -1, f"{key} is missing from {side}"))
        first = min(self.failures, default=None)
        return self.worst, None if first is None else first[2]

    def _score(self, key: str, rank: int, where: str, value: np.ndarray) -> None:
        base = key.removesuffix(AGAIN)
        if key not in self.expected:
            return  # told as missing from the reference
        e = rel_err(value, self.reference[base])
        tol = self._tolerance(base)
        self.worst = max(self.worst, e)
        own = self.reference.program_error(base) if not e <= tol and isinstance(self.reference, Reference) else 0.0
        if not e <= max(tol, CONDITIONING * own):
            when = " after a second step on the same inputs" if key != base else ""
            bound = self._allowed(base, tol, own)
            self.failures.append(
                (
                    key,
                    rank,
                    f"{base}{where}{when} (relative error {e:.3g} > {bound}) "
                    f"differs from the reference interpreter"
                    f"{self._nonfinite(base, value, self.reference[base])}",
                )
            )

    def _allowed(self, key: str, tol: float, own: float) -> str:
        if not CONDITIONING * own > tol:
            return f"{tol:g}"
        dtypes = " and ".join(sorted(self._dtypes(key)))
        return (
            f"{CONDITIONING * own:.3g}, {CONDITIONING:g}x the {own:.3g} of the program itself computed in "
            f"{dtypes} statement by statement: ill-conditioned on these inputs"
        )

    def _source(self, key: str) -> str:
        """The statement whose value ``key`` reports (a state: the one it is updated to, if it is)."""
        _, kind, name = key.split(".", 2)
        if kind == "state":
            return self.prog.updates.get(name, name)
        if kind == "output":
            return self.prog.outputs[name]
        return next(s for s in self.prog.effects if s.op == "send" and s.attr("tag") == name).args[0]

    def _type(self, key: str):
        key = key.removesuffix(AGAIN)
        _, kind, name = key.split(".", 2)
        return self.prog[name].type if kind == "state" else self.prog[self._source(key)].type

    def _tolerance(self, key: str) -> float:
        """The loosest tolerance of the dtypes the value was computed in on its way: a float32 state
        updated from a bfloat16 allreduce carries bfloat16's error (inputs are given to the oracle
        already rounded to their dtype, so they add none)."""
        return max(TOLERANCE[d] for d in self._dtypes(key))

    def _dtypes(self, key: str) -> set[str]:
        """The float dtypes the value of ``key`` was computed in on its way from the inputs."""
        own = self._type(key).dtype
        out, todo, seen = {own if own in TOLERANCE else "float32"}, [self._source(key)], set()
        while todo:
            s = self.prog[todo.pop()]
            if s.name in seen or s.op in ("input", "scalar", "recv", "const"):
                continue
            seen.add(s.name)
            if s.type is not None and s.type.dtype in TOLERANCE:
                out.add(s.type.dtype)
            todo.extend(a for a in s.args if isinstance(a, str) and a in self.prog)
        return out

    def _nonfinite(self, key: str, got: np.ndarray, want: np.ndarray) -> str:
        """Why a value may be inf or NaN where the reference's is finite: the reference computes in float64,
        so a float16 intermediate that overflows there does not."""
        got, want = np.asarray(got), np.asarray(want)
        if got.shape != want.shape:
            return ""
        count = int(np.count_nonzero(~np.isfinite(got) & np.isfinite(want)))
        if not count:
            return ""
        largest, narrow = min((float(np.finfo(_NUMPY_FLOAT[d]).max), d) for d in self._dtypes(key))
        return (
            f"; {count} element{'s' * (count != 1)} inf or NaN where the reference's are finite: computed in "
            f"{narrow}, whose largest finite value is {largest:.6g}, an intermediate may overflow where the "
            "reference interpreter, computing in float64, does not"
        )


# numpy's float for each dtype with the same largest finite value (bfloat16 shares float32's range)
_NUMPY_FLOAT: dict[str, type[np.floating[Any]]] = {
    "float16": np.float16,
    "bfloat16": np.float32,
    "float32": np.float32,
    "float64": np.float64,
}
