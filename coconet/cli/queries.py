"""Commands that read the results store: ``coconet best`` (a program's winner at one size) and ``coconet
results`` (every key tuned or predicted for a program)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from coconet.cli.common import (
    BACKEND_METAVAR,
    JSON_OPT,
    PROGRAM_HELP,
    SHARDABLE_HELP,
    SIZE_OPT,
    echo_json,
    program_path,
    require_sizes,
)
from coconet.cli.output import fmt_s, machines_text, ratio, table_console
from coconet.errors import CoconetError
from coconet.schedules.dims import format_sizes


def best(
    file: Path = typer.Argument(..., callback=program_path, help=PROGRAM_HELP),
    size: Optional[List[str]] = SIZE_OPT,
    world: Optional[int] = typer.Option(None, "--world", min=1, help="Only a winner at this world (default: any)."),
    topology: str = typer.Option("local", "--topology", help="The topology the winner was tuned or predicted on."),
    backend: Optional[str] = typer.Option(
        None, "--backend", metavar=BACKEND_METAVAR, help="Only a winner on this backend (default: any)."
    ),
    source: Optional[str] = typer.Option(
        None,
        "--source",
        help="measured or predicted: only a winner of that kind "
        "(default: a measured one where the key has one, else a predicted one).",
    ),
    shardable: List[str] = typer.Option(
        [], "--shardable", help=f"The winner of a tuning that asked this. {SHARDABLE_HELP}"
    ),
    db: Optional[str] = typer.Option(
        None, "--db", help="Store URL (default $COCONET_DATABASE_URL, else SQLite in the user data dir)."
    ),
    server: Optional[str] = typer.Option(None, "--server", help="Ask a coconet server instead of a store."),
    token: Optional[str] = typer.Option(
        None, "--token", help="The server's token, if it asks one for reads (default $COCONET_API_TOKEN)."
    ),
    as_json: bool = JSON_OPT,
) -> None:
    """The best schedule recorded for a program at one size: measured, or predicted by the cost model (said),
    with its time and speed-up; the nearest tuned sizes' winner where these were not tuned (said)."""
    from coconet.api import best as find_best
    from coconet.api import load

    if source not in (None, "measured", "predicted"):
        raise CoconetError(f"--source {source!r}: measured or predicted")
    prog = load(file)
    size = require_sizes(prog, size)
    if len(size) != 1:
        raise CoconetError("coconet best answers one --size at a time")
    found = find_best(
        prog,
        size[0],
        topology=topology,
        world=world,
        backend=backend,
        store=db,
        server=server,
        token=token or os.environ.get("COCONET_API_TOKEN"),
        shardable=shardable or None,
        source=source,
    )
    if as_json:
        echo_json(found)
        return
    console = Console(highlight=False, soft_wrap=True)
    stats = found["stats"]
    head = (
        f"{prog.name}  world={found['world']}  {format_sizes(found['sizes'])}  topology={found['topology']}: "
        f"{found['source']}"
    )
    if found["source"] != "measured" and found.get("prediction"):
        pred = found["prediction"]
        head += f" by {pred['model']} (calibration {pred.get('calibration') or 'unknown'})"
    console.print(head, markup=False)
    console.print(
        f"{found['backend']}: {found['schedule']}  {fmt_s(stats['median_s'])}"
        + (f"  {ratio(found['speedup'])}x over the baseline" if found.get("speedup") else "")
        + f"  winner record {found['winner_id']}",
        markup=False,
    )
    if found.get("machines"):
        console.print(machines_text(found["machines"]), markup=False)
    if not found["exact"]:
        console.print(
            f"note: not tuned at these sizes; the winner of {format_sizes(found['tuned_sizes'])}", markup=False
        )


def results(
    file: Path = typer.Argument(..., callback=program_path, help=PROGRAM_HELP),
    topology: Optional[str] = typer.Option(None, "--topology", help="Only this topology's (default: every one)."),
    db: Optional[str] = typer.Option(
        None, "--db", help="Store URL (default $COCONET_DATABASE_URL, else SQLite in the user data dir)."
    ),
    as_json: bool = JSON_OPT,
) -> None:
    """Every key tuned or predicted for a program: one current winner per (sizes, topology, world, backend),
    measured or predicted."""
    from coconet.api import load
    from coconet.server.records import answer_source, machines_of
    from coconet.server.store import Store

    prog = load(file)
    with Store.open(db, create=db is None) as store:  # the default store may not be made yet; a named one must be
        rows = store.results(prog.hash, topology)
    docs = [
        {
            "sizes": b.winner.sizes,
            "topology": b.winner.topology,
            "world": b.winner.world,
            "backend": b.winner.backend,
            "schedule": b.schedule,
            "median_s": b.median_s,
            "speedup": b.speedup,
            "source": answer_source(b.source),
            "winner_id": b.winner.id,
            "machines": machines_of(b.measurement),
        }
        for b in rows
    ]
    if as_json:
        echo_json({"program": prog.name, "program_hash": prog.hash, "results": docs})
        return
    if not docs:
        Console(highlight=False).print(f"nothing tuned or predicted for {prog.name} in this store", markup=False)
        return
    print_results(prog.name, docs, table_console())


def print_results(name: str, docs: list[dict], console: Console) -> None:
    """The keys as a table, or on a terminal too narrow for one, a key a line with its schedule under it."""
    prints = {(d["machines"] or {}).get("fingerprint", "") for d in docs}
    heads: tuple[str, ...] = ("sizes", "topology", "world", "backend", "source", "median", "speed-up")
    heads += ("machines",) if len(prints) > 1 else ()  # one machine is said once, under the table
    rows = [
        (
            format_sizes(d["sizes"]),
            d["topology"],
            str(d["world"]),
            d["backend"],
            d["source"],
            fmt_s(d["median_s"]),
            f"{ratio(d['speedup'])}x" if d["speedup"] else "",
            (d["machines"] or {}).get("fingerprint", ""),  # the fingerprint's hash: `best` says it in words
        )[: len(heads)]
        for d in docs
    ]
    widths = [max(len(col), *(len(r[i]) for r in rows)) for i, col in enumerate(heads)]
    caption = f"machines: fingerprint {next(iter(prints))}" if len(prints) == 1 and "" not in prints else None
    if sum(widths) + 3 * len(heads) + 30 > console.width:
        # a terminal too narrow for the table: a key a line, its schedule under it, nothing cut
        console.print(f"{name}: {len(docs)} keys", markup=False)
        for row, d in zip(rows, docs):
            named = [f"world {v}" if h == "world" else v for h, v in zip(heads, row)]
            console.print("  ".join(v for v in named if v), markup=False)
            console.print(Padding(Text(d["schedule"], overflow="fold"), (0, 0, 0, 4)))
        if caption:
            console.print(caption, markup=False)
        return
    table = Table(title=f"{name}: {len(docs)} keys", title_justify="left", show_edge=False, caption=caption)
    table.caption_justify = "left"
    for col in heads:
        table.add_column(col, no_wrap=True, justify="right" if col in ("world", "median", "speed-up") else "left")
    table.add_column("schedule", ratio=1, overflow="fold")
    for row, d in zip(rows, docs):
        table.add_row(*row, d["schedule"])
    console.print(table)
