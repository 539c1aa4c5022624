"""The Ray cluster the ranks run on: joining it (or starting a local one), what its nodes offer, and
whether one candidate's ranks fit it.

A study measures its candidates one at a time, each on ``ranks`` one-CPU (or one-GPU) actors per backend.
``plan`` decides before the first trial what the cluster can do: refuse at once a cluster that cannot hold
one candidate (naming what is needed and what is there, rather than waiting minutes for a placement that
never comes), leave out a backend that needs every rank on one node (shm) where no node can hold them,
and let the backends take turns where the cluster holds one backend's ranks but not all of them at once.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coconet.codegen.backends import BACKENDS
from coconet.codegen.backends import get as backend_of
from coconet.errors import ClusterError, CoconetError

ONE_NODE = frozenset(b for b in BACKENDS if backend_of(b).one_node)  # backends whose ranks share memory
PLACEMENTS = ("pack", "spread")
PROBE_S = 30.0
_CONNECTING = threading.Lock()  # the service's job threads may all ask at once; ray.init may run once


@dataclass(frozen=True)
class Node:
    id: str
    address: str
    cpus: float
    gpus: float


@dataclass(frozen=True)
class Offer:
    """What the cluster's live nodes hold, as Ray counts it."""

    nodes: tuple[Node, ...]

    @property
    def cpus(self) -> float:
        return sum(n.cpus for n in self.nodes)

    @property
    def gpus(self) -> float:
        return sum(n.gpus for n in self.nodes)

    def text(self) -> str:
        per = ", ".join(f"{n.cpus:g} CPU" + (f" {n.gpus:g} GPU" if n.gpus else "") for n in self.nodes)
        return f"{len(self.nodes)} node{'s' if len(self.nodes) != 1 else ''} ({per or 'nothing'})"


@dataclass(frozen=True)
class Need:
    """One candidate's ranks: ``ranks`` actors of one CPU, and one GPU each when ``gpu``."""

    ranks: int
    gpu: bool = False

    def text(self) -> str:
        return f"{self.ranks} rank{'s' if self.ranks != 1 else ''} of 1 CPU" + (" and 1 GPU" if self.gpu else "")


@dataclass(frozen=True)
class Plan:
    backends: tuple[str, ...]
    shared: bool  # every backend's ranks held at once; else the backends take turns, one group at a time
    left_out: dict[str, str] = field(default_factory=dict)  # backend -> why it cannot run on this cluster


def offer() -> Offer:
    """The live nodes of the cluster this process is connected to."""
    import ray

    nodes = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = n.get("Resources", {})
        nodes.append(Node(n["NodeID"], n.get("NodeManagerAddress", "?"), res.get("CPU", 0.0), res.get("GPU", 0.0)))
    return Offer(tuple(nodes))


def plan(
    need: Need, backends: tuple[str, ...], cluster: Offer, *, asked: bool = False, placement: str = "pack"
) -> Plan:
    """What of ``backends`` this cluster runs, and whether they hold their ranks at once. Refused when not one
    candidate fits, or when backends the user ``asked`` for cannot run here."""
    unit = "GPU" if need.gpu else "CPU"
    total = cluster.gpus if need.gpu else cluster.cpus
    if total < need.ranks or (need.gpu and cluster.cpus < need.ranks):
        raise ClusterError(
            f"the Ray cluster cannot hold one candidate: it needs {need.text()}, and offers "
            f"{cluster.text()}; add nodes or lower --world"
        )
    widest = max((n.gpus if need.gpu else n.cpus for n in cluster.nodes), default=0.0)
    left_out = {}
    for b in backends:
        if b not in ONE_NODE:
            continue
        if placement != "pack":
            left_out[b] = "its ranks share memory, and --placement spread puts them on several nodes"
        elif widest < need.ranks:
            left_out[b] = (
                f"its ranks share memory on one node, and no node holds {need.ranks} {unit}s "
                f"(the largest has {widest:g})"
            )
    if asked and left_out:
        raise ClusterError("; ".join(f"backend {b} cannot run here: {why}" for b, why in left_out.items()))
    kept = tuple(b for b in backends if b not in left_out)
    if not kept:
        raise ClusterError(
            "no backend can run on this cluster: " + "; ".join(f"{b}: {why}" for b, why in left_out.items())
        )
    return Plan(kept, shared=total >= need.ranks * len(kept), left_out=left_out)


def connect(address: str | None = None, *, ranks: int = 1) -> None:
    """Join the Ray cluster at ``address``, or start a local one with room for ``ranks`` one-CPU
    actors (more than this machine's cores if need be: ranks may share a core, slower but correct)."""
    import ray

    with _CONNECTING:
        if ray.is_initialized():
            return
        if address:
            require_listening(address)
            _use_token_if_any()
            _probe(address)
            try:
                ray.init(address=address, logging_level="ERROR", log_to_driver=False)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise CoconetError(
                    f"--ray-address {address}: could not join the Ray cluster: {_first_line(str(e))}"
                ) from None
        elif threading.current_thread() is threading.main_thread():
            _start_local(ranks)
        else:
            _start_in_own_thread(ranks)


def require_listening(address: str, timeout_s: float = 10.0) -> None:
    """A ``host:port`` that no one listens on is refused here: ray.init retries it for minutes, saying only
    'Failed to connect to GCS'. Other forms (``auto``, ``ray://…``) are Ray's to read."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise CoconetError(
            f"--ray-address {address}: no Ray cluster answers there "
            f"({e.strerror or type(e).__name__}); start one with `ray start --head`"
        ) from None


def auth_token_path() -> Path:
    """Where ``ray start`` (Ray 2.59 on) writes the token of a cluster with token authentication."""
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def _use_token_if_any() -> None:
    # A head started by `ray start` asks for its token (Ray's default since 2.59), and a driver without
    # RAY_AUTH_MODE=token never sends one, whatever it holds: it retries for 20 s, then fails. With a token at
    # hand and no mode chosen, the driver speaks token; a cluster without authentication takes that as well.
    if os.environ.get("RAY_AUTH_MODE"):
        return
    if os.environ.get("RAY_AUTH_TOKEN") or auth_token_path().is_file():
        os.environ["RAY_AUTH_MODE"] = "token"
        try:  # Ray read its config when imported: it reads it again, as its own token setup does
            from ray._raylet import Config
        except ImportError:
            return
        Config.initialize("")


_PROBE = """
import sys
from ray._raylet import GcsClient
try:
    GcsClient(address=sys.argv[1]).internal_kv_get(b"coconet-probe", namespace=None, timeout=float(sys.argv[2]))
except Exception as e:
    print(f"{type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(3)
"""


def _probe(address: str, timeout_s: float = PROBE_S) -> None:
    """One request to the cluster's GCS in a process of its own: a refusal (a token missing or wrong, another
    Ray version) comes back at once as one line, where ray.init retries for 20 s over lines of Ray's logs."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE, address, str(timeout_s / 2)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise CoconetError(f"--ray-address {address}: the Ray cluster did not answer within {timeout_s:g} s") from None
    if proc.returncode == 0:
        return
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else f"exit code {proc.returncode}"
    if "AuthenticationError" in last or "InvalidAuthToken" in last:
        raise CoconetError(
            f"--ray-address {address}: the Ray cluster asks for its token and "
            + ("refused this one" if os.environ.get("RAY_AUTH_MODE") == "token" else "none was given")
            + f": copy it from the head (`ray get-auth-token` there) into {auth_token_path()} or "
            "$RAY_AUTH_TOKEN (RAY_AUTH_MODE=token is then set for you)"
        )
    raise CoconetError(f"--ray-address {address}: could not join the Ray cluster: {_first_line(last)}")


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else "no reason given"


def _start_local(ranks: int) -> None:
    import ray

    # address="local": a new cluster of this process's own, never one a `ray start` on this machine left
    # running (or left named in Ray's temp dir after it died)
    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, ranks),
        include_dashboard=False,
        logging_level="ERROR",
        log_to_driver=False,
    )


def _start_in_own_thread(ranks: int) -> None:
    """Ray's local processes die with the thread that started them (PR_SET_PDEATHSIG follows the thread, not
    the process): started by a job's thread, the cluster went down when that thread ended, and at the
    service's exit Ray's agents, left without their raylet, stayed on. A thread of its own starts it and lives
    as long as the process, so the cluster ends with ``ray.shutdown`` at exit, as it does started from main."""
    started = threading.Event()
    failed: list[BaseException] = []

    def own() -> None:
        try:
            _start_local(ranks)
        except BaseException as e:  # handed to the caller, raised there
            failed.append(e)
        finally:
            started.set()
        if not failed:
            threading.Event().wait()  # never set: this thread must not end while the process runs

    threading.Thread(target=own, name="coconet-ray", daemon=True).start()
    started.wait()
    if failed:
        raise failed[0]


def describe(nodes: Any) -> str:
    """A placement in words: how many ranks on how many nodes."""
    ids = list(nodes)
    k = len(set(ids))
    return f"{len(ids)} rank{'s' if len(ids) != 1 else ''} on {k} node{'s' if k != 1 else ''}"
