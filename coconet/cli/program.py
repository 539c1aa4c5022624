"""Commands on a program itself: ``check`` (its typed listing), ``export`` (its JSON IR), ``schedules`` (its legal
schedules)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, List, Optional

import typer
from rich.console import Console
from rich.table import Table

from coconet.cli.common import JSON_OPT, PROGRAM_HELP, SIZE_OPT, echo_json, program_path, writable
from coconet.errors import CoconetError
from coconet.loader import load_file
from coconet.schedules.dims import parse_sizes
from coconet.schedules.schedule import Schedule
from coconet.schedules.serialize import export as to_json
from coconet.schedules.space import generate


def _statement_row(s: Any, sizes: dict[str, int] | None) -> dict[str, Any]:
    row: dict[str, Any] = {"name": s.name, "op": s.op, "args": list(s.args)}
    attrs = {k: v for k, v in s.attrs if k not in ("shape", "layout", "dtype")}
    if attrs:
        row["attrs"] = {k: list(v) if isinstance(v, tuple) else v for k, v in attrs.items()}
    if s.type is not None:
        row["shape"] = [d.to_json() for d in s.type.shape]
        if sizes is not None:
            row["sizes"] = [d.evaluate(sizes) for d in s.type.shape]
        row["dtype"] = s.type.dtype or "weak"
        row["layout"] = str(s.type.layout)
    return row


def check(
    file: Path = typer.Argument(..., callback=program_path, help=PROGRAM_HELP),
    size: Optional[List[str]] = SIZE_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Parse and verify a program; print the typed listing (shape, dtype, layout per statement)."""
    prog = load_file(file)
    sizes = parse_sizes(size, prog.dims) if size else None
    rows = [_statement_row(s, sizes) for s in prog.stmts]
    if as_json:
        echo_json({"program": prog.name, "hash": prog.hash, "dims": list(prog.dims), "statements": rows})
        return
    console = Console(highlight=False)
    table = Table(title=f"{prog.name}  dims=({', '.join(prog.dims)})  hash={prog.hash}", title_justify="left")
    for col in ("name", "op", "operands", "shape", "dtype", "layout"):
        table.add_column(col, no_wrap=col != "operands")
    for s, row in zip(prog.stmts, rows):
        operands = ", ".join(s.args)
        attrs = row.get("attrs")
        if attrs:
            operands = ", ".join([operands] * bool(operands) + [f"{k}={v}" for k, v in attrs.items()])
        if s.type is None:
            table.add_row(s.name, s.op, operands, "", "", "", style="bold")
            continue
        shape = row["sizes"] if sizes is not None else [str(d) for d in s.type.shape]
        table.add_row(s.name, s.op, operands, "(" + ", ".join(map(str, shape)) + ")", row["dtype"], row["layout"])
    console.print(table)


def export(
    file: Path = typer.Argument(..., callback=program_path, help=PROGRAM_HELP),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write the JSON IR here instead of stdout."),
    as_json: bool = JSON_OPT,
) -> None:
    """Write the program's JSON IR (the form the server accepts)."""
    writable(output, "-o")
    prog = load_file(file)
    text = to_json(prog) + "\n"
    if output is None:
        sys.stdout.write(text)
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    if as_json:
        echo_json({"program": prog.name, "hash": prog.hash, "path": str(output)})
    else:
        Console(stderr=True, highlight=False).print(f"wrote {output} ({prog.name}, hash {prog.hash})")


def schedules(
    file: Path = typer.Argument(..., callback=program_path, help=PROGRAM_HELP),
    depth: int = typer.Option(6, "--depth", min=0, max=12, help="Longest transform sequence to explore."),
    show: Optional[str] = typer.Option(
        None, "--show", help="Print one schedule (its id or text) statement by statement."
    ),
    verify: bool = typer.Option(
        False, "--verify", help="Check every schedule against the reference interpreter on 1-4 simulated ranks."
    ),
    size: Optional[List[str]] = SIZE_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """List the legal schedules: canonical text and what each one does."""
    from coconet.schedules import equivalence

    prog = load_file(file)
    if show is not None:
        space = generate(prog, depth=depth) if show.isdigit() else None
        if space is not None and int(show) >= len(space):
            raise CoconetError(f"there is no schedule {show}; the space has {len(space)} (0-{len(space) - 1})")
        sched = space[int(show)] if space is not None else Schedule.parse(show, prog)
        if as_json:
            echo_json({**sched.to_json(), "description": sched.describe(), "pretty": sched.pretty()})
        else:
            sys.stdout.write(sched.pretty() + "\n")
        return
    space = generate(prog, depth=depth)
    if space.refused:
        text, reason = space.refused[0]
        raise CoconetError(f"the space generator offered an illegal schedule {text!r}: {reason}")
    if verify:
        sizes = parse_sizes(size, prog.dims) if size else equivalence.small_sizes(prog)
        least = prog.least_world  # a broadcast from rank 2 needs 3 ranks at least
        worlds = [w for w in (1, 2, 3, 4) if w >= least] or [least]
        for i, sched in enumerate(space):
            for world in worlds:
                bad = equivalence.check(sched, world, sizes)
                if bad:
                    raise CoconetError(
                        f"schedule {i} ({sched.text}) is not equivalent at R={world}, sizes {sizes}: {bad[0]}"
                    )
    if as_json:
        out = space.to_json()
        if verify:
            out["verified"] = {"worlds": worlds, "sizes": sizes}
        echo_json(out)
    else:
        sys.stdout.write(space.listing())
        if verify:
            ranks = f"{worlds[0]}-{worlds[-1]}" if len(worlds) > 1 else f"{worlds[0]}"
            sys.stdout.write(f"all {len(space)} schedules equal the program on {ranks} ranks at {sizes}\n")
