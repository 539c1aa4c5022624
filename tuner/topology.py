"""Topologies: the machine a cost-model prediction is for, as figures an α-β model needs.

A topology is ``nodes × ranks_per_node`` ranks joined by two kinds of link (inside a node, between
nodes), each an α (seconds per message step) and a bandwidth (GB/s that one step of a ring gets),
plus what one rank can do on its own: stream memory, multiply matrices, launch a kernel. Which
algorithm a backend runs for each collective (ring, tree, direct) is part of the topology because
it is a property of the library on that machine, not of the program.

A topology may also carry ``measured`` fits: ``T(n) = α + β·n`` of a collective on a backend at this
topology's world, as ``coconet calibrate`` measures them on the local machine. Where a fit exists the
model uses it instead of composing the links, so that gloo's loopback collectives cost what they were
seen to cost.

Figures live in YAML files: the published machines shipped in ``configs/topologies/*.yaml`` (each number
with its source in a comment), and the user's own under ``<data dir>/topologies`` (``coconet.paths``), where
``coconet calibrate`` writes ``local``, this machine. ``load_topology`` reads one by name (the user's first)
or path, validating every field with an error that names it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import yaml

from coconet.codegen.backends import REGISTRY, Registry
from coconet.codegen.backends import get as backend_of
from coconet.errors import TopologyError
from coconet.paths import data_dir
from coconet.tuner.topology_file import LinkFile, TopologyFile, validate

DEVICES = ("cpu", "cuda")
BACKENDS = REGISTRY.names  # what a file may list (coconet.codegen.backends)
# The collectives the model prices, and the algorithms each may run as (see coconet.tuner.cost).
ALGORITHMS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "allreduce": ("ring", "tree", "direct"),
        "reduce_scatter": ("ring", "direct", "allreduce"),
        "all_gather": ("ring", "direct"),
        "broadcast": ("ring", "tree", "direct"),
        "send": ("direct",),
    }
)
LOCAL = "local"  # this machine, as `coconet calibrate` measured it here


@dataclass(frozen=True)
class Link:
    """One step over a link: ``alpha_s`` of latency, then bytes at ``bandwidth_GBps`` (1 GB = 1e9 B)."""

    alpha_s: float
    bandwidth_GBps: float
    kind: str = ""

    @property
    def beta(self) -> float:
        """Seconds per byte."""
        return 1.0 / (self.bandwidth_GBps * 1e9)


@dataclass(frozen=True)
class Fit:
    """A measured collective: ``alpha_s + beta_s_per_byte · n`` for a buffer of n bytes (the whole
    buffer: an allreduce's tensor, a reduce_scatter's input, an all_gather's output)."""

    alpha_s: float
    beta_s_per_byte: float

    def time(self, nbytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes


@dataclass(frozen=True)
class Topology:
    name: str
    device: str
    nodes: int
    ranks_per_node: int
    intra: Link
    inter: Link | None
    # per rank, while every rank of the node streams at once: an in-place read-modify-write's bytes/s
    memory_bandwidth_GBps: float
    # per rank: dense matmul FLOP/s by dtype (float32 at least)
    matmul_TFLOPS: Mapping[str, float]
    backends: tuple[str, ...]
    # per kernel or eager op: what a launch (CUDA) or a dispatch (CPU) costs before any byte moves
    launch_s: float = 5e-6
    # per call of a compiled (fused) kernel, where it differs: Inductor's guards on CPU; None: launch_s
    compiled_launch_s: float | None = None
    # per rank: elementwise operations per second of a fused kernel when it is compute-bound (dropout's
    # Philox rounds); None: never compute-bound
    elementwise_Gops: float | None = None
    # the same for one eager torch op (dropout's Philox rounds run unfused as int64 ops); None: never
    eager_elementwise_Gops: float | None = None
    # the cache a rank has to itself (bytes: the working set of an op's three streams that still runs
    # fast) and its bandwidth: a temporary of at most a third of it streams from there
    cache_bytes: int = 0
    cache_bandwidth_GBps: float | None = None
    # what a freshly allocated buffer costs per byte over a reused one, by its size: (bytes, s/byte)
    # points, log-linear between them, nothing below the first, the last beyond it. On CPU a large
    # block is new pages the writing kernel faults in (glibc hands large freed blocks back to the OS);
    # empty for a caching allocator (CUDA), where a fresh buffer is a reused one.
    fresh_cost: tuple[tuple[int, float], ...] = ()
    # fraction of the shorter of computation and communication that overlapping hides: 1 where the
    # network moves bytes without the compute units (DMA, NVLink copy engines), less where the same
    # cores do both (gloo over loopback)
    overlap: float = 1.0
    # the same while the computation is memory-bound; None: as ``overlap``. Below it where moving bytes
    # over the link takes the memory bandwidth the computation streams with (gloo over loopback)
    overlap_memory: float | None = None
    # shared-memory collectives (the shm backend): α of one barrier; their bytes move at memory bandwidth
    shm_barrier_s: float = 2e-6
    algorithms: Mapping[str, Mapping[str, tuple[str, ...]]] = field(default_factory=dict)
    measured: Mapping[str, Mapping[str, Fit]] = field(default_factory=dict)
    fingerprint: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""

    def __post_init__(self) -> None:
        # read-only views: a topology is a value, shared by every prediction made with it
        for name in ("matmul_TFLOPS", "fingerprint"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        object.__setattr__(
            self,
            "algorithms",
            MappingProxyType(
                {b: MappingProxyType({op: tuple(a) for op, a in ops.items()}) for b, ops in self.algorithms.items()}
            ),
        )
        object.__setattr__(
            self, "measured", MappingProxyType({b: MappingProxyType(dict(ops)) for b, ops in self.measured.items()})
        )
        object.__setattr__(self, "backends", tuple(self.backends))
        object.__setattr__(self, "fresh_cost", tuple((int(n), float(c)) for n, c in self.fresh_cost))

    def __hash__(self) -> int:
        return hash(self.digest)

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def fused_launch_s(self) -> float:
        return self.launch_s if self.compiled_launch_s is None else self.compiled_launch_s

    @property
    def memory_beta(self) -> float:
        return 1.0 / (self.memory_bandwidth_GBps * 1e9)

    def flops(self, dtype: str) -> float:
        """Matmul FLOP/s of one rank in ``dtype`` (float32's figure where the dtype has none)."""
        tf = self.matmul_TFLOPS.get(dtype) or self.matmul_TFLOPS["float32"]
        return tf * 1e12

    def algorithms_for(self, backend: str, op: str) -> tuple[str, ...]:
        """What ``backend`` runs ``op`` as on this topology: as its file says, else as the backend does."""
        got = self.algorithms.get(backend, {}).get(op)
        return got if got else backend_of(backend).algorithms[op]

    def shared_by(self, k: float) -> "Topology":
        """This topology with every rate measured per rank divided among ``k`` times as many ranks, which share
        its nodes' memory and cores: what more ranks than it places get each."""
        if k == 1:
            return self
        return dataclasses.replace(
            self,
            memory_bandwidth_GBps=self.memory_bandwidth_GBps / k,
            matmul_TFLOPS={d: tf / k for d, tf in self.matmul_TFLOPS.items()},
            launch_s=self.launch_s * k,
            compiled_launch_s=None if self.compiled_launch_s is None else self.compiled_launch_s * k,
            elementwise_Gops=self.elementwise_Gops and self.elementwise_Gops / k,
            eager_elementwise_Gops=self.eager_elementwise_Gops and self.eager_elementwise_Gops / k,
            cache_bandwidth_GBps=self.cache_bandwidth_GBps and self.cache_bandwidth_GBps / k,
            fresh_cost=tuple((n, c * k) for n, c in self.fresh_cost),
        )

    def fresh_s_per_byte(self, nbytes: float) -> float:
        pts = self.fresh_cost
        if not pts or nbytes < pts[0][0]:
            return 0.0
        if nbytes >= pts[-1][0]:
            return pts[-1][1]
        for (n0, c0), (n1, c1) in zip(pts, pts[1:]):
            if nbytes < n1:
                return c0 + (c1 - c0) * math.log2(nbytes / n0) / math.log2(n1 / n0)
        return pts[-1][1]

    def fit(self, backend: str, op: str) -> Fit | None:
        return self.measured.get(backend, {}).get(op)

    def check_backend(self, backend: str) -> None:
        if backend not in self.backends:
            raise TopologyError(
                f"topology {self.name} does not run backend {backend!r} (it allows {', '.join(self.backends)})",
                field="backends",
            )

    @cached_property
    def digest(self) -> str:
        """A hash of every figure: two topologies with one name but other numbers differ here."""
        text = json.dumps(to_dict(self), sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_yaml(self) -> str:
        return yaml.safe_dump(to_dict(self), sort_keys=False, default_flow_style=None, width=100)


# --- (de)serialisation ---


def to_dict(t: Topology) -> dict[str, Any]:
    def link(x: Link | None) -> dict | None:
        if x is None:
            return None
        return {"kind": x.kind, "alpha_s": x.alpha_s, "bandwidth_GBps": x.bandwidth_GBps}

    out: dict[str, Any] = {
        "name": t.name,
        "description": t.description,
        "device": t.device,
        "nodes": t.nodes,
        "ranks_per_node": t.ranks_per_node,
        "backends": list(t.backends),
        "links": {"intra": link(t.intra), "inter": link(t.inter)},
        "memory_bandwidth_GBps": t.memory_bandwidth_GBps,
        "matmul_TFLOPS": dict(t.matmul_TFLOPS),
        "launch_s": t.launch_s,
        "compiled_launch_s": t.compiled_launch_s,
        "elementwise_Gops": t.elementwise_Gops,
        "eager_elementwise_Gops": t.eager_elementwise_Gops,
        "cache_bytes": t.cache_bytes,
        "cache_bandwidth_GBps": t.cache_bandwidth_GBps,
        "fresh_cost": [[n, c] for n, c in t.fresh_cost],
        "overlap": t.overlap,
        "overlap_memory": t.overlap_memory,
        "shm_barrier_s": t.shm_barrier_s,
        "algorithms": {b: {op: list(a) for op, a in ops.items()} for b, ops in t.algorithms.items()},
        "measured": {
            b: {op: {"alpha_s": f.alpha_s, "beta_s_per_byte": f.beta_s_per_byte} for op, f in ops.items()}
            for b, ops in t.measured.items()
        },
        "fingerprint": {k: str(v) if isinstance(v, str) else v for k, v in t.fingerprint.items()},
    }
    if t.inter is None:
        del out["links"]["inter"]
    return out


def _fail(source: str, path: str, message: str) -> TopologyError:
    return TopologyError(f"topology {source}: {path}: {message}", field=path)


def _link(f: LinkFile, path: str, source: str) -> Link:
    if (f.bandwidth_GBps is None) == (f.beta_s_per_byte is None):
        raise _fail(source, f"{path}.bandwidth_GBps", "give exactly one of bandwidth_GBps and beta_s_per_byte")
    bw = f.bandwidth_GBps if f.bandwidth_GBps is not None else 1.0 / (float(f.beta_s_per_byte or 0) * 1e9)
    return Link(f.alpha_s, bw, f.kind)


def _check(f: TopologyFile, source: str, registry: Registry) -> None:
    """What no one field says alone: which backends run where, the links a node count needs, float32's
    figure, sizes that increase, the algorithms each collective may run and the fingerprint's values."""
    _check_backends(f, source, registry)
    if f.nodes > 1 and f.links.inter is None:
        raise _fail(source, "links.inter", "is required when nodes > 1")
    if "float32" not in f.matmul_TFLOPS:
        raise _fail(source, "matmul_TFLOPS.float32", "is required")
    for i in range(1, len(f.fresh_cost)):
        if f.fresh_cost[i][0] <= f.fresh_cost[i - 1][0]:
            raise _fail(source, f"fresh_cost[{i}]", "sizes must increase")
    for b, ops in f.algorithms.items():
        for op, algs in ops.items():
            algs = [algs] if isinstance(algs, str) else algs
            if not algs or any(a not in ALGORITHMS[op] for a in algs):
                allowed = ", ".join(ALGORITHMS[op])
                raise _fail(source, f"algorithms.{b}.{op}", f"must be a list of {allowed}, got {algs!r}")
    for k, v in f.fingerprint.items():
        if not isinstance(v, (str, int, float, bool)) and v is not None:
            raise _fail(source, f"fingerprint.{k}", f"must be a string or a number, got {type(v).__name__}")


def _check_backends(f: TopologyFile, source: str, registry: Registry) -> None:
    """Every backend named is one of ``registry``'s, and runs on this topology's device and node count."""
    named = [(f"backends[{i}]", b) for i, b in enumerate(f.backends)]
    named += [(f"{part}.{b}", b) for part in ("algorithms", "measured") for b in getattr(f, part)]
    for path, name in named:
        if name not in registry.names:
            *most, last = [repr(n) for n in registry.names]
            known = f"{', '.join(most)} or {last}" if most else last
            raise _fail(source, path, f"must be {known}, got {name!r}")
    for name in f.backends:
        b = registry.get(name)
        if b.one_node and f.nodes != 1:
            raise _fail(source, "backends", f"{name} runs within one node only (nodes must be 1)")
    wrong = [name for name in f.backends if registry.get(name).device_type != f.device]
    if wrong:
        on = registry.get(wrong[0]).device_type
        verb = "runs" if len(wrong) == 1 else "run"
        raise _fail(source, "backends", f"{' and '.join(wrong)} {verb} on {on} tensors (device {on}), not {f.device}")


def from_dict(data: Any, source: str = "<dict>", registry: Registry = REGISTRY) -> Topology:
    """A topology from a parsed YAML document, every field validated (``TopologyFile``), its backends
    ``registry``'s; an error names the field's path and the file."""
    f = validate(data, source)
    _check(f, source, registry)
    return Topology(
        name=f.name,
        device=f.device,
        nodes=f.nodes,
        ranks_per_node=f.ranks_per_node,
        intra=_link(f.links.intra, "links.intra", source),
        inter=_link(f.links.inter, "links.inter", source) if f.links.inter is not None else None,
        memory_bandwidth_GBps=f.memory_bandwidth_GBps,
        matmul_TFLOPS=f.matmul_TFLOPS,
        backends=tuple(f.backends),
        launch_s=f.launch_s,
        compiled_launch_s=f.compiled_launch_s,
        elementwise_Gops=f.elementwise_Gops,
        eager_elementwise_Gops=f.eager_elementwise_Gops,
        cache_bytes=f.cache_bytes,
        cache_bandwidth_GBps=f.cache_bandwidth_GBps,
        fresh_cost=tuple(f.fresh_cost),
        overlap=f.overlap,
        overlap_memory=f.overlap_memory,
        shm_barrier_s=f.shm_barrier_s,
        algorithms={
            b: {op: (a,) if isinstance(a, str) else tuple(a) for op, a in ops.items()}
            for b, ops in f.algorithms.items()
        },
        measured={
            b: {op: Fit(fit.alpha_s, fit.beta_s_per_byte) for op, fit in ops.items()} for b, ops in f.measured.items()
        },
        fingerprint=f.fingerprint,
        description=f.description,
    )


def from_yaml(text: str, source: str = "<yaml>") -> Topology:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise TopologyError(f"topology {source}: not valid YAML: {' '.join(str(e).split())}", field=None) from None
    return from_dict(data, source)


# --- where topologies live ---


def user_dir() -> Path:
    """Where the topologies measured on the user's machines live: ``<data dir>/topologies``
    (``coconet.paths.data_dir``: ``$COCONET_DATA_DIR``, else the platform's user data dir)."""
    return data_dir() / "topologies"


def package_dir() -> Path:
    """The published machines shipped with coconet (read only: nothing is written there)."""
    return Path(str(resources.files("coconet.configs"))) / "topologies"


def _search_dirs(name: str | None = None) -> list[Path]:
    # the user's first; `local` is this machine, which only a calibration here describes, never a shipped file
    return [user_dir()] if name == LOCAL else [user_dir(), package_dir()]


def list_topologies() -> list[str]:
    names: set[str] = set()
    for d in _search_dirs():
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.yaml") if d == user_dir() or p.stem != LOCAL)
    return sorted(names)


def topology_path(name: str) -> Path | None:
    for d in _search_dirs(name):
        p = d / f"{name}.yaml"
        if p.is_file():
            return p
    return None


def load_topology(name_or_path: str | os.PathLike) -> Topology:
    """A topology by name (``dgx-h100-8``: the user's data dir, then the shipped ones) or by path. ``local`` is
    read as calibrated; ``coconet.tuner.calibrate.local_topology`` calibrates it where it is missing or stale."""
    text = str(name_or_path)
    path = Path(text)
    if text.endswith((".yaml", ".yml")) or os.sep in text or path.is_file():
        if not path.is_file():
            raise TopologyError(f"no topology file {text}", field=None)
        return from_yaml(path.read_text(), str(path))
    found = topology_path(text)
    if found is None:
        known = ", ".join(list_topologies()) or "none"
        hint = "; `coconet calibrate` measures this machine as `local`" if text == LOCAL else ""
        raise TopologyError(f"no topology named {text!r} (known: {known}){hint}", field=None)
    return from_yaml(found.read_text(), found.name)


def save_topology(topology: Topology, path: str | os.PathLike, header: str = "") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = topology.to_yaml()
    path.write_text((header.rstrip("\n") + "\n" if header else "") + body)
    return path
