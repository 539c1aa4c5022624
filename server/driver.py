"""The process that drives a running job (a worker of ``coconet serve``, or ``coconet tune``), as a text the
store keeps with the job, so that a process on the same machine can tell at once that the job's driver is
gone instead of waiting for its heartbeat to go stale.

The text names the machine (host name, boot, PID namespace) and the process (pid and start time, so a
reused pid is not taken for the driver). Only a driver on this machine can be seen gone; of one elsewhere,
or one whose text cannot be read, nothing is known and only its heartbeat tells.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Driver:
    host: str
    machine: str  # boot id and PID namespace: two containers may share a host name
    pid: int
    start: str  # clock ticks after boot at which the process started (/proc/PID/stat)

    @property
    def text(self) -> str:
        return f"{self.pid}@{self.host} {self.machine} {self.start}"

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}"

    @classmethod
    def parse(cls, text: str | None) -> Driver | None:
        try:
            who, machine, start = (text or "").split(" ")
            pid, host = who.split("@", 1)
            return cls(host, machine, int(pid), start)
        except ValueError:
            return None


def describe(text: str | None) -> str | None:
    """The driver ``text`` names, as "pid N on HOST"; None if there is none or it cannot be read."""
    driver = Driver.parse(text)
    return driver.describe() if driver else None


def this_process() -> Driver | None:
    """This process as a driver; None where the system does not say when a process started (no /proc)."""
    stat = _stat(os.getpid())
    return Driver(socket.gethostname(), _machine(), os.getpid(), stat[1]) if stat else None


def gone(text: str | None) -> Driver | None:
    """The driver ``text`` names, if it is a process of this machine that has ended; else None."""
    driver = Driver.parse(text)
    me = this_process()
    if driver is None or me is None or (driver.host, driver.machine) != (me.host, me.machine):
        return None
    state, start = _stat(driver.pid) or ("", None)
    return driver if start != driver.start or state in ("Z", "X") else None  # a zombie has ended too


def _machine() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return "-"
    return f"{boot}/{namespace}".replace(" ", "")


def _stat(pid: int) -> tuple[str, str] | None:
    """The process's state letter and start time."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: count the fields after its closing one
    fields = stat.rsplit(")", 1)[-1].split()
    return (fields[0], fields[19]) if len(fields) > 19 else None
