"""How much of a step's communication ran under its computation, read off a rank's Chrome trace.

``coconet run --trace DIR`` profiles one step per rank. Compute is what the main thread spends in
matrix multiplies; communication is every span on the threads that carry collectives (gloo's
workers, the shm backend's communication thread). Their intersection is the time both were in
progress at once: zero for a schedule that waits on each collective, up to the whole collective
when it is hidden behind the matmul.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# the last: the runtime's matmul on CPU
MATMUL = {"aten::mm", "aten::matmul", "aten::bmm", "aten::addmm", "mkldnn::_linear_pointwise"}


@dataclass(frozen=True)
class Overlap:
    step_s: float  # from the first to the last event of the profiled step
    compute_s: float  # matmuls on the main thread
    comm_s: float  # collectives on the other threads
    overlapped_s: float  # both at once

    @property
    def hidden(self) -> float:
        """The fraction of communication that ran while a matmul was computing."""
        return self.overlapped_s / self.comm_s if self.comm_s else 0.0


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(spans) -> float:
    return sum(b - a for a, b in spans)


def _intersect(xs, ys) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def overlap(trace: Path | str) -> Overlap:
    events = [
        e
        for e in json.loads(Path(trace).read_text())["traceEvents"]
        if e.get("ph") == "X" and "dur" in e and e.get("cat") in ("cpu_op", "user_annotation", None)
    ]
    mm = [e for e in events if e["name"] in MATMUL]
    if not events:
        return Overlap(0.0, 0.0, 0.0, 0.0)
    main = mm[0]["tid"] if mm else max({e["tid"] for e in events}, key=lambda t: sum(e["tid"] == t for e in events))
    compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in mm if e["tid"] == main])
    comm = _union([(e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] != main])
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    us = 1e-6
    return Overlap(
        (end - start) * us, _length(compute) * us, _length(comm) * us, _length(_intersect(compute, comm)) * us
    )
