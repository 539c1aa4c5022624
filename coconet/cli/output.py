"""How the commands print: times and ratios, tables as wide as their rows, and progress on stderr (a bar on a
terminal, a line per step in a pipe or a log)."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, List, Optional, cast

from rich.console import Console

if TYPE_CHECKING:  # rich.progress is imported where a bar is shown (progress_bar)
    from rich.progress import TaskID


def fmt_s(x: Optional[float]) -> str:
    if x is None:
        return ""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x * 1e9:.3g} ns"


def fmt_ci(ci: Optional[list]) -> str:
    """A confidence interval, its unit said once where both ends share it."""
    if not ci:
        return ""
    lo, hi = fmt_s(ci[0]), fmt_s(ci[1])
    if lo.split()[-1] == hi.split()[-1]:
        return f"{lo.split()[0]}–{hi}"
    return f"{lo}–{hi}"


def table_console() -> Console:
    """stdout for a table: as wide as the terminal, or, in a pipe or a file, as wide as its rows (rich would
    wrap at 80 columns, folding every schedule over lines)."""
    console = Console(highlight=False)
    return console if console.is_terminal else Console(highlight=False, width=4096)


class Lines:
    """Progress where stderr is a pipe or a log, not a terminal: a line each time a task advances (rich's bar
    would print once, at the end). It takes the calls the long commands make of rich's ``Progress``."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.tasks: dict[int, dict[str, Any]] = {}
        self.t0 = time.monotonic()

    def __enter__(self) -> "Lines":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, description: str, total: float | None = None, **fields: Any) -> TaskID:
        self.tasks[len(self.tasks)] = {"description": description, "total": total, "completed": 0}
        return cast("TaskID", len(self.tasks) - 1)  # an int, as Progress's are

    def update(
        self,
        task: TaskID,
        *,
        advance: float | None = None,
        completed: float | None = None,
        total: float | None = None,
        description: str | None = None,
        status: str = "",
        **_: Any,
    ) -> None:
        t = self.tasks[task]
        before = (t["completed"], t["description"])
        t["total"] = total if total is not None else t["total"]
        t["completed"] = completed if completed is not None else t["completed"] + (advance or 0)
        t["description"] = description or t["description"]
        if self.quiet or (t["completed"], t["description"]) == before:
            return
        done = f"  {t['completed']:g}/{t['total']:g}" if t["total"] else ""
        line = f"[{time.monotonic() - self.t0:6.1f} s] {t['description']}{done}  {status}".rstrip()
        print(line, file=sys.stderr, flush=True)


def progress_bar(quiet: bool = False, transient: bool = False):
    """The bar on stderr of the long commands: what, done of total, elapsed, and a status field (the last
    result, the best so far); a line per step where stderr is no terminal. ``quiet`` (--json): none.
    ``transient``: gone once the table (or an error) is printed, for commands whose table says it all."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Column

    if not Console(stderr=True).is_terminal:
        return Lines(quiet)
    return Progress(
        TextColumn("{task.description}", table_column=Column(no_wrap=True)),
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}", table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")),
        console=Console(stderr=True),
        disable=quiet,
        transient=transient,
    )


def result_status(backend: str, result: Any) -> str:
    """The last result, as a bar's status: where it ran, what it is, how long a step took or why not."""
    how = fmt_s(result.median_s) if result.status == "ok" else result.status
    return f"{how}  {backend} {result.schedule}"


def machines_text(m: dict) -> str:
    """Where a measurement ran, from its record's fingerprint: ``ran on 2 ranks on 1 node of 1 node: …``."""
    where = f"{m['placement']} of " if m.get("placement") else ""
    return f"ran on {where}{m.get('machines', 'machines not recorded')} (fingerprint {m.get('fingerprint', '?')})"


def failure_text(f: dict) -> str:
    many = (
        f" (x{f['count']}, e.g. {f['backend']}: {f['schedule']})"
        if f["count"] > 1
        else f" ({f['backend']}: {f['schedule']})"
    )
    return f"{f['status']}: {' '.join(f['error'].split()) or 'no reason given'}{many}"


def sharded_note(names: List[str]) -> str:
    joined = ", ".join(names)
    return (
        f"note: the winner leaves {joined} sharded (as_slice): after its step each rank holds only its rows of "
        f"{joined}, which the program declares Replicated"
    )


def ratio(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"
