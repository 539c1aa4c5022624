"""The machines that ran a measurement, as they were found rather than as a topology's name says they are.

A ``Fingerprint`` lists every node: its CPU model, logical CPUs, memory, architecture and GPUs (model per
device; none without one). ``detect_local`` reads this machine (``/proc``, ``nvidia-smi`` or torch; no Ray);
``detect_cluster`` runs the same reading as one small Ray task pinned to each live node. A fingerprint has a
stable text form (``1 node: AMD EPYC 7B13, 2 CPUs, 8 GiB, x86_64, no GPU``) and a short hash of its canonical
JSON, both recorded with every measurement (``versions``: ``fingerprint``, ``machines``).

``check_topology`` compares a topology's claims with the machines found: node count, then per node the CPU
model, CPU count, GPU model and GPU count where the topology declares them. GPU models are compared by
their model number (``H100-SXM5-80GB`` and ``NVIDIA H100 80GB HBM3`` are both an H100) and CPU models by
the words the topology gives (``AMD EPYC 7763`` is ``AMD EPYC 7763 64-Core Processor``), since a published
description names a part as its datasheet does and a driver as its vendor does.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from coconet.errors import ClusterError, TopologyError

GIB = 2**30
NVIDIA_SMI_S = 10.0


@dataclass(frozen=True, order=True)
class Node:
    """One machine: what it runs ranks with."""

    cpu: str
    cpus: int
    memory_gib: int  # rounded: a kernel update moves the exact figure by a few MiB
    machine: str = ""  # the architecture (x86_64, aarch64)
    gpus: tuple[str, ...] = ()  # the model of each visible GPU

    def text(self) -> str:
        gpus = Counter(self.gpus)
        gpu = ", ".join(f"{k} x {m}" for m, k in sorted(gpus.items())) if gpus else "no GPU"
        return f"{self.cpu}, {self.cpus} CPUs, {self.memory_gib} GiB, {self.machine or 'unknown arch'}, {gpu}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "cpu": self.cpu,
            "cpus": self.cpus,
            "memory_gib": self.memory_gib,
            "machine": self.machine,
            "gpus": list(self.gpus),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Node:
        try:
            return cls(
                str(d["cpu"]),
                int(d["cpus"]),
                int(d["memory_gib"]),
                str(d.get("machine", "")),
                tuple(str(g) for g in d.get("gpus", ())),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise TopologyError(
                f"a node's fingerprint needs cpu, cpus and memory_gib: {e}", field="fingerprint"
            ) from None


@dataclass(frozen=True)
class Fingerprint:
    """Every node that runs (or ran) ranks, in a canonical order: two readings of one cluster compare equal."""

    nodes: tuple[Node, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(sorted(self.nodes)))

    @property
    def node_count(self) -> int:
        return len(self.nodes)

    @property
    def gpus(self) -> int:
        return sum(len(n.gpus) for n in self.nodes)

    def text(self) -> str:
        """``2 nodes: 2 x (AMD EPYC 7B13, 2 CPUs, …)``; alike nodes counted once."""
        groups = Counter(n.text() for n in self.nodes)
        k = self.node_count
        head = f"{k} node{'s' if k != 1 else ''}"
        parts = [t if c == 1 else f"{c} x ({t})" for t, c in groups.items()]
        return f"{head}: {'; '.join(parts)}" if parts else f"{head}"

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": [n.to_dict() for n in self.nodes]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Fingerprint:
        nodes = d.get("nodes") if isinstance(d, Mapping) else None
        if not isinstance(nodes, list):
            raise TopologyError("a fingerprint is {nodes: [...]}", field="fingerprint")
        return cls(tuple(Node.from_dict(n) for n in nodes))

    @property
    def digest(self) -> str:
        """A short hash of the canonical JSON: the same machines give the same hash on every run."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def versions(self) -> dict[str, str]:
        """What a measurement's ``versions`` record of the machines it ran on."""
        return {"fingerprint": self.digest, "machines": self.text()}


# --- reading a machine ---


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def logical_cpus() -> int:
    """The CPUs this process may run on (a container's or a cpuset's, where the machine has more)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0


def gpu_models() -> tuple[str, ...]:
    """The model of each GPU in this machine: nvidia-smi's names (which start no CUDA context here), else
    torch's; none without either. Every GPU of the machine, whatever ``CUDA_VISIBLE_DEVICES`` hides from this
    process: Ray hides them from a task that asked for none, and the fingerprint is of the machine."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=NVIDIA_SMI_S
            )
            if out.returncode == 0:
                return tuple(ln.strip() for ln in out.stdout.splitlines() if ln.strip())
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        import torch
    except ImportError:
        return ()
    if not torch.cuda.is_available():
        return ()
    return tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))


def this_node() -> Node:
    return Node(
        cpu=cpu_model(),
        cpus=logical_cpus(),
        memory_gib=round(memory_bytes() / GIB),
        machine=platform.machine(),
        gpus=gpu_models(),
    )


def detect_local() -> Fingerprint:
    """This machine, read without Ray."""
    return Fingerprint((this_node(),))


def detect_cluster(timeout_s: float = 60.0) -> dict[str, Node]:
    """Every live node of the Ray cluster this process is connected to, by node id: one task pinned to each
    reads its machine as ``this_node`` does."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ids = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    task = ray.remote(num_cpus=0)(_read_node)
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(i, soft=False)).remote() for i in ids]
    try:
        found = ray.get(refs, timeout=timeout_s)
    except Exception as e:  # a node that died or never ran the task: no fingerprint can be claimed
        raise ClusterError(
            f"could not read the machines of the Ray cluster: {type(e).__name__}: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else 'no reason given'}"
        ) from None
    return {i: Node.from_dict(d) for i, d in zip(ids, found)}


def _read_node() -> dict[str, Any]:
    return this_node().to_dict()


def of_nodes(nodes: Mapping[str, Node], ids: Iterable[str] | None = None) -> Fingerprint:
    """The fingerprint of the nodes ``ids`` of a cluster read by ``detect_cluster`` (every node when None)."""
    chosen = list(dict.fromkeys(ids)) if ids is not None else list(nodes)
    return Fingerprint(tuple(nodes[i] for i in chosen if i in nodes))


# --- a topology's claims against the machines ---


def gpu_family(name: str) -> str:
    """A GPU's model number: the first word with a digit in it (``h100`` of ``NVIDIA H100 80GB HBM3``)."""
    for word in re.split(r"[^a-z0-9]+", name.lower()):
        if any(c.isdigit() for c in word):
            return word
    return name.lower().strip()


def _words(text: str) -> set[str]:
    return {w for w in re.split(r"[^a-z0-9]+", text.lower()) if w}


def claimed(topology: Any) -> str:
    """What a topology says its machines are, in the words ``Fingerprint.text`` uses."""
    fp = topology.fingerprint
    parts = [f"{topology.nodes} node{'s' if topology.nodes != 1 else ''}", f"device {topology.device}"]
    if fp.get("cpu"):
        parts.append(str(fp["cpu"]))
    if fp.get("cpus"):
        parts.append(f"{fp['cpus']} CPUs per node")
    if fp.get("gpu"):
        parts.append(f"{fp.get('gpus', '?')} x {fp['gpu']}")
    return f"topology {topology.name}: " + ", ".join(parts)


def mismatches(topology: Any, found: Fingerprint, *, per_node: bool = False) -> list[str]:
    """Where ``topology``'s claims and the machines ``found`` differ (empty: they agree). ``per_node``: the
    topology describes one machine, which every node found must be (its node count is not compared, and its
    GPU count is per node)."""
    fp, out = topology.fingerprint, []
    if topology.nodes != found.node_count and not per_node:
        out.append(f"{topology.nodes} nodes declared, {found.node_count} found")
    if fp.get("cpus") and any(n.cpus != int(fp["cpus"]) for n in found.nodes):
        out.append(f"{fp['cpus']} CPUs per node declared, {sorted({n.cpus for n in found.nodes})} found")
    if fp.get("cpu") and any(not _words(str(fp["cpu"])) <= _words(n.cpu) for n in found.nodes):
        out.append(f"CPU {fp['cpu']} declared, {sorted({n.cpu for n in found.nodes})} found")
    if topology.device == "cuda" and any(not n.gpus for n in found.nodes):
        out.append("GPUs declared (device cuda), a node without one found")
    if fp.get("gpu"):
        want = gpu_family(str(fp["gpu"]))
        other = sorted({g for n in found.nodes for g in n.gpus if gpu_family(g) != want})
        if other or not found.gpus:
            out.append(f"GPU {fp['gpu']} declared, {', '.join(other) or 'none'} found")
    if per_node and any(len(n.gpus) != int(fp.get("gpus", 0)) for n in found.nodes):
        out.append(f"{fp.get('gpus', 0)} GPUs per node declared, {sorted({len(n.gpus) for n in found.nodes})} found")
    elif not per_node and fp.get("gpus") and topology.device == "cuda" and int(fp["gpus"]) != found.gpus:
        out.append(f"{fp['gpus']} GPUs declared, {found.gpus} found")
    return out


def check_topology(topology: Any, found: Fingerprint, *, per_node: bool = False) -> None:
    """Refuse to measure under a topology's name on machines it does not describe, naming both (``per_node``:
    as ``mismatches``)."""
    wrong = mismatches(topology, found, per_node=per_node)
    if wrong:
        raise TopologyError(
            f"--topology {topology.name} does not describe the machines that would run the ranks "
            f"({'; '.join(wrong)}): {claimed(topology)}; found {found.text()}. Measure under the "
            "name of the machines you have: `local` for this one, or a cluster's from `coconet "
            "calibrate --ray-address ADDR --name NAME`",
            field="fingerprint",
        )
