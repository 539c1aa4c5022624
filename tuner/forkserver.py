"""Rank processes forked from a warm interpreter.

A rank started as a fresh interpreter spends seconds importing torch before it does anything (about 3 s
of CPU on a 2-core machine, for every rank at once), so a launch of a few small schedules is mostly
start-up, and so is every fresh group that a failing schedule leaves the rest to. A fork server imports
torch, numpy and the rank's module once, in an interpreter of its own, and forks each rank from there:
the rank then starts in milliseconds.

The server is never the caller: forking the caller would copy its threads, its OpenMP pool and its
``__main__``. It is started by the first launch from a process and kept for that process's later
launches that run with the same interpreter, environment and working directory (what Python, torch and
glibc read when a process starts must be what a fresh rank would have read). It exits when its caller
closes its end of the socket or dies, and its ranks die with it (``rank.die_with_parent``). CUDA ranks
start as fresh interpreters: a CUDA context must not be forked, and nothing is gained from a server that
could not touch the device before forking.

From a server's second launch of compiled kernels on, the server warms Inductor before it forks
(``prestart(compiled=True)``): its imports and the set-up every process does before its first kernel (the
vector ISA probed by compiling test programs, the pattern tables traced), seconds of CPU that each rank
spent before its first kernel, even one found in the on-disk cache. The server stays single-threaded for
it (tqdm's monitor thread off).

``COCONET_FORKSERVER=0`` starts every rank as a fresh interpreter.

Why not ``multiprocessing``'s forkserver with ``set_forkserver_preload``: its preload imports modules and runs
nothing else, so the Inductor warm-up above could only be an import's side effect, and that warm-up is most of
what the server saves once it has served a launch (Adam's fused kernel, ``launch_startup_compiled.json``: a
launch took 1.3 s at world 2 and 3.0 s at world 4 from the warmed server, 8.0 and 14.9 s from the same server
unwarmed, 9.3 and 20.2 s from fresh interpreters; docs/schedules.md). It also keeps one server per process
for the environment it first saw, where a launch here may change the environment (``COCONET_…`` switches,
threads per rank) and must get a server that started with it; and its children are started by
``Process.start`` with a pickled target, where a rank here is handed its log and report descriptors and
reports its exit code to the launcher, which polls ranks as ``subprocess.Popen`` objects.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Callable

from coconet.tuner import rank as rank_module
from coconet.tuner.rank import freeze_imports

ENV_SWITCH = "COCONET_FORKSERVER"
READY_S = 120.0  # the server's imports, on a loaded machine
# coconet.tuner.launch: a rank's job holds the launch's Options, so unpickling it imported the launcher (and
# the lowering) in every rank of every launch
PRELOAD = (
    "numpy",
    "torch",
    "torch.distributed",
    "coconet.tuner.rank",
    "coconet.codegen.baselines",
    "coconet.tuner.launch",
    "coconet.kernels.collectives",
    "coconet.kernels.shm",
    "coconet.kernels.dropout",
    "coconet.kernels.ops",
)  # the runtime generated modules import
COMPILER = (
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "torch.fx.experimental.proxy_tensor",
    "coconet.kernels.compiled",
)  # what a rank's first compiled kernel imports
# set anew for every test by pytest, and read by nothing at start-up: not part of a server's key (a server
# per test would never be reused), each rank gets the caller's value at its spawn instead
VOLATILE = ("PYTEST_CURRENT_TEST",)
RANK_NAME = "coconet-rank"  # the forked ranks' process name (ps, /proc/PID/comm)
_MAX_MESSAGE = 1 << 20


class Forked:
    """A rank forked by a ``ForkServer``: what ``subprocess.Popen`` offers that a launch uses."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server, self.pid = server, pid

    @property
    def returncode(self) -> int | None:
        return self.server.codes.get(self.pid)

    def poll(self) -> int | None:
        self.server.drain(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                assert timeout is not None  # a deadline is set only with one
                raise subprocess.TimeoutExpired(f"{RANK_NAME} {self.pid}", timeout)
            self.server.drain(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The caller's end of a fork server (module doc). Spawns and exit reports go over one socket; a lock
    keeps the caller's threads from reading each other's replies."""

    def __init__(self, env: dict[str, str], cwd: str) -> None:
        self.codes: dict[int, int] = {}  # pid -> exit code, as the server reports it
        self.live: set[int] = set()
        self.dead = False
        self.lock = threading.RLock()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "coconet.tuner.forkserver", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )  # its own session: Ctrl-C is the caller's
        finally:
            theirs.close()
        self.sock = ours
        self.ready = False  # its imports run while the caller goes on (``prestart``)
        self.warmed = False
        self.spawned = 0
        self.warm_failures: list[str] | None = None  # the warm-up's steps that failed, once it has run

    def spawn(self, job: str, rank: int, log_fd: int, pipe_fd: int) -> Forked:
        with self.lock:
            deadline = time.monotonic() + READY_S
            while not self.ready:
                if self._recv(max(0.0, deadline - time.monotonic())) is None:
                    self.close()
                    raise OSError(f"the fork server did not start within {READY_S:g} s")
            volatile = {k: os.environ.get(k) for k in VOLATILE}
            socket.send_fds(self.sock, [pickle.dumps(("spawn", job, rank, volatile))], [log_fd, pipe_fd])
            while True:
                msg = self._recv(READY_S)
                if msg is None:
                    raise OSError("the fork server stopped answering")
                if msg[0] == "pid":
                    self.live.add(msg[1])
                    self.spawned += 1
                    return Forked(self, msg[1])

    def warm(self) -> None:
        """Has the server warm Inductor before its next fork (once), if it has forked ranks before: the
        spawns after the request wait for the warm-up. Not for a server's first launch: that one's ranks
        warm up side by side on the machine's cores, where the server would do it alone before forking
        them (a single `coconet run` took 12.0 s against 7.3 s with fresh interpreters, world 2)."""
        with self.lock:
            if self.spawned and not self.warmed and not self.dead:
                self.sock.send(pickle.dumps(("warm",)))
                self.warmed = True

    def drain(self, timeout: float | None) -> None:
        """Takes in what the server has said within ``timeout`` seconds (at least one message, if any
        comes), filing exit codes."""
        with self.lock:
            self._recv(timeout)
            while self._recv(0.0) is not None:
                pass

    def _recv(self, timeout: float | None) -> tuple | None:
        if self.dead:
            return None
        if not select.select([self.sock], [], [], timeout)[0]:
            return None
        data = self.sock.recv(_MAX_MESSAGE)
        if not data:  # the server is gone, and its ranks with it (they die with their parent)
            self.dead = True
            for pid in self.live:
                self.codes.setdefault(pid, -signal.SIGKILL)
            self.live.clear()
            return None
        msg = pickle.loads(data)
        if msg[0] == "ready":
            self.ready = True
        elif msg[0] == "warmed":
            self.warm_failures = msg[1]
        elif msg[0] == "exit":
            self.codes[msg[1]] = msg[2]
            self.live.discard(msg[1])
        return msg

    @property
    def idle(self) -> bool:
        self.drain(0.0)
        return not self.live

    def close(self) -> None:
        self.dead = True
        self.sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Servers:
    """The fork servers of this process by (interpreter, environment, working directory). A server whose
    key no launch uses any more is closed once its ranks are gone, when a launch with a new key comes."""

    def __init__(self) -> None:
        self.by_key: dict[tuple, ForkServer] = {}
        self.pid = os.getpid()
        self.lock = threading.Lock()

    def get(self) -> ForkServer:
        env, cwd = {k: v for k, v in os.environ.items() if k not in VOLATILE}, os.getcwd()
        key = (sys.executable, cwd, tuple(sorted(env.items())))
        with self.lock:
            if self.pid != os.getpid():  # a forked copy of the caller: the servers answer the parent only
                self.by_key, self.pid = {}, os.getpid()
            server = self.by_key.get(key)
            if server is not None and not server.dead:
                return server
            for k, old in list(self.by_key.items()):
                if old.dead or old.idle:
                    old.close()
                    del self.by_key[k]
            server = self.by_key[key] = ForkServer(env, cwd)
            return server


_SERVERS = Servers()  # no server runs until a launch asks for one


def _enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def prestart(*, compiled: bool = False) -> None:
    """Starts this process's fork server for the caller's environment, if it has none, and returns at once:
    its imports then run beside the caller's own (a launch's lowering imports torch too). ``compiled``: the
    ranks will compile kernels, so the server warms Inductor too before it forks them."""
    if _enabled():
        try:
            server = _SERVERS.get()
            if compiled:
                server.warm()
        except OSError:
            pass  # start_rank falls back to fresh interpreters


def start_rank(job: str, rank: int, log_fd: int, pipe_fd: int, *, fresh: bool = False):
    """Rank ``rank`` of the launch whose job file is ``job``, writing its output to ``log_fd`` and its
    reports to ``pipe_fd``, in a process group of its own: forked by this process's fork server, or (with
    ``fresh``, ``COCONET_FORKSERVER=0``, or a server that cannot start) a fresh interpreter."""
    if not fresh and _enabled():
        try:
            return _SERVERS.get().spawn(job, rank, log_fd, pipe_fd)
        except OSError:
            pass  # a fresh interpreter does what the server would have
    return subprocess.Popen(
        [sys.executable, "-m", "coconet.tuner.rank", job, str(rank), str(pipe_fd)],
        pass_fds=(pipe_fd,),
        stdin=subprocess.DEVNULL,
        stdout=log_fd,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def kill_group(proc) -> None:
    """SIGKILL to a live rank's process group (the rank, and whatever it started)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # forked, and not yet in a group of its own
        proc.kill()


def _serve(sock: socket.socket) -> None:
    for name in PRELOAD:
        importlib.import_module(name)

    freeze_imports()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD writes to the wakeup fd
    sock.send(pickle.dumps(("ready",)))
    while True:
        watched: list[socket.socket | int] = [sock, wake_r]
        ready = select.select(watched, [], [])[0]
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(sock)
        if sock not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 2)
        except OSError:
            return
        if not data:  # the caller is gone: so are we, and our ranks die with us
            return
        msg = pickle.loads(data)
        if msg[0] == "warm":
            warmed = _warm_compiler()
            freeze_imports()
            sock.send(pickle.dumps(("warmed", warmed)))
            continue
        _, job, rank, volatile = msg
        pid = os.fork()
        if pid == 0:
            _child(sock, (wake_r, wake_w), fds, job, rank, volatile)
        try:
            os.setpgid(pid, pid)  # set here too: the caller may signal the group before the child sets it
        except OSError:
            pass
        for fd in fds:
            os.close(fd)
        sock.send(pickle.dumps(("pid", pid)))


def _warm_compiler() -> list[str]:
    """What every process does before its first compiled kernel, done once here for the ranks to inherit.
    Each step is Inductor's own, cached for the process's life; a torch that lacks one, or a step that
    fails, leaves it to the ranks, which then do it themselves (and report what fails there)."""

    def probe_isa() -> None:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        pick_vec_isa()

    def trace_patterns() -> None:
        import torch
        from torch._inductor.fx_passes import joint_graph, post_grad

        try:
            import tqdm
        except ImportError:  # then nothing starts its monitor thread
            pass
        else:
            tqdm.tqdm.monitor_interval = 0  # its monitor thread would be running at every fork
        joint_graph.lazy_init(torch.device("cpu"))
        post_grad.lazy_init()

    steps: list[tuple[str, Callable[[], object]]] = [
        (n, functools.partial(importlib.import_module, n)) for n in COMPILER
    ]
    steps += [("the ISA probe", probe_isa), ("the pattern tables", trace_patterns)]
    failed = []
    for name, step in steps:
        try:
            step()
        except Exception as e:  # an optimisation only: the ranks redo the step, and a real failure shows there
            failed.append(f"{name}: {type(e).__name__}: {e}")
    return failed


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(pickle.dumps(("exit", pid, os.waitstatus_to_exitcode(status))))


def _child(
    sock: socket.socket, wake: tuple[int, int], fds: list[int], job: str, rank: int, volatile: dict[str, str | None]
) -> None:
    code = 1
    try:
        for k, v in volatile.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            os.setpgid(0, 0)
        except OSError:
            pass
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sock.close()
        for fd in wake:
            os.close(fd)
        log_fd, pipe_fd = fds
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        _name(f"{RANK_NAME}{rank}")
        argv = [job, str(rank), str(pipe_fd)]
        sys.argv = [rank_module.__file__, *argv]
        code = rank_module.main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:
                pass
        os._exit(code)


def _name(name: str) -> None:
    try:
        ctypes.CDLL("libc.so.6").prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> int:
    # not tied to its caller by PR_SET_PDEATHSIG, which follows the thread that started it: a caller's
    # thread that ends would take the server, and the ranks of the caller's other threads, with it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[0]))
    try:
        _serve(sock)
    except (BrokenPipeError, ConnectionResetError):  # the caller went away mid-reply
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
