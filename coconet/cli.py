"""The ``coconet`` command line (docs/architecture.md, "Packages and modules").

Every command takes ``--json`` for a machine-readable answer on stdout. Errors
are one line ``error: …`` on stderr with exit code 2 — never a traceback
(``COCONET_DEBUG=1`` shows it for internal errors).
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import json
import os
import re
import select
import signal
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from coconet.codegen.baselines import baseline_for, shardable_text
from coconet.codegen.lower import BACKENDS, KERNELS, lower
from coconet.codegen.runtime import write as write_module
from coconet.errors import CoconetError
from coconet.extras import extra_for, missing
from coconet.loader import example_names, examples_dir, load_file, named_example
from coconet.schedules import shardable as shard
from coconet.schedules.dims import format_sizes, parse_sizes
from coconet.schedules.schedule import Schedule
from coconet.schedules.serialize import export as to_json
from coconet.schedules.space import generate


class _Command(typer.core.TyperCommand):
    """A command that refuses an option of one value given twice: click keeps the last one silently, and
    `run --backend shm --backend gloo` ran gloo alone."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if not ctx.resilient_parsing:
            _, _, order = self.make_parser(ctx).parse_args(args=list(args))
            seen: set[str] = set()
            for param in order:
                if param.param_type_name != "option" or param.multiple or param.is_flag or param.count:
                    continue
                if param.name in seen:
                    raise typer.BadParameter(f"given more than once: {ctx.info_name} takes one value",
                                             ctx=ctx, param=param)
                seen.add(param.name)
        return super().parse_args(ctx, args)


app = typer.Typer(
    name="coconet",
    help="Co-optimise computation and communication of distributed ML programs, and tune their schedules.",
    add_completion=True,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

def _version(value: bool) -> None:
    if value:
        from coconet import __version__

        sys.stdout.write(f"coconet {__version__}\n")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_version,
                                       help="Print the version and exit.")) -> None:
    """Co-optimise computation and communication of distributed ML programs, and tune their schedules."""


JSON_OPT = typer.Option(False, "--json", help="Answer in JSON on stdout.")
SIZE_OPT = typer.Option(None, "--size", help="Size bindings, e.g. N=2^20 or B=8,S=1024,H=3072 (repeatable).")

PROGRAM_HELP = "The program: a .py file defining `program`, its JSON IR, or the name of an example (adam, sgd, ...)."


def _program_path(value: Path) -> Path:
    """A program argument as a path: a bare name that is no file here is the example of that name."""
    return Path(named_example(str(value)))


SHARDABLE_HELP = ("State a schedule may leave sharded (as_slice, ZeRO-style: after the step each rank holds only "
                  "its rows): names, repeatable or joined by commas; `all` for any. Default: what the program's "
                  "baseline caller never reads (Adam: m, v), else none.")


def _print_error(message: str) -> None:
    Console(stderr=True, highlight=False, soft_wrap=True).print(f"error: {' '.join(message.split())}", markup=False)


def _fail(message: str) -> None:
    _print_error(message)
    raise typer.Exit(2)


_PIPE_CLOSED = 128 + signal.SIGPIPE  # what a shell reports for a writer its pipe's reader left (`| head`)


def _stdout_gone() -> bool:
    """Whether stdout's reader went away (`coconet schedules … | head`): then the command stops without a
    word, as the tools it is piped with do. A broken pipe elsewhere (a rank's) is not this."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        gone = any(ev & select.POLLERR for _, ev in poll.poll(0))  # a pipe with no reader polls as an error
    except (AttributeError, OSError, ValueError):  # no poll, or stdout is not a file
        return False
    if gone:
        _stdout_to_devnull()
    return gone


def _stdout_to_devnull() -> None:
    # what is still buffered can reach no one: /dev/null takes it, so the flush at exit does not fail again
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.close(null)


def _guard(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except CoconetError as e:
            _fail(" ".join(str(e).split("\n")))
        except KeyboardInterrupt:
            _fail("interrupted")
        except Exception as e:
            if isinstance(e, BrokenPipeError) and _stdout_gone():
                raise typer.Exit(_PIPE_CLOSED) from None
            if isinstance(e, MemoryError):
                _fail(f"out of memory: {e or 'an allocation failed'} (try smaller sizes or fewer ranks)")
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):  # the disk's, not ours
                _fail(f"cannot write {e.filename or 'the answer'}: {e.strerror}")
            if isinstance(e, OSError) and e.filename is not None and e.strerror:  # a path the user gave, or its folder
                _fail(f"{e.filename}: {e.strerror}")
            if isinstance(e, ModuleNotFoundError) and extra_for(e.name) is not None and e.name:
                _fail(str(missing(e.name, f"`coconet {fn.__name__}`")))
            if os.environ.get("COCONET_DEBUG"):
                raise
            _fail(f"internal error: {type(e).__name__}: {e} (set COCONET_DEBUG=1 for the traceback)")

    return wrapper


def _echo_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def _writable(path: Optional[Path], option: str, *, folder: bool = False) -> Optional[Path]:
    """A file (or with ``folder``, a folder) the command will write, checked before the work whose answer it
    holds: a bench measures for minutes, and a path it cannot write would lose them. Missing folders are
    made when it writes; a path under a file, or where this user cannot write, is refused now."""
    if path is None:
        return None
    if path.exists() and path.is_dir() != folder:
        raise CoconetError(f"{option} {path} is a {'file' if folder else 'folder'}: name "
                           f"{'a folder' if folder else 'the file to write'}")
    there = path.parent
    while not there.exists():
        there = there.parent
    if not there.is_dir():
        raise CoconetError(f"{option} {path}: {there} is a file, not a folder")
    if not os.access(there, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise CoconetError(f"{option} {path}: this user cannot write there")
    return path


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


@app.command(cls=_Command)
@_guard
def check(
    file: Path = typer.Argument(..., callback=_program_path, help=PROGRAM_HELP),
    size: Optional[List[str]] = SIZE_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Parse and verify a program; print the typed listing (shape, dtype, layout per statement)."""
    prog = load_file(file)
    sizes = parse_sizes(size, prog.dims) if size else None
    rows = [_statement_row(s, sizes) for s in prog.stmts]
    if as_json:
        _echo_json({"program": prog.name, "hash": prog.hash, "dims": list(prog.dims), "statements": rows})
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


@app.command(cls=_Command)
@_guard
def export(
    file: Path = typer.Argument(..., callback=_program_path, help=PROGRAM_HELP),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write the JSON IR here instead of stdout."),
    as_json: bool = JSON_OPT,
) -> None:
    """Write the program's JSON IR (the form the server accepts)."""
    _writable(output, "-o")
    prog = load_file(file)
    text = to_json(prog) + "\n"
    if output is None:
        sys.stdout.write(text)
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    if as_json:
        _echo_json({"program": prog.name, "hash": prog.hash, "path": str(output)})
    else:
        Console(stderr=True, highlight=False).print(f"wrote {output} ({prog.name}, hash {prog.hash})")


@app.command(cls=_Command)
@_guard
def schedules(
    file: Path = typer.Argument(..., callback=_program_path, help=PROGRAM_HELP),
    depth: int = typer.Option(6, "--depth", min=0, max=12, help="Longest transform sequence to explore."),
    show: Optional[str] = typer.Option(None, "--show",
                                       help="Print one schedule (its id or text) statement by statement."),
    verify: bool = typer.Option(False, "--verify", help="Check every schedule against the reference interpreter "
                                "on 1-4 simulated ranks."),
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
            _echo_json({**sched.to_json(), "description": sched.describe(), "pretty": sched.pretty()})
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
                    raise CoconetError(f"schedule {i} ({sched.text}) is not equivalent at R={world}, "
                                       f"sizes {sizes}: {bad[0]}")
    if as_json:
        out = space.to_json()
        if verify:
            out["verified"] = {"worlds": worlds, "sizes": sizes}
        _echo_json(out)
    else:
        sys.stdout.write(space.listing())
        if verify:
            ranks = f"{worlds[0]}-{worlds[-1]}" if len(worlds) > 1 else f"{worlds[0]}"
            sys.stdout.write(f"all {len(space)} schedules equal the program on {ranks} ranks at {sizes}\n")


def _require_sizes(prog: Any, size: Optional[List[str]]) -> None:
    if not size:
        raise CoconetError(f"--size is required: bind {', '.join(prog.dims)} (e.g. --size {prog.dims[0]}=2^20)"
                           if prog.dims else "--size is required")


def _pick_schedules(prog: Any, picks: List[str], depth: int, best: Optional[Callable[[], Any]] = None,
                    space: Any = None) -> list:
    """The schedules ``picks`` name, the baseline first; ``space``: the program's, where the caller made it
    already (else made here at the first `all` or id)."""
    chosen: list = [Schedule(prog)]  # the baseline runs first: every speed-up is against it
    for pick in picks:
        pick = pick.strip()
        if pick == "best":
            if best is None:
                raise CoconetError("--schedule best is for coconet run (it reads the results store)")
            chosen.append(best())
            continue
        if pick == "all" or pick.isdigit():
            space = space if space is not None else generate(prog, depth=depth)
            if pick == "all":
                chosen.extend(space)
                continue
            if int(pick) >= len(space):
                raise CoconetError(f"there is no schedule {pick}; the space has {len(space)} (0-{len(space) - 1})")
            chosen.append(space[int(pick)])
            continue
        chosen.append(Schedule.parse(pick, prog))
    unique: dict[str, Any] = {}
    for sched in chosen:
        unique.setdefault(sched.hash, sched)
    return list(unique.values())


def _tuned_best(prog: Any, sizes: dict, world: int, backend: str, db: Optional[str], shardable: List[str]) -> Any:
    """The store's winner for this program, sizes and world on this machine with this backend (or of the
    nearest tuned sizes, said on stderr)."""
    from coconet.server.store import Store

    allowed = shardable_text(prog, shardable or None)
    with Store.open(db, create=db is None) as store:  # the default store may not be made yet; a named one must be
        found = store.best(prog.hash, sizes, "local", world, backend=backend, shardable=allowed)
        url = store.url
    if found is None or found.measurement.schedule_json is None:
        size_text = format_sizes(sizes)
        flags = "".join(f" --shardable {n}" for n in shardable)
        raise CoconetError(f"no tuned schedule of {prog.name} on {backend} at world {world} in {url} that leaves "
                           f"at most {shard.words(allowed)} sharded: run `coconet tune FILE --world {world} "
                           f"--size {size_text} --backend {backend}{flags}` first")
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    if not found.exact:
        err.print(f"note: {format_sizes(sizes)} was not tuned; using the winner of {found.winner.sizes_key}",
                  markup=False)
    err.print(f"note: --schedule best is {_answer_text(found)}", markup=False)
    if found.source != "measured":
        err.print(f"note: nothing measured answers here; `coconet tune FILE --world {world} --size "
                  f"{format_sizes(sizes)} --backend {backend}` measures it", markup=False)
    return Schedule.from_json(found.measurement.schedule_json, prog), found


def _answer_text(found: Any) -> str:
    """What a stored winner is, in words: measured (with its time) or predicted (by which model, calibrated
    how), and its record."""
    m, w = found.measurement, found.winner
    speedup = f", {_ratio(w.speedup)}x over the baseline" if w.speedup else ""
    if found.source == "measured":
        return f"measured: {_fmt_s(m.median_s)} a step{speedup} (winner record {w.id})"
    v = m.versions or {}
    return (f"predicted, not measured: {_fmt_s(m.median_s)} a step{speedup} by the cost model "
            f"({v.get('model', 'unnamed')}, topology {w.topology} calibration {v.get('topology', 'unknown')}; "
            f"winner record {w.id})")


def _fmt_s(x: Optional[float]) -> str:
    if x is None:
        return ""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x * 1e9:.3g} ns"


def _fmt_ci(ci: Optional[list]) -> str:
    """A confidence interval, its unit said once where both ends share it."""
    if not ci:
        return ""
    lo, hi = _fmt_s(ci[0]), _fmt_s(ci[1])
    if lo.split()[-1] == hi.split()[-1]:
        return f"{lo.split()[0]}–{hi}"
    return f"{lo}–{hi}"


def _table_console() -> Console:
    """stdout for a table: as wide as the terminal, or, in a pipe or a file, as wide as its rows (rich would
    wrap at 80 columns, folding every schedule over lines)."""
    console = Console(highlight=False)
    return console if console.is_terminal else Console(highlight=False, width=4096)


class _Lines:
    """Progress where stderr is a pipe or a log, not a terminal: a line each time a task advances (rich's bar
    would print once, at the end). It takes the calls the long commands make of rich's ``Progress``."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.tasks: dict[int, dict[str, Any]] = {}
        self.t0 = time.monotonic()

    def __enter__(self) -> "_Lines":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, description: str, total: float | None = None, **fields: Any) -> int:
        self.tasks[len(self.tasks)] = {"description": description, "total": total, "completed": 0}
        return len(self.tasks) - 1

    def update(self, task: int, *, advance: float | None = None, completed: float | None = None,
               total: float | None = None, description: str | None = None, status: str = "", **_: Any) -> None:
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


def _progress_bar(quiet: bool = False, transient: bool = False):
    """The bar on stderr of the long commands: what, done of total, elapsed, and a status field (the last
    result, the best so far); a line per step where stderr is no terminal. ``quiet`` (--json): none.
    ``transient``: gone once the table (or an error) is printed, for commands whose table says it all."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Column

    if not Console(stderr=True).is_terminal:
        return _Lines(quiet)
    return Progress(TextColumn("{task.description}", table_column=Column(no_wrap=True)), BarColumn(bar_width=20),
                    MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[status]}",
                               table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")),
                    console=Console(stderr=True), disable=quiet, transient=transient)


def _result_status(backend: str, result: Any) -> str:
    """The last result, as a bar's status: where it ran, what it is, how long a step took or why not."""
    how = _fmt_s(result.median_s) if result.status == "ok" else result.status
    return f"{how}  {backend} {result.schedule}"


@app.command(cls=_Command)
@_guard
def run(
    file: Path = typer.Argument(..., callback=_program_path, help=PROGRAM_HELP),
    world: Optional[int] = typer.Option(None, "--world", min=1, max=64, help="Ranks per pipeline stage (default 2; "
                                        "under torchrun, WORLD_SIZE / stages, which it must match if given)."),
    size: Optional[List[str]] = SIZE_OPT,
    schedule: List[str] = typer.Option(["baseline"], "--schedule", help="A schedule's text, its id in "
                                       "`coconet schedules`, `baseline` or `all` (repeatable). The baseline "
                                       "always runs too."),
    backend: str = typer.Option("gloo", "--backend", metavar="[gloo|nccl|shm]",
                                help="gloo (CPU tensors), nccl (CUDA tensors) or shm (CPU "
                                "tensors, collectives in shared memory)."),
    kernels: str = typer.Option("compiled", "--kernels", metavar="[compiled|eager]",
                                help="compiled: fused groups compiled by Inductor "
                                "(the first call compiles; cached on disk); eager: plain torch statements."),
    stages: Optional[int] = typer.Option(None, "--stages", min=1, max=16,
                                         help="Pipeline stages for programs that send/recv (default 2)."),
    repeats: int = typer.Option(20, "--repeats", min=1, help="Timed steps per schedule."),
    warmup: int = typer.Option(3, "--warmup", min=0, help="Untimed steps first."),
    seed: int = typer.Option(0, "--seed", help="Seed of the inputs and of dropout."),
    timeout: float = typer.Option(120.0, "--timeout", min=1.0, help="Seconds a schedule may take before "
                                  "its ranks are stopped and reported."),
    no_check: bool = typer.Option(False, "--no-check", help="Skip the check against the reference interpreter."),
    depth: int = typer.Option(6, "--depth", min=0, max=12, help="Depth of the space for `all` and ids."),
    emit: Optional[Path] = typer.Option(None, "--emit", help="Also write each schedule's generated module here."),
    standalone: bool = typer.Option(False, "--standalone", help="With --emit: copy the runtime (coconet.kernels) "
                                    "the modules import into DIR/coconet_kernels/, so that they run with torch "
                                    "alone."),
    db: Optional[str] = typer.Option(None, "--db", help="Store that `--schedule best` reads (default "
                                     "$COCONET_DATABASE_URL, else SQLite in the user data dir)."),
    shardable: List[str] = typer.Option([], "--shardable", help=f"For `--schedule best`: the winner of a tuning "
                                        f"that asked this. {SHARDABLE_HELP}"),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Profile one more step per rank and write its "
                                         "Chrome trace here (chrome://tracing, Perfetto); `coconet.tuner.trace` "
                                         "reads off how much communication ran under compute."),
    launcher: str = typer.Option("auto", "--launcher", metavar="[auto|local|env]",
                                 help="local: start the ranks on this machine; env: this "
                                 "process is one rank of a job that torchrun started (or any launcher that sets "
                                 "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), joined through env://, rank 0 "
                                 "printing the results; auto: env when those variables are set, else local."),
    as_json: bool = JSON_OPT,
) -> None:
    """Run schedules on R ranks of this machine, or as one rank of a torchrun job: check every output against
    the reference interpreter and time the step (median and 95% CI of the slowest rank per step)."""
    from coconet.tuner.envlaunch import choose

    job = choose(launcher)
    if backend not in BACKENDS:
        raise CoconetError(f"unknown backend {backend!r} (use {', '.join(BACKENDS)})")
    if kernels not in KERNELS:
        raise CoconetError(f"unknown --kernels {kernels!r} (use {' or '.join(KERNELS)})")
    _writable(emit, "--emit", folder=True)
    if standalone and emit is None:
        raise CoconetError("--standalone says how --emit writes the modules: give --emit DIR too")
    _writable(trace, "--trace", folder=True)
    prog = load_file(file)
    _require_sizes(prog, size)
    sizes = parse_sizes(size, prog.dims)
    if job is not None:
        from coconet.tuner.envlaunch import require_one_node, world_of

        world = world_of(world, job, (stages or 2) if prog.is_pipeline else 1)
        require_one_node(backend, job)
    world = world or 2
    quiet = job is not None and job.rank != 0  # one rank speaks for the job
    from coconet.server.records import answer_source

    stored: list = []  # the store's answer behind --schedule best, said beside the results

    def tuned() -> Any:
        sched, found = _tuned_best(prog, sizes, world, backend, db, shardable)
        stored.append({"schedule": sched.text, "hash": sched.hash, "source": answer_source(found.source),
                       "exact": found.exact, "tuned_sizes": found.winner.sizes, "winner_id": found.winner.id,
                       "median_s": found.measurement.median_s, "speedup": found.winner.speedup})
        return sched

    space = generate(prog, depth=depth)  # `all` and ids pick from it; the table gives each schedule's id in it
    picked = _pick_schedules(prog, schedule, depth, best=tuned, space=space)
    if emit is not None and not quiet:
        emit.mkdir(parents=True, exist_ok=True)
        for sched in picked:
            gen = lower(sched, backend, kernels)
            write_module(gen.source, backend, emit / f"{prog.name}_{sched.hash}_{backend}.py", standalone)
    from coconet.tuner.launch import Options, run_schedules  # torch: seconds to import, so after the checks

    opts = Options(world=world, sizes=sizes, backend=backend, kernels=kernels, stages=stages or 2, seed=seed,
                   warmup=warmup, repeats=repeats, check=not no_check, timeout_s=timeout,
                   trace=str(trace.resolve()) if trace is not None else None)
    with _progress_bar(quiet=as_json or quiet, transient=True) as bar:
        task = bar.add_task(f"{prog.name} on {world} ranks ({backend})", total=len(picked), status="")
        progress = lambda i, r: bar.update(task, advance=1, status=_result_status(backend, r))  # noqa: E731
        if job is not None:
            from coconet.tuner.envlaunch import run_in_job

            results = run_in_job(picked, opts, job, on_result=progress)
        else:
            results = run_schedules(picked, opts, program_file=str(file) if str(file).endswith(".py") else None,
                                    on_result=progress)
    failed = [r for r in results if r.status != "ok"]
    if quiet:
        raise typer.Exit(1 if failed else 0)
    base = results[0].median_s
    ids = {sched.hash: i for i, sched in enumerate(space)}
    rows = []
    for r in results:
        row = r.to_json()
        row["id"] = ids.get(r.hash)  # its number in `coconet schedules`, for --schedule ID
        row["speedup"] = base / r.median_s if base and r.median_s else None
        rows.append(row)
    if as_json:
        _echo_json({"program": prog.name, "program_hash": prog.hash, "world": world, "backend": backend,
                    "stages": opts.stages if prog.is_pipeline else 1, "sizes": sizes, "results": rows,
                    **({"best": stored[0]} if stored else {})})
    else:
        _print_run_table(prog, world, backend, sizes, rows)
    if failed:
        raise typer.Exit(1)


def _print_run_table(prog: Any, world: int, backend: str, sizes: dict, rows: list) -> None:
    console = _table_console()
    sizes_text = format_sizes(sizes)
    table = Table(title=f"{prog.name}  world={world}  backend={backend}  {sizes_text}", title_justify="left",
                  show_edge=False)
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
            "" if err is None else f"{err:.1e}", _fmt_s(row["median_s"]),
            _fmt_ci(ci), f"{row['speedup']:.2f}x" if row["speedup"] else "", Text(row["schedule"]))
    console.print(table)
    for row in rows:
        if row["error"]:
            Console(stderr=True, highlight=False, soft_wrap=True).print(
                f"{row['schedule']}: {row['status']}: {row['error']}", markup=False)


@app.command(cls=_Command)
@_guard
def tune(
    file: Path = typer.Argument(..., callback=_program_path, help=PROGRAM_HELP),
    world: int = typer.Option(2, "--world", min=1, help="Ranks (per pipeline stage); at most 64 on the local "
                               "Ray cluster this machine starts."),
    size: Optional[List[str]] = SIZE_OPT,
    budget: int = typer.Option(32, "--budget", min=1, help="Candidates measured per size; the whole space when "
                               "it is smaller (then the search is exhaustive)."),
    topology: str = typer.Option("local", "--topology", help="`local` (this machine, calibrated on first use); "
                                 "another name only with --ray-address, on a cluster that is that topology: its "
                                 "nodes, CPUs and GPU model are checked against the topology before any trial."),
    backend: List[str] = typer.Option([], "--backend", metavar="[gloo|nccl|shm]",
                                      help="Restrict the backends tried (repeatable); default: "
                                      "every one this machine runs (gloo and shm on CPU, nccl on GPUs)."),
    db: Optional[str] = typer.Option(None, "--db", help="Store URL (default $COCONET_DATABASE_URL, else SQLite in "
                                     "the user data dir)."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="Join this Ray cluster instead of "
                                              "starting a local one (HOST:PORT of its head; a cluster with "
                                              "Ray's token authentication needs its token in ~/.ray/auth_token "
                                              "or $RAY_AUTH_TOKEN)."),
    placement: str = typer.Option("pack", "--placement", metavar="[pack|spread]",
                                  help="Where a candidate's ranks go on the cluster: "
                                  "pack (as few nodes as hold them) or spread (across nodes; shm, which needs "
                                  "one node, is then not tried)."),
    kernels: str = typer.Option("compiled", "--kernels", metavar="[compiled|eager]", help="compiled or eager."),
    depth: int = typer.Option(6, "--depth", min=0, help="Longest transform sequence in the space searched."),
    timeout: float = typer.Option(300.0, "--timeout", min=1.0, help="Seconds a candidate's check or timing may "
                                  "take before its ranks are killed (timeout)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the search, of the inputs and of dropout."),
    shardable: List[str] = typer.Option([], "--shardable", help=f"{SHARDABLE_HELP} Schedules sharding other "
                                        "state are not tried; the winner is recorded for this choice."),
    as_json: bool = JSON_OPT,
) -> None:
    """Find the fastest schedule per size on this topology: measured on Ray, searched by Optuna, recorded in the
    store. With one --size the JSON is one result; with several, a list (smallest sizes first)."""
    from coconet.server.store import Store
    from coconet.tuner.runner import Protocol
    from coconet.tuner.tune import Request, check

    if kernels not in KERNELS:
        raise CoconetError(f"unknown --kernels {kernels!r} (use {' or '.join(KERNELS)})")
    prog = load_file(file)
    _require_sizes(prog, size)
    points = [parse_sizes(spec, prog.dims) for spec in size]
    request = Request(prog, tuple(points), world, topology, budget, tuple(dict.fromkeys(backend)),
                      Protocol(timeout_s=timeout, kernels=kernels), depth, seed=seed, ray_address=ray_address,
                      program_file=str(file) if file.suffix == ".py" else None,
                      shardable=tuple(shardable) if shardable else None, placement=placement)
    check(request)
    with Store.open(db) as store:
        results = _tune_with_progress(request, store, quiet=as_json)
    docs = [r.to_json(prog, topology, world) for r in results]
    if as_json:
        _echo_json(docs[0] if len(docs) == 1 else docs)
    else:
        for r, doc in zip(results, docs):
            _print_tune_table(prog, doc, r)
    if any(d["best"] is None for d in docs):  # as `run` when a schedule fails: the answer is printed, and partial
        raise typer.Exit(1)


def _tune_with_progress(request: Any, store: Any, quiet: bool) -> list:
    from coconet.tuner.tune import cost_prior
    from coconet.tuner.tune import tune as run_tune

    if quiet:
        return run_tune(request, store, prior=cost_prior)
    with _progress_bar() as bar:
        tasks: dict[str, Any] = {}

        def show(sizes: dict, p: Any) -> None:
            key = format_sizes(sizes)
            if key not in tasks:
                tasks[key] = bar.add_task(key, total=p.budget, status="")
            best = f"best {_fmt_s(p.best[1])} {p.best[0]}" if p.best else "no result yet"
            bar.update(tasks[key], completed=p.trials, total=p.budget,
                       status=f"failed {p.failed}  {best}"[:100])

        return run_tune(request, store, on_progress=show, prior=cost_prior)


def _print_tune_table(prog: Any, doc: dict, tuned: Any) -> None:
    console = _table_console()
    sizes_text = format_sizes(doc["sizes"])
    shardable = ",".join(doc["shardable"]) or "none"
    table = Table(title=f"{prog.name}  world={doc['world']}  {sizes_text}  topology={doc['topology']}  "
                  f"shardable={shardable}  search: {doc['trials']} trials, {doc['failed']} failed",
                  title_justify="left", show_edge=False)
    for col in ("status", "backend", "median", "95% CI", "vs baseline\n(search)"):
        table.add_column(col, no_wrap=True, justify="left" if col in ("status", "backend") else "right")
    table.add_column("schedule", ratio=1, overflow="fold")
    searched = tuned.outcome.baseline_searched
    base = searched.result.median_s if searched is not None else None
    trials = sorted(tuned.outcome.trials, key=lambda t: (t.result.status != "ok", t.result.median_s or 0))
    for t in trials:
        r = t.result
        ci = r.ci95_s
        win = doc["best"] and t.candidate.schedule.hash == doc["best"]["hash"] \
            and t.candidate.backend == doc["best"]["backend"]
        table.add_row(r.status if r.status == "ok" else f"[red]{r.status}[/red]", t.candidate.backend,
                      _fmt_s(r.median_s), _fmt_ci(ci),
                      f"{base / r.median_s:.2f}x" if base and r.median_s else "",
                      Text(("* " if win else "") + t.candidate.text))
    console.print(table)
    if doc["best"]:
        b = doc["best"]
        console.print(f"winner, timed again in turns with the runner-up and the baseline: {b['backend']}: "
                      f"{b['schedule']}  {_fmt_s(b['median_s'])} [{_fmt_s(b['ci95_s'][0])}, "
                      f"{_fmt_s(b['ci95_s'][1])}]"
                      + (f"  {_ratio(doc['speedup'])}x over the baseline" if doc["speedup"] else "")
                      + f"  record {doc['record_id']}", markup=False)
        if doc.get("machines"):
            console.print(_machines_text(doc["machines"]), markup=False)
        if doc["order_reversed"] and doc["search_best"]:
            s = doc["search_best"]
            console.print(f"note: the search had {s['backend']}: {s['schedule']} faster ({_fmt_s(s['median_s'])}); "
                          "timed again in turns, the winner above beat it", markup=False)
        if b["sharded"]:
            console.print(_sharded_note(b["sharded"]), markup=False)
    else:
        console.print("no schedule ran correctly: nothing recorded as the winner", markup=False)
    for b, why in doc.get("backends_left_out", {}).items():
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"note: backend {b} not tried: {why}",
                                                                    markup=False)
    if doc["failures"]:
        err = Console(stderr=True, highlight=False, soft_wrap=True)
        err.print(f"{doc['failed']} trial(s) failed:", markup=False)
        for f in doc["failures"]:
            err.print(f"  {_failure_text(f)}", markup=False)


def _machines_text(m: dict) -> str:
    """Where a measurement ran, from its record's fingerprint: ``ran on 2 ranks on 1 node of 1 node: …``."""
    where = f"{m['placement']} of " if m.get("placement") else ""
    return f"ran on {where}{m.get('machines', 'machines not recorded')} (fingerprint {m.get('fingerprint', '?')})"


def _failure_text(f: dict) -> str:
    many = f" (x{f['count']}, e.g. {f['backend']}: {f['schedule']})" if f["count"] > 1 else \
        f" ({f['backend']}: {f['schedule']})"
    return f"{f['status']}: {' '.join(f['error'].split()) or 'no reason given'}{many}"


@app.command(cls=_Command)
@_guard
def sweep(
    config: Path = typer.Argument(..., help="Sweep definition (YAML): programs and sizes, topologies, worlds, "
                                  "budget; see configs/sweeps/. `paper` names the one coconet ships."),
    simulate: bool = typer.Option(False, "--simulate", help="Predict every key with the cost model, the local "
                                  "topology's too."),
    db: Optional[str] = typer.Option(None, "--db", help="Store URL (default $COCONET_DATABASE_URL, else SQLite in "
                                     "the user data dir)."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="Measure the local keys on this Ray "
                                               "cluster (HOST:PORT) instead of one started here."),
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
        _echo_json(run_sweep(cfg, simulate=simulate, store=db, ray_address=ray_address))
        return
    terminal = Console(stderr=True).is_terminal
    with (Progress(TextColumn("{task.description}"), TimeElapsedColumn(), console=Console(stderr=True))
          if terminal else _Lines()) as bar:
        task = bar.add_task("sweep")

        def show(r: Any) -> None:
            bar.update(task, description=f"{r.predicted} predicted, {r.measured} measured, "
                                         f"{r.skipped} skipped of {r.keys} keys so far")

        doc = run_sweep(cfg, simulate=simulate, store=db, ray_address=ray_address, on_progress=show)
    rate = f"{doc['keys_per_s']:.0f} keys/s" if doc["keys_per_s"] else ""
    Console(highlight=False).print(
        f"{doc['keys']} keys: {doc['predicted']} predicted ({doc['predictions']} schedule predictions), "
        f"{doc['measured']} measured, {doc['skipped']} already done"
        + (f", {doc['kept_measured']} left alone (measured: a prediction never replaces a measurement)"
           if doc["kept_measured"] else "") + f"; {doc['seconds']:.1f} s {rate}", markup=False)
    if doc["unfit"]:
        Console(highlight=False, stderr=True).print(
            f"note: {doc['unfit']} keys left out: their world needs more ranks than the topology has", markup=False)
    if doc["too_large"]:
        Console(highlight=False, stderr=True).print(
            f"note: {doc['too_large']} local keys left out: this machine cannot hold them (the first: "
            f"{doc['too_large_why']})", markup=False)


@app.command(cls=_Command)
@_guard
def calibrate(
    world: int = typer.Option(2, "--world", min=2, max=64, help="Ranks to time collectives among."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Where to write the topology YAML. Default: "
                                          "local.yaml in the user data dir's topologies/ ($COCONET_DATA_DIR, else "
                                          "the platform's, e.g. ~/.local/share/coconet), where `--topology local` "
                                          "reads it; never inside the installed package."),
    max_log2: int = typer.Option(24, "--max-log2", min=6, max=30, hidden=True,
                                 help="Largest collective timed: 2^K bytes."),
    repeats: int = typer.Option(10, "--repeats", min=1, hidden=True, help="Samples per size."),
    quick: bool = typer.Option(False, "--quick", hidden=True, help="Small buffers, no compiled kernels (tests)."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="Measure this Ray cluster of alike nodes "
                                              "instead: everything below within one node, plus the link between "
                                              "two nodes (alpha and beta of a gloo allreduce across them)."),
    name: Optional[str] = typer.Option(None, "--name", help="The topology's name: `local` (this machine, the "
                                       "default), or the cluster's with --ray-address (needed there); written "
                                       "as NAME.yaml in the user data dir's topologies/."),
    as_json: bool = JSON_OPT,
) -> None:
    """Measure this machine for the cost model: alpha and beta of gloo's allreduce, reduce_scatter and
    all_gather over R local ranks (2^8..2^24 bytes, least squares on the medians), the shm backend's
    collectives (reported; the model prices them as memory traffic plus barriers), memory and cache
    bandwidth, page faults of fresh buffers, dispatch, elementwise and matmul throughput, and overlap.
    Writes the `local` topology with this machine's fingerprint (coconet tune calibrates it on first use, and
    again when the machine's fingerprint changes). With --ray-address, a Ray cluster of alike nodes: the same
    within one node, plus the link between two nodes, written as --name with the cluster's fingerprint."""
    from coconet.tuner.calibrate import HEADER, Settings, default_output
    from coconet.tuner.calibrate import calibrate as run_calibration
    from coconet.tuner.topology import LOCAL, save_topology, to_dict, user_dir

    _writable(output, "-o")
    if ray_address and not name:
        raise CoconetError("--ray-address measures a cluster: name its topology (--name NAME)")
    if name is not None and (not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name) or name.endswith(".yaml")):
        raise CoconetError(f"--name {name!r}: letters, digits, '.', '_' and '-', without .yaml")
    if name not in (None, LOCAL) and not ray_address:
        raise CoconetError(f"--name {name}: this machine is `local`; another name is a cluster's (--ray-address)")
    settings = Settings(world=world, max_log2=max_log2, repeats=repeats,
                        **({"memory_bytes": 2**22, "compiled": False, "min_log2": min(8, max_log2)} if quick else {}))
    if ray_address:
        from coconet.tuner.calibrate_cluster import calibrate_cluster
        from coconet.tuner.cluster import connect

        connect(ray_address)
        result = calibrate_cluster(settings, str(name))
    else:
        result = run_calibration(settings)
    path = output if output is not None else (user_dir() / f"{name}.yaml" if name else default_output())
    try:
        save_topology(result.topology, path, header=HEADER)
    except OSError as e:
        raise CoconetError(f"cannot write {path}: {e.strerror or e}") from None
    t = result.topology
    if as_json:
        _echo_json({"path": str(path), "seconds": result.seconds, "topology": to_dict(t),
                    "shm_measured": result.extras,
                    "samples": {b: {op: [[n, s] for n, s in pts] for op, pts in ops.items()}
                                for b, ops in result.samples.items()}})
        return
    rows = [("gloo link (ring step)", f"alpha {_fmt_s(t.intra.alpha_s)}", f"{t.intra.bandwidth_GBps:.3g} GB/s")]
    if t.inter is not None:
        rows.append(("gloo link between nodes", f"alpha {_fmt_s(t.inter.alpha_s)}",
                     f"{t.inter.bandwidth_GBps:.3g} GB/s"))
    for op, fit in t.measured.get("gloo", {}).items():
        rows.append((f"gloo {op}", f"alpha {_fmt_s(fit.alpha_s)}",
                     f"{1e-9 / fit.beta_s_per_byte:.3g} GB/s" if fit.beta_s_per_byte else "-"))
    for op in ("allreduce", "reduce_scatter", "all_gather"):
        x = result.extras
        if f"shm_{op}_bytes" in x:  # the model prices shm collectives as memory traffic: side by side
            rows.append((f"shm {op}, 2^{int(x[f'shm_{op}_bytes']).bit_length() - 1} B",
                         f"measured {_fmt_s(x[f'shm_{op}_measured_s'])}", f"model {_fmt_s(x[f'shm_{op}_model_s'])}"))
    rows += [("shm barrier", _fmt_s(t.shm_barrier_s), ""),
             ("memory (per rank, all streaming)", "", f"{t.memory_bandwidth_GBps:.3g} GB/s"),
             ("cache (per rank)", f"{t.cache_bytes / 2**20:.3g} MiB", f"{t.cache_bandwidth_GBps or 0:.3g} GB/s"),
             ("fresh buffer (largest)", "", f"{1e-9 / t.fresh_cost[-1][1]:.3g} GB/s" if t.fresh_cost and
              t.fresh_cost[-1][1] else "-"),
             ("matmul float32", "", f"{t.matmul_TFLOPS['float32'] * 1e3:.3g} GFLOP/s"),
             ("eager op dispatch", _fmt_s(t.launch_s), ""),
             ("compiled kernel call", _fmt_s(t.compiled_launch_s), ""),
             ("elementwise (compiled / eager)", "",
              f"{t.elementwise_Gops or 0:.3g} / {t.eager_elementwise_Gops or 0:.3g} Gop/s"),
             ("overlap of comm and compute", f"{t.overlap:.2f}", "")]
    console = Console(highlight=False)
    table = Table(title=f"{t.name} topology: {t.nodes} x {world} ranks, measured in {result.seconds:.0f} s",
                  title_justify="left")
    for col in ("figure", "latency / measured", "rate / model"):
        table.add_column(col, no_wrap=True)
    for r in rows:
        table.add_row(*r)
    console.print(table)
    Console(stderr=True, highlight=False, soft_wrap=True).print(f"wrote {path}", markup=False)


def _workload_file(workload: str) -> Path:
    path = Path(workload)
    if path.suffix in (".py", ".json"):
        return path

    candidate = examples_dir() / f"{workload}.py"
    if not candidate.exists():
        known = ", ".join(example_names()) or "none here"
        raise CoconetError(f"no workload {workload!r}: name an example ({known}) or a program file")
    return candidate


def _device_name(device: str) -> str:
    if device == "cpu":
        return f"cpu, {os.cpu_count()} cores"
    import torch

    return torch.cuda.get_device_name()


def _sharded_note(names: List[str]) -> str:
    joined = ", ".join(names)
    return (f"note: the winner leaves {joined} sharded (as_slice): after its step each rank holds only its rows of "
            f"{joined}, which the program declares Replicated")


def _ratio(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def _fmt_speedup(point: dict) -> str:
    """The speed-up, and under it the spread of the rounds' own."""
    if not point["best_speedup"]:
        return ""
    spread = point.get("best_speedup_rounds")
    under = f"\n({_ratio(min(spread))}–{_ratio(max(spread))})" if spread else ""
    return f"{_ratio(point['best_speedup'])}x" + under


def _fmt_over_floor(point: dict) -> str:
    """Against the run's floor, and under it against each round's own when they differ."""
    if not point["best_over_floor"]:
        return ""
    spread = point.get("best_over_floor_rounds") or []
    own = f"\n({_ratio(min(spread))}–{_ratio(max(spread))})" if len(spread) > 1 else (
        f"\n({_ratio(spread[0])})" if spread and abs(spread[0] - point["best_over_floor"]) > 0.005 else "")
    return f"{_ratio(point['best_over_floor'])}x" + own


def _over_rounds(rows: list[dict]) -> dict:
    """One schedule's rows from successive launches as one: the median of its rounds' medians, or the first
    round that did not run."""
    failed = next((r for r in rows if r["status"] != "ok" or not r["median_s"]), None)
    if len(rows) == 1 or failed is not None:
        return failed or rows[0]
    medians = [r["median_s"] for r in rows]
    out = dict(rows[0], median_s=statistics.median(medians), round_medians_s=medians, ci95_s=None,
               round_ci95_s=[r["ci95_s"] for r in rows], samples=sum(r["samples"] for r in rows))
    if all(r.get("bandwidth_GBps") for r in rows):
        out["round_bandwidth_GBps"] = [r["bandwidth_GBps"] for r in rows]
        out["bandwidth_GBps"] = max(out["round_bandwidth_GBps"])
    return out


def _write_report(path: Path, report: dict) -> None:
    """Whole or not at all: a reader (or a run killed mid-write) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(partial, path)


@app.command(cls=_Command)
@_guard
def bench(
    workload: str = typer.Argument(..., help="An example's name (adam, megatron_mlp, …) or a program file."),
    world: int = typer.Option(2, "--world", min=1, max=64),
    size: List[str] = typer.Option(..., "--size", help="One point per --size, e.g. --size N=2^20 --size N=2^22."),
    backend: List[str] = typer.Option(["gloo", "shm"], "--backend", metavar="[gloo|nccl|shm]",
                                      help="gloo, shm or nccl (repeatable: every "
                                      "schedule runs on each)."),
    kernels: str = typer.Option("compiled", "--kernels", metavar="[compiled|eager]", help="compiled or eager."),
    repeats: int = typer.Option(10, "--repeats", min=1, help="Timed steps per schedule and point."),
    rounds: int = typer.Option(1, "--rounds", min=1, help="Launch every point this many times, one after the "
                               "other: a time is then the median of its rounds' medians, and the speed-up is "
                               "also given per round (load on a shared machine comes and goes between them)."),
    warmup: int = typer.Option(3, "--warmup", min=0, help="Untimed steps first."),
    timeout: float = typer.Option(600.0, "--timeout", min=1.0, help="Seconds a launch may take before its "
                                  "ranks are stopped."),
    schedule: List[str] = typer.Option(["all"], "--schedule", help="Which schedules (as `coconet run`: text, id "
                                       "or `all`); the program as written always runs first."),
    knobs: str = typer.Option("default", "--knobs", help="default: each schedule at its knobs' defaults (or the "
                              "values its text gives); all: each schedule at every combination of its knobs' values."),
    shardable: List[str] = typer.Option([], "--shardable", help=f"{SHARDABLE_HELP} Schedules sharding other "
                                        "state are left out: the baseline leaves it whole."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write the JSON here too."),
    plot: Optional[Path] = typer.Option(None, "--plot",
                                        help="Write a PNG: time vs size, speed-up, distance to the floor."),
    as_json: bool = JSON_OPT,
) -> None:
    """Every schedule against the PyTorch baseline (hand-written for the paper's workloads, else the program
    as eager PyTorch) and the floor (the bytes the step must move at the memory bandwidth, or its matmuls
    at the matmul rate, whichever is longer), per size."""
    from coconet.codegen.footprint import require_fits
    from coconet.tuner.bandwidth import memory_bandwidths
    from coconet.tuner.rank import allocator_policy
    from coconet.tuner.roofline import bytes_moved_once, compute_floor, matmul_flops_per_rank, matmul_rate

    for b in backend:
        if b not in BACKENDS:
            raise CoconetError(f"unknown backend {b!r} (use {', '.join(BACKENDS)})")
    if knobs not in ("default", "all"):
        raise CoconetError(f"--knobs {knobs!r}: use default or all")
    backends = list(dict.fromkeys(backend))
    # one floor per point: the memory and matmul rates of the device the ranks' tensors live on
    device = "cuda" if "nccl" in backends else "cpu"
    if device == "cuda" and len(backends) > 1:
        raise CoconetError(f"--backend nccl runs on CUDA tensors and {', '.join(b for b in backends if b != 'nccl')} "
                           "on CPU tensors: their floors differ, bench them in separate runs")
    _writable(output, "-o")
    _writable(plot, "--plot")
    file = _workload_file(workload)
    prog = load_file(file)
    points_sizes = [parse_sizes(spec, prog.dims) for spec in size]
    baseline = baseline_for(prog)
    allowed = shard.resolve(prog, shardable) if shardable else set(baseline.shardable)
    picked = _pick_schedules(prog, schedule, 6)
    if knobs == "all":
        from coconet.tuner.search import knob_variants

        picked = list({v.hash: v for s in picked for v in knob_variants(s)}.values())
    space = [s for s in picked if set(s.sharded) <= allowed]
    left_out = [{"schedule": s.text, "sharded": sorted(s.sharded)} for s in picked if not set(s.sharded) <= allowed]
    # Measured again before every round and after the last, in this run: load from elsewhere on the
    # machine comes and goes, and the floor takes the best the machine showed.
    bandwidths: list[float] = []
    by_kernel: dict[str, list[float]] = {}  # the probe's kernels' rates, each sample

    def sample_bandwidth() -> None:
        got = memory_bandwidths(device=device)
        for name, rate in got.items():
            by_kernel.setdefault(name, []).append(rate / 1e9)
        bandwidths.append(max(got.values()))

    # the matmul rate of one rank's threads (as the launcher gives them), where the program has matmuls
    nranks = world * (2 if prog.is_pipeline else 1)
    prog.require_world(world)
    for sizes in points_sizes:  # every point must fit, before the first one runs
        require_fits(prog, sizes, world, check=True)
    from coconet.tuner.launch import Options, require_cuda, run_schedules  # torch: seconds, so after the checks

    if device == "cuda":
        require_cuda(nranks)  # before any point is measured
    cpus = os.cpu_count() or 1
    # a CUDA rank has a GPU to itself: its matmul rate is the device's, and no rank shares it
    threads = max(1, cpus // nranks) if device == "cpu" else 1
    rate_cpus = cpus if device == "cpu" else nranks
    matmuls = any(matmul_flops_per_rank(prog, sizes, world) for sizes in points_sizes)
    rates: list[float] = []
    report: dict[str, Any] = {
        "workload": prog.name, "program_hash": prog.hash, "world": world, "backends": backends, "kernels": kernels,
        "knobs": knobs,
        "torch_baseline": baseline.doc, "rank_allocator": allocator_policy(), "cpus": os.cpu_count(), "rounds": rounds,
        "shardable": sorted(allowed), "left_out": left_out, "floor_device": _device_name(device), "points": []}

    def floors() -> None:
        """The floors of the points so far, at the best rates sampled so far: here between launches, and by
        the ranks of every launch right after its timed steps."""
        rows = [r for pt in report["points"] for r in [pt["torch"]] + pt["results"] if r]
        probed = [r["bandwidth_GBps"] * 1e9 for r in rows if r.get("bandwidth_GBps")]
        top = max(bandwidths + probed)
        report["memory_bandwidth_GBps"] = top / 1e9
        report["memory_bandwidth_samples_GBps"] = [b / 1e9 for b in bandwidths]
        report["memory_bandwidth_kernels_GBps"] = by_kernel
        report["memory_bandwidth_launches_GBps"] = [b / 1e9 for b in probed]
        if matmuls:
            report["matmul_GFLOPs_per_thread"] = max(rates) / 1e9
            report["matmul_GFLOPs_per_thread_samples"] = [r / 1e9 for r in rates]
            report["threads_per_rank"] = threads
        def floor(point: dict, bandwidth: float, rate: float | None) -> float:
            compute = compute_floor(prog, point["sizes"], world, rate, rate_cpus, threads) if rate else 0.0
            return max(point["bytes_moved_once"] / bandwidth, compute)

        for i, point in enumerate(report["points"]):
            point["memory_floor_s"] = point["bytes_moved_once"] / top
            point["matmul_flops_per_rank"] = matmul_flops_per_rank(prog, point["sizes"], world)
            point["compute_floor_s"] = compute_floor(prog, point["sizes"], world, max(rates), rate_cpus,
                                                    threads) if rates else 0.0
            point["floor_s"] = max(point["memory_floor_s"], point["compute_floor_s"])
            point["best_over_floor"] = point["best"]["median_s"] / point["floor_s"] if point["best"] else None
            # The floor above takes the best rates of the whole run, and this machine's memory bandwidth comes in
            # modes (52-56 and 78-83 GB/s here) that last minutes: also each round's floor at the bandwidth its
            # ranks measured right after timing the best schedule (else the one sampled before the round), and
            # the best schedule's median of that round against it.
            best = point["best"]
            if not best:
                continue
            own = slice(i * rounds, (i + 1) * rounds)
            probes = best.get("round_bandwidth_GBps") or ([best["bandwidth_GBps"]] if best.get("bandwidth_GBps")
                                                          else None)
            near = [b * 1e9 for b in probes] if probes else bandwidths[own]
            point["floor_rounds_s"] = [floor(point, bw, rate) for bw, rate in
                                       zip(near, rates[own] if rates else [None] * rounds)]
            medians = best.get("round_medians_s") or [best["median_s"]]
            point["best_over_floor_rounds"] = [m / f for m, f in zip(medians, point["floor_rounds_s"])]

    def point_of(sizes: dict, per_round: list[tuple[dict, list[dict]]]) -> dict:
        torch_row = _over_rounds([t for t, _ in per_round])
        rows = [_over_rounds(list(same)) for same in zip(*(r for _, r in per_round))]
        ok = [r for r in rows if r["status"] == "ok" and r["median_s"]]
        best = min(ok, key=lambda r: r["median_s"]) if ok else None
        point = {"sizes": sizes, "rounds_done": len(per_round),
                 "bytes_moved_once": bytes_moved_once(prog, sizes, world, allowed), "torch": torch_row,
                 "results": rows, "best": best}
        ref = torch_row["median_s"] if torch_row and torch_row["median_s"] else rows[0]["median_s"]
        for b in backends:
            mine = [r for r in ok if r["backend"] == b]
            point[f"best_{b}"] = min(mine, key=lambda r: r["median_s"]) if mine else None
        point["best_speedup"] = ref / best["median_s"] if best and ref else None
        if best and "round_medians_s" in best and "round_medians_s" in torch_row:
            point["best_speedup_rounds"] = [t / b for t, b in zip(torch_row["round_medians_s"],
                                                                  best["round_medians_s"])]
        return point

    def save(sizes: dict, per_round: list, in_progress: dict | None) -> None:
        """Written as every result comes: a run stopped (Ctrl-C, the OOM killer, a time limit) keeps the points
        it made, this point's finished rounds as a point of fewer rounds (rounds_done), and the results of the
        round it was in (round_in_progress), which no statistic of a point takes."""
        if output is None:
            return
        if per_round:
            report["points"].append(point_of(sizes, per_round))
        floors()
        _write_report(output, dict(report, complete=False, round_in_progress=in_progress))
        if per_round:
            report["points"].pop()

    def row(b: str, result, sched=None) -> dict:
        return dict(result.to_json(), backend=b, **({} if sched is None else {"sharded": sorted(sched.sharded)}))

    with _progress_bar(quiet=as_json, transient=True) as bar:
        for sizes in points_sizes:
            per_round: list[tuple[dict, list[dict]]] = []
            point_task = bar.add_task(format_sizes(sizes), total=rounds * (1 + len(space) * len(backends)), status="")
            for n_round in range(rounds):
                sample_bandwidth()
                if matmuls:
                    rates.append(matmul_rate(threads, device=device) / threads)
                rows, torch_row = [], None
                in_progress: dict[str, Any] = {"sizes": sizes, "round": n_round + 1, "torch": None, "results": []}
                for k, b in enumerate(backends):  # the baseline runs once a round, in its first launch, beside them
                    opts = Options(world=world, sizes=sizes, backend=b, kernels=kernels, repeats=repeats, warmup=warmup,
                                   timeout_s=timeout, stages=2, probe=True)
                    first = 1 if k == 0 else 0  # the baseline's place in the results

                    # called from within run_schedules below, before the loops move on
                    def landed(i: int, result, b=b, first=first) -> None:
                        if i < first:
                            in_progress["torch"] = row(b, result)
                        else:
                            in_progress["results"].append(row(b, result, space[i - first]))
                        save(sizes, per_round, in_progress)
                        bar.update(point_task, advance=1,
                                   status=f"round {n_round + 1}/{rounds}  {_result_status(b, result)}")

                    results = run_schedules(space, opts, program_file=str(file) if file.suffix == ".py" else None,
                                            baselines=[baseline] if k == 0 else [], on_result=landed)
                    if k == 0:
                        torch_row = row(b, results.pop(0))
                    rows += [row(b, r, s) for r, s in zip(results, space)]
                per_round.append((torch_row, rows))
                save(sizes, per_round, None)
            report["points"].append(point_of(sizes, per_round))
    sample_bandwidth()
    if matmuls:
        rates.append(matmul_rate(threads, device=device) / threads)
    floors()
    report["complete"] = True
    if output is not None:
        _write_report(output, report)
    if plot is not None:
        from coconet.tuner.plots import bench_plot

        bench_plot(report, plot)
    if as_json:
        _echo_json(report)
        return
    _print_bench(report, Console(highlight=False))


def _print_bench(report: dict, console: Console) -> None:
    table = Table(title=f"{report['workload']}  world={report['world']}  backends={','.join(report['backends'])}  "
                  f"kernels={report['kernels']}  memory {report['memory_bandwidth_GBps']:.1f} GB/s "
                  f"({report['floor_device']})", title_justify="left", show_edge=False)
    # the numbers whole in 80 columns: headers break where they can, and the best schedules, often longer than a
    # line, follow the table rather than squeeze it
    longest = max((len(f"{d}={n},") for pt in report["points"] for d, n in pt["sizes"].items()), default=5)
    table.add_column("sizes", min_width=longest)  # broken between sizes, never inside one
    for col in ("torch", "as\nwritten", "best", "speed-\nup", "floor", "best/\nfloor"):
        table.add_column(col, justify="right", no_wrap=True)
    for pt in report["points"]:
        t = pt["torch"]
        table.add_row(format_sizes(pt["sizes"]).replace(",", ", "), _fmt_s(t["median_s"]) if t else "",
                      _fmt_s(pt["results"][0]["median_s"]), _fmt_s(pt["best"]["median_s"]) if pt["best"] else "",
                      _fmt_speedup(pt), _fmt_s(pt["floor_s"]), _fmt_over_floor(pt))
    console.print(table)
    for pt in report["points"]:
        if pt["best"]:
            console.print(Text(f"best at {format_sizes(pt['sizes'])}: {pt['best']['backend']}  "
                               f"{pt['best']['schedule']}"))
    left_out = report["left_out"]
    if left_out:
        names = sorted({n for x in left_out for n in x["sharded"]} - set(report["shardable"]))
        console.print(f"{len(left_out)} schedule(s) left out: they leave some of {', '.join(names)} sharded, which "
                      f"the baseline leaves whole (--shardable NAME lets through those that shard NAME; "
                      f"--shardable all, every one)", markup=False)


@app.command(cls=_Command)
@_guard
def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on; other than loopback only with "
                             "a token in $COCONET_API_TOKEN."),
    port: int = typer.Option(8000, "--port", min=0, max=65535),
    db: Optional[str] = typer.Option(None, "--db", help="Store URL (default $COCONET_DATABASE_URL, else SQLite in "
                                     "the user data dir)."),
    workers: int = typer.Option(1, "--workers", min=0, max=64, help="Tuning jobs run at once (threads driving "
                                "Ray); 0: serve results only."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="Join this Ray cluster instead of "
                                              "starting a local one."),
    open_writes: bool = typer.Option(False, "--open", help="Take writes without a token (loopback --host only): "
                                     "any program on this machine can then start tuning jobs."),
    allow_host: List[str] = typer.Option([], "--allow-host", help="Another name clients reach the server by "
                                         "(besides 127.0.0.1, localhost, ::1 and --host); repeatable, * for any."),
    as_json: bool = JSON_OPT,
) -> None:
    """Serve the REST API (/api/v1, OpenAPI at /docs) and the dashboard (/); tuning jobs run in the server.
    Writes need `Authorization: Bearer $COCONET_API_TOKEN` (or --open, on loopback). Ctrl-C or SIGTERM stop it
    after the trial in progress; a job cut short is queued again and resumes on the next start."""
    import uvicorn

    from coconet.server.app import ENV_TOKEN, create_app
    from coconet.server.http import server_config

    token = os.environ.get(ENV_TOKEN) or None
    if open_writes and not _is_loopback(host):
        raise CoconetError(f"--open takes writes from anyone who reaches the server: only on a loopback --host, "
                           f"not {host}")
    if token is None and not _is_loopback(host):
        raise CoconetError(f"--host {host} is reachable from other machines: set {ENV_TOKEN} to the token that "
                           "writes must carry (or serve on 127.0.0.1)")
    if open_writes and token is not None:
        raise CoconetError(f"--open and {ENV_TOKEN} together: with a token, writes carry it; leave out one of them")
    _require_listenable(host, port)  # uvicorn logs the failure and exits the process: say it here first
    hosts = [*_served_names(host), *allow_host]
    app_ = create_app(db, token=token, workers=workers, ray_address=ray_address, open_writes=open_writes,
                      hosts=hosts)
    if as_json:
        _echo_json({"url": f"http://{host}:{port}", "api": "/api/v1", "docs": "/docs", "store": app_.state.store.url,
                    "workers": workers, "auth": token is not None, "open": open_writes, "hosts": hosts})
        sys.stdout.flush()
    elif open_writes:
        Console(stderr=True, highlight=False, soft_wrap=True).print(
            f"note: --open: writes need no token; any program on this machine can post programs and start "
            f"tuning jobs on http://{host}:{port}", markup=False)
    server = uvicorn.Server(server_config(app_, host=host, port=port, log_level="info", access_log=not as_json,
                                          timeout_graceful_shutdown=30))
    try:
        server.run()
    except KeyboardInterrupt:
        pass  # uvicorn stopped cleanly and re-raised the signal it caught: that is how serve ends
    except SystemExit:  # uvicorn's way of failing to start (the port taken between the check and now)
        pass
    if not server.started and not server.should_exit:
        raise CoconetError(f"could not serve on {host}:{port} (see the log above)")


def _require_listenable(host: str, port: int) -> None:
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise CoconetError(f"--host {host}: {e.strerror or e}") from None
    family, kind, proto, _, addr = infos[0]
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            sock.bind(addr)
    except OSError as e:
        raise CoconetError(f"cannot serve on {host}:{port}: {e.strerror or e}") from None


def _served_names(host: str) -> list[str]:
    """The names clients may reach a server bound to ``host`` by, besides the loopback ones: the host itself,
    or for every interface (0.0.0.0, ::) this machine's name."""
    if host.strip("[]") in ("0.0.0.0", "::", ""):
        return sorted({socket.gethostname(), socket.getfqdn()} - {""})
    return [host]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@app.command(cls=_Command)
@_guard
def best(
    file: Path = typer.Argument(..., callback=_program_path, help=PROGRAM_HELP),
    size: Optional[List[str]] = SIZE_OPT,
    world: Optional[int] = typer.Option(None, "--world", min=1, help="Only a winner at this world (default: any)."),
    topology: str = typer.Option("local", "--topology", help="The topology the winner was tuned or predicted on."),
    backend: Optional[str] = typer.Option(None, "--backend", metavar="[gloo|nccl|shm]",
                                          help="Only a winner on this backend (default: any)."),
    source: Optional[str] = typer.Option(None, "--source", help="measured or predicted: only a winner of that kind "
                                         "(default: a measured one where the key has one, else a predicted one)."),
    shardable: List[str] = typer.Option([], "--shardable", help=f"The winner of a tuning that asked this. "
                                        f"{SHARDABLE_HELP}"),
    db: Optional[str] = typer.Option(None, "--db", help="Store URL (default $COCONET_DATABASE_URL, else SQLite in "
                                     "the user data dir)."),
    server: Optional[str] = typer.Option(None, "--server", help="Ask a coconet server instead of a store."),
    token: Optional[str] = typer.Option(None, "--token", help="The server's token, if it asks one for reads "
                                        "(default $COCONET_API_TOKEN)."),
    as_json: bool = JSON_OPT,
) -> None:
    """The best schedule recorded for a program at one size: measured, or predicted by the cost model (said),
    with its time and speed-up; the nearest tuned sizes' winner where these were not tuned (said)."""
    from coconet.api import best as find_best
    from coconet.api import load

    if source not in (None, "measured", "predicted"):
        raise CoconetError(f"--source {source!r}: measured or predicted")
    prog = load(file)
    _require_sizes(prog, size)
    if len(size) != 1:
        raise CoconetError("coconet best answers one --size at a time")
    found = find_best(prog, size[0], topology=topology, world=world, backend=backend, store=db, server=server,
                      token=token or os.environ.get("COCONET_API_TOKEN"), shardable=shardable or None,
                      source=source)
    if as_json:
        _echo_json(found)
        return
    console = Console(highlight=False, soft_wrap=True)
    stats = found["stats"]
    head = (f"{prog.name}  world={found['world']}  {format_sizes(found['sizes'])}  topology={found['topology']}: "
            f"{found['source']}")
    if found["source"] != "measured" and found.get("prediction"):
        pred = found["prediction"]
        head += f" by {pred['model']} (calibration {pred.get('calibration') or 'unknown'})"
    console.print(head, markup=False)
    console.print(f"{found['backend']}: {found['schedule']}  {_fmt_s(stats['median_s'])}"
                  + (f"  {_ratio(found['speedup'])}x over the baseline" if found.get("speedup") else "")
                  + f"  winner record {found['winner_id']}", markup=False)
    if found.get("machines"):
        console.print(_machines_text(found["machines"]), markup=False)
    if not found["exact"]:
        console.print(f"note: not tuned at these sizes; the winner of {format_sizes(found['tuned_sizes'])}",
                      markup=False)


@app.command(cls=_Command)
@_guard
def results(
    file: Path = typer.Argument(..., callback=_program_path, help=PROGRAM_HELP),
    topology: Optional[str] = typer.Option(None, "--topology", help="Only this topology's (default: every one)."),
    db: Optional[str] = typer.Option(None, "--db", help="Store URL (default $COCONET_DATABASE_URL, else SQLite in "
                                     "the user data dir)."),
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
    docs = [{"sizes": b.winner.sizes, "topology": b.winner.topology, "world": b.winner.world,
             "backend": b.winner.backend, "schedule": b.schedule, "median_s": b.median_s, "speedup": b.speedup,
             "source": answer_source(b.source), "winner_id": b.winner.id, "machines": machines_of(b.measurement)}
            for b in rows]
    if as_json:
        _echo_json({"program": prog.name, "program_hash": prog.hash, "results": docs})
        return
    if not docs:
        Console(highlight=False).print(f"nothing tuned or predicted for {prog.name} in this store", markup=False)
        return
    table = Table(title=f"{prog.name}: {len(docs)} keys", title_justify="left", show_edge=False)
    for col in ("sizes", "topology", "world", "backend", "source", "median", "speed-up"):
        table.add_column(col, no_wrap=True, justify="right" if col in ("world", "median", "speed-up") else "left")
    table.add_column("machines", no_wrap=True, min_width=12)  # the fingerprint's hash: `best` says it in words
    table.add_column("schedule", ratio=1, overflow="fold")
    for d in docs:
        table.add_row(format_sizes(d["sizes"]), d["topology"], str(d["world"]), d["backend"], d["source"],
                      _fmt_s(d["median_s"]), f"{_ratio(d['speedup'])}x" if d["speedup"] else "",
                      (d["machines"] or {}).get("fingerprint", ""), d["schedule"])
    Console(highlight=False).print(table)


@app.command(cls=_Command)
@_guard
def submit(
    file: Path = typer.Argument(..., callback=_program_path,
                                help="The program: a .py file defining `program` (run here; only its JSON IR "
                                "is sent), or its JSON IR."),
    server: str = typer.Option(..., "--server", help="The coconet server, e.g. http://127.0.0.1:8000."),
    world: int = typer.Option(2, "--world", min=1, help="Ranks to tune on."),
    size: Optional[List[str]] = SIZE_OPT,
    token: Optional[str] = typer.Option(None, "--token", help="The server's write token (default "
                                        "$COCONET_API_TOKEN)."),
    topology: str = typer.Option("local", "--topology", help="The topology the server tunes on."),
    budget: int = typer.Option(32, "--budget", min=1, help="Candidates measured per size."),
    poll: float = typer.Option(1.0, "--poll", min=0.05, help="Seconds between progress checks."),
    timeout: Optional[float] = typer.Option(None, "--timeout", min=1.0, help="Stop following after this many "
                                            "seconds (the jobs go on on the server)."),
    code: bool = typer.Option(False, "--code/--no-code", help="Print each winner's generated module after its "
                              "summary (in --json: its `code`)."),
    emit: Optional[Path] = typer.Option(None, "--emit", help="Write each winner's generated module into this folder "
                                        "(NAME_HASH_BACKEND.py, as `coconet run --emit`)."),
    shardable: List[str] = typer.Option([], "--shardable", help=SHARDABLE_HELP),
    as_json: bool = JSON_OPT,
) -> None:
    """Submit a program to a coconet server, tune it there (one job per --size), follow the jobs and print each
    winner: its schedule, time and speed-up (its generated module with --code, or into files with --emit). With
    one --size the JSON is one result; with several, a list."""
    from coconet.client import ENV_TOKEN, Client, ServiceError

    _writable(emit, "--emit", folder=True)
    prog = load_file(file)
    _require_sizes(prog, size)
    points = [parse_sizes(spec, prog.dims) for spec in size]
    with Client.open(server, token or os.environ.get(ENV_TOKEN) or None) as client:
        program = client.send_program(prog)
        # checked here; none given, the server's default
        names = list(shard.spelled(shardable_text(prog, shardable))) if shardable else None
        jobs = [client.post_job(program, sizes, topology=topology, world=world, budget=budget,
                                shardable=names)["id"] for sizes in points]
        try:
            final = _follow_jobs(client, jobs, poll, timeout, quiet=as_json)
        except KeyboardInterrupt:
            raise ServiceError(f"stopped following; job{'s' if len(jobs) > 1 else ''} "
                               f"{', '.join(map(str, jobs))} go on on the server") from None
        docs = [_submitted(client, final[j], code or emit is not None) for j in jobs]
    if emit is not None:
        emit.mkdir(parents=True, exist_ok=True)
        for d in docs:
            if d["code"] is not None:
                path = write_module(d["code"], d["best"]["backend"],
                                    emit / f"{prog.name}_{d['best']['hash']}_{d['best']['backend']}.py")
                Console(stderr=True, highlight=False, soft_wrap=True).print(f"wrote {path}", markup=False)
            if not code:
                d["code"] = None
    failed = [d for d in docs if d["state"] != "done" or d["best"] is None]
    if as_json:
        _echo_json(docs[0] if len(docs) == 1 else docs)
    else:
        for d in docs:
            _print_submitted(prog.name, d)
    if failed:
        raise ServiceError("; ".join(f"job {d['job']} {d['state']}: {d['error'] or 'no reason given'}"
                                     for d in failed))


def _follow_jobs(client: Any, jobs: list[int], poll: float, timeout: Optional[float], quiet: bool) -> dict:
    from coconet.client import follow

    if quiet:
        return follow(client, jobs, poll_s=poll, timeout_s=timeout)
    with _progress_bar() as bar:
        tasks = {j: bar.add_task(f"job {j}", total=None, status="submitted") for j in jobs}

        def show(job: dict) -> None:
            p = job["progress"]
            sizes = format_sizes(job["sizes"])
            best = f"best {_fmt_s(p['best_s'])}" if p.get("best_s") else "no result yet"
            bar.update(tasks[job["id"]], description=f"job {job['id']} {sizes}", completed=p["done"],
                       total=p["total"], status=f"{job['state']}  failed {p['failed']}  {best}")

        return follow(client, jobs, poll_s=poll, timeout_s=timeout, on_update=show)


def _submitted(client: Any, job: dict, with_code: bool) -> dict:
    """A finished job as `submit` reports it: the winner from GET /best (the server's public answer) and its code."""
    from coconet.client import ServiceError

    doc: dict[str, Any] = {"job": job["id"], "state": job["state"], "error": job.get("error"),
                           "program_hash": job["program"], "sizes": job["sizes"], "topology": job["topology"],
                           "world": job["world"], "best": None, "runner_up": None, "baseline": None, "speedup": None,
                           "code": None}
    if job["state"] != "done":
        return doc
    asked = job["shardable"]
    try:
        best = client.best(job["program"], job["sizes"], topology=job["topology"], world=job["world"],
                           shardable=asked if isinstance(asked, str) else ",".join(asked))
    except ServiceError as e:
        if getattr(e, "status", None) != 404:  # 404: nothing for the key, nor near it: this job found no winner
            raise
        best = {}
    if not best.get("exact"):
        why = (job.get("result") or {}).get("failures") or []
        doc["error"] = "the job finished without a winner (no schedule ran correctly)" + (
            f"; commonest failure: {_failure_text(why[0])}" if why else "")
        return doc
    stats, base = best["stats"], best.get("baseline")
    doc["best"] = {"schedule": best["schedule"], "backend": best["backend"], "hash": best["schedule_hash"],
                   "median_s": stats["median_s"], "ci95_s": stats["ci95_s"], "source": best["source"],
                   "sharded": best.get("sharded", []), "shardable": best.get("shardable"), "job": best.get("job"),
                   "order_reversed": best.get("order_reversed", False)}
    if base:
        doc["baseline"] = {"schedule": base["schedule"], "backend": base["backend"],
                           "median_s": base["stats"]["median_s"], "ci95_s": base["stats"]["ci95_s"]}
    up = best.get("runner_up")
    doc["runner_up"] = None if not up else {"schedule": up["schedule"], "backend": up["backend"],
                                             "median_s": up["stats"]["median_s"], "ci95_s": up["stats"]["ci95_s"]}
    doc["speedup"] = best.get("speedup")
    if with_code:
        doc["code"] = client.code(best["schedule_hash"], program=job["program"], backend=best["backend"])["source"]
    return doc


def _print_submitted(name: str, d: dict) -> None:
    console = Console(highlight=False, soft_wrap=True)  # a schedule's text is copied from here: never wrapped
    sizes = format_sizes(d["sizes"])
    head = f"{name}  world={d['world']}  {sizes}  topology={d['topology']}  job {d['job']}"
    b = d["best"]
    if b is None:
        console.print(f"{head}: {d['state']}, no winner", markup=False)
        return
    ci = b["ci95_s"]
    console.print(f"{head}\nwinner ({b['source']}): {b['backend']}: {b['schedule']}  {_fmt_s(b['median_s'])}"
                  + (f" [{_fmt_s(ci[0])}, {_fmt_s(ci[1])}]" if ci else "")
                  + (f"  {d['speedup']:.2f}x over the baseline" if d["speedup"] else ""), markup=False)
    up = d.get("runner_up")
    if up:  # the winner, the runner-up and the baseline are timed again in turns: the same machine state
        console.print(f"runner-up, timed again in turns with the winner: {up['backend']}: {up['schedule']}  "
                      f"{_fmt_s(up['median_s'])}", markup=False)
    if b.get("order_reversed"):
        console.print("note: timed again in turns, the winner beat the runner-up that the search had found faster",
                      markup=False)
    if b["sharded"]:
        console.print(_sharded_note(b["sharded"]), markup=False)
    if b["job"] != d["job"]:  # GET /best answers the fastest winner of the key, whoever found it
        console.print("note: the server's best for this key, " + (
            f"found by job {b['job']}" if b["job"] is not None else "recorded outside a job")
            + f": faster than the winner of job {d['job']}", markup=False)
    if d["code"] is not None:
        console.rule(f"generated code ({b['backend']})")
        sys.stdout.write(d["code"] if d["code"].endswith("\n") else d["code"] + "\n")


def _terminated(signum: int, frame: Any) -> None:
    # SIGTERM (kill, a scheduler) unwinds like Ctrl-C: finally blocks run, a local Ray cluster is shut
    # down at exit and running jobs are marked interrupted, rather than the process vanishing mid-write.
    raise KeyboardInterrupt


def main() -> None:
    signal.signal(signal.SIGTERM, _terminated)
    try:
        code = app(standalone_mode=False)
    except typer.Abort:
        _print_error("interrupted")
        code = 2
    except Exception as e:
        # Usage errors (click's, or typer's own in the versions that vendor click)
        # carry format_message/exit_code; anything else escaped _guard: a bug.
        if not (hasattr(e, "format_message") and hasattr(e, "exit_code")):
            raise
        ctx = getattr(e, "ctx", None)
        if type(e).__name__ == "NoArgsIsHelpError" and ctx is not None:
            code = 0  # click printed the help as it raised
        else:
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            _print_error(f"{e.format_message()}{hint}")
            code = 2
    try:
        if sys.stdout is not None:  # None: started with stdout closed
            sys.stdout.flush()  # here, not at exit: a reader that left before the last write is not an error to print
    except BrokenPipeError:
        _stdout_gone()
        code = _PIPE_CLOSED
    except OSError as e:  # a full disk, /dev/full
        _print_error(f"cannot write the answer to stdout: {e.strerror or e}")
        _stdout_to_devnull()
        code = 2
    code = code if isinstance(code, int) else 0
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        # none of coconet's threads: a program file's, refused at load. Exit would wait for it for ever.
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
