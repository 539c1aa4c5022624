"""The ``coconet`` command line (docs/architecture.md, "Packages and modules").

Every command takes ``--json`` for a machine-readable answer on stdout. Errors
are one line ``error: …`` on stderr with exit code 2 — never a traceback
(``COCONET_DEBUG=1`` shows it for internal errors).

One module per group of commands: ``program`` (check, export, schedules), ``run``, ``tune`` (tune, sweep),
``calibrate``, ``bench``, ``server`` (serve, submit) and ``queries`` (best, results); ``guard`` (how a command
fails), ``common`` (shared options and checks) and ``output`` (how they print) serve them all. A command imports
the layers it drives beyond the IR and codegen (the tuner, the store, the service, the client) when it runs, so
that ``coconet --help`` and a refused argument answer at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Callable

import typer

from coconet.cli import bench, calibrate, program, queries, run, server, tune
from coconet.cli.guard import PIPE_CLOSED, Command, guard, print_error, stdout_gone, stdout_to_devnull

# in the order `coconet --help` lists them
COMMANDS: tuple[Callable[..., Any], ...] = (
    program.check,
    program.export,
    program.schedules,
    run.run,
    tune.tune,
    tune.sweep,
    calibrate.calibrate,
    bench.bench,
    server.serve,
    queries.best,
    queries.results,
    server.submit,
)


def _version(value: bool) -> None:
    if value:
        from coconet import __version__

        sys.stdout.write(f"coconet {__version__}\n")
        raise typer.Exit()


def _root(
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_version, help="Print the version and exit."
    ),
) -> None:
    """Co-optimise computation and communication of distributed ML programs, and tune their schedules."""


def make_app() -> typer.Typer:
    """The ``coconet`` app with every command, each behind ``guard`` (its errors as one line)."""
    app = typer.Typer(
        name="coconet",
        help="Co-optimise computation and communication of distributed ML programs, and tune their schedules.",
        add_completion=True,
        no_args_is_help=True,
        pretty_exceptions_enable=False,
    )
    app.callback()(_root)
    for command in COMMANDS:
        app.command(cls=Command)(guard(command))
    return app


app = make_app()


def _terminated(signum: int, frame: Any) -> None:
    # SIGTERM (kill, a scheduler) unwinds like Ctrl-C: finally blocks run, a local Ray cluster is shut
    # down at exit and running jobs are marked interrupted, rather than the process vanishing mid-write.
    raise KeyboardInterrupt


def main() -> None:
    signal.signal(signal.SIGTERM, _terminated)
    try:
        code = app(standalone_mode=False)
    except typer.Abort:
        print_error("interrupted")
        code = 2
    except Exception as e:
        # Usage errors (click's, or typer's own in the versions that vendor click)
        # carry format_message/exit_code; anything else escaped guard: a bug.
        if not (hasattr(e, "format_message") and hasattr(e, "exit_code")):
            raise
        ctx = getattr(e, "ctx", None)
        if type(e).__name__ == "NoArgsIsHelpError" and ctx is not None:
            code = 0  # click printed the help as it raised
        else:
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            print_error(f"{e.format_message()}{hint}")
            code = 2
    try:
        if sys.stdout is not None:  # None: started with stdout closed
            sys.stdout.flush()  # here, not at exit: a reader that left before the last write is not an error to print
    except BrokenPipeError:
        stdout_gone()
        code = PIPE_CLOSED
    except OSError as e:  # a full disk, /dev/full
        print_error(f"cannot write the answer to stdout: {e.strerror or e}")
        stdout_to_devnull()
        code = 2
    code = code if isinstance(code, int) else 0
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        # none of coconet's threads: a program file's, refused at load. Exit would wait for it for ever.
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
