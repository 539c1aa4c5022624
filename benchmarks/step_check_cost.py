"""What coconet.compile's input checks cost a step that is handed the same tensors again.

    python benchmarks/step_check_cost.py [--calls 200000] [--out benchmarks/results/step_check_cost.json]

A compiled step checks each input's shape, dtype and device (and, for sliced inputs, this rank's rows) once per
tensor identity; later calls look each input's key up in a dict. This times ``Step.check`` on Adam's four
tensors and five scalars under ZeRO-1 (world 2, rank 1), steady state, against an empty loop over the same
dicts, and the first check of new tensors; no process group is needed (the check runs before the step)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ZERO1 = "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0)"


def _per_call(fn, calls: int) -> float:
    best = float("inf")
    for _ in range(5):  # the fastest of five runs: the least disturbed by what else the machine does
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / calls)
    return best


def main(argv: list[str] | None = None) -> dict:
    import torch

    import coconet

    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    n = 1 << 20
    step = coconet.compile("examples/adam.py", {"N": n}, schedule=ZERO1, world=2, rank=1, kernels="eager")
    rows = step.inputs["m"].shape
    tensors = {"g": torch.zeros(n), "w": torch.zeros(n), "m": torch.zeros(rows), "v": torch.zeros(rows)}
    scalars = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "t": 1}
    step.check(tensors, scalars)
    check = _per_call(lambda: step.check(tensors, scalars), args.calls)
    empty = _per_call(lambda: [t for t in tensors.values()], args.calls)

    def first():
        step._seen.clear()
        step.check(tensors, scalars)

    fresh = _per_call(first, args.calls // 10)
    report = {
        "command": "python benchmarks/step_check_cost.py " + " ".join(argv or []),
        "inputs": len(tensors),
        "scalars": len(scalars),
        "steady_ns_per_call": check,
        "empty_loop_ns_per_call": empty,
        "steady_ns_per_input": check / len(tensors),
        "first_check_ns_per_call": fresh,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
    print(
        f"steady state: {check:.0f} ns a call ({check / len(tensors):.0f} ns an input; an empty loop over the "
        f"inputs {empty:.0f} ns); first check of new tensors: {fresh / 1e3:.1f} us a call"
    )
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
