"""The cost model: a schedule's step time on a topology, predicted from what its generated code does.

A schedule is lowered (``coconet.codegen.lower``) into units — an eager statement, a fused kernel, a
fused collective, an overlapped matmul, a bucket of collectives — and the model prices the same units of
the same lowering plan (``coconet.codegen.plan.LoweringPlan``: which groups run in place, which statements
a fused collective absorbs, which allreduce clones its operand), in ``coconet.tuner.pricing``, and
evaluates them here at sizes on a topology. Each unit costs, per rank:

- kernels: an eager op reads its operands and writes its result; a fused group reads its inputs and
  writes its outputs once (state in place where the code generator writes it there). Bytes move at
  memory bandwidth, a temporary at cache bandwidth when one launch's piece of it fits a third of the
  rank's cache (the program's inputs and state always come from memory); a fresh buffer costs what
  faulting in its pages costs at its size. A matmul is a roofline, the larger of flops/peak and
  bytes/bandwidth; a fused dropout is compute-bound on its Philox rounds, an eager one on its int64
  passes (``DropoutCost``: a call per element on CUDA, per four elements on CPU); a launch costs
  ``launch_s``. Sliced values move 1/R of the bytes.
- collectives: α-β per link, composed as the backend's algorithm does (ring, tree, direct; across
  nodes the slowest link's bandwidth, NCCL's count of inter-node steps for latency), or a measured
  fit where the topology has one (gloo over loopback). On ``shm`` a collective is memory traffic
  through shared segments — the bytes each helper of ``coconet.kernels.shm`` copies — plus barriers.
  Chunked and bucketed collectives pay α per launch.
- overlap: a unit whose collectives run in flight while it computes (a chunked fused collective on
  a network backend, an overlapped matmul) takes the larger of the two rather than their sum, as far
  as the topology lets them run together: ``overlap`` of its compute-bound time and
  ``overlap_memory`` of its memory-bound time can carry communication, and the first of ``chunks``
  chunks cannot hide any.
- ranks beyond the topology's (a machine calibrated with 2 ranks, asked about 4): they share its memory and
  cores, so every rate measured per rank is divided among them.

Everything size-independent is computed once per (schedule, backend) and cached by the schedule's
hash; a prediction then evaluates a few dozen products of bound dims. Predictions are model output:
callers label them ``source: model``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from coconet.codegen import backends
from coconet.codegen.plan import LoweringPlan
from coconet.errors import CoconetError, SizeError
from coconet.schedules.schedule import Schedule
from coconet.tuner.collective_time import bucket_launches, collective_time, shm_collective
from coconet.tuner.pricing import (
    DROPOUT_PER_BLOCK,
    DROPOUT_PER_ELEMENT,
    Builder,
    Comm,
    DropoutCost,
    Kernel,
    PerWorld,
    Plan,
    Unit,
)
from coconet.tuner.topology import Topology

__all__ = [
    "DEFAULT_STAGES",
    "DROPOUT_PER_BLOCK",
    "DROPOUT_PER_ELEMENT",
    "Comm",
    "DropoutCost",
    "Kernel",
    "Plan",
    "Prediction",
    "Unit",
    "collective_time",
    "evaluate",
    "explain",
    "plan",
    "predict",
    "rank",
    "shm_collective",
]

DEFAULT_STAGES = 2  # as `coconet run` runs a pipeline program


# --- the plan: what a schedule's generated code does, sizes still symbolic ---


@dataclass(frozen=True)
class Prediction:
    """Predicted seconds of one step (the slowest rank), and where they go. ``seconds`` equals
    ``compute_s + memory_s + communication_s + overhead_s - overlapped_s``."""

    seconds: float
    compute_s: float
    memory_s: float
    communication_s: float
    overhead_s: float
    overlapped_s: float
    source: str = "model"

    def to_json(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "compute_s": self.compute_s,
            "memory_s": self.memory_s,
            "communication_s": self.communication_s,
            "overhead_s": self.overhead_s,
            "overlapped_s": self.overlapped_s,
            "source": self.source,
        }


@functools.lru_cache(maxsize=16384)
def _plan(key: "_Key") -> Plan:
    # the kernels compiled: coconet run's default, and what the tuner times
    return Builder(LoweringPlan.of(key.schedule, key.backend, compiled=True)).plan()


class _Key:
    """A schedule and backend as a cache key: equal when their hashes are, so one cache entry serves
    every copy of a schedule (the space generator's, a parsed one)."""

    __slots__ = ("schedule", "backend", "ident")

    def __init__(self, schedule: Schedule, backend: str):
        self.schedule, self.backend = schedule, backend
        self.ident = (schedule.hash, backend)

    def __hash__(self) -> int:
        return hash(self.ident)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key) and other.ident == self.ident


def plan(schedule: Schedule, backend: str) -> Plan:
    """The size-independent structure of ``schedule`` lowered for ``backend`` (cached by hash)."""
    backends.get(backend)  # a BackendError naming the known ones for any other
    return _plan(_Key(schedule, backend))


# --- evaluation ---


def _fraction(marker: float, world: int) -> float:
    if marker == PerWorld.PEERS_FRACTION:
        return (world - 1) / world
    if marker == PerWorld.TWO_PEERS:
        return 2.0 * (world - 1)
    if marker == PerWorld.PEERS:
        return float(world - 1)
    return float(world)


def _value(terms, elems: list[float], world: int) -> float:
    total = 0.0
    for term in terms:
        v = term[0]
        for i in term[1]:
            v *= elems[i]
        if len(term) > 2:
            v *= _fraction(term[2], world)
        total += v
    return total


def _each(terms, elems: list[float], world: int) -> list[float]:
    return [_value((t,), elems, world) for t in terms]


def _elems(plan: Plan, sizes: Mapping[str, int], world: int) -> list[float]:
    dims = []
    for d in plan.dims:
        n = d.evaluate(sizes)
        if n <= 0:
            raise SizeError(f"dim {d} evaluates to {n} with sizes {dict(sizes)}; sizes must be positive")
        dims.append(n)
    out = []
    for idx, sliced in plan.extents:
        total = 1
        for k, i in enumerate(idx):
            total *= -(-dims[i] // world) if k == sliced else dims[i]
        out.append(float(total))
    return out


@dataclass(frozen=True)
class _Rates:
    """What a topology's figures make of a byte, a launch and an operation for one rank of ``world`` × ``stages``."""

    topo: Topology
    backend: str
    world: int
    each: Topology  # the topology's per-rank rates, shared among more ranks than it places
    mem_beta: float
    cache_beta: float
    buffer_limit: float
    faults: bool
    overlap_memory: float
    send_crosses: bool

    @classmethod
    def of(cls, topo: Topology, backend: str, world: int, stages: int) -> "_Rates":
        # more ranks than the topology places (one calibrated with R ranks a node, asked about more) share its
        # nodes' memory and cores
        each = topo.shared_by(max(1.0, world * stages / topo.world))
        mem_beta = each.memory_beta
        # stage s holds ranks [s·world, (s+1)·world); a send goes world ranks on, across nodes for some rank?
        rpn = topo.ranks_per_node
        return cls(
            topo=topo,
            backend=backend,
            world=world,
            each=each,
            mem_beta=mem_beta,
            cache_beta=1.0 / (each.cache_bandwidth_GBps * 1e9) if each.cache_bandwidth_GBps else mem_beta,
            buffer_limit=topo.cache_bytes / 3 if topo.cache_bandwidth_GBps else -1.0,
            faults=bool(topo.fresh_cost),
            overlap_memory=topo.overlap if topo.overlap_memory is None else topo.overlap_memory,
            send_crosses=stages > 1 and any(r // rpn != (r + world) // rpn for r in range(min(world, rpn))),
        )


def _kernel_time(k: Kernel, elems: list[float], r: _Rates) -> tuple[float, float, float]:
    """(compute-bound, memory-bound, launch) seconds of one kernel: the larger of its compute and memory time
    counts."""
    world, each = r.world, r.each
    # each buffer streams from cache if one launch's piece of it fits a third of it (the three
    # streams of an op, as calibrate measures the cache), the program's inputs and state from memory
    per = max(1, k.launches)
    mem_t = 0.0
    for term in k.read + k.write:
        b = _value((term,), elems, world)
        mem_t += b * (r.cache_beta if b / per <= r.buffer_limit else r.mem_beta)
    for term in k.cold:
        b = _value((term,), elems, world)
        if b / per <= r.buffer_limit:
            mem_t += b * (r.mem_beta - r.cache_beta)
    if r.faults and k.fresh:
        for b in _each(k.fresh, elems, world):
            mem_t += b * each.fresh_s_per_byte(b / k.launches if k.launches > 1 else b)
    c_t = 0.0
    if k.flops:
        c_t = _value(k.flops, elems, world) / each.flops(k.dtype)
    if k.ops:
        ew_rate = each.elementwise_Gops * 1e9 if each.elementwise_Gops else math.inf
        eager_rate = each.eager_elementwise_Gops * 1e9 if each.eager_elementwise_Gops else math.inf
        c_t = max(c_t, _value(k.ops, elems, world) / (ew_rate if k.compiled else eager_rate))
    launch = k.launches * (each.fused_launch_s if k.compiled else each.launch_s)
    return (c_t, 0.0, launch) if c_t > mem_t else (0.0, mem_t, launch)


def _comm_time(c: Comm, elems: list[float], r: _Rates, comm: float, mem: float) -> tuple[float, float]:
    """(communication, memory traffic) seconds of a unit's collectives so far (``comm``, ``mem``) and one
    more collective, bucket of them, or barrier: added launch by launch, as the sums are."""
    topo, world = r.topo, r.world
    if c.op == "barrier":
        return comm + c.launches * topo.shm_barrier_s, mem
    sizes_b = _each(c.members, elems, world)
    if c.shm:
        for total in bucket_launches(sizes_b, c.cap) if c.cap else [sum(sizes_b)]:
            per = total / c.launches * (world if c.parts else 1)
            moved, fresh, barriers = shm_collective(c.op, per, world)
            t = moved * r.mem_beta
            if r.faults and fresh:
                t += fresh * r.each.fresh_s_per_byte(fresh)
            mem += c.launches * t
            comm += c.launches * (barriers * topo.shm_barrier_s + r.each.launch_s)
        return comm, mem
    if c.between_stages:
        transport = backends.get(r.backend).transport
        return comm + collective_time("send", sum(sizes_b), topo, transport, world, crosses_nodes=r.send_crosses), mem
    for total in bucket_launches(sizes_b, c.cap) if c.cap else [sum(sizes_b)]:
        comm += c.launches * collective_time(c.op, total / c.launches, topo, r.backend, world)
        if c.flatten and len(sizes_b) > 1:
            mem += 4 * total * r.mem_beta  # into the flat buffer and back, read and written
    return comm, mem


def evaluate(
    plan: Plan,
    sizes: Mapping[str, int],
    topo: Topology,
    backend: str,
    world: int,
    stages: int = 1,
    detail: list | None = None,
) -> Prediction:
    elems = _elems(plan, sizes, world)
    r = _Rates.of(topo, backend, world, stages)
    compute = memory = comm = overhead = hidden = 0.0
    for unit in plan.units:
        u_compute = u_memory = u_over = 0.0
        for k in unit.kernels:
            c_t, mem_t, launch = _kernel_time(k, elems, r)
            u_compute, u_memory, u_over = u_compute + c_t, u_memory + mem_t, u_over + launch
        u_comm = u_comm_mem = 0.0
        for c in unit.comms:
            u_comm, u_comm_mem = _comm_time(c, elems, r, u_comm, u_comm_mem)
        work = u_compute + u_memory + u_over
        talk = u_comm + u_comm_mem
        u_hidden = 0.0
        if unit.chunks > 1 and talk and work:
            # the collectives progress under the computation: fully under compute-bound work where the
            # link does not need the compute units, partly under memory-bound work (the same bytes' path)
            under = topo.overlap * u_compute + r.overlap_memory * (u_memory + u_over)
            u_hidden = min(under, talk) * (unit.chunks - 1) / unit.chunks
        compute += u_compute
        memory += u_memory + u_comm_mem
        comm += u_comm
        overhead += u_over
        hidden += u_hidden
        if detail is not None:
            detail.append(
                (
                    unit.what,
                    work + talk - u_hidden,
                    {
                        "compute": u_compute,
                        "memory": u_memory + u_comm_mem,
                        "communication": u_comm,
                        "overhead": u_over,
                        "overlapped": u_hidden,
                    },
                )
            )
    seconds = compute + memory + comm + overhead - hidden
    return Prediction(seconds, compute, memory, comm, overhead, hidden)


def _world(schedule: Schedule, topo: Topology, world: int | None, stages: int | None) -> tuple[int, int]:
    """(ranks per stage: a collective's group, stages) from ``world``, the ranks of all stages together
    (the topology's, when not given)."""
    stages = (stages or DEFAULT_STAGES) if schedule.program.is_pipeline else 1
    total = topo.world if world is None else world
    if total < 1:
        raise CoconetError(f"world must be positive, got {total}")
    if total % stages:
        raise CoconetError(f"{total} ranks do not split into {stages} pipeline stages")
    return total // stages, stages


def predict(
    schedule: Schedule,
    sizes: Mapping[str, int],
    topology: Topology,
    backend: str,
    *,
    world: int | None = None,
    stages: int | None = None,
) -> Prediction:
    """Predicted step time of ``schedule`` at ``sizes`` with ``backend`` on ``topology``: on all its ranks,
    or on ``world`` of them. A pipeline program's ranks form ``stages`` (default 2) stages of
    ``world // stages`` (``coconet run --world`` counts one stage's); the prediction is one stage's step,
    its send included."""
    topology.check_backend(backend)
    group, stages = _world(schedule, topology, world, stages)
    return evaluate(plan(schedule, backend), sizes, topology, backend, group, stages)


def explain(
    schedule: Schedule,
    sizes: Mapping[str, int],
    topology: Topology,
    backend: str,
    *,
    world: int | None = None,
    stages: int | None = None,
) -> list[tuple[str, float, dict]]:
    """Per unit of the lowered schedule: what it is, its predicted seconds and their breakdown."""
    topology.check_backend(backend)
    group, stages = _world(schedule, topology, world, stages)
    detail: list = []
    evaluate(plan(schedule, backend), sizes, topology, backend, group, stages, detail)
    return detail


def rank(
    schedules: Iterable[Schedule],
    sizes: Mapping[str, int],
    topology: Topology,
    backend: str,
    *,
    world: int | None = None,
    stages: int | None = None,
) -> list[Schedule]:
    """``schedules`` best-first by predicted time; ties keep their given order."""
    scored = [
        (predict(s, sizes, topology, backend, world=world, stages=stages).seconds, i, s)
        for i, s in enumerate(schedules)
    ]
    scored.sort(key=lambda x: (x[0], x[1]))
    return [s for _, _, s in scored]
