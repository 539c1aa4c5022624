"""A lowering plan priced: per unit of the step, the kernels it runs (launches, bytes read and written,
fresh buffers, flops, elementwise operations) and the collectives it issues, with sizes still symbolic
(``Plan``). Every decision is the lowering plan's (``coconet.codegen.plan``); ``coconet.tuner.cost``
evaluates a ``Plan`` at sizes on a topology.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import AbstractSet, Callable

from coconet.codegen.analysis import row_dim
from coconet.codegen.fused import FusedCollective
from coconet.codegen.plan import LoweringPlan
from coconet.schedules.dims import Dim
from coconet.schedules.ir import CONVS, PRODUCTS, VIEWS, Group, Stmt
from coconet.schedules.types import ITEMSIZE, Replicated, Sliced, TensorType
from coconet.tuner.priced import Comm, Kernel, PerWorld, Plan, Term, Unit, scaled


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


class Builder:
    """Prices a lowering plan (``coconet.codegen.plan``): every decision is the plan's, read through its
    attributes; the builder only counts what each unit moves and computes."""

    def __init__(self, plan: LoweringPlan):
        self.lowering = plan
        self.p, self.backend, self.knobs = plan.program, plan.backend, plan.knobs
        self.rows = plan.rows  # statements computed on rows of their value, each with its dim
        self.held = plan.held  # computed into a buffer kept from step to step (held_source)
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
        statement computed on this rank's rows, is cut to those rows (as ``Emitter.operand`` cuts it)."""
        t, out = self.p[a].type, s.type
        if t is None or t.is_scalar:
            return None
        if s.op in PRODUCTS:
            return self.local(t)  # a product reads its operands as they lie (Emitter.stmt)
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
        return s.op in ("input", "recv") or (s.op in VIEWS and self.is_cold(s.args[0]))

    def reads(self, s: Stmt, skip: AbstractSet[str] = frozenset(), cold: bool = False) -> tuple[Term, ...]:
        out: list[Term] = []
        for a in dict.fromkeys(s.args):
            if a in skip or self.p[a].op == "const" or (cold and not self.is_cold(a)):
                continue
            out += self.nbytes(self.p[a].type, self.consumed(s, a))
        return tuple(out)

    # units

    def plan(self) -> Plan:
        p, lp = self.p, self.lowering
        units: list[Unit] = []
        for u in lp.units:
            if isinstance(u, Group):
                units.append(self.group(u))
            else:
                units.extend(self.stmt(p[u]))
        tail: list[Kernel] = []
        for v in lp.aliased:  # state another is updated to: copied as the step begins
            t = p[v].type
            b = self.nbytes(t, self.local(t))
            tail.append(Kernel(f"clone {v}", 1, b, b, b, cold=b))
        copied = dict(lp.copied_at_end)
        for target, v in p.updates.items():  # in the program's order: each copied, computed into, or written
            t = p[target].type
            if target in lp.at_end:  # computed into the state: no new tensor, no copy
                k = self.eager(p[v])
                tail.append(
                    dataclasses.replace(
                        k, what=f"{v} into {target}", fresh=(), cold=k.cold + self.nbytes(t, self.local(t))
                    )
                )
            elif target in copied:
                tail.append(
                    Kernel(
                        f"{target}.copy_",
                        1,
                        self.nbytes(p[v].type, self.local(p[v].type)),
                        self.nbytes(t, self.local(t)),
                        cold=self.nbytes(t, self.local(t)),
                    )
                )
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
            return Kernel(
                s.name,
                launches * rng.dispatches,
                base + rng_r,
                out + rng_w,
                out + rng_w,
                ops=ops,
                dtype=t.dtype,
                cold=self.reads(s, cold=True),
            )
        if s.op in ("sum", "partial_sum", "norm"):
            return Kernel(s.name, launches, self.reads(s), dtype=t.dtype or "float32", cold=self.reads(s, cold=True))
        if s.op in ("softmax", "log_softmax"):
            # torch's kernel reads each row three times (its max, its sum of exponentials, the result)
            return Kernel(
                s.name, launches, self.reads(s) * 3, out, out, dtype=t.dtype or "float32", cold=self.reads(s, cold=True)
            )
        fresh = () if s.name in self.held else out
        return Kernel(
            s.name,
            launches,
            self.reads(s),
            out,
            fresh,
            dtype=(t.dtype if t else None) or "float32",
            cold=self.reads(s, cold=True),
        )

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
        again, cold_again = self.read_again(s, chunks, whole_each_chunk, lambda arg: self.consumed(s, arg))
        reads, cold = self.reads(s) + again, self.reads(s, cold=True) + cold_again
        return Kernel(s.name, chunks, reads, out, out, flops=flops, dtype=s.type.dtype or "float32", cold=cold)

    def read_again(
        self, s: Stmt, chunks: int, whole_each_chunk: int | None, piece: Callable[[str], int | None]
    ) -> tuple[tuple[Term, ...], tuple[Term, ...]]:
        """What ``chunks`` launches of ``s`` read beyond one pass over its operands: operand ``whole_each_chunk``
        (0 or 1; None: none) again by each launch after the first, its ``piece``; and of those, the cold bytes."""
        if whole_each_chunk is None or chunks <= 1:
            return (), ()
        arg = s.args[whole_each_chunk]
        again = self.nbytes(self.p[arg].type, piece(arg), chunks - 1)
        return again, (again if self.is_cold(arg) else ())

    def tensordot(self, s: Stmt, chunks: int = 1) -> Kernel:
        """A contraction: 2 flops per multiply-add, each element of this rank's piece of the result taking one
        per element of the contracted dims (this rank's share of them where both operands are sliced there); in
        ``chunks`` launches (an overlap's bands of a's rows), each reading all of b."""
        a = self.p[s.args[0]].type
        contracted = s.attr("dims")[0]
        sliced = a.layout.dim if isinstance(a.layout, Sliced) and a.layout.dim in contracted else None
        k_ext = self.extent(tuple(a.shape[d] for d in contracted), None if sliced is None else contracted.index(sliced))
        out_ext = self.local(s.type)
        flops = ((2.0, (out_ext, k_ext)),) if out_ext is not None else ()
        out = self.nbytes(s.type, out_ext)
        again, cold_again = self.read_again(s, chunks, 1, lambda arg: self.consumed(s, arg))
        reads, cold = self.reads(s) + again, self.reads(s, cold=True) + cold_again
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
        again, cold_again = self.read_again(s, chunks, whole_each_chunk, lambda arg: self.local(p[arg].type))
        reads, cold = reads + again, cold + cold_again
        return Kernel(s.name, chunks, reads, out, out, flops=flops, dtype=s.type.dtype or "float32", cold=cold)

    def collective(self, s: Stmt) -> Comm:
        p = self.p
        t = s.type if s.op == "all_gather" else p[s.args[0]].type
        return Comm(s.op, self.nbytes(t, self.whole(t)), shm=self.backend.shared_memory)

    def stmt(self, s: Stmt) -> list[Unit]:
        p, op = self.p, s.op
        if op in ("input", "scalar", "const", "update", "output", "recv") or op in VIEWS:
            return []  # recv: the stage before pays the transfer, as its send; a slice or a transpose is a view
        if op == "send":
            t = p[s.args[0]].type
            return [Unit(s.name, (), (Comm("send", self.nbytes(t, self.local(t)), between_stages=True),))]
        if op == "matmul":
            return [Unit(s.name, (self.matmul(s),))]
        if op == "tensordot":
            return [Unit(s.name, (self.tensordot(s),))]
        if op in CONVS:
            return [Unit(s.name, (self.conv(s),))]
        if op in ("allreduce", "broadcast"):
            t = p[s.args[0]].type
            clone = op == "broadcast" or s.name in self.lowering.copies
            b = self.nbytes(t, self.local(t))
            cold = b if self.is_cold(s.args[0]) else ()
            ks: tuple[Kernel, ...] = (Kernel(f"clone {s.args[0]}", 1, b, b, b, cold=cold),) if clone else ()
            return [Unit(s.name, ks, (self.collective(s),))]
        if op == "reduce_scatter":
            return [Unit(s.name, self.scatter_copies(s), (self.collective(s),))]
        if op == "all_gather" and s.name in self.lowering.fused_gathers:
            return []  # in the fuse kernel that computes its rows
        if op == "all_gather" and s.name in self.lowering.into_state:
            # two barriers; this rank's rows into its own copy of the state and every peer's
            part = p[s.args[0]].type
            mine = self.nbytes(part, self.local(part))
            peers = scaled(mine, PerWorld.PEERS)
            ks = (
                Kernel(f"{s.name} rows", 1, mine, mine, cold=mine),
                Kernel(f"{s.name} peers' rows", 1, peers, peers, cold=peers),
            )
            return [Unit(s.name, ks, (Comm("barrier", (), launches=2, shm=True),))]
        if op == "all_gather":
            return [Unit(s.name, self.gather_copies(s), (self.collective(s),))]
        return [Unit(s.name, (self.eager(s),))]  # a 0-d result moves no bytes: a launch

    def scatter_copies(self, s: Stmt) -> tuple[Kernel, ...]:
        """gloo/nccl: a reduce_scatter along a dim other than 0 moves it first (a copy); its output is
        a fresh buffer of this rank's rows. shm reads rows in place (its bytes are in the collective)."""
        if self.backend.shared_memory:
            return ()
        x = self.p[s.args[0]].type
        out = self.nbytes(s.type, self.local(s.type))
        if s.type.layout.dim != 0:
            whole = self.nbytes(x, self.local(x))
            return (Kernel(f"{s.name} contiguous", 1, whole, whole, whole), Kernel(f"{s.name} out", 0, (), (), out))
        return (Kernel(f"{s.name} out", 0, (), (), out),)

    def gather_copies(self, s: Stmt) -> tuple[Kernel, ...]:
        if self.backend.shared_memory:
            return ()
        part = self.p[s.args[0]].type
        out = self.nbytes(s.type, self.whole(s.type))
        ks = [Kernel(f"{s.name} out", 0, (), (), out)]
        if part.layout.dim != 0:
            mine = self.nbytes(part, self.local(part))
            ks.append(Kernel(f"{s.name} contiguous", 1, mine, mine, mine))
        return tuple(ks)

    def group(self, g: Group) -> Unit:
        if g.kind == "fuse":
            return self.fuse(g)
        if g.kind == "overlap":
            return self.overlap(g)
        if g.kind == "bucket":
            return self.bucket(g)
        return self.fused_collective(g)

    def fuse(self, g: Group) -> Unit:
        p = self.p
        fk = self.lowering.fuse_kernels[g]
        ins, inplace = fk.ins, fk.inplace
        outs = [*fk.outs, *fk.sums]
        members = (*fk.rows, *g.members)
        if not fk.compiled:  # a custom op's code runs as written: statement by statement
            return Unit(str(g), tuple(self.eager(p[m]) for m in members))
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
        into = set(fk.into.values())
        for o in outs:
            b = self.nbytes(p[o].type, self.written(o))
            if o in into:  # this rank's rows into its own copy of the state and every peer's: to memory
                writes += scaled(b, PerWorld.ALL)
                cold += scaled(b, PerWorld.ALL)
                continue
            writes += b
            if o not in inplace and o not in self.held:
                fresh += b
            else:  # into the state, or into the buffer a fused collective reads it from (held_source)
                cold += b
        ops = self.fused_dropout_ops(g.members)
        dtype = next((p[o].type.dtype for o in outs if p[o].type and p[o].type.dtype), "float32")
        k = Kernel(
            str(g), 1, tuple(reads), tuple(writes), tuple(fresh), ops=ops, dtype=dtype, compiled=True, cold=tuple(cold)
        )
        # its gathers into state: one barrier before the kernel writes the peers' copies, one after
        comms = (Comm("barrier", (), launches=2, shm=True),) if into else ()
        return Unit(str(g), (k,), comms)

    def dropout_cost(self) -> DropoutCost:
        return DROPOUT_PER_ELEMENT if self.backend.per_element_dropout else DROPOUT_PER_BLOCK

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

    def fused_collective(self, g: Group) -> Unit:
        p = self.p
        chunks = self.knobs["fc_chunks"]
        fc = self.lowering.fused_collectives[g]
        rs = fc.rs
        x = p[rs.args[0]].type
        shm = self.backend.shared_memory
        whole_in = self.nbytes(x, self.whole(x))
        mine_in = self.nbytes(rs.type, self.local(rs.type))
        # what the kernel reads of every rank's rows: the inputs its pre statements compute them from
        mine_src = tuple(
            t
            for x in fc.sources
            for t in self.nbytes(dataclasses.replace(rs.type, dtype=p[x].type.dtype), self.local(rs.type))
        )
        kernels, comms = self.fc_reduce(fc, chunks, whole_in, mine_in)
        # the computation on this rank's slice: one compiled kernel per chunk, or its statements eagerly
        if fc.compiles:
            kernels.append(self.fc_kernel(g, fc, chunks, mine_in, mine_src))
        else:
            kernels += self.fc_eager(fc, chunks)
        self.fc_gathers(fc, chunks, kernels, comms)
        if shm and (fc.gathers or fc.direct):  # one barrier ends the collective: its gathers, the peers' reads
            comms.append(Comm("barrier", (), launches=1, shm=True))
        for o in fc.sliced_outs if not fc.compiles else ():  # compiled, the kernel writes them into the whole output
            b = self.nbytes(p[o].type, self.local(p[o].type))
            kernels.append(Kernel(f"cat {o}", 1, b, b, b))
        overlapped = 1 if shm else chunks
        return Unit(str(g), tuple(kernels), tuple(comms), overlapped)

    def fc_reduce(self, fc: FusedCollective, chunks: int, whole_in, mine_in) -> tuple[list[Kernel], list[Comm]]:
        """A fused collective's reduction: on shm every row but this rank's published once (unless the peers
        read the input where it lies), one barrier, then per chunk the rows reduced out of the peers' segments
        (by the kernel itself when it sums them as it reads); elsewhere, a reduce_scatter per chunk."""
        rs, R = fc.rs, PerWorld  # the number of ranks, bound at evaluation (see PerWorld)
        kernels: list[Kernel] = []
        if not self.backend.shared_memory:
            if chunks > 1:  # each chunk's rows of every rank's block, gathered into one send buffer
                kernels.append(Kernel(f"{rs.name} chunk buffers", chunks, whole_in, whole_in, whole_in))
            return kernels, [Comm("reduce_scatter", whole_in, launches=chunks)]
        if not fc.direct:
            kernels.append(
                Kernel(
                    f"{rs.name} publish",
                    1,
                    scaled(whole_in, R.PEERS_FRACTION),
                    scaled(whole_in, R.PEERS_FRACTION),
                    cold=scaled(whole_in, R.PEERS_FRACTION) if self.is_cold(rs.args[0]) else (),
                )
            )
        if not fc.sums_parts:
            kernels.append(Kernel(f"{rs.name} reduce", chunks, scaled(mine_in, R.TWO_PEERS), scaled(mine_in, R.PEERS)))
        return kernels, [Comm("barrier", (), launches=1, shm=True)]

    def fc_kernel(self, g: Group, fc: FusedCollective, chunks: int, mine_in, mine_src) -> Kernel:
        """A fused collective's chunk as one compiled kernel per chunk."""
        p, R = self.p, PerWorld
        reads: list[Term] = []
        cold: list[Term] = []
        for a in fc.ins:
            if a in fc.sources or p[a].op == "const":
                continue
            readers = [p[m] for m in fc.compute if a in p[m].args]
            exts = {self.consumed(m, a) for m in readers}
            best = max((e for e in exts if e is not None), key=self.extents_rank, default=None)
            reads += self.nbytes(p[a].type, best)
            if self.is_cold(a):
                cold += self.nbytes(p[a].type, best)
        reads += scaled(mine_src, R.ALL) if fc.sums_parts else mine_in
        writes: list[Term] = []
        for o in fc.inplace:
            writes += self.nbytes(p[o].type, self.local(p[o].type))
            cold += self.nbytes(p[o].type, self.local(p[o].type))
        for m in fc.compute:
            if m in fc.needed:  # a partial sum is a scalar: no bytes
                writes += self.nbytes(p[m].type, self.local(p[m].type))
        if fc.rs.name in fc.sliced_outs:  # the reduced rows, which the group hands on, into one tensor
            writes += mine_in
        for m in fc.into:  # this rank's rows of the state, into its own copy and every peer's: to memory
            part = p[p[m].args[0]].type
            rows = scaled(self.nbytes(part, self.local(part)), R.ALL)
            writes += rows
            cold += rows
        x = p[fc.rs.args[0]].type
        return Kernel(
            f"{g} kernel",
            chunks,
            tuple(reads),
            tuple(writes),
            (),
            ops=self.fused_dropout_ops(fc.compute),
            compiled=True,
            dtype=x.dtype or "float32",
            cold=tuple(cold),
        )

    def fc_eager(self, fc: FusedCollective, chunks: int) -> list[Kernel]:
        """A fused collective's chunk statement by statement, its results copied into the state they update."""
        p = self.p
        kernels = [self.eager(p[m], launches=chunks) for m in fc.compute]
        for t in fc.inplace.values():
            b = self.nbytes(p[t].type, self.local(p[t].type))
            kernels.append(Kernel(f"{t}.copy_", chunks, b, b, cold=b))
        for m in fc.into:
            part = p[p[m].args[0]].type
            b = self.nbytes(part, self.local(part))
            peers = scaled(b, PerWorld.PEERS)
            kernels.append(Kernel(f"{m} into the peers' copies", chunks, peers, peers, cold=peers))
        return kernels

    def fc_gathers(self, fc: FusedCollective, chunks: int, kernels: list[Kernel], comms: list[Comm]) -> None:
        """A fused collective's all_gathers, added to its ``kernels`` and ``comms``."""
        p = self.p
        for m in fc.gathers:
            part = p[p[m].args[0]].type
            mine = self.nbytes(part, self.local(part))
            whole = self.nbytes(p[m].type, self.whole(p[m].type))
            if m in fc.into:
                # the state is whole: it lives in the segment the peers wrote their rows into (a state that
                # cannot move there, a view into a larger buffer, copies them in: not priced)
                continue
            if self.backend.shared_memory:
                # each chunk into this rank's slot; every rank's rows copied out
                kernels.append(Kernel(f"{m} publish", chunks, mine, mine))
                kernels.append(Kernel(f"{m} copy out", 1, whole, whole, whole))
            else:
                # gloo's list all_gather lands in a flat buffer, then in the views: one more copy
                kernels.append(Kernel(f"{m} into views", chunks, whole, whole, whole))
                comms.append(Comm("all_gather", whole, launches=chunks))

    def overlap(self, g: Group) -> Unit:
        p = self.p
        chunks = self.knobs["chunks"]
        mm, coll = p[g.members[0]], p[g.members[1]]
        # chunks of a's rows times all of b (allreduce), or all of a times chunks of b's columns; a convolution's
        # chunks of the batch by all of w, or (scattered along the batch) all of x by chunks of w
        by_rows = coll.op == "allreduce" or (mm.op in CONVS and coll.type.layout != Sliced(0))
        if mm.op == "tensordot":  # bands of a's rows by all of b, against an allreduce
            k = self.tensordot(mm, chunks)
        else:
            k = (self.conv if mm.op in CONVS else self.matmul)(mm, chunks, whole_each_chunk=1 if by_rows else 0)
        out = self.nbytes(coll.type, self.local(coll.type))
        cat = Kernel(f"cat {coll.name}", 1, out, out, out)
        t = mm.type
        comm = Comm(coll.op, self.nbytes(t, self.whole(t)), launches=chunks, shm=self.backend.shared_memory)
        kernels = [k, cat]
        if coll.op == "reduce_scatter" and not self.backend.shared_memory:
            kernels += [Kernel(f"{coll.name} out", 0, (), (), out)]
        return Unit(str(g), tuple(kernels), (comm,), chunks)

    def bucket(self, g: Group) -> Unit:
        p = self.p
        cap = self.knobs["bucket_bytes"]
        first = p[g.members[0]]
        shm = self.backend.shared_memory
        kernels: list[Kernel] = []
        members: list[Term] = []
        parts = False
        for m in g.members:
            s = p[m]
            if s.op == "allreduce" and m in self.lowering.copies:
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
        comm = Comm(first.op, tuple(members), cap=cap, shm=shm, flatten=self.backend.flattens_buckets, parts=parts)
        return Unit(str(g), tuple(kernels), (comm,))
