"""The cost model: a schedule's step time on a topology, predicted from what its generated code does.

A schedule is lowered (``coconet.codegen.lower``) into units — an eager statement, a fused kernel, a
fused collective, an overlapped matmul, a bucket of collectives — and the model walks the same units,
with the same helpers deciding what the code generator decides (which groups run in place, which
statements a fused collective absorbs, which allreduce clones its operand). Each unit costs, per rank:

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

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from coconet.codegen.analysis import (
    absorbed_by_collective,
    computed_on_rows,
    custom_group,
    group_io,
    in_place_outputs,
    needs_copy,
    row_dim,
    step_positions,
    step_units,
)
from coconet.codegen.lower import (
    fuse_absorbed,
    fuse_gathers_into,
    fuse_reduced,
    fused_collective_plan,
    gathers_into_state,
    held_sources,
    kernel_reduced,
    updated_in_place,
)
from coconet.errors import CoconetError, SizeError
from coconet.schedules.dims import Dim
from coconet.schedules.ir import CONVS, Group, Program, Stmt
from coconet.schedules.schedule import Schedule
from coconet.schedules.types import ITEMSIZE, Replicated, Sliced, TensorType
from coconet.tuner.topology import Topology

BACKENDS = ("gloo", "nccl", "shm")
DEFAULT_STAGES = 2  # as `coconet run` runs a pipeline program


@dataclass(frozen=True)
class DropoutCost:
    """What dropout's counter-based RNG costs per element of the value, counted off ``_dropout`` of the
    generated code (torch dispatches, element passes and bytes of its int64 ops, eager; integer operations
    in a compiled kernel, at the rate ``elementwise_Gops`` measures on a kernel of Philox calls)."""

    dispatches: int
    passes: float
    read: float
    write: float
    fused_ops: float


# On CUDA every element runs its own Philox4x32-10 call (12 int64 ops per round, 10 rounds, the lane
# select and the mask); a fused kernel keeps the rounds in registers, ~135 integer operations.
DROPOUT_PER_ELEMENT = DropoutCost(dispatches=148, passes=138, read=1276, write=1068, fused_ops=135)
# On CPU one call serves four elements where a row is whole blocks of four (the model assumes it is):
# the rounds run over a quarter of the elements, and a fused kernel keeps the four words in a buffer
# (``coconet calibrate`` measures the rate on such a kernel).
DROPOUT_PER_BLOCK = DropoutCost(dispatches=142, passes=37.5, read=331, write=285, fused_ops=34)


# --- the plan: what a schedule's generated code does, sizes still symbolic ---

# A term is ``coef × Π extent_elems[i]`` (times a function of the world R when it has a third item, a
# _PerWorld marker); an extent is a shape, with the dim that is sliced (or -1).
Term = tuple  # (float, tuple[int, ...]) or (float, tuple[int, ...], float)


@dataclass(frozen=True)
class Kernel:
    """One kernel or a run of eager ops: ``launches`` dispatches moving ``read`` + ``write`` bytes."""

    what: str
    launches: int
    read: tuple[Term, ...] = ()
    write: tuple[Term, ...] = ()
    fresh: tuple[Term, ...] = ()  # newly allocated buffers it fills, one term each
    # of read + write, the bytes that come from or go to memory whatever the cache holds: the
    # program's inputs and state (a temporary written by the kernel before may still be in cache)
    cold: tuple[Term, ...] = ()
    flops: tuple[Term, ...] = ()
    ops: tuple[Term, ...] = ()  # elementwise integer/float operations (compute-bound fused work)
    dtype: str = "float32"
    compiled: bool = False


@dataclass(frozen=True)
class Comm:
    """Collectives of one kind issued as ``launches`` messages (chunks), or, with ``cap``, as the
    bucket's launches of at most ``cap`` bytes over ``members`` (one term per buffer)."""

    op: str
    members: tuple[Term, ...]
    launches: int = 1
    cap: int | None = None
    shm: bool = False
    between_stages: bool = False
    flatten: bool = False  # gloo's coalesced collectives copy the buffers into one and back
    parts: bool = False  # members are this rank's parts of all_gathers (the shm bucket groups those)


@dataclass(frozen=True)
class Unit:
    what: str
    kernels: tuple[Kernel, ...]
    comms: tuple[Comm, ...] = ()
    chunks: int = 1  # > 1: the collectives are in flight while the kernels of later chunks run


@dataclass(frozen=True)
class Plan:
    dims: tuple[Dim, ...]
    extents: tuple[tuple[tuple[int, ...], int], ...]  # (indices into dims, sliced position or -1)
    units: tuple[Unit, ...]
    pipeline: bool


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
        return {"seconds": self.seconds, "compute_s": self.compute_s, "memory_s": self.memory_s,
                "communication_s": self.communication_s, "overhead_s": self.overhead_s,
                "overlapped_s": self.overlapped_s, "source": self.source}


class _Builder:
    def __init__(self, p: Program, backend: str, knobs: Mapping[str, int]):
        self.p, self.backend, self.knobs = p, backend, knobs
        self.into_state: dict[str, str] = {}  # shm all_gathers written straight into state (set by plan)
        self.fuse_into: dict[Group, dict[str, str]] = {}  # and those a fuse kernel writes (set by plan)
        self.fused_gathers: set[str] = set()
        self.rows: dict[str, int] = {}  # statements computed on this rank's rows, each with its dim (set by plan)
        self.reduced: dict[Group, tuple[str, ...]] = {}  # sums and norms a fuse kernel computes (set by plan)
        self.at: dict[str, int] = {}  # each statement's place in the step (set by plan)
        self.held: set[str] = set()  # computed into a buffer kept from step to step (held_sources, set by plan)
        self.dims: dict[Dim, int] = {}
        self.extents: dict[tuple[tuple[int, ...], int], int] = {}

    # sizes

    def extent(self, shape: tuple[Dim, ...], sliced: int | None) -> int:
        idx = tuple(self.dims.setdefault(d, len(self.dims)) for d in shape)
        key = (idx, -1 if sliced is None else sliced)
        return self.extents.setdefault(key, len(self.extents))

    def local(self, t: TensorType) -> int | None:
        """This rank's piece of a value (None for a 0-d one: it costs a launch, not bandwidth)."""
        if t.is_scalar:
            return None
        return self.extent(t.shape, t.layout.dim if isinstance(t.layout, Sliced) else None)

    def written(self, name: str) -> int | None:
        """The piece of its value a statement writes: its rows where it is computed on them (``rows``)."""
        t = self.p[name].type
        return self.extent(t.shape, self.rows[name]) if name in self.rows else self.local(t)

    def whole(self, t: TensorType) -> int | None:
        return None if t.is_scalar else self.extent(t.shape, None)

    def nbytes(self, t: TensorType, ext: int | None, times: float = 1.0) -> tuple[Term, ...]:
        if ext is None:
            return ()
        return ((times * ITEMSIZE.get(t.dtype or "float32", 4), (ext,)),)

    def consumed(self, s: Stmt, a: str) -> int | None:
        """The piece of operand ``a`` that ``s`` reads: a Replicated operand of a Sliced result, or of a
        statement computed on this rank's rows, is cut to those rows (as ``_Emitter.operand`` cuts it)."""
        t, out = self.p[a].type, s.type
        if t is None or t.is_scalar:
            return None
        if s.name in self.rows:
            d = row_dim(out.shape, self.rows[s.name], t.shape)
            return self.local(t) if d is None else self.extent(t.shape, d)
        if out is not None and isinstance(out.layout, Sliced) and isinstance(t.layout, Replicated):
            d = row_dim(out.shape, out.layout.dim, t.shape)
            if d is not None:
                return self.extent(t.shape, d)
        return self.local(t)

    def is_cold(self, a: str) -> bool:
        s = self.p[a]
        return s.op in ("input", "recv") or (s.op == "slice" and self.is_cold(s.args[0]))  # a slice is a view

    def reads(self, s: Stmt, skip: set[str] = frozenset(), cold: bool = False) -> tuple[Term, ...]:
        out: list[Term] = []
        for a in dict.fromkeys(s.args):
            if a in skip or self.p[a].op == "const" or (cold and not self.is_cold(a)):
                continue
            out += self.nbytes(self.p[a].type, self.consumed(s, a))
        return tuple(out)

    # units

    def plan(self) -> Plan:
        p = self.p
        absorbed = absorbed_by_collective(p)  # the lowering compiles kernels (coconet run's default)
        skip = {m for ms in absorbed.values() for m in ms}
        skip.update(m for ms in kernel_reduced(p, self.backend, absorbed).values() for m in ms)
        rows = fuse_absorbed(p, skip)
        self.rows = {m: d for ms in rows.values() for m, d in ms.items()}
        skip |= set(self.rows)
        self.reduced = fuse_reduced(p)
        self.held = held_sources(p, self.backend, absorbed)
        skip.update(m for ms in self.reduced.values() for m in ms)
        for g, ms in absorbed.items():  # a chunk computes its own rows of them (the lowering's rowwise)
            d = p[g.members[0]].type.layout.dim
            self.rows.update((m, d) for m in ms if isinstance(p[m].type.layout, Replicated))
        rows_only = computed_on_rows(p, skip)  # computed on the rows their readers cut, as the lowering does
        at_end = updated_in_place(p, skip | set(rows_only))
        self.rows.update(rows_only)
        skip |= set(at_end.values())
        order = step_units(p)
        self.at = step_positions(order, absorbed, rows, self.reduced, kernel_reduced(p, self.backend, absorbed))
        self.into_state = gathers_into_state(p, order, absorbed) if self.backend == "shm" else {}
        # a fuse kernel's rows into every copy of the state: the gather moves no bytes of its own
        self.fuse_into = fuse_gathers_into(p, order, self.into_state, absorbed, rows) if self.backend == "shm" else {}
        self.fused_gathers = {ag for into in self.fuse_into.values() for ag in into}
        units: list[Unit] = []
        written: set[str] = set(self.into_state.values())
        for u in order:
            if u in skip:
                continue
            if isinstance(u, Group):
                unit, wrote = self.group(u, absorbed.get(u, ()), rows.get(u, {}))
                written |= wrote
                units.append(unit)
            else:
                units.extend(self.stmt(p[u]))
        tail: list[Kernel] = []
        for v in p.updates.values():
            if p[v].op in ("input", "scalar"):  # state aliased by another update: copied first
                t = p[v].type
                b = self.nbytes(t, self.local(t))
                tail.append(Kernel(f"clone {v}", 1, b, b, b, cold=b))
        for target, v in p.updates.items():
            if target in written:
                continue
            if target in at_end:  # computed into the state: no new tensor, no copy
                k = self.eager(p[v])
                tail.append(dataclasses.replace(k, what=f"{v} into {target}", fresh=(),
                                                cold=k.cold + self.nbytes(p[target].type, self.local(p[target].type))))
                continue
            t = p[target].type
            tail.append(Kernel(f"{target}.copy_", 1, self.nbytes(p[v].type, self.local(p[v].type)),
                               self.nbytes(t, self.local(t)), cold=self.nbytes(t, self.local(t))))
        if tail:
            units.append(Unit("updates", tuple(tail)))
        dims = tuple(sorted(self.dims, key=self.dims.__getitem__))
        extents = tuple(sorted(self.extents, key=self.extents.__getitem__))
        return Plan(dims, extents, tuple(units), p.is_pipeline)

    def eager(self, s: Stmt, launches: int = 1) -> Kernel:
        """One statement as torch runs it: read its operands, write a fresh result."""
        t = s.type
        out = self.nbytes(t, self.written(s.name))
        if s.op == "dropout":
            ext, rng = self.local(t), self.dropout_cost()
            # the value read and the result written, plus the RNG's int64 passes
            base = self.reads(s)
            rng_r, rng_w = (((rng.read, (ext,)),), ((rng.write, (ext,)),)) if ext is not None else ((), ())
            ops = ((rng.passes, (ext,)),) if ext is not None else ()
            return Kernel(s.name, launches * rng.dispatches, base + rng_r, out + rng_w, out + rng_w, ops=ops,
                          dtype=t.dtype, cold=self.reads(s, cold=True))
        if s.op in ("sum", "partial_sum", "norm"):
            return Kernel(s.name, launches, self.reads(s), dtype=t.dtype or "float32", cold=self.reads(s, cold=True))
        if s.op in ("softmax", "log_softmax"):
            # torch's kernel reads each row three times (its max, its sum of exponentials, the result)
            return Kernel(s.name, launches, self.reads(s) * 3, out, out, dtype=t.dtype or "float32",
                          cold=self.reads(s, cold=True))
        fresh = () if s.name in self.held else out
        return Kernel(s.name, launches, self.reads(s), out, fresh, dtype=(t.dtype if t else None) or "float32",
                      cold=self.reads(s, cold=True))

    def matmul(self, s: Stmt, chunks: int = 1, whole_each_chunk: int | None = None) -> Kernel:
        """A matmul, in ``chunks`` launches; each launch reads all of operand ``whole_each_chunk`` (0 or 1)
        and its chunk of the other."""
        p = self.p
        a = p[s.args[0]].type
        ka = a.layout.dim == a.ndim - 1 if isinstance(a.layout, Sliced) else False
        k_ext = self.extent((a.shape[-1],), 0 if ka else None)
        out_ext = self.local(s.type)
        flops = ((2.0, (out_ext, k_ext)),) if out_ext is not None else ()
        out = self.nbytes(s.type, out_ext)
        reads, cold = self.reads(s), self.reads(s, cold=True)
        if whole_each_chunk is not None and chunks > 1:
            arg = s.args[whole_each_chunk]
            again = self.nbytes(p[arg].type, self.consumed(s, arg), chunks - 1)
            reads += again
            cold += again if self.is_cold(arg) else ()
        return Kernel(s.name, chunks, reads, out, out, flops=flops, dtype=s.type.dtype or "float32", cold=cold)

    def conv(self, s: Stmt, chunks: int = 1, whole_each_chunk: int | None = None) -> Kernel:
        """A convolution priced as a matmul: 2 flops per multiply-add, of which each output element of this
        rank's batch rows takes one per element of the weight's row (its piece's input channels by the taps),
        so this rank's batch by output positions times its piece of the weight. Its operands are read as they
        lie, in ``chunks`` launches that each read all of operand ``whole_each_chunk`` (0 or 1)."""
        p = self.p
        x, w = (p[a].type for a in s.args)
        rows = self.extent((x.shape[0],) + s.type.shape[2:], 0 if x.layout == Sliced(0) else None)
        flops = ((2.0, (rows, self.local(w))),)
        out = self.nbytes(s.type, self.local(s.type))
        reads = tuple(t for a in s.args for t in self.nbytes(p[a].type, self.local(p[a].type)))
        cold = tuple(t for a in s.args if self.is_cold(a) for t in self.nbytes(p[a].type, self.local(p[a].type)))
        if whole_each_chunk is not None and chunks > 1:
            arg = s.args[whole_each_chunk]
            again = self.nbytes(p[arg].type, self.local(p[arg].type), chunks - 1)
            reads += again
            cold += again if self.is_cold(arg) else ()
        return Kernel(s.name, chunks, reads, out, out, flops=flops, dtype=s.type.dtype or "float32", cold=cold)

    def collective(self, s: Stmt) -> Comm:
        p = self.p
        t = s.type if s.op == "all_gather" else p[s.args[0]].type
        return Comm(s.op, self.nbytes(t, self.whole(t)), shm=self.backend == "shm")

    def stmt(self, s: Stmt) -> list[Unit]:
        p, op = self.p, s.op
        if op in ("input", "scalar", "const", "update", "output", "recv", "slice"):
            return []  # recv: the stage before pays the transfer, as its send; a slice is a view
        if op == "send":
            t = p[s.args[0]].type
            return [Unit(s.name, (), (Comm("send", self.nbytes(t, self.local(t)), between_stages=True),))]
        if op == "matmul":
            return [Unit(s.name, (self.matmul(s),))]
        if op in CONVS:
            return [Unit(s.name, (self.conv(s),))]
        if op in ("allreduce", "broadcast"):
            t = p[s.args[0]].type
            clone = op == "broadcast" or needs_copy(p, s.name)
            b = self.nbytes(t, self.local(t))
            ks = (Kernel(f"clone {s.args[0]}", 1, b, b, b, cold=b if self.is_cold(s.args[0]) else ()),) if clone else ()
            return [Unit(s.name, ks, (self.collective(s),))]
        if op == "reduce_scatter":
            return [Unit(s.name, self.scatter_copies(s), (self.collective(s),))]
        if op == "all_gather" and s.name in self.fused_gathers:
            return []  # in the fuse kernel that computes its rows
        if op == "all_gather" and s.name in self.into_state:
            # two barriers; this rank's rows into its own copy of the state and every peer's
            part = p[s.args[0]].type
            mine = self.nbytes(part, self.local(part))
            peers = _scaled(mine, _PerWorld.PEERS)
            ks = (Kernel(f"{s.name} rows", 1, mine, mine, cold=mine),
                  Kernel(f"{s.name} peers' rows", 1, peers, peers, cold=peers))
            return [Unit(s.name, ks, (Comm("barrier", (), launches=2, shm=True),))]
        if op == "all_gather":
            return [Unit(s.name, self.gather_copies(s), (self.collective(s),))]
        return [Unit(s.name, (self.eager(s),))]  # a 0-d result moves no bytes: a launch

    def scatter_copies(self, s: Stmt) -> tuple[Kernel, ...]:
        """gloo/nccl: a reduce_scatter along a dim other than 0 moves it first (a copy); its output is
        a fresh buffer of this rank's rows. shm reads rows in place (its bytes are in the collective)."""
        if self.backend == "shm":
            return ()
        x = self.p[s.args[0]].type
        out = self.nbytes(s.type, self.local(s.type))
        if s.type.layout.dim != 0:
            whole = self.nbytes(x, self.local(x))
            return (Kernel(f"{s.name} contiguous", 1, whole, whole, whole), Kernel(f"{s.name} out", 0, (), (), out))
        return (Kernel(f"{s.name} out", 0, (), (), out),)

    def gather_copies(self, s: Stmt) -> tuple[Kernel, ...]:
        if self.backend == "shm":
            return ()
        part = self.p[s.args[0]].type
        out = self.nbytes(s.type, self.whole(s.type))
        ks = [Kernel(f"{s.name} out", 0, (), (), out)]
        if part.layout.dim != 0:
            mine = self.nbytes(part, self.local(part))
            ks.append(Kernel(f"{s.name} contiguous", 1, mine, mine, mine))
        return tuple(ks)

    def group(self, g: Group, absorbed: tuple[str, ...], rows: Mapping[str, int]) -> tuple[Unit, set[str]]:
        if g.kind == "fuse":
            return self.fuse(g, rows)
        if g.kind == "overlap":
            return self.overlap(g), set()
        if g.kind == "bucket":
            return self.bucket(g), set()
        return self.fused_collective(g, absorbed)

    def fuse(self, g: Group, rows: Mapping[str, int]) -> tuple[Unit, set[str]]:
        """``rows``: statements the kernel computes on this rank's rows (``fuse_absorbed``), each with its dim."""
        p = self.p
        reduced = self.reduced.get(g, ())  # sums and norms of members the kernel computes (fuse_reduced)
        ins, outs = group_io(p, g, (*rows, *reduced))
        inplace = in_place_outputs(p, g, outs, self.at)
        outs = [*outs, *reduced]
        members = (*rows, *g.members)
        if custom_group(p, g):  # a custom op's code runs as written: statement by statement
            return Unit(str(g), tuple(self.eager(p[m]) for m in members)), set(inplace.values())
        reads: list[Term] = []
        cold: list[Term] = []
        for a in ins:
            if p[a].op == "const":
                continue
            readers = [p[m] for m in members if a in p[m].args]
            exts = {self.consumed(m, a) for m in readers}
            # read once, as the largest piece any member takes
            best = max((e for e in exts if e is not None), key=lambda e: self.extents_rank(e), default=None)
            reads += self.nbytes(p[a].type, best)
            if self.is_cold(a):
                cold += self.nbytes(p[a].type, best)
        writes: list[Term] = []
        fresh: list[Term] = []
        into = set(self.fuse_into.get(g, {}).values())
        for o in outs:
            b = self.nbytes(p[o].type, self.written(o))
            if o in into:  # this rank's rows into its own copy of the state and every peer's: to memory
                writes += _scaled(b, _PerWorld.ALL)
                cold += _scaled(b, _PerWorld.ALL)
                continue
            writes += b
            if o not in inplace and o not in self.held:
                fresh += b
            else:  # into the state, or into the buffer a fused collective reads it from (held_source)
                cold += b
        ops = self.fused_dropout_ops(g.members)
        dtype = next((p[o].type.dtype for o in outs if p[o].type and p[o].type.dtype), "float32")
        k = Kernel(str(g), 1, tuple(reads), tuple(writes), tuple(fresh), ops=ops, dtype=dtype, compiled=True,
                   cold=tuple(cold))
        # its gathers into state: one barrier before the kernel writes the peers' copies, one after
        comms = (Comm("barrier", (), launches=2, shm=True),) if into else ()
        return Unit(str(g), (k,), comms), set(inplace.values())

    def dropout_cost(self) -> DropoutCost:
        return DROPOUT_PER_ELEMENT if self.backend == "nccl" else DROPOUT_PER_BLOCK

    def fused_dropout_ops(self, members) -> tuple[Term, ...]:
        """The Philox rounds of the dropouts among ``members``, run inside one compiled kernel."""
        p = self.p
        ops: list[Term] = []
        for m in members:
            if p[m].op == "dropout":
                ext = self.local(p[m].type)
                if ext is not None:
                    ops.append((self.dropout_cost().fused_ops, (ext,)))
        return tuple(ops)

    def extents_rank(self, e: int) -> tuple[int, int]:
        # a whole value before a slice of it: the larger read
        idx, sliced = next(k for k, v in self.extents.items() if v == e)
        return (sliced < 0, len(idx))

    def fused_collective(self, g: Group, absorbed: tuple[str, ...]) -> tuple[Unit, set[str]]:
        p = self.p
        chunks = self.knobs.get("fc_chunks", 1)
        fc = fused_collective_plan(p, self.backend, g, absorbed)
        rs, ins, inplace, into, direct = fc.rs, fc.ins, fc.inplace, fc.into, fc.direct
        gathers, sliced_outs, compute = fc.gathers, fc.sliced_outs, fc.compute
        x = p[rs.args[0]].type
        shm = self.backend == "shm"
        compiled, parts = fc.compiles, fc.sums_parts
        kernels: list[Kernel] = []
        comms: list[Comm] = []
        whole_in = self.nbytes(x, self.whole(x))
        mine_in = self.nbytes(rs.type, self.local(rs.type))
        # what the kernel reads of every rank's rows: the inputs its pre statements compute them from
        mine_src = tuple(t for x in fc.sources
                         for t in self.nbytes(dataclasses.replace(rs.type, dtype=p[x].type.dtype), self.local(rs.type)))
        R = _PerWorld  # the number of ranks, bound at evaluation (see _PerWorld)
        if shm:
            # publish every row but this rank's own, once (unless the peers read the input where it lies); one
            # barrier; then per chunk the rows are reduced out of the peers' segments (by the kernel itself
            # when it sums them as it reads)
            if not direct:
                kernels.append(Kernel(f"{rs.name} publish", 1, _scaled(whole_in, R.PEERS_FRACTION),
                                      _scaled(whole_in, R.PEERS_FRACTION),
                                      cold=_scaled(whole_in, R.PEERS_FRACTION) if self.is_cold(rs.args[0]) else ()))
            comms.append(Comm("barrier", (), launches=1, shm=True))
            if not parts:
                kernels.append(Kernel(f"{rs.name} reduce", chunks, _scaled(mine_in, R.TWO_PEERS),
                                      _scaled(mine_in, R.PEERS)))
        else:
            if chunks > 1:  # each chunk's rows of every rank's block, gathered into one send buffer
                kernels.append(Kernel(f"{rs.name} chunk buffers", chunks, whole_in, whole_in, whole_in))
            comms.append(Comm("reduce_scatter", whole_in, launches=chunks))
        # the computation on this rank's slice: one compiled kernel per chunk, or its statements eagerly
        if compiled:
            reads: list[Term] = []
            cold: list[Term] = []
            for a in ins:
                if a in fc.sources or p[a].op == "const":
                    continue
                readers = [p[m] for m in compute if a in p[m].args]
                exts = {self.consumed(m, a) for m in readers}
                best = max((e for e in exts if e is not None), key=self.extents_rank, default=None)
                reads += self.nbytes(p[a].type, best)
                if self.is_cold(a):
                    cold += self.nbytes(p[a].type, best)
            reads += _scaled(mine_src, R.ALL) if parts else mine_in
            writes: list[Term] = []
            fresh: list[Term] = []
            for o in inplace:
                writes += self.nbytes(p[o].type, self.local(p[o].type))
                cold += self.nbytes(p[o].type, self.local(p[o].type))
            for m in compute:
                if m in fc.needed:  # a partial sum is a scalar: no bytes
                    writes += self.nbytes(p[m].type, self.local(p[m].type))
            if rs.name in sliced_outs:  # the reduced rows, which the group hands on, into one tensor
                writes += mine_in
            for m in into:  # this rank's rows of the state, into its own copy and every peer's: to memory
                part = p[p[m].args[0]].type
                rows = _scaled(self.nbytes(part, self.local(part)), R.ALL)
                writes += rows
                cold += rows
            kernels.append(Kernel(f"{g} kernel", chunks, tuple(reads), tuple(writes), tuple(fresh),
                                  ops=self.fused_dropout_ops(compute),
                                  compiled=True, dtype=x.dtype or "float32", cold=tuple(cold)))
        else:
            for m in compute:
                k = self.eager(p[m], launches=chunks)
                kernels.append(k)
            for t in inplace.values():
                b = self.nbytes(p[t].type, self.local(p[t].type))
                kernels.append(Kernel(f"{t}.copy_", chunks, b, b, cold=b))
            for m in into:
                part = p[p[m].args[0]].type
                b = self.nbytes(part, self.local(part))
                peers = _scaled(b, R.PEERS)
                kernels.append(Kernel(f"{m} into the peers' copies", chunks, peers, peers, cold=peers))
        for m in gathers:
            part = p[p[m].args[0]].type
            mine = self.nbytes(part, self.local(part))
            whole = self.nbytes(p[m].type, self.whole(p[m].type))
            if m in into:
                # the state is whole: it lives in the segment the peers wrote their rows into (a state that
                # cannot move there, a view into a larger buffer, copies them in: not priced)
                continue
            if shm:
                # each chunk into this rank's slot; every rank's rows copied out
                kernels.append(Kernel(f"{m} publish", chunks, mine, mine))
                kernels.append(Kernel(f"{m} copy out", 1, whole, whole, whole))
            else:
                # gloo's list all_gather lands in a flat buffer, then in the views: one more copy
                kernels.append(Kernel(f"{m} into views", chunks, whole, whole, whole))
                comms.append(Comm("all_gather", whole, launches=chunks))
        if shm and (gathers or direct):  # one barrier ends the collective: its gathers, the peers' reads of the input
            comms.append(Comm("barrier", (), launches=1, shm=True))
        for o in sliced_outs if not compiled else ():  # compiled, the kernel writes them into the whole output
            b = self.nbytes(p[o].type, self.local(p[o].type))
            kernels.append(Kernel(f"cat {o}", 1, b, b, b))
        overlapped = 1 if shm else chunks
        return Unit(str(g), tuple(kernels), tuple(comms), overlapped), set(inplace.values()) | set(into.values())

    def overlap(self, g: Group) -> Unit:
        p = self.p
        chunks = self.knobs.get("chunks", 4)
        mm, coll = p[g.members[0]], p[g.members[1]]
        # chunks of a's rows times all of b (allreduce), or all of a times chunks of b's columns; a convolution's
        # chunks of the batch by all of w, or (scattered along the batch) all of x by chunks of w
        by_rows = coll.op == "allreduce" or (mm.op in CONVS and coll.type.layout != Sliced(0))
        k = (self.conv if mm.op in CONVS else self.matmul)(mm, chunks, whole_each_chunk=1 if by_rows else 0)
        out = self.nbytes(coll.type, self.local(coll.type))
        cat = Kernel(f"cat {coll.name}", 1, out, out, out)
        t = mm.type
        comm = Comm(coll.op, self.nbytes(t, self.whole(t)), launches=chunks, shm=self.backend == "shm")
        kernels = [k, cat]
        if coll.op == "reduce_scatter" and self.backend != "shm":
            kernels += [Kernel(f"{coll.name} out", 0, (), (), out)]
        return Unit(str(g), tuple(kernels), (comm,), chunks)

    def bucket(self, g: Group) -> Unit:
        p = self.p
        cap = self.knobs.get("bucket_bytes", 2**22)
        first = p[g.members[0]]
        shm = self.backend == "shm"
        kernels: list[Kernel] = []
        members: list[Term] = []
        parts = False
        for m in g.members:
            s = p[m]
            if s.op == "allreduce" and needs_copy(p, m):
                t = p[s.args[0]].type
                b = self.nbytes(t, self.local(t))
                kernels.append(Kernel(f"clone {s.args[0]}", 1, b, b, b, cold=b if self.is_cold(s.args[0]) else ()))
            if s.op == "all_gather":
                if shm:  # the shm bucket groups the parts it sends
                    members += self.nbytes(p[s.args[0]].type, self.local(p[s.args[0]].type))
                    parts = True
                else:
                    members += self.nbytes(s.type, self.whole(s.type))
                    kernels += self.gather_copies(s)
            else:
                t = p[s.args[0]].type
                members += self.nbytes(t, self.whole(t))
                if s.op == "reduce_scatter":
                    kernels += self.scatter_copies(s)
        comm = Comm(first.op, tuple(members), cap=cap, shm=shm, flatten=self.backend == "gloo", parts=parts)
        return Unit(str(g), tuple(kernels), (comm,))


class _PerWorld:
    """Factors of a buffer's bytes that depend on the world R, bound only at evaluation (a plan serves
    every world): markers in a term's third item."""

    PEERS_FRACTION = -1.0  # (R - 1) / R
    TWO_PEERS = -2.0  # 2 (R - 1): a reduction reads its own and every peer's rows, pairwise
    PEERS = -3.0  # R - 1
    ALL = -4.0  # R


def _scaled(terms: Iterable[Term], marker: float) -> tuple[Term, ...]:
    # a term's coefficient carries the marker in a second slot: (coef, idx, marker)
    return tuple((c, idx, marker) for c, idx in terms)  # type: ignore[misc]


@functools.lru_cache(maxsize=16384)
def _plan(key: "_Key") -> Plan:
    s = key.schedule
    return _Builder(s.scheduled, key.backend, s.knob_values).plan()


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
    if backend not in BACKENDS:
        raise CoconetError(f"unknown backend {backend!r} (use {', '.join(BACKENDS)})")
    return _plan(_Key(schedule, backend))


# --- evaluation ---

def _fraction(marker: float, world: int) -> float:
    if marker == _PerWorld.PEERS_FRACTION:
        return (world - 1) / world
    if marker == _PerWorld.TWO_PEERS:
        return 2.0 * (world - 1)
    if marker == _PerWorld.PEERS:
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


def collective_time(op: str, nbytes: float, topo: Topology, backend: str, world: int,
                    between_stages: bool = False, crosses_nodes: bool | None = None) -> float:
    """Seconds of one collective over a whole buffer of ``nbytes`` among ``world`` ranks on a network
    backend (gloo, nccl): the topology's measured fit, else the best of the backend's algorithms."""
    if world <= 1 and op != "send":
        return 0.0
    fit = topo.fit(backend, op)
    if fit is not None and world == topo.world:
        return fit.time(nbytes)
    if crosses_nodes is None:  # ranks fill nodes in order; a topology's nodes are all there is
        nodes = min(topo.nodes, max(1, -(-world // topo.ranks_per_node)))
    else:
        nodes = 2 if crosses_nodes and topo.nodes > 1 else 1
    intra, inter = topo.intra, topo.inter if nodes > 1 and topo.inter is not None else None
    beta = max(intra.beta, inter.beta) if inter else intra.beta  # a ring or tree moves at its slowest link
    a_in, a_out = intra.alpha_s, (inter.alpha_s if inter else intra.alpha_s)
    launch = topo.launch_s
    if op == "send":
        return launch + (a_out if inter else a_in) + nbytes * beta
    p = world
    best = math.inf
    for alg in topo.algorithms_for(backend, op):
        if op == "allreduce":
            if alg == "ring":
                steps, inter_steps = 2 * (p - 1), 2 * (nodes - 1)
                t = (steps - inter_steps) * a_in + inter_steps * a_out + 2 * (p - 1) / p * nbytes * beta
            elif alg == "tree":  # NCCL: a chain inside each node, a binary tree across nodes, up and down
                per_node = -(-p // nodes)
                t = 2 * ((per_node - 1) * a_in + math.ceil(math.log2(nodes)) * a_out) + 2 * nbytes * beta
            else:  # direct: every rank exchanges with every other at once, twice
                t = 2 * max(a_in, a_out) + 2 * (p - 1) / p * nbytes * beta
        elif op == "reduce_scatter" and alg == "allreduce":  # the whole buffer reduced; each keeps its rows
            t = 2 * (p - nodes) * a_in + 2 * (nodes - 1) * a_out + 2 * (p - 1) / p * nbytes * beta
        elif op in ("reduce_scatter", "all_gather"):
            if alg == "ring":
                t = (p - nodes) * a_in + (nodes - 1) * a_out + (p - 1) / p * nbytes * beta
            else:
                t = max(a_in, a_out) + (p - 1) / p * nbytes * beta
        else:  # broadcast
            if alg == "ring":  # pipelined along a chain
                t = (p - nodes) * a_in + (nodes - 1) * a_out + nbytes * beta
            elif alg == "tree":
                t = math.ceil(math.log2(p)) * (max(a_in, a_out) + nbytes * beta)
            else:  # the root sends to each peer in turn
                t = (p - 1) * (max(a_in, a_out) + nbytes * beta)
        best = min(best, t)
    return launch + best


def shm_collective(op: str, nbytes: float, world: int) -> tuple[float, float, int]:
    """(bytes moved through memory, of which fresh, barriers) per rank for one collective of the shm
    backend over a whole buffer of ``nbytes``, counted from ``coconet.kernels.shm``."""
    R = world
    peers = (R - 1) / R
    if op == "allreduce":
        # publish the peers' rows, reduce own rows out of every segment, copy every rank's rows back
        return (2 * peers + 3 * peers + 2) * nbytes, 0.0, 2
    if op == "reduce_scatter":
        return (2 * peers + 3 * peers) * nbytes, nbytes / R, 1
    if op == "all_gather":
        return (2 / R + 2) * nbytes, nbytes, 1
    if op == "broadcast":
        return 2 * nbytes, 0.0, 1
    return 0.0, 0.0, 1  # a barrier alone


def _bucket_launches(sizes: Sequence[float], cap: int) -> list[float]:
    """The bytes of each launch, grouped as ``_launches`` of the generated code groups them."""
    groups: list[float] = []
    size = 0.0
    for n in sizes:
        if groups and size + n > cap:
            groups.append(0.0)
            size = 0.0
        if not groups:
            groups.append(0.0)
        groups[-1] += n
        size += n
    return groups


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


def evaluate(plan: Plan, sizes: Mapping[str, int], topo: Topology, backend: str, world: int,
             stages: int = 1, detail: list | None = None) -> Prediction:
    elems = _elems(plan, sizes, world)
    # the kernels' rates: more ranks than the topology places (one calibrated with R ranks a node, asked about
    # more) share its nodes' memory and cores
    each = topo.shared_by(max(1.0, world * stages / topo.world))
    mem_beta = each.memory_beta
    cache_beta = 1.0 / (each.cache_bandwidth_GBps * 1e9) if each.cache_bandwidth_GBps else mem_beta
    buffer_limit = topo.cache_bytes / 3 if topo.cache_bandwidth_GBps else -1.0
    faults = bool(topo.fresh_cost)
    overlap_memory = topo.overlap if topo.overlap_memory is None else topo.overlap_memory
    fresh_cost = each.fresh_s_per_byte
    ew_rate = each.elementwise_Gops * 1e9 if each.elementwise_Gops else math.inf
    eager_rate = each.eager_elementwise_Gops * 1e9 if each.eager_elementwise_Gops else math.inf
    eager_launch = each.launch_s
    fused_launch = each.fused_launch_s
    # stage s holds ranks [s·world, (s+1)·world); a send goes world ranks on, across nodes for some rank?
    rpn = topo.ranks_per_node
    send_crosses = stages > 1 and any(r // rpn != (r + world) // rpn for r in range(min(world, rpn)))
    compute = memory = comm = overhead = hidden = 0.0
    for unit in plan.units:
        u_compute = u_memory = u_over = 0.0
        for k in unit.kernels:
            # each buffer streams from cache if one launch's piece of it fits a third of it (the three
            # streams of an op, as calibrate measures the cache), the program's inputs and state from memory
            per = max(1, k.launches)
            mem_t = 0.0
            for term in k.read + k.write:
                b = _value((term,), elems, world)
                mem_t += b * (cache_beta if b / per <= buffer_limit else mem_beta)
            for term in k.cold:
                b = _value((term,), elems, world)
                if b / per <= buffer_limit:
                    mem_t += b * (mem_beta - cache_beta)
            if faults and k.fresh:
                for b in _each(k.fresh, elems, world):
                    mem_t += b * fresh_cost(b / k.launches if k.launches > 1 else b)
            c_t = 0.0
            if k.flops:
                c_t = _value(k.flops, elems, world) / each.flops(k.dtype)
            if k.ops:
                c_t = max(c_t, _value(k.ops, elems, world) / (ew_rate if k.compiled else eager_rate))
            if c_t > mem_t:
                u_compute += c_t
            else:
                u_memory += mem_t
            u_over += k.launches * (fused_launch if k.compiled else eager_launch)
        u_comm = u_comm_mem = 0.0
        for c in unit.comms:
            if c.op == "barrier":
                u_comm += c.launches * topo.shm_barrier_s
                continue
            sizes_b = _each(c.members, elems, world)
            if c.shm:
                launches = _bucket_launches(sizes_b, c.cap) if c.cap else [sum(sizes_b)]
                for total in launches:
                    per = total / c.launches * (world if c.parts else 1)
                    moved, fresh, barriers = shm_collective(c.op, per, world)
                    t = moved * mem_beta
                    if faults and fresh:
                        t += fresh * fresh_cost(fresh)
                    u_comm_mem += c.launches * t
                    u_comm += c.launches * (barriers * topo.shm_barrier_s + eager_launch)
                continue
            if c.between_stages:
                n = sum(sizes_b)
                u_comm += collective_time("send", n, topo, backend if backend != "shm" else "gloo", world,
                                          crosses_nodes=send_crosses)
                continue
            launches = _bucket_launches(sizes_b, c.cap) if c.cap else [sum(sizes_b)]
            for total in launches:
                per = total / c.launches
                u_comm += c.launches * collective_time(c.op, per, topo, backend, world)
                if c.flatten and len(sizes_b) > 1:
                    u_comm_mem += 4 * total * mem_beta  # into the flat buffer and back, read and written
        work = u_compute + u_memory + u_over
        talk = u_comm + u_comm_mem
        u_hidden = 0.0
        if unit.chunks > 1 and talk and work:
            # the collectives progress under the computation: fully under compute-bound work where the
            # link does not need the compute units, partly under memory-bound work (the same bytes' path)
            under = topo.overlap * u_compute + overlap_memory * (u_memory + u_over)
            u_hidden = min(under, talk) * (unit.chunks - 1) / unit.chunks
        compute += u_compute
        memory += u_memory + u_comm_mem
        comm += u_comm
        overhead += u_over
        hidden += u_hidden
        if detail is not None:
            detail.append((unit.what, work + talk - u_hidden, {"compute": u_compute, "memory": u_memory + u_comm_mem,
                                                               "communication": u_comm, "overhead": u_over,
                                                               "overlapped": u_hidden}))
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


def predict(schedule: Schedule, sizes: Mapping[str, int], topology: Topology, backend: str, *,
            world: int | None = None, stages: int | None = None) -> Prediction:
    """Predicted step time of ``schedule`` at ``sizes`` with ``backend`` on ``topology``: on all its ranks,
    or on ``world`` of them. A pipeline program's ranks form ``stages`` (default 2) stages of
    ``world // stages`` (``coconet run --world`` counts one stage's); the prediction is one stage's step,
    its send included."""
    topology.check_backend(backend)
    group, stages = _world(schedule, topology, world, stages)
    return evaluate(plan(schedule, backend), sizes, topology, backend, group, stages)


def explain(schedule: Schedule, sizes: Mapping[str, int], topology: Topology, backend: str, *,
            world: int | None = None, stages: int | None = None) -> list[tuple[str, float, dict]]:
    """Per unit of the lowered schedule: what it is, its predicted seconds and their breakdown."""
    topology.check_backend(backend)
    group, stages = _world(schedule, topology, world, stages)
    detail: list = []
    evaluate(plan(schedule, backend), sizes, topology, backend, group, stages, detail)
    return detail


def rank(schedules: Iterable[Schedule], sizes: Mapping[str, int], topology: Topology, backend: str, *,
         world: int | None = None, stages: int | None = None) -> list[Schedule]:
    """``schedules`` best-first by predicted time; ties keep their given order."""
    scored = [(predict(s, sizes, topology, backend, world=world, stages=stages).seconds, i, s)
              for i, s in enumerate(schedules)]
    scored.sort(key=lambda x: (x[0], x[1]))
    return [s for _, _, s in scored]
