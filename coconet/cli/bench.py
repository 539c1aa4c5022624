"""``coconet bench``: the options of the harness (``coconet.tuner.bench``), its progress, and its report as a
table."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from coconet.cli.common import BACKEND_METAVAR, JSON_OPT, SHARDABLE_HELP, echo_json, pick_schedules, spoken, writable
from coconet.cli.output import fmt_s, progress_bar, ratio, result_status
from coconet.codegen.backends import BACKENDS, REGISTRY
from coconet.errors import CoconetError
from coconet.loader import example_names, examples_dir, load_file
from coconet.schedules.dims import format_sizes, parse_sizes


def bench(
    workload: str = typer.Argument(..., help="An example's name (adam, megatron_mlp, …) or a program file."),
    world: int = typer.Option(2, "--world", min=1, max=64),
    size: List[str] = typer.Option(..., "--size", help="One point per --size, e.g. --size N=2^20 --size N=2^22."),
    backend: List[str] = typer.Option(
        list(REGISTRY.on("cpu")),
        "--backend",
        metavar=BACKEND_METAVAR,
        help=f"{spoken(BACKENDS)} (repeatable: every schedule runs on each).",
    ),
    kernels: str = typer.Option("compiled", "--kernels", metavar="[compiled|eager]", help="compiled or eager."),
    repeats: int = typer.Option(10, "--repeats", min=1, help="Timed steps per schedule and point."),
    rounds: int = typer.Option(
        1,
        "--rounds",
        min=1,
        help="Launch every point this many times, one after the "
        "other: a time is then the median of its rounds' medians, and the speed-up is "
        "also given per round (load on a shared machine comes and goes between them).",
    ),
    warmup: int = typer.Option(3, "--warmup", min=0, help="Untimed steps first."),
    timeout: float = typer.Option(
        600.0, "--timeout", min=1.0, help="Seconds a launch may take before its ranks are stopped."
    ),
    schedule: List[str] = typer.Option(
        ["all"],
        "--schedule",
        help="Which schedules (as `coconet run`: text, id or `all`); the program as written always runs first.",
    ),
    knobs: str = typer.Option(
        "default",
        "--knobs",
        help="default: each schedule at its knobs' defaults (or the "
        "values its text gives); all: each schedule at every combination of its knobs' values.",
    ),
    shardable: List[str] = typer.Option(
        [],
        "--shardable",
        help=f"{SHARDABLE_HELP} Schedules sharding other state are left out: the baseline leaves it whole.",
    ),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write the JSON here too."),
    plot: Optional[Path] = typer.Option(
        None,
        "--plot",
        help="Write the figure (time vs size, speed-up, distance to the floor): PATH.html as an interactive page, "
        "PATH.png (or .svg, .pdf) as an image, which needs Chromium.",
    ),
    as_json: bool = JSON_OPT,
) -> None:
    """Every schedule against the PyTorch baseline (hand-written for the paper's workloads, else the program
    as eager PyTorch) and the floor (the bytes the step must move at the memory bandwidth, or its matmuls
    at the matmul rate, whichever is longer), per size."""
    from coconet.tuner.bench import BenchSettings
    from coconet.tuner.bench import bench as run_bench

    settings = BenchSettings(
        world=world,
        backends=tuple(backend),
        kernels=kernels,
        repeats=repeats,
        rounds=rounds,
        warmup=warmup,
        timeout_s=timeout,
        knobs=knobs,
        shardable=tuple(shardable),
    )
    writable(output, "-o")
    writable(plot, "--plot")
    if plot is not None:
        from coconet.tuner.plots import can_write  # plotly, when it is there: only with --plot

        can_write(plot)  # before the minutes of measuring whose figure it is
    file = _workload_file(workload)
    prog = load_file(file)
    points = [parse_sizes(spec, prog.dims) for spec in size]
    picked = pick_schedules(prog, schedule, 6)
    with progress_bar(quiet=as_json, transient=True) as bar:
        tasks: list[Any] = []

        def started(sizes: dict, total: int) -> None:
            tasks.append(bar.add_task(format_sizes(sizes), total=total, status=""))

        def landed(n_round: int, b: str, result: Any) -> None:
            bar.update(tasks[-1], advance=1, status=f"round {n_round + 1}/{rounds}  {result_status(b, result)}")

        report = run_bench(
            prog,
            points,
            picked,
            settings,
            program_file=str(file) if file.suffix == ".py" else None,
            output=output,
            on_point=started,
            on_result=landed,
        )
    if plot is not None:
        from coconet.tuner.plots import bench_plot

        bench_plot(report, plot)
    if as_json:
        echo_json(report)
        return
    _print_bench(report, Console(highlight=False))


def _workload_file(workload: str) -> Path:
    path = Path(workload)
    if path.suffix in (".py", ".json"):
        return path

    candidate = examples_dir() / f"{workload}.py"
    if not candidate.exists():
        known = ", ".join(example_names()) or "none here"
        raise CoconetError(f"no workload {workload!r}: name an example ({known}) or a program file")
    return candidate


def _fmt_speedup(point: dict) -> str:
    """The speed-up, and under it the spread of the rounds' own."""
    if not point["best_speedup"]:
        return ""
    spread = point.get("best_speedup_rounds")
    under = f"\n({ratio(min(spread))}–{ratio(max(spread))})" if spread else ""
    return f"{ratio(point['best_speedup'])}x" + under


def _fmt_over_floor(point: dict) -> str:
    """Against the run's floor, and under it against each round's own when they differ."""
    if not point["best_over_floor"]:
        return ""
    spread = point.get("best_over_floor_rounds") or []
    own = (
        f"\n({ratio(min(spread))}–{ratio(max(spread))})"
        if len(spread) > 1
        else (f"\n({ratio(spread[0])})" if spread and abs(spread[0] - point["best_over_floor"]) > 0.005 else "")
    )
    return f"{ratio(point['best_over_floor'])}x" + own


def _print_bench(report: dict, console: Console) -> None:
    table = Table(
        title=f"{report['workload']}  world={report['world']}  backends={','.join(report['backends'])}  "
        f"kernels={report['kernels']}  memory {report['memory_bandwidth_GBps']:.1f} GB/s "
        f"({report['floor_device']})",
        title_justify="left",
        show_edge=False,
    )
    # the numbers whole in 80 columns: headers break where they can, and the best schedules, often longer than a
    # line, follow the table rather than squeeze it
    longest = max((len(f"{d}={n},") for pt in report["points"] for d, n in pt["sizes"].items()), default=5)
    table.add_column("sizes", min_width=longest)  # broken between sizes, never inside one
    for col in ("torch", "as\nwritten", "best", "speed-\nup", "floor", "best/\nfloor"):
        table.add_column(col, justify="right", no_wrap=True)
    for pt in report["points"]:
        t = pt["torch"]
        table.add_row(
            format_sizes(pt["sizes"]).replace(",", ", "),
            fmt_s(t["median_s"]) if t else "",
            fmt_s(pt["results"][0]["median_s"]),
            fmt_s(pt["best"]["median_s"]) if pt["best"] else "",
            _fmt_speedup(pt),
            fmt_s(pt["floor_s"]),
            _fmt_over_floor(pt),
        )
    console.print(table)
    for pt in report["points"]:
        if pt["best"]:
            console.print(
                Text(f"best at {format_sizes(pt['sizes'])}: {pt['best']['backend']}  {pt['best']['schedule']}")
            )
    left_out = report["left_out"]
    if left_out:
        names = sorted({n for x in left_out for n in x["sharded"]} - set(report["shardable"]))
        console.print(
            f"{len(left_out)} schedule(s) left out: they leave some of {', '.join(names)} sharded, which "
            f"the baseline leaves whole (--shardable NAME lets through those that shard NAME; "
            f"--shardable all, every one)",
            markup=False,
        )
