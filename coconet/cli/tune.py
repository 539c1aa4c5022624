"""``coconet tune`` (the fastest schedule per size on a topology, measured on Ray, searched by Optuna,
recorded in the store) and ``coconet sweep`` (many programs, sizes and topologies offline, measured where
local and predicted by the cost model elsewhere)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from coconet.cli.common import (
    BACKEND_METAVAR,
    JSON_OPT,
    LOCAL_BACKENDS_HELP,
    PROGRAM_HELP,
    SHARDABLE_HELP,
    SIZE_OPT,
    echo_json,
    program_path,
    require_sizes,
)
from coconet.cli.output import (
    Lines,
    failure_text,
    fmt_ci,
    fmt_s,
    machines_text,
    progress_bar,
    ratio,
    sharded_note,
    table_console,
)
from coconet.codegen.lower import KERNELS
from coconet.errors import CoconetError
from coconet.extras import EXTRAS, STORE, require
from coconet.loader import load_file
from coconet.schedules.dims import format_sizes, parse_sizes


def tune(
    file: Path = typer.Argument(..., callback=program_path, help=PROGRAM_HELP),
    world: int = typer.Option(
        2, "--world", min=1, help="Ranks (per pipeline stage); at most 64 on the local Ray cluster this machine starts."
    ),
    size: Optional[List[str]] = SIZE_OPT,
    budget: int = typer.Option(
        32,
        "--budget",
        min=1,
        help="Candidates measured per size; the whole space when it is smaller (then the search is exhaustive).",
    ),
    topology: str = typer.Option(
        "local",
        "--topology",
        help="`local` (this machine, calibrated on first use); "
        "another name only with --ray-address, on a cluster that is that topology: its "
        "nodes, CPUs and GPU model are checked against the topology before any trial.",
    ),
    backend: List[str] = typer.Option(
        [],
        "--backend",
        metavar=BACKEND_METAVAR,
        help=f"Restrict the backends tried (repeatable); default: every one this machine runs ({LOCAL_BACKENDS_HELP}).",
    ),
    db: Optional[str] = typer.Option(
        None, "--db", help="Store URL (default $COCONET_DATABASE_URL, else SQLite in the user data dir)."
    ),
    ray_address: Optional[str] = typer.Option(
        None,
        "--ray-address",
        help="Join this Ray cluster instead of "
        "starting a local one (HOST:PORT of its head; a cluster with "
        "Ray's token authentication needs its token in ~/.ray/auth_token "
        "or $RAY_AUTH_TOKEN).",
    ),
    placement: str = typer.Option(
        "pack",
        "--placement",
        metavar="[pack|spread]",
        help="Where a candidate's ranks go on the cluster: "
        "pack (as few nodes as hold them) or spread (across nodes; shm, which needs "
        "one node, is then not tried).",
    ),
    kernels: str = typer.Option("compiled", "--kernels", metavar="[compiled|eager]", help="compiled or eager."),
    depth: int = typer.Option(6, "--depth", min=0, help="Longest transform sequence in the space searched."),
    timeout: float = typer.Option(
        300.0,
        "--timeout",
        min=1.0,
        help="Seconds a candidate's check or timing may take before its ranks are killed (timeout).",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the search, of the inputs and of dropout."),
    shardable: List[str] = typer.Option(
        [],
        "--shardable",
        help=f"{SHARDABLE_HELP} Schedules sharding other state are not tried; the winner is recorded for this choice.",
    ),
    as_json: bool = JSON_OPT,
) -> None:
    """Find the fastest schedule per size on this topology: measured on Ray, searched by Optuna, recorded in the
    store. With one --size the JSON is one result; with several, a list (smallest sizes first)."""
    from coconet.api import tune as run_tune  # numpy and the tuner: after the checks

    require((*STORE, *EXTRAS["tune"]), "`coconet tune`")  # the store named first, as the command always has
    if kernels not in KERNELS:
        raise CoconetError(f"unknown --kernels {kernels!r} (use {' or '.join(KERNELS)})")
    prog = load_file(file)
    size = require_sizes(prog, size)
    points = [parse_sizes(spec, prog.dims) for spec in size]
    tuned: list[tuple[Any, dict]] = []  # each size's outcome (its trials, for the table) and its record
    with progress_bar(quiet=as_json) as bar:
        tasks: dict[str, Any] = {}

        def show(sizes: dict, p: Any) -> None:
            key = format_sizes(sizes)
            if key not in tasks:
                tasks[key] = bar.add_task(key, total=p.budget, status="")
            best = f"best {fmt_s(p.best[1])} {p.best[0]}" if p.best else "no result yet"
            bar.update(tasks[key], completed=p.trials, total=p.budget, status=f"failed {p.failed}  {best}"[:100])

        run_tune(
            file,
            points,
            world=world,
            budget=budget,
            topology=topology,
            backends=backend,
            store=db,
            ray_address=ray_address,
            kernels=kernels,
            depth=depth,
            seed=seed,
            timeout_s=timeout,
            shardable=shardable or None,
            placement=placement,
            on_progress=None if as_json else show,
            on_tuned=lambda t, doc: tuned.append((t, doc)),
        )
    docs = [doc for _, doc in tuned]
    if as_json:
        echo_json(docs[0] if len(docs) == 1 else docs)
    else:
        for t, doc in tuned:
            _print_tune_table(prog, doc, t)
    if any(d["best"] is None for d in docs):  # as `run` when a schedule fails: the answer is printed, and partial
        raise typer.Exit(1)


def _print_tune_table(prog: Any, doc: dict, tuned: Any) -> None:
    console = table_console()
    sizes_text = format_sizes(doc["sizes"])
    shardable = ",".join(doc["shardable"]) or "none"
    table = Table(
        title=f"{prog.name}  world={doc['world']}  {sizes_text}  topology={doc['topology']}  "
        f"shardable={shardable}  search: {doc['trials']} trials, {doc['failed']} failed",
        title_justify="left",
        show_edge=False,
    )
    for col in ("status", "backend", "median", "95% CI", "vs baseline\n(search)"):
        table.add_column(col, no_wrap=True, justify="left" if col in ("status", "backend") else "right")
    table.add_column("schedule", ratio=1, overflow="fold")
    searched = tuned.outcome.baseline_searched
    base = searched.result.median_s if searched is not None else None
    trials = sorted(tuned.outcome.trials, key=lambda t: (t.result.status != "ok", t.result.median_s or 0))
    for t in trials:
        r = t.result
        ci = r.ci95_s
        win = (
            doc["best"]
            and t.candidate.schedule.hash == doc["best"]["hash"]
            and t.candidate.backend == doc["best"]["backend"]
        )
        table.add_row(
            r.status if r.status == "ok" else f"[red]{r.status}[/red]",
            t.candidate.backend,
            fmt_s(r.median_s),
            fmt_ci(ci),
            f"{base / r.median_s:.2f}x" if base and r.median_s else "",
            Text(("* " if win else "") + t.candidate.text),
        )
    console.print(table)
    if doc["best"]:
        b = doc["best"]
        console.print(
            f"winner, timed again in turns with the runner-up and the baseline: {b['backend']}: "
            f"{b['schedule']}  {fmt_s(b['median_s'])} [{fmt_s(b['ci95_s'][0])}, "
            f"{fmt_s(b['ci95_s'][1])}]"
            + (f"  {ratio(doc['speedup'])}x over the baseline" if doc["speedup"] else "")
            + f"  record {doc['record_id']}",
            markup=False,
        )
        if doc.get("machines"):
            console.print(machines_text(doc["machines"]), markup=False)
        if doc["order_reversed"] and doc["search_best"]:
            s = doc["search_best"]
            console.print(
                f"note: the search had {s['backend']}: {s['schedule']} faster ({fmt_s(s['median_s'])}); "
                "timed again in turns, the winner above beat it",
                markup=False,
            )
        if b["sharded"]:
            console.print(sharded_note(b["sharded"]), markup=False)
    else:
        console.print("no schedule ran correctly: nothing recorded as the winner", markup=False)
    for b, why in doc.get("backends_left_out", {}).items():
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"note: backend {b} not tried: {why}", markup=False)
    if doc["failures"]:
        err = Console(stderr=True, highlight=False, soft_wrap=True)
        err.print(f"{doc['failed']} trial(s) failed:", markup=False)
        for f in doc["failures"]:
            err.print(f"  {failure_text(f)}", markup=False)


def sweep(
    config: Path = typer.Argument(
        ...,
        help="Sweep definition (YAML): programs and sizes, topologies, worlds, "
        "budget; see configs/sweeps/. `paper` names the one coconet ships.",
    ),
    simulate: bool = typer.Option(
        False, "--simulate", help="Predict every key with the cost model, the local topology's too."
    ),
    db: Optional[str] = typer.Option(
        None, "--db", help="Store URL (default $COCONET_DATABASE_URL, else SQLite in the user data dir)."
    ),
    ray_address: Optional[str] = typer.Option(
        None,
        "--ray-address",
        help="Measure the local keys on this Ray cluster (HOST:PORT) instead of one started here.",
    ),
    as_json: bool = JSON_OPT,
) -> None:
    """Offline sweep over programs x sizes x topologies: measured (tuned) on the local topology, predicted by the
    cost model elsewhere (recorded as source: model). Keys already done are skipped, so a stopped sweep resumes;
    a key with a measured winner is never predicted."""
    from rich.progress import Progress, TextColumn, TimeElapsedColumn

    from coconet.api import sweep as run_sweep
    from coconet.tuner.sweep import SweepConfig

    cfg = SweepConfig.load(config)  # refused before the progress bar, as one error line
    if as_json:
        echo_json(run_sweep(cfg, simulate=simulate, store=db, ray_address=ray_address))
        return
    terminal = Console(stderr=True).is_terminal
    with (
        Progress(TextColumn("{task.description}"), TimeElapsedColumn(), console=Console(stderr=True))
        if terminal
        else Lines()
    ) as bar:
        task = bar.add_task("sweep")

        def show(r: Any) -> None:
            bar.update(
                task,
                description=f"{r.predicted} predicted, {r.measured} measured, "
                f"{r.skipped} skipped of {r.keys} keys so far",
            )

        doc = run_sweep(cfg, simulate=simulate, store=db, ray_address=ray_address, on_progress=show)
    rate = f"{doc['keys_per_s']:.0f} keys/s" if doc["keys_per_s"] else ""
    Console(highlight=False).print(
        f"{doc['keys']} keys: {doc['predicted']} predicted ({doc['predictions']} schedule predictions), "
        f"{doc['measured']} measured, {doc['skipped']} already done"
        + (
            f", {doc['kept_measured']} left alone (measured: a prediction never replaces a measurement)"
            if doc["kept_measured"]
            else ""
        )
        + f"; {doc['seconds']:.1f} s {rate}",
        markup=False,
    )
    if doc["unfit"]:
        Console(highlight=False, stderr=True).print(
            f"note: {doc['unfit']} keys left out: their world needs more ranks than the topology has", markup=False
        )
    if doc["too_large"]:
        Console(highlight=False, stderr=True).print(
            f"note: {doc['too_large']} local keys left out: this machine cannot hold them (the first: "
            f"{doc['too_large_why']})",
            markup=False,
        )
