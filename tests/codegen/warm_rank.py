"""A rank script (``python -m MODULE RANK WORLD PORT ...``) run in a process forked from a warm interpreter
instead of a fresh one: torch, its compiler and coconet are imported once, by multiprocessing's fork
server, as a launch's own ranks are forked from one (coconet.tuner.forkserver). Each rank's stdout and
stderr go to a file of its own."""

import os
import runpy
import sys

from coconet.tuner import forkserver

# what the launch's fork server imports, and its warm-up's compiler, then what the rank scripts add
PRELOAD = [*forkserver.PRELOAD, *forkserver.COMPILER, "coconet.codegen.lower", "coconet.schedules.interp", __name__]


def main(module: str, argv: list[str], log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
