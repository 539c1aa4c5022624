"""``coconet run``: schedules checked and timed on ranks of this machine, or as one rank of a torchrun job;
``--emit`` writes their generated modules, ``--schedule best`` takes the store's winner."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from coconet.cli.common import (
    BACKEND_METAVAR,
    BACKENDS_HELP,
    JSON_OPT,
    PROGRAM_HELP,
    SHARDABLE_HELP,
    SIZE_OPT,
    echo_json,
    program_path,
    require_sizes,
    writable,
)
from coconet.cli.output import fmt_ci, fmt_s, progress_bar, ratio, result_status, table_console
from coconet.codegen.backends import DEFAULT
from coconet.codegen.lower import BACKENDS, KERNELS
from coconet.errors import CoconetError
from coconet.extras import STORE, require
from coconet.loader import load_file
from coconet.schedules.dims import format_sizes, parse_sizes


def _say_best(found: Any, sizes: dict, backend: str) -> None:
    """On stderr, what `--schedule best` runs: the store's winner (of the nearest tuned sizes where these were
    not tuned; at the world asked), measured or predicted."""
    world = found.winner.world
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    if not found.exact:
        err.print(
            f"note: {format_sizes(sizes)} was not tuned; using the winner of {found.winner.sizes_key}", markup=False
        )
    err.print(f"note: --schedule best is {_answer_text(found)}", markup=False)
    if found.source != "measured":
        err.print(
            f"note: nothing measured answers here; `coconet tune FILE --world {world} --size "
            f"{format_sizes(sizes)} --backend {backend}` measures it",
            markup=False,
        )


def _answer_text(found: Any) -> str:
    """What a stored winner is, in words: measured (with its time) or predicted (by which model, calibrated
    how), and its record."""
    m, w = found.measurement, found.winner
    speedup = f", {ratio(w.speedup)}x over the baseline" if w.speedup else ""
    if found.source == "measured":
        return f"measured: {fmt_s(m.median_s)} a step{speedup} (winner record {w.id})"
    v = m.versions or {}
    return (
        f"predicted, not measured: {fmt_s(m.median_s)} a step{speedup} by the cost model "
        f"({v.get('model', 'unnamed')}, topology {w.topology} calibration {v.get('topology', 'unknown')}; "
        f"winner record {w.id})"
    )


def run(
    file: Path = typer.Argument(..., callback=program_path, help=PROGRAM_HELP),
    world: Optional[int] = typer.Option(
        None,
        "--world",
        min=1,
        max=64,
        help="Ranks per pipeline stage (default 2; under torchrun, WORLD_SIZE / stages, which it must match if given).",
    ),
    size: Optional[List[str]] = SIZE_OPT,
    schedule: List[str] = typer.Option(
        ["baseline"],
        "--schedule",
        help="A schedule's text, its id in "
        "`coconet schedules`, `baseline` or `all` (repeatable). The baseline "
        "always runs too.",
    ),
    backend: str = typer.Option(DEFAULT, "--backend", metavar=BACKEND_METAVAR, help=BACKENDS_HELP),
    kernels: str = typer.Option(
        "compiled",
        "--kernels",
        metavar="[compiled|eager]",
        help="compiled: fused groups compiled by Inductor "
        "(the first call compiles; cached on disk); eager: plain torch statements.",
    ),
    stages: Optional[int] = typer.Option(
        None, "--stages", min=1, max=16, help="Pipeline stages for programs that send/recv (default 2)."
    ),
    repeats: int = typer.Option(20, "--repeats", min=1, help="Timed steps per schedule."),
    warmup: int = typer.Option(3, "--warmup", min=0, help="Untimed steps first."),
    seed: int = typer.Option(0, "--seed", help="Seed of the inputs and of dropout."),
    timeout: float = typer.Option(
        120.0, "--timeout", min=1.0, help="Seconds a schedule may take before its ranks are stopped and reported."
    ),
    no_check: bool = typer.Option(False, "--no-check", help="Skip the check against the reference interpreter."),
    depth: int = typer.Option(6, "--depth", min=0, max=12, help="Depth of the space for `all` and ids."),
    emit: Optional[Path] = typer.Option(None, "--emit", help="Also write each schedule's generated module here."),
    standalone: bool = typer.Option(
        False,
        "--standalone",
        help="With --emit: copy the runtime (coconet.kernels) "
        "the modules import into DIR/coconet_kernels/, so that they run with torch "
        "alone.",
    ),
    db: Optional[str] = typer.Option(
        None,
        "--db",
        help="Store that `--schedule best` reads (default $COCONET_DATABASE_URL, else SQLite in the user data dir).",
    ),
    shardable: List[str] = typer.Option(
        [], "--shardable", help=f"For `--schedule best`: the winner of a tuning that asked this. {SHARDABLE_HELP}"
    ),
    trace: Optional[Path] = typer.Option(
        None,
        "--trace",
        help="Profile one more step per rank and write its "
        "Chrome trace here (chrome://tracing, Perfetto); `coconet.tuner.trace` "
        "reads off how much communication ran under compute.",
    ),
    launcher: str = typer.Option(
        "auto",
        "--launcher",
        metavar="[auto|local|env]",
        help="local: start the ranks on this machine; env: this "
        "process is one rank of a job that torchrun started (or any launcher that sets "
        "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), joined through env://, rank 0 "
        "printing the results; auto: env when those variables are set, else local.",
    ),
    as_json: bool = JSON_OPT,
) -> None:
    """Run schedules on R ranks of this machine, or as one rank of a torchrun job: check every output against
    the reference interpreter and time the step (median and 95% CI of the slowest rank per step)."""
    from coconet.api import run as run_schedules  # numpy and the tuner: after the checks
    from coconet.tuner.envlaunch import choose

    job = choose(launcher)
    if backend not in BACKENDS:
        raise CoconetError(f"unknown backend {backend!r} (use {', '.join(BACKENDS)})")
    if kernels not in KERNELS:
        raise CoconetError(f"unknown --kernels {kernels!r} (use {' or '.join(KERNELS)})")
    writable(emit, "--emit", folder=True)
    if standalone and emit is None:
        raise CoconetError("--standalone says how --emit writes the modules: give --emit DIR too")
    writable(trace, "--trace", folder=True)
    prog = load_file(file)
    size = require_sizes(prog, size)
    sizes = parse_sizes(size, prog.dims)
    if "best" in (s.strip() for s in schedule):
        require(STORE, "`coconet run`")  # the command, not the function it calls, named in the error
    quiet = job is not None and job.rank != 0  # one rank speaks for the job
    with progress_bar(quiet=as_json or quiet, transient=True) as bar:
        tasks: list = []

        def started(picked: list, ranks: int) -> None:
            tasks.append(bar.add_task(f"{prog.name} on {ranks} ranks ({backend})", total=len(picked), status=""))

        answer = run_schedules(
            file,
            sizes,
            world=world,
            schedules=schedule,
            backend=backend,
            kernels=kernels,
            stages=stages,
            repeats=repeats,
            warmup=warmup,
            seed=seed,
            timeout_s=timeout,
            check=not no_check,
            depth=depth,
            store=db,
            shardable=shardable,
            launcher=launcher,
            emit=emit,
            standalone=standalone,
            trace=trace,
            on_start=started,
            on_result=lambda i, r: bar.update(tasks[0], advance=1, status=result_status(backend, r)),
            on_best=lambda found: _say_best(found, sizes, backend),
        )
    failed = [r for r in answer["results"] if r["status"] != "ok"]
    if quiet:
        raise typer.Exit(1 if failed else 0)
    if as_json:
        echo_json(answer)
    else:
        _print_run_table(prog, answer["world"], backend, sizes, answer["results"])
    if failed:
        raise typer.Exit(1)


def _print_run_table(prog: Any, world: int, backend: str, sizes: dict, rows: list) -> None:
    console = table_console()
    sizes_text = format_sizes(sizes)
    table = Table(
        title=f"{prog.name}  world={world}  backend={backend}  {sizes_text}", title_justify="left", show_edge=False
    )
    table.add_column("id", no_wrap=True, justify="right")  # --schedule ID runs it again
    for col in ("status", "max rel\nerr", "median", "95% CI", "vs baseline"):
        table.add_column(col, no_wrap=True, justify="left" if col == "status" else "right")
    table.add_column("schedule", ratio=1, overflow="fold")
    for row in rows:
        ci = row["ci95_s"]
        err = row["max_rel_err"]
        table.add_row(
            "" if row.get("id") is None else str(row["id"]),
            row["status"] if row["status"] == "ok" else f"[red]{row['status']}[/red]",
            "" if err is None else f"{err:.1e}",
            fmt_s(row["median_s"]),
            fmt_ci(ci),
            f"{row['speedup']:.2f}x" if row["speedup"] else "",
            Text(row["schedule"]),
        )
    console.print(table)
    for row in rows:
        if row["error"]:
            Console(stderr=True, highlight=False, soft_wrap=True).print(
                f"{row['schedule']}: {row['status']}: {row['error']}", markup=False
            )
