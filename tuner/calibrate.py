"""``coconet calibrate``: the figures of the ``local`` topology, measured on this machine and written with its
fingerprint into the user's data dir (``default_output``); ``local_topology`` runs it on first use, and again
when the machine's fingerprint is no longer the one it was calibrated on.

The parent starts R rank processes (``python -m coconet.tuner.calibrate_rank JOB RANK FD``: fresh
interpreters, in their own session, dying with the parent) joined by a gloo group on a free loopback
port, each with the torch threads a ``coconet run`` rank gets. Together they time:

- gloo allreduce, reduce_scatter and all_gather from 2^8 to 2^24 bytes: each sample is the slowest
  rank's time after a barrier, as ``coconet run`` times a step; α and β are fitted by least squares on
  the medians, relative to each median so that small sizes weigh as much as large ones;
- the same collectives of the shm backend (the helpers of ``coconet.kernels.shm``) and one shm barrier;
- memory bandwidth: an in-place ``a.add_(b)`` (three streams), every rank at once, the best of several,
  from tensors that fit the cache to 256 MiB ones: DRAM's rate, the cache's rate and where it ends;
- what a fresh buffer costs over a reused one, by size (page faults), an eager op's dispatch, a
  compiled kernel's call, dropout's Philox rounds as eager int64 ops and compiled, float32 matmul;
- overlap: a matmul in chunks with each chunk's allreduce in flight while the next multiplies, against
  the matmul and then its allreduce (what an overlapped schedule saves); an allreduce in flight while
  the rank streams memory, against each alone.

The shm collectives are measured and reported, but the model prices them from the bytes their helpers
copy, at memory bandwidth, plus barriers (``coconet.tuner.cost.shm_collective``), so that the shm
backend can be predicted where nothing was measured; the report puts the two side by side.
"""

from __future__ import annotations

import datetime
import os
import pickle
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

try:
    import fcntl
except ImportError:  # not on Windows
    fcntl = None  # type: ignore[assignment]

from coconet.codegen.backends import get as backend_of
from coconet.errors import CoconetError
from coconet.tuner.cost import shm_collective
from coconet.tuner.fingerprint import detect_local
from coconet.tuner.topology import LOCAL, Fit, Link, Topology, load_topology, save_topology, user_dir

OPS = ("allreduce", "reduce_scatter", "all_gather")
STARTUP_S = 60.0
HEADER = (
    "# Written by `coconet calibrate`: figures measured on this machine (see coconet.tuner.calibrate for how "
    "each is taken)."
)


@dataclass(frozen=True)
class Settings:
    world: int = 2
    min_log2: int = 8
    max_log2: int = 24
    repeats: int = 10
    memory_bytes: int = 2**28  # per tensor of the bandwidth kernel
    compiled: bool = True  # time a compiled kernel's call (compiles one on first use)
    timeout_s: float = 600.0


# What a first use of `local` runs: the whole calibration. On a 2-core machine it takes about a minute, of which
# the collectives' α-β are a few seconds; what a shorter run leaves out (the largest collectives, samples,
# 256 MiB memory streams) moved gloo's β and the memory bandwidth beyond the full run's own spread
# (benchmarks/first_calibration.py), and the rest (compiling a kernel, the page-fault sweep) the model needs too
FIRST_USE = Settings()
FIRST_USE_S = 60.0  # about what it takes on a 2-core machine


@dataclass(frozen=True)
class Calibration:
    topology: Topology
    # bytes -> median seconds, per backend and collective, as measured
    samples: dict[str, dict[str, list[tuple[int, float]]]] = field(default_factory=dict)
    extras: dict[str, float] = field(default_factory=dict)
    # (bytes, figure) curves behind the cache and page-fault figures
    sweeps: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    seconds: float = 0.0


def fit_alpha_beta(points: Sequence[tuple[float, float]]) -> Fit:
    """α, β ≥ 0 minimising the squared error of ``α + β·n`` relative to each measured time. The loss
    is soft beyond 10%: on a shared machine one median in a sweep can be another process's doing."""
    from scipy.optimize import least_squares, nnls

    n = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    if len(points) == 1:
        return Fit(0.0, float(t[0] / n[0]))
    a = np.stack([1.0 / t, n / t], axis=1)
    (alpha, beta), _ = nnls(a, np.ones_like(t))  # the plain fit starts the robust one
    scale = np.array([max(alpha, 1e-9), max(beta, 1e-15)])
    got = least_squares(
        lambda x: a @ (x * scale) - 1.0, x0=np.ones(2), bounds=(0.0, np.inf), loss="soft_l1", f_scale=0.1
    )
    alpha, beta = got.x * scale
    return Fit(float(alpha), float(beta))


def default_output() -> Path:
    """``local.yaml`` in the user's data dir (``coconet.tuner.topology.user_dir``), where ``--topology local``
    reads it: never the installed package, which ships published machines only."""
    return user_dir() / f"{LOCAL}.yaml"


def calibrate(settings: Settings = Settings()) -> Calibration:
    if settings.world < 2:
        raise CoconetError("calibrate needs at least 2 ranks (--world 2 or more) to time collectives")
    if not 4 <= settings.min_log2 <= settings.max_log2 <= 30:
        raise CoconetError(f"sizes 2^{settings.min_log2}..2^{settings.max_log2} bytes: need 4 <= min <= max <= 30")
    started = time.monotonic()
    results = _launch(settings)
    return _build(settings, results, time.monotonic() - started)


def local_topology(settings: Settings = FIRST_USE, *, say: Callable[[str], None] | None = None) -> Topology:
    """The ``local`` topology of this machine: as calibrated before when its fingerprint is this machine's,
    else calibrated now and written to ``default_output``, saying so through ``say`` (stderr by default).
    A topology calibrated on other hardware (a moved data dir, a changed machine) is measured again rather than
    refused: ``local`` means this machine, and a calibration is the only fix. One process calibrates at a time
    (a lock beside the file); the others then read what it wrote."""
    here = detect_local()
    path = default_output()
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.with_suffix(".lock")):
        why = "no `local` topology has been calibrated in " + str(path.parent)
        if path.is_file():
            topo = load_topology(path)
            if topo.fingerprint.get("hardware_hash") == here.digest:
                return topo
            why = (
                f"the `local` topology in {path} was calibrated on "
                f"{topo.fingerprint.get('hardware') or 'a machine of no recorded fingerprint'}, "
                f"and this machine is {here.text()}"
            )
        (say or _stderr)(
            f"{why}: calibrating it now (about {FIRST_USE_S:g} s on 2 cores, once; `coconet "
            f"calibrate` does it again at will)"
        )
        topo = calibrate(settings).topology
        save_topology(topo, path, header=HEADER)
        return topo


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        if fcntl is None:  # no advisory locks (Windows): calibrations in parallel only cost time
            yield
            return
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _stderr(text: str) -> None:
    print(f"coconet: {text}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(settings: Settings) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="coconet-calibrate-"))
    job = workdir / "job.pkl"
    threads = max(1, (os.cpu_count() or 1) // settings.world)
    with open(job, "wb") as f:
        pickle.dump({"settings": settings, "port": _free_port(), "threads": threads, "path": list(sys.path)}, f)
    procs: list[subprocess.Popen] = []
    conns: dict[Connection, int] = {}
    try:
        for r in range(settings.world):
            rfd, wfd = os.pipe()
            log = open(workdir / f"rank{r}.log", "wb")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "coconet.tuner.calibrate_rank", str(job), str(r), str(wfd)],
                    pass_fds=(wfd,),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            os.close(wfd)
            log.close()
            conns[Connection(rfd, writable=False)] = r
        deadline = time.monotonic() + settings.timeout_s + STARTUP_S
        while conns:
            ready = wait(list(conns), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise CoconetError(f"calibration did not finish within {settings.timeout_s:g} s")
            for conn in ready:
                rank = conns[conn]
                try:
                    kind, data = conn.recv()
                except (EOFError, OSError):
                    del conns[conn]
                    code = procs[rank].wait(timeout=10)
                    if code != 0:
                        tail = (workdir / f"rank{rank}.log").read_text(errors="replace").strip().splitlines()[-3:]
                        raise CoconetError(
                            f"calibration rank {rank} died (exit code {code})"
                            + (f": {' | '.join(tail)}" if tail else "")
                        ) from None
                    continue
                if kind == "error":
                    raise CoconetError(f"calibration rank {rank}: {data}")
                if kind == "result":
                    return data
        raise CoconetError("calibration ranks exited without a result")
    finally:
        for p in procs:  # each rank leads its own session: this stops it and anything it started
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
        for c in conns:
            c.close()

        shutil.rmtree(workdir, ignore_errors=True)


def _build(settings: Settings, res: dict[str, Any], seconds: float) -> Calibration:
    R = settings.world
    samples = res["collectives"]
    fits = {b: {op: fit_alpha_beta(points) for op, points in ops.items()} for b, ops in samples.items()}
    ar = fits["gloo"]["allreduce"]
    # the loopback link as a ring sees it: T = 2(R-1)·α + 2(R-1)/R·n·β
    alpha = ar.alpha_s / (2 * (R - 1))
    beta = ar.beta_s_per_byte * R / (2 * (R - 1))
    link = Link(alpha, 1.0 / (max(beta, 1e-15) * 1e9), "loopback")
    machines = detect_local()
    node = machines.nodes[0]
    fingerprint = {
        "hardware": machines.text(),
        "hardware_hash": machines.digest,
        "cpu": node.cpu,
        "cpus": node.cpus,
        "memory_gib": node.memory_gib,
        "machine": node.machine,
        **({"gpu": node.gpus[0], "gpus": len(node.gpus)} if node.gpus else {}),
        "system": platform.platform(terse=True),
        "python": platform.python_version(),
        "torch": res["torch"],
        "ranks": R,
        "threads_per_rank": res["threads"],
        "calibrated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "calibration_s": round(seconds, 1),
    }
    mem = res["memory_bandwidth"]
    cache_bytes = res["cache_bytes"]
    extras_sweeps = {"memory_sweep": res["memory_sweep"], "alloc_sweep": res["alloc_sweep"]}
    topo = Topology(
        name="local",
        description=f"this machine: {R} ranks over gloo loopback and shared memory, measured by coconet calibrate",
        device="cpu",
        nodes=1,
        ranks_per_node=R,
        intra=link,
        inter=None,
        memory_bandwidth_GBps=mem / 1e9,
        matmul_TFLOPS={"float32": res["matmul_flops"] / 1e12},
        # the two transports a calibration measures, each in its own way (calibrate_rank): gloo's collectives
        # over loopback, fitted α-β, and shm's in shared memory, priced as memory traffic and barriers
        backends=("gloo", "shm"),
        launch_s=res["launch_s"],
        compiled_launch_s=res.get("compiled_launch_s"),
        elementwise_Gops=res["elementwise_ops"] / 1e9,
        cache_bytes=cache_bytes,
        cache_bandwidth_GBps=res["cache_bandwidth"] / 1e9 if cache_bytes else None,
        fresh_cost=tuple(res["alloc_sweep"]),
        eager_elementwise_Gops=res["eager_ops"] / 1e9,
        overlap=res["overlap"],
        overlap_memory=res["overlap_memory"],
        shm_barrier_s=res["shm_barrier_s"],
        algorithms={"gloo": backend_of("gloo").algorithms},  # written out: the file says what the fits ran as
        measured={"gloo": fits["gloo"]},
        fingerprint=fingerprint,
    )
    extras = {f"shm_{op}_alpha_s": f.alpha_s for op, f in fits["shm"].items()}
    extras |= {f"shm_{op}_GBps": 1e-9 / f.beta_s_per_byte for op, f in fits["shm"].items() if f.beta_s_per_byte}
    for op, points in samples["shm"].items():  # the largest size: measured, and as the model prices it
        n, measured = points[-1]
        moved, fresh, barriers = shm_collective(op, n, R)
        extras[f"shm_{op}_bytes"] = n
        extras[f"shm_{op}_measured_s"] = measured
        extras[f"shm_{op}_model_s"] = (
            moved * topo.memory_beta
            + fresh * topo.fresh_s_per_byte(fresh)
            + barriers * topo.shm_barrier_s
            + topo.launch_s
        )
    return Calibration(topology=topo, samples=samples, extras=extras, sweeps=extras_sweeps, seconds=seconds)


# --- the rank processes ---
