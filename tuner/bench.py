"""Benchmarking a program's schedules (``coconet bench``): every schedule against the PyTorch baseline
(hand-written for the paper's workloads, else the program as eager PyTorch) and against the floor (the bytes
the step must move at the memory bandwidth, or its matmuls at the matmul rate, whichever is longer), per size
(docs/architecture.md, "Packages and modules").

Each point (one binding of the sizes) is launched ``rounds`` times, one round after the other; within a round
the baseline runs once, in the first backend's launch, beside the schedules. The machine's memory bandwidth
(and matmul rate, where the program has matmuls) is measured again before every round and after the last: load
from elsewhere on the machine comes and goes, and the floor takes the best the machine showed. With an
``output`` file the report is written as every result comes, so that a run stopped part-way keeps what it made.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from coconet.codegen.backends import BACKENDS, REGISTRY
from coconet.codegen.backends import get as backend_of
from coconet.codegen.baselines import Baseline, baseline_for
from coconet.codegen.footprint import require_fits
from coconet.errors import CoconetError
from coconet.schedules import shardable as shard
from coconet.schedules.ir import Program
from coconet.schedules.schedule import Schedule
from coconet.tuner.bandwidth import memory_bandwidths
from coconet.tuner.launch import Options, RunResult, require_cuda, run_schedules
from coconet.tuner.rank import allocator_policy
from coconet.tuner.roofline import bytes_moved_once, compute_floor, matmul_flops_per_rank, matmul_rate
from coconet.tuner.search import knob_variants

KNOBS = ("default", "all")


@dataclass(frozen=True)
class BenchSettings:
    """How a bench measures, checked as it is made. ``knobs``: ``default`` runs each schedule at its knobs'
    defaults (or the values its text gives), ``all`` at every combination of its knobs' values.
    ``shardable``: the state a schedule may leave sharded (names, or ``all``); none given, what the program's
    baseline caller never reads. Schedules sharding other state are left out: the baseline leaves it whole."""

    world: int = 2
    backends: tuple[str, ...] = REGISTRY.on("cpu")
    kernels: str = "compiled"
    repeats: int = 10
    rounds: int = 1
    warmup: int = 3
    timeout_s: float = 600.0
    knobs: str = "default"
    shardable: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for b in self.backends:
            if b not in BACKENDS:
                raise CoconetError(f"unknown backend {b!r} (use {', '.join(BACKENDS)})")
        if not self.backends:
            raise CoconetError("no backend to bench on: give one or more of " + ", ".join(BACKENDS))
        if self.knobs not in KNOBS:
            raise CoconetError(f"--knobs {self.knobs!r}: use default or all")
        object.__setattr__(self, "backends", tuple(dict.fromkeys(self.backends)))
        # one floor per point: the memory and matmul rates of the device the ranks' tensors live on
        gpu = [b for b in self.backends if backend_of(b).device_type == "cuda"]
        others = [b for b in self.backends if b not in gpu]
        if gpu and others:
            raise CoconetError(
                f"--backend {', '.join(gpu)} runs on CUDA tensors and {', '.join(others)} on CPU tensors: their "
                "floors differ, bench them in separate runs"
            )

    @property
    def device(self) -> str:
        """Where the ranks' tensors live, whose memory and matmul rates make the floor."""
        return backend_of(self.backends[0]).device_type


OnPoint = Callable[[Mapping[str, int], int], None]  # a point starts: its sizes, the results it will give
OnResult = Callable[[int, str, RunResult], None]  # a result landed: its round (from 0), backend, result


def bench(
    prog: Program,
    points: Sequence[Mapping[str, int]],
    schedules: Sequence[Schedule],
    settings: BenchSettings,
    *,
    program_file: str | None = None,
    output: Path | None = None,
    on_point: OnPoint | None = None,
    on_result: OnResult | None = None,
) -> dict[str, Any]:
    """The report of ``schedules`` (the program as written first) at each of ``points``: per point the
    baseline's row, every schedule's, the best and its speed-up, and the floor; the rates measured on the way.
    ``program_file``: where the ranks can load the program's custom ops again. ``output``: a file written as
    every result comes (``complete`` false until the last). Every point must fit in memory before the first
    one runs."""
    baseline = baseline_for(prog)
    allowed = shard.resolve(prog, settings.shardable) if settings.shardable else set(baseline.shardable)
    picked = list(schedules)
    if settings.knobs == "all":
        picked = list({v.hash: v for s in picked for v in knob_variants(s)}.values())
    space = [s for s in picked if set(s.sharded) <= allowed]
    left_out = [{"schedule": s.text, "sharded": sorted(s.sharded)} for s in picked if not set(s.sharded) <= allowed]
    prog.require_world(settings.world)
    for sizes in points:  # every point must fit, before the first one runs
        require_fits(prog, sizes, settings.world, check=True)
    if settings.device == "cuda":
        require_cuda(settings.world * (2 if prog.is_pipeline else 1))  # before any point is measured
    run = _Run(prog, settings, points, space, baseline, allowed, left_out, output)
    for sizes in points:
        run.measure_point(sizes, program_file, on_point, on_result)
    return run.finish()


def over_rounds(rows: list[dict]) -> dict:
    """One schedule's rows from successive launches as one: the median of its rounds' medians, or the first
    round that did not run."""
    failed = next((r for r in rows if r["status"] != "ok" or not r["median_s"]), None)
    if len(rows) == 1 or failed is not None:
        return failed or rows[0]
    medians = [r["median_s"] for r in rows]
    out = dict(
        rows[0],
        median_s=statistics.median(medians),
        round_medians_s=medians,
        ci95_s=None,
        round_ci95_s=[r["ci95_s"] for r in rows],
        samples=sum(r["samples"] for r in rows),
    )
    if all(r.get("bandwidth_GBps") for r in rows):
        out["round_bandwidth_GBps"] = [r["bandwidth_GBps"] for r in rows]
        out["bandwidth_GBps"] = max(out["round_bandwidth_GBps"])
    return out


def write_report(path: Path, report: dict) -> None:
    """Whole or not at all: a reader (or a run killed mid-write) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(partial, path)


def device_name(device: str) -> str:
    if device == "cpu":
        return f"cpu, {os.cpu_count()} cores"
    import torch

    return torch.cuda.get_device_name()


class _Run:
    """One bench's state: the report so far, and the rates sampled so far (memory bandwidth; matmul rate per
    thread of a rank, where the program has matmuls)."""

    def __init__(
        self,
        prog: Program,
        settings: BenchSettings,
        points: Sequence[Mapping[str, int]],
        space: list[Schedule],
        baseline: Baseline,
        allowed: set[str],
        left_out: list[dict],
        output: Path | None,
    ) -> None:
        self.prog, self.settings, self.space, self.baseline, self.allowed = prog, settings, space, baseline, allowed
        self.output = output
        self.bandwidths: list[float] = []
        self.by_kernel: dict[str, list[float]] = {}  # the probe's kernels' rates, each sample
        self.rates: list[float] = []
        nranks = settings.world * (2 if prog.is_pipeline else 1)
        cpus = os.cpu_count() or 1
        # a CUDA rank has a GPU to itself: its matmul rate is the device's, and no rank shares it
        self.threads = max(1, cpus // nranks) if settings.device == "cpu" else 1
        self.rate_cpus = cpus if settings.device == "cpu" else nranks
        self.matmuls = any(matmul_flops_per_rank(prog, sizes, settings.world) for sizes in points)
        self.report: dict[str, Any] = {
            "workload": prog.name,
            "program_hash": prog.hash,
            "world": settings.world,
            "backends": list(settings.backends),
            "kernels": settings.kernels,
            "knobs": settings.knobs,
            "torch_baseline": baseline.doc,
            "rank_allocator": allocator_policy(),
            "cpus": os.cpu_count(),
            "rounds": settings.rounds,
            "shardable": sorted(allowed),
            "left_out": left_out,
            "floor_device": device_name(settings.device),
            "points": [],
        }

    def sample(self) -> None:
        """The machine's rates now: measured before every round and after the last, in this run."""
        got = memory_bandwidths(device=self.settings.device)
        for name, rate in got.items():
            self.by_kernel.setdefault(name, []).append(rate / 1e9)
        self.bandwidths.append(max(got.values()))
        if self.matmuls:  # the matmul rate of one rank's threads (as the launcher gives them)
            self.rates.append(matmul_rate(self.threads, device=self.settings.device) / self.threads)

    def measure_point(
        self, sizes: Mapping[str, int], program_file: str | None, on_point: OnPoint | None, on_result: OnResult | None
    ) -> None:
        s = self.settings
        per_round: list[tuple[dict, list[dict]]] = []
        if on_point is not None:
            on_point(sizes, s.rounds * (1 + len(self.space) * len(s.backends)))
        for n_round in range(s.rounds):
            self.sample()
            in_progress: dict[str, Any] = {"sizes": sizes, "round": n_round + 1, "torch": None, "results": []}

            def landed(b: str, row: dict, result: RunResult, baseline: bool) -> None:
                if baseline:
                    in_progress["torch"] = row
                else:
                    in_progress["results"].append(row)
                self.save(sizes, per_round, in_progress)
                if on_result is not None:
                    on_result(n_round, b, result)

            per_round.append(self.measure_round(sizes, program_file, landed))
            self.save(sizes, per_round, None)
        self.report["points"].append(self.point_of(sizes, per_round))

    def measure_round(
        self, sizes: Mapping[str, int], program_file: str | None, landed: Callable[[str, dict, RunResult, bool], None]
    ) -> tuple[dict, list[dict]]:
        """One launch per backend: the baseline's row (from the first launch) and every schedule's."""
        s = self.settings
        rows: list[dict] = []
        torch_row: dict = {}  # the first launch's first result
        for k, b in enumerate(s.backends):  # the baseline runs once a round, in its first launch, beside them
            opts = Options(
                world=s.world,
                sizes=sizes,
                backend=b,
                kernels=s.kernels,
                repeats=s.repeats,
                warmup=s.warmup,
                timeout_s=s.timeout_s,
                stages=2,
                probe=True,
            )
            first = 1 if k == 0 else 0  # the baseline's place in the results

            # called from within run_schedules below, before the loops move on
            def one(i: int, result: RunResult, b: str = b, first: int = first) -> None:
                sched = None if i < first else self.space[i - first]
                landed(b, self.row(b, result, sched), result, i < first)

            results = run_schedules(
                self.space, opts, program_file=program_file, baselines=[self.baseline] if k == 0 else [], on_result=one
            )
            if k == 0:
                torch_row = self.row(b, results.pop(0))
            rows += [self.row(b, r, sched) for r, sched in zip(results, self.space)]
        return torch_row, rows

    @staticmethod
    def row(b: str, result: RunResult, sched: Schedule | None = None) -> dict:
        return dict(result.to_json(), backend=b, **({} if sched is None else {"sharded": sorted(sched.sharded)}))

    def point_of(self, sizes: Mapping[str, int], per_round: list[tuple[dict, list[dict]]]) -> dict:
        torch_row = over_rounds([t for t, _ in per_round])
        rows = [over_rounds(list(same)) for same in zip(*(r for _, r in per_round))]
        ok = [r for r in rows if r["status"] == "ok" and r["median_s"]]
        best = min(ok, key=lambda r: r["median_s"]) if ok else None
        point = {
            "sizes": sizes,
            "rounds_done": len(per_round),
            "bytes_moved_once": bytes_moved_once(self.prog, sizes, self.settings.world, self.allowed),
            "torch": torch_row,
            "results": rows,
            "best": best,
        }
        ref = torch_row["median_s"] if torch_row and torch_row["median_s"] else rows[0]["median_s"]
        for b in self.settings.backends:
            mine = [r for r in ok if r["backend"] == b]
            point[f"best_{b}"] = min(mine, key=lambda r: r["median_s"]) if mine else None
        point["best_speedup"] = ref / best["median_s"] if best and ref else None
        if best and "round_medians_s" in best and "round_medians_s" in torch_row:
            point["best_speedup_rounds"] = [
                t / b for t, b in zip(torch_row["round_medians_s"], best["round_medians_s"])
            ]
        return point

    def save(self, sizes: Mapping[str, int], per_round: list, in_progress: dict | None) -> None:
        """Written as every result comes: a run stopped (Ctrl-C, the OOM killer, a time limit) keeps the points
        it made, this point's finished rounds as a point of fewer rounds (rounds_done), and the results of the
        round it was in (round_in_progress), which no statistic of a point takes."""
        if self.output is None:
            return
        if per_round:
            self.report["points"].append(self.point_of(sizes, per_round))
        self.floors()
        write_report(self.output, dict(self.report, complete=False, round_in_progress=in_progress))
        if per_round:
            self.report["points"].pop()

    def floors(self) -> None:
        """The floors of the points so far, at the best rates sampled so far: here between launches, and by
        the ranks of every launch right after its timed steps."""
        report = self.report
        rows = [r for pt in report["points"] for r in [pt["torch"]] + pt["results"] if r]
        probed = [r["bandwidth_GBps"] * 1e9 for r in rows if r.get("bandwidth_GBps")]
        top = max(self.bandwidths + probed)
        report["memory_bandwidth_GBps"] = top / 1e9
        report["memory_bandwidth_samples_GBps"] = [b / 1e9 for b in self.bandwidths]
        report["memory_bandwidth_kernels_GBps"] = self.by_kernel
        report["memory_bandwidth_launches_GBps"] = [b / 1e9 for b in probed]
        if self.matmuls:
            report["matmul_GFLOPs_per_thread"] = max(self.rates) / 1e9
            report["matmul_GFLOPs_per_thread_samples"] = [r / 1e9 for r in self.rates]
            report["threads_per_rank"] = self.threads
        for i, point in enumerate(report["points"]):
            point["memory_floor_s"] = point["bytes_moved_once"] / top
            point["matmul_flops_per_rank"] = matmul_flops_per_rank(self.prog, point["sizes"], self.settings.world)
            point["compute_floor_s"] = self.compute_floor(point, max(self.rates)) if self.rates else 0.0
            point["floor_s"] = max(point["memory_floor_s"], point["compute_floor_s"])
            point["best_over_floor"] = point["best"]["median_s"] / point["floor_s"] if point["best"] else None
            if point["best"]:
                self.round_floors(i, point)

    def round_floors(self, i: int, point: dict) -> None:
        """The floor above takes the best rates of the whole run, and a machine's memory bandwidth comes in modes
        that last minutes: also each round's floor at the bandwidth its ranks measured right after timing the
        best schedule (else the one sampled before the round), and the best schedule's median of that round
        against it."""
        rounds, best = self.settings.rounds, point["best"]
        own = slice(i * rounds, (i + 1) * rounds)
        probes = best.get("round_bandwidth_GBps") or ([best["bandwidth_GBps"]] if best.get("bandwidth_GBps") else None)
        near = [b * 1e9 for b in probes] if probes else self.bandwidths[own]
        rates = self.rates[own] if self.rates else [None] * rounds
        point["floor_rounds_s"] = [
            max(point["bytes_moved_once"] / bw, self.compute_floor(point, rate) if rate else 0.0)
            for bw, rate in zip(near, rates)
        ]
        medians = best.get("round_medians_s") or [best["median_s"]]
        point["best_over_floor_rounds"] = [m / f for m, f in zip(medians, point["floor_rounds_s"])]

    def compute_floor(self, point: dict, rate: float) -> float:
        return compute_floor(self.prog, point["sizes"], self.settings.world, rate, self.rate_cpus, self.threads)

    def finish(self) -> dict[str, Any]:
        self.sample()
        self.floors()
        self.report["complete"] = True
        if self.output is not None:
            write_report(self.output, self.report)
        return self.report
