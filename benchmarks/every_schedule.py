"""Every schedule of every program (the examples, then benchmarks/programs) run on one backend and
checked against the reference, one program per process, several programs at once, results as JSON lines.

    python benchmarks/every_schedule.py --backend nccl --world 1 --kernels eager --jobs 8 \\
        --deadline-s 300 --out every_schedule_nccl.jsonl [PROGRAM.py ...]

What tests/codegen/test_nccl.py asserts, but for a machine on loan: a row per schedule as soon as it is
known, so a run cut off by its deadline keeps what it found; a program still running at the deadline is
stopped and listed as such. The test takes its sizes from here (uneven, so that no split divides evenly). Times
at world 1 are one rank's step, collectives included; they rank the schedules of one program, nothing more.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
SIZES = {"N": 1000003, "B": 2, "S": 33, "H": 257, "M": 37, "K": 29, "F": 7, "C": 19, "W": 31, "A": 7, "D": 16}


def programs(named: list[str]) -> list[Path]:
    if named:
        return [Path(p).resolve() for p in named]
    return sorted((ROOT / "examples").glob("*.py")) + sorted((ROOT / "benchmarks" / "programs").glob("*.py"))


def run_one(path: Path, args: argparse.Namespace) -> None:
    """One program's schedules in one launch; each row printed as its result lands."""
    from coconet.schedules.space import generate
    from coconet.tuner.launch import Options, run_schedules

    prog = runpy.run_path(str(path))["program"].ir
    scheds = list(generate(prog))
    # a pipeline needs a rank per stage, and NCCL refuses two ranks of one group on one GPU
    stages = 2 if prog.is_pipeline and args.world >= 2 else 1
    opts = Options(
        world=args.world,
        sizes={d: SIZES[d] for d in prog.dims},
        backend=args.backend,
        kernels=args.kernels,
        stages=stages,
        warmup=2,
        repeats=5,
        timeout_s=args.timeout_s,
    )
    start = time.perf_counter()

    def landed(i: int, result) -> None:
        row = dict(
            result.to_json(),
            program=path.stem,
            backend=args.backend,
            kernels=args.kernels,
            world=args.world,
            stages=stages,
            seconds_since_start=round(time.perf_counter() - start, 2),
        )
        print(json.dumps(row), flush=True)

    run_schedules(scheds, opts, program_file=str(path), on_result=landed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("programs", nargs="*")
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--kernels", default="compiled", choices=["compiled", "eager"])
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--deadline-s", type=float, default=600.0)
    ap.add_argument("--timeout-s", type=float, default=120.0, help="one schedule's limit, as Options.timeout_s")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--logs", type=Path, default=None, help="each program's output (default: a temp dir)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        run_one(Path(args.programs[0]), args)
        return

    todo, running = programs(args.programs), []
    end = time.monotonic() + args.deadline_s
    logs = args.logs or Path(tempfile.mkdtemp(prefix="every_schedule_"))
    logs.mkdir(parents=True, exist_ok=True)
    rows, stopped = [], []
    with args.out.open("w") as out:

        def reap(proc, path, log, killed: bool) -> None:
            log.close()
            lines = (logs / f"{path.stem}.out").read_text().splitlines()
            got = [json.loads(line) for line in lines if line.startswith('{"schedule"')]
            for row in got:
                out.write(json.dumps(row) + "\n")
            out.flush()
            rows.extend(got)
            if killed or proc.returncode:
                tail = "\n".join([line for line in lines if not line.startswith('{"schedule"')][-15:])
                summary = {
                    "program": path.stem,
                    "stopped_at_deadline": killed,
                    "returncode": proc.returncode,
                    "rows": len(got),
                    "tail": tail,
                }
                stopped.append(summary)
                out.write(json.dumps(summary) + "\n")
            print(
                f"{path.stem}: {len(got)} rows, {sum(r['status'] == 'ok' and r['correct'] for r in got)} ok"
                + (" (stopped at the deadline)" if killed else f" (exit {proc.returncode})" if proc.returncode else ""),
                flush=True,
            )

        while (todo or running) and time.monotonic() < end:
            while todo and len(running) < args.jobs:
                path = todo.pop(0)
                log = (logs / f"{path.stem}.out").open("w")
                cmd = [
                    sys.executable,
                    __file__,
                    str(path),
                    "--one",
                    "--backend",
                    args.backend,
                    "--kernels",
                    args.kernels,
                    "--world",
                    str(args.world),
                    "--timeout-s",
                    str(args.timeout_s),
                    "--out",
                    "-",
                ]
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                running.append((proc, path, log))
            for item in list(running):
                if item[0].poll() is not None:
                    running.remove(item)
                    reap(*item, killed=False)
            time.sleep(0.2)
        for proc, path, log in running:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reap(proc, path, log, killed=True)
        for path in todo:
            stopped.append({"program": path.stem, "not_started": True})
            out.write(json.dumps(stopped[-1]) + "\n")
    ok = sum(r["status"] == "ok" and bool(r["correct"]) for r in rows)
    bad = [r for r in rows if not (r["status"] == "ok" and r["correct"])]
    print(
        f"{args.backend} {args.kernels}: {ok}/{len(rows)} schedules ok and correct; "
        f"{len(stopped)} program(s) stopped or not started"
    )
    for r in bad[:40]:
        print(f"  {r['program']}: {r['schedule'][:80]}  {r['status']} {(r['error'] or '')[:300]}")


if __name__ == "__main__":
    main()
