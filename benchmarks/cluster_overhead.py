"""What tuning on a warm Ray cluster costs against the local runner: time to the first trial, and per trial.

    python benchmarks/cluster_overhead.py [--program examples/sgd.py] [--world 2] [--size N=2^12]
                                          [--budget 4] [--rounds 3]
                                          [--out benchmarks/results/cluster_overhead.json]

The script starts a two-node Ray cluster on this machine (``ray start --head`` and ``ray start --address``,
one CPU each, in a temp dir of its own; stopped by pid at the end), then in interleaved rounds runs the same
``coconet tune PROGRAM --world W --size S --budget K --kernels eager`` twice, each into a fresh SQLite store:
once with ``--ray-address`` (the warm cluster) and once without (the local runner: a Ray of its own, started
by the command). Order alternates from round to round.

What a trial costs is read from the store, not from the command's output: every trial is a row in
``measurements`` stamped when it was recorded. Per command:

- ``ray_joined_s``: from launching the command to its job's row, written once Ray is joined (or started) and
  the cluster's offer read (interpreter, imports, the program's checks, ``ray.init``);
- ``first_trial_s``: from launching the command to the first trial's row (the above, then placing the ranks,
  starting their actors and group, the first candidate's lowering, check and timed steps);
- ``per_trial_s``: the median gap between consecutive trial rows (the search's trials, ``trials`` in the
  command's ``--json``; the winner's re-timing after them is left out);
- ``per_trial_overhead_s``: that gap less the trial's own timed steps (the sum of its samples): what each trial
  costs beyond the steps it times (actors, lowering, the check against the reference, the store).

The report gives each way's medians over rounds and the paired ratios cluster / local of each round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from coconet.tuner.plots import COLOURS, figure, write_figure

ROOT = Path(__file__).resolve().parents[1]
RAY = Path(sys.executable).parent / "ray"
WAYS = ("cluster", "local")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(roots: set[int]) -> list[int]:
    """``roots`` and every process descending from them (Ray's processes rename themselves: found by parent)."""
    children: dict[int, list[int]] = {}
    for line in subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout.splitlines():
        pid, ppid = map(int, line.split())
        children.setdefault(ppid, []).append(pid)
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _naming(marker: str) -> set[int]:
    """The processes whose command line holds ``marker`` (read from /proc: ps cuts long lines)."""
    found = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if marker in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.add(int(proc.name))
            except OSError:
                continue
    return found


class Cluster:
    """Two Ray nodes of one CPU each on this machine, in a temp dir of their own; stopped by pid."""

    def __init__(self) -> None:
        self.temp = Path(tempfile.mkdtemp(prefix="ccb-", dir="/tmp"))  # short: Ray's sockets live in it
        self.port, self.worker_nm = _free_port(), _free_port()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env["RAY_USAGE_STATS_ENABLED"] = "0"
        self.address = f"127.0.0.1:{self.port}"

    def __enter__(self) -> Cluster:
        try:
            subprocess.run(
                [
                    str(RAY),
                    "start",
                    "--head",
                    "--port",
                    str(self.port),
                    "--num-cpus",
                    "1",
                    "--temp-dir",
                    str(self.temp),
                    "--include-dashboard=false",
                ],
                env=self.env,
                check=True,
                capture_output=True,
                timeout=180,
            )
            subprocess.run(
                [
                    str(RAY),
                    "start",
                    "--address",
                    self.address,
                    "--num-cpus",
                    "1",
                    "--node-manager-port",
                    str(self.worker_nm),
                ],
                env={**self.env, "RAY_AUTH_MODE": "token"},
                check=True,
                capture_output=True,
                timeout=180,
            )
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        for pid in _tree(_naming(str(self.temp)) | _naming(f"--node_manager_port={self.worker_nm}")):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.temp, ignore_errors=True)


def _tune(args, way: str, cluster: Cluster, work: Path, i: int) -> dict:
    """One ``coconet tune`` command, timed from its launch to each trial's row in its store."""
    from coconet.server.store import Store

    db = f"sqlite:///{work / f'{way}{i}.db'}"
    cmd = [
        sys.executable,
        "-m",
        "coconet",
        "tune",
        str(args.program),
        "--world",
        str(args.world),
        "--size",
        args.size,
        "--budget",
        str(args.budget),
        "--kernels",
        "eager",
        "--db",
        db,
        "--json",
    ]
    if way == "cluster":
        cmd += ["--ray-address", cluster.address]
    env = cluster.env if way == "cluster" else {k: v for k, v in cluster.env.items() if k != "RAY_ADDRESS"}
    t0 = time.time()
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    total = time.time() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr[-2000:]}")
    doc = json.loads(done.stdout)
    with Store.open(db) as store:
        [job] = store.jobs(program_hash=doc["program_hash"])
        rows = sorted(
            (m for m in store.measurements(doc["program_hash"]) if m.source == "measured"), key=lambda m: m.created_at
        )
    rows = rows[: doc["trials"]]  # the search's trials; the re-timing of the fastest in turns comes after
    if not rows:
        raise SystemExit(f"{way}: no trial recorded")
    stamps = [_seconds(m.created_at) for m in rows]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    overheads = [g - sum(m.samples) for g, m in zip(gaps, rows[1:])]
    return {
        "command_s": total,
        "ray_joined_s": _seconds(job.created_at) - t0,
        "first_trial_s": stamps[0] - t0,
        "trials": len(rows),
        "per_trial_s": statistics.median(gaps) if gaps else None,
        "per_trial_overhead_s": statistics.median(overheads) if overheads else None,
        "placement": sorted({m.versions.get("placement", "") for m in rows}),
    }


def _seconds(stamp: datetime) -> float:
    """A store's timestamp as seconds since the epoch (SQLite hands them back without their UTC zone)."""
    return stamp.replace(tzinfo=stamp.tzinfo or timezone.utc).timestamp()


def _plot(report: dict, path: Path) -> None:
    import plotly.graph_objects as go  # plotly: only when plotting

    panels = (
        ("ray_joined_s", "launch to Ray joined"),
        ("first_trial_s", "launch to first trial"),
        ("per_trial_overhead_s", "per-trial overhead"),
    )
    fig = figure(1, 3, subplot_titles=[title for _, title in panels])
    names = {w: f"{w} ({'--ray-address' if w == 'cluster' else 'own Ray'})" for w in WAYS}
    for col, (key, _) in enumerate(panels, start=1):
        for way in WAYS:
            ys = [r[way][key] for r in report["rounds"] if r[way][key] is not None]
            fig.add_trace(
                go.Box(
                    x=[names[way]] * len(ys),
                    y=ys,
                    name=names[way],
                    boxpoints="all",  # every round's point beside its box, as few as there are
                    pointpos=0,
                    marker={"color": "black", "size": 5},
                    line={"color": COLOURS[0]},
                    fillcolor="rgba(0,0,0,0)",
                    showlegend=False,
                ),
                row=1,
                col=col,
            )
        fig.update_yaxes(title_text="seconds", rangemode="tozero", row=1, col=col)
    fig.update_layout(
        title={
            "text": f"coconet tune {report['program']} --world {report['world']} --size {report['size']} "
            f"--budget {report['budget']}, {len(report['rounds'])} rounds",
            "font": {"size": 12},
        }
    )
    write_figure(fig, path, width=1200, height=380)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--program", type=Path, default=Path("examples/sgd.py"))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--size", default="N=2^12")
    ap.add_argument("--budget", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    report: dict = {
        "program": str(args.program),
        "world": args.world,
        "size": args.size,
        "budget": args.budget,
        "cluster": "2 Ray nodes on this machine, 1 CPU each",
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "rounds": [],
    }
    work = Path(tempfile.mkdtemp(prefix="coconet-cluster-bench-"))
    try:
        with Cluster() as cluster:
            for i in range(args.rounds):
                row = {}
                for way in WAYS if i % 2 == 0 else WAYS[::-1]:
                    row[way] = _tune(args, way, cluster, work, i)
                    print(
                        f"round {i} {way}: first trial {row[way]['first_trial_s']:.2f} s, per trial "
                        f"{row[way]['per_trial_s'] or 0:.2f} s (overhead {row[way]['per_trial_overhead_s'] or 0:.2f}"
                        f" s), {row[way]['trials']} trials",
                        flush=True,
                    )
                report["rounds"].append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for key in ("ray_joined_s", "first_trial_s", "per_trial_s", "per_trial_overhead_s", "command_s"):
        per_way = {
            way: statistics.median(r[way][key] for r in report["rounds"] if r[way][key] is not None) for way in WAYS
        }
        ratios = [
            r["cluster"][key] / r["local"][key] for r in report["rounds"] if r["cluster"][key] and r["local"][key]
        ]
        summary[key] = {**per_way, "cluster / local (paired, median)": statistics.median(ratios) if ratios else None}
    report["median"] = summary
    for key, m in summary.items():
        print(
            f"{key}: cluster {m['cluster']:.2f} s, local {m['local']:.2f} s, "
            f"cluster / local {m['cluster / local (paired, median)'] or float('nan'):.2f}"
        )
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
        _plot(report, args.out.with_suffix(".png"))
    return report


if __name__ == "__main__":
    main()
