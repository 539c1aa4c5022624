"""Does overlap overlap? The Megatron layer's matmul with its reduce_scatter in flight, traced.

    python benchmarks/overlap.py [--world 2] [--size B=4,S=512,H=1024] \
        [--out benchmarks/results/overlap_megatron_w2.json]

In one run, on gloo and shm: ``split(ar0)`` (the matmul, then its
reduce_scatter) against ``split(ar0); overlap(mm0, rs0)`` (the matmul in
chunks, chunk k's reduce_scatter in flight while chunk k+1 multiplies). Each
step is timed (median of the slowest rank), and one more step per rank is
profiled: the report gives, on rank 0, the time spent in matmuls on the main
thread, the time collectives were in progress on the threads that carry them
(gloo's workers, the shm communication thread) and the time both were at once.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import runpy
import tempfile
from pathlib import Path

from coconet.schedules.dims import parse_sizes
from coconet.schedules.schedule import Schedule
from coconet.tuner.launch import Options, run_schedules
from coconet.tuner.trace import overlap

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = ("split(ar0)", "split(ar0); overlap(mm0, rs0)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--size", default="B=4,S=512,H=1024")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/overlap_megatron_w2.json")
    args = ap.parse_args()
    prog = runpy.run_path(str(ROOT / "examples/megatron_mlp.py"))["program"].ir
    sizes = parse_sizes([args.size], prog.dims)
    scheds = [Schedule.parse(t, prog) for t in SCHEDULES]
    scheds[1] = scheds[1].with_knobs(chunks=args.chunks)
    report = {
        "workload": prog.name,
        "world": args.world,
        "sizes": sizes,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "rows": [],
    }
    for backend in ("gloo", "shm"):
        with tempfile.TemporaryDirectory() as traces:
            opts = Options(
                world=args.world,
                sizes=sizes,
                backend=backend,
                repeats=args.repeats,
                warmup=2,
                timeout_s=300,
                trace=traces,
            )
            for sched, res in zip(scheds, run_schedules(scheds, opts)):
                found = sorted(Path(traces).glob(f"*{sched.hash}*_rank0.json"))
                o = overlap(found[0]) if found else None
                row = {
                    "backend": backend,
                    "schedule": res.schedule,
                    "status": res.status,
                    "median_s": res.median_s,
                    "traced_step_s": o.step_s if o else None,
                    "matmul_s": o.compute_s if o else None,
                    "comm_in_progress_s": o.comm_s if o else None,
                    "both_s": o.overlapped_s if o else None,
                    "comm_hidden": o.hidden if o else None,
                }
                report["rows"].append(row)
                print(json.dumps(row))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
