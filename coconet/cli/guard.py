"""What every ``coconet`` command shares in how it fails: one line ``error: …`` on stderr with exit code 2,
never a traceback (``COCONET_DEBUG=1`` shows it for internal errors), and a reader of stdout that leaves early
(``| head``) ends the command without a word."""

from __future__ import annotations

import errno
import functools
import os
import select
import signal
import sys
from typing import Any, Callable

import typer
from rich.console import Console

from coconet.errors import CoconetError
from coconet.extras import extra_for, missing


class Command(typer.core.TyperCommand):
    """A command that refuses an option of one value given twice: click keeps the last one silently, and
    `run --backend shm --backend gloo` ran gloo alone."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if not ctx.resilient_parsing:
            _, _, order = self.make_parser(ctx).parse_args(args=list(args))
            seen: set[str] = set()
            for param in order:
                # an option of one value: typer's options are TyperOptions
                if not isinstance(param, typer.core.TyperOption) or param.multiple or param.is_flag or param.count:
                    continue
                if param.name in seen:
                    raise typer.BadParameter(
                        f"given more than once: {ctx.info_name} takes one value", ctx=ctx, param=param
                    )
                seen.add(param.name)
        return super().parse_args(ctx, args)


def print_error(message: str) -> None:
    Console(stderr=True, highlight=False, soft_wrap=True).print(f"error: {' '.join(message.split())}", markup=False)


def fail(message: str) -> None:
    print_error(message)
    raise typer.Exit(2)


PIPE_CLOSED = 128 + signal.SIGPIPE  # what a shell reports for a writer its pipe's reader left (`| head`)


def stdout_gone() -> bool:
    """Whether stdout's reader went away (`coconet schedules … | head`): then the command stops without a
    word, as the tools it is piped with do. A broken pipe elsewhere (a rank's) is not this."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        gone = any(ev & select.POLLERR for _, ev in poll.poll(0))  # a pipe with no reader polls as an error
    except (AttributeError, OSError, ValueError):  # no poll, or stdout is not a file
        return False
    if gone:
        stdout_to_devnull()
    return gone


def stdout_to_devnull() -> None:
    # what is still buffered can reach no one: /dev/null takes it, so the flush at exit does not fail again
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.close(null)


def guard(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except CoconetError as e:
            fail(" ".join(str(e).split("\n")))
        except KeyboardInterrupt:
            fail("interrupted")
        except Exception as e:
            if isinstance(e, BrokenPipeError) and stdout_gone():
                raise typer.Exit(PIPE_CLOSED) from None
            if isinstance(e, MemoryError):
                fail(f"out of memory: {e or 'an allocation failed'} (try smaller sizes or fewer ranks)")
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):  # the disk's, not ours
                fail(f"cannot write {e.filename or 'the answer'}: {e.strerror}")
            if isinstance(e, OSError) and e.filename is not None and e.strerror:  # a path the user gave, or its folder
                fail(f"{e.filename}: {e.strerror}")
            if isinstance(e, ModuleNotFoundError) and e.name and extra_for(e.name) is not None:
                fail(str(missing(e.name, f"`coconet {fn.__name__}`")))
            if os.environ.get("COCONET_DEBUG"):
                raise
            fail(f"internal error: {type(e).__name__}: {e} (set COCONET_DEBUG=1 for the traceback)")

    return wrapper
