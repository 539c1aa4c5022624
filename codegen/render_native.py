"""A chunk kernel as C (``coconet.kernels.native``): where a fused collective's chunk or a fuse kernel on shm
streams rows into the peers' copies of a state or into this rank's slot, which Inductor's kernel cannot do as
cheaply.
"""

from __future__ import annotations

from coconet.codegen.emitter import Emitter
from coconet.codegen.names import CUT, holder_rows
from coconet.kernels.chunk import FACTORS, HALF, ChunkKernel, Untranslatable
from coconet.kernels.native import c_source
from coconet.schedules.dims import Dim
from coconet.schedules.ir import COMPARE, ROWWISE_OPS, Stmt


def native_chunk(
    e: Emitter,
    compute: list[str],
    inplace: dict[str, str],
    into,
    peers,
    buffers,
    parts: Stmt | None,
    parts_names: tuple[str, ...],
    args: dict[str, str],
    dims: list[str],
    results: list[str],
    pre: tuple[str, ...] = (),
    sources: tuple[str, ...] = (),
    ranked=None,
    slots=None,
) -> tuple[str, str, int] | None:
    """The chunk kernel as C (coconet.kernels.native): its parameters' kinds, its source and how many partial
    sums it returns. Only where it stores a gathered state's rows into the peers' copies (shm), where its
    streamed stores save the read of every line an ordinary store makes first, or a gathered value into this
    rank's slot (``slots``). None where a statement has no
    translation or it returns anything but partial sums (Inductor's kernel serves alone)."""
    p = e.p
    slots = slots or {}
    if not e.backend.native_chunks or not (into or slots) or any(p[r].op != "partial_sum" for r in results):
        return None
    chunk = _Translation(
        e, compute, into, peers, buffers or {}, parts, parts_names, args, pre, sources, ranked or {}, slots
    )
    kinds = chunk.kinds(dims)
    if kinds is None:
        return None
    translated = chunk.statements(kinds, results)
    if translated is None:
        return None
    stmts, sums, pre_stmts = translated
    writes = chunk.writes(inplace)
    if any(t is None for t, _ in writes):
        return None
    spec = ChunkKernel(
        params=tuple(kinds),
        parts=(e.ident(parts.name), parts_names[0], parts.attr("op")) if parts is not None else None,
        stmts=tuple(stmts),
        numbers=frozenset(e.ident(m) for m in compute if e.number(m)),
        writes=tuple(writes),
        streams=tuple((args[peers[m]], e.ident(p[m].args[0])) for m in into),
        sums=tuple(sums),
        constants=tuple(chunk.constants),
        host=frozenset(chunk.host),
        pre=tuple(pre_stmts),
        part=e.ident(sources[0]) if pre else None,
        also=tuple(zip(map(e.ident, sources[1:]), parts_names[1:])) if pre else (),
        ranked=tuple((e.ident(x), param) for x, param in (ranked or {}).items()),
    )
    try:
        return spec.kinds, c_source(spec), len(sums)
    except Untranslatable:
        return None


def _of(dtype, kind: str) -> str:
    """The kind of rows of a half-precision dtype (bf16 rows, f16 peers, …)."""
    return f"{HALF[dtype]} {kind}" if dtype in HALF else kind


class _Translation:
    """What ``native_chunk`` reads of a chunk kernel to give it in C: each parameter's kind, its statements and
    what it writes (see native_chunk for the arguments)."""

    def __init__(
        self, e: Emitter, compute, into, peers, buffers, parts, parts_names, args, pre, sources, ranked, slots
    ):
        p = self.p = e.p
        self.e, self.compute, self.into, self.peers, self.buffers = e, compute, into, peers, buffers
        self.parts, self.parts_names, self.args, self.pre, self.sources = parts, parts_names, args, pre, sources
        self.ranked = ranked
        self.by_ident = {e.ident(s.name): s for s in p.stmts}
        self.slot_params = {args[rows]: o for o, rows in slots.items()}
        self.peer_params = {args[peers[m]]: p[m].type.dtype for m in into}
        self.holders = {buf: p[o] for o, buf in buffers.items()}  # the buffer a sliced output is written into
        self.constants: list[tuple[str, float]] = []
        self.host: set[str] = set()
        # the shape of what the chunk computes: an (m, 1) or (1, w) float32 operand of (m, w) statements is a
        # factor broadcast to its rows (Adafactor's r and c), read a row at a time
        self.shape = next((p[p[m].args[0]].type.shape for m in into), None) or next(
            (p[m].type.shape for m in compute if p[m].op != "partial_sum" and p[m].type is not None), None
        )

    def rows_or_factor(self, t) -> str:
        shape = self.shape
        if shape is not None and len(shape) == 2 and t.shape != shape and (t.dtype or "float32") == "float32":
            if t.shape == (shape[0], Dim.const(1)):
                return "row factor"
            if t.shape == (Dim.const(1), shape[1]):
                return "column factor"
        return _of(t.dtype, "rows")

    def kind(self, expr: str, param: str) -> str | None:
        """What the parameter ``param`` (``expr`` at the call) is to the C kernel; None where C takes no such."""
        p, by_ident = self.p, self.by_ident
        cut = CUT.fullmatch(expr)
        if param in self.peer_params:
            return _of(self.peer_params[param], "peers")
        if param in self.parts_names:
            dtype = p[self.sources[self.parts_names.index(param)]].type.dtype if self.pre else self.parts.type.dtype
            return _of(dtype, "parts")
        if param in self.ranked.values():
            return "rank numbers"
        if param in self.slot_params:
            return _of(p[self.slot_params[param]].type.dtype, "rows")
        if cut:  # rows of a tensor, or of a holder (its dtype the output's)
            tensor = by_ident.get(cut.group(1)) or self.holders.get(cut.group(1))
            return self.rows_or_factor(tensor.type) if tensor is not None else "rows"
        if expr in by_ident and by_ident[expr].type is not None and by_ident[expr].type.dtype != "int64":
            s = by_ident[expr]
            kind = "scalar" if s.type.shape == () else self.rows_or_factor(s.type)
            if kind == "scalar" and s.op == "const":
                self.constants.append((param, s.attr("value")))
            if kind == "scalar" and self.e.number(s.name):
                self.host.add(param)
            return kind
        return None  # dropout's first row, an int scalar

    def kinds(self, dims: list[str]) -> list[tuple[str, str]] | None:
        kinds: list[tuple[str, str]] = [(d, "dim") for d in dims]
        for expr, param in self.args.items():
            kind = self.kind(expr, param)
            if kind is None:
                return None
            kinds.append((param, kind))
        return kinds

    def name_of(self, text: str) -> str | None:
        text = CUT.sub(lambda m: self.args.get(m.group(0), "?"), text)
        return text if text.isidentifier() else None

    def statements(self, kinds, results) -> tuple[list, list, list] | None:
        """The statements as C takes them: (computed, partial sums returned, computed on every rank's rows)."""
        p, e, shape = self.p, self.e, self.shape
        factors = {param for param, kind in kinds if kind in FACTORS}
        stmts: list[tuple] = []
        sums: list[tuple[str, str | None]] = []
        pre_stmts: list[tuple] = []
        if self.pre and any(p[x].type.dtype != "float32" and p[x].type.dtype not in HALF for x in self.sources):
            return None
        for m in (*self.pre, *self.compute):
            s = p[m]
            if s.op in ROWWISE_OPS:
                return None  # C computes a chunk of flat elements: a row's reduction is Inductor's
            dtype = (
                "bool"
                if s.op in COMPARE
                else s.attr("dtype")
                if s.op == "cast" and s.attr("dtype") in HALF
                else "float32"
            )
            # arithmetic kept in a half dtype is Inductor's: torch's kernels round every op to it, which C can do
            # but at a cost that outweighs what it saves (benchmarks/results/interleaved_adam_bf16_rounded_w*.json)
            if s.type is None or (s.type.dtype or "float32") != dtype or s.op == "dropout":
                return None
            operands = [self.name_of(e.operand(s, a)) for a in s.args]
            if factors and (s.type.shape if s.op != "partial_sum" else p[s.args[0]].type.shape) != shape:
                return None  # beside factors, every value of the chunk is one of its rows' (a sum of a factor is not)
            if None in operands or (
                s.op != "partial_sum"
                and any(
                    p[a].type.shape not in ((), s.type.shape) and not (s.type.shape == shape and x in factors)
                    for a, x in zip(s.args, operands)
                )
            ):
                return None  # C reads an operand row for row, a factor a row at a time: another broadcast is Inductor's
            if s.op == "partial_sum":
                if m in results:
                    sums.append((e.ident(m), operands[0]))
                continue
            (pre_stmts if m in self.pre else stmts).append(
                (e.ident(m), s.op, tuple(operands), s.attr("dtype") if s.op == "cast" else s.attr("value"))
            )
        return stmts, sums, pre_stmts

    def writes(self, inplace) -> list[tuple[str | None, str]]:
        """(where, value) of every store: state in place, a gathered state's rows, a holder's, a slot's."""
        p, e = self.p, self.e
        writes = [(self.name_of(e.operand(p[o], t)), e.ident(o)) for o, t in inplace.items()]
        writes += [(self.name_of(e.operand(p[p[m].args[0]], t)), e.ident(p[m].args[0])) for m, t in self.into.items()]
        writes += [(self.name_of(holder_rows(p, o, buf)), e.ident(o)) for o, buf in self.buffers.items()]
        writes += [(param, e.ident(o)) for param, o in self.slot_params.items()]
        return writes
