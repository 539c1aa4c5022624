"""The reference interpreter: the oracle every schedule and backend is checked against.

It runs a program for ``world`` simulated ranks (``stages × world`` for
pipelines) in NumPy float64, statement by statement, holding for each rank the
piece of each value its layout gives it: the whole value for Replicated and
Local, rows ``[r·⌈n/R⌉, min((r+1)·⌈n/R⌉, n))`` along the sliced dim for
Sliced (so the last ranks may hold fewer rows, or none). Inputs are rounded to
their declared dtype first, so a float16 backend and the oracle start from
identical values; after that everything is float64 except ``cast``, which
rounds. Updates are simultaneous: every statement reads the state as it was
before the step. With ``precision="declared"`` every statement's value is
rounded to its own dtype instead, as a step computing statement by statement in
the program's dtypes would hold it: how far that lies from the float64 values
is how ill-conditioned the program is on its inputs (``equivalence.Reference``).

Pipelines run stage after stage; a ``recv`` on stage 0 is an input, on stage
s > 0 it is what stage s-1 sent with the same tag. What the last stage sends is
the pipeline's result.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from coconet.errors import ProgramError, SizeError
from coconet.schedules import rng
from coconet.schedules.dsl import as_ir
from coconet.schedules.ir import Program, Stmt
from coconet.schedules.pieces import Pieces, assemble, concrete_shape, distribute, local_region, round_to, slice_bounds
from coconet.schedules.types import Local, Replicated, Sliced, TensorType


def make_inputs(
    program: Any, world: int, sizes: Mapping[str, int], seed: int = 0, stage: int = 0
) -> dict[str, np.ndarray]:
    """Deterministic global input values for ``program``: same (seed, stage, name) → same values.

    Floats are drawn uniformly from [0.25, 1) — positive, so that sqrt, log and
    division are defined in any program — and rounded to the declared dtype.
    int64 scalars (seeds, counters) are drawn from [0, 2^31). Local tensors get
    one value per rank, stacked as ``(world, *shape)``.
    """
    prog = as_ir(program)
    out: dict[str, np.ndarray] = {}
    for s in prog.inputs:
        if s.op == "recv" and stage > 0:
            continue
        shape = concrete_shape(s.type, sizes)
        if isinstance(s.type.layout, Local):
            shape = (world,) + shape
        out[s.name] = _draw(_generator(s, seed, stage), s.type.dtype, shape)
    return out


def rank_inputs(
    program: Any, world: int, sizes: Mapping[str, int], rank: int, seed: int = 0, stage: int = 0
) -> dict[str, np.ndarray]:
    """``rank``'s pieces of ``make_inputs``, the same values. A rank's row of a Local float input is drawn alone
    (the generator skipped past the rows before it: a uniform draw takes one step of its stream), so a rank
    does not hold every rank's gradient to keep its own."""
    prog = as_ir(program)
    out: dict[str, np.ndarray] = {}
    for s in prog.inputs:
        if s.op == "recv" and stage > 0:
            continue
        t, shape = s.type, concrete_shape(s.type, sizes)
        gen = _generator(s, seed, stage)
        if isinstance(t.layout, Local) and t.dtype != "int64":  # integers are drawn by rejection: no skipping
            gen.bit_generator.advance(rank * math.prod(shape))
            out[s.name] = _draw(gen, t.dtype, shape)
        else:
            whole = _draw(gen, t.dtype, ((world,) if isinstance(t.layout, Local) else ()) + shape)
            out[s.name] = whole[rank] if isinstance(t.layout, Local) else distribute(t, whole, shape, world)[rank]
    return out


def _generator(s: Stmt, seed: int, stage: int) -> np.random.Generator:
    return np.random.default_rng([seed, stage, zlib.crc32(s.name.encode())])


def _draw(gen: np.random.Generator, dtype: str | None, shape: tuple[int, ...]) -> np.ndarray:
    if dtype == "int64":
        return gen.integers(0, 2**31, size=shape, dtype=np.int64)
    return round_to(gen.uniform(0.25, 1.0, size=shape), dtype)


@dataclass
class StageResult:
    state: dict[str, Pieces] = field(default_factory=dict)  # updated state, all inputs included
    outputs: dict[str, Pieces] = field(default_factory=dict)
    sent: dict[str, Pieces] = field(default_factory=dict)
    values: dict[str, Pieces] = field(default_factory=dict)  # every statement's pieces (with keep_values)


@dataclass
class Result:
    program: Program
    world: int
    sizes: dict[str, int]
    stages: list[StageResult]

    def _type(self, name: str) -> TensorType:
        return self.program[name].type

    def state(self, name: str, stage: int = 0) -> np.ndarray:
        return assemble(self._type(name), self.stages[stage].state[name])

    def output(self, name: str, stage: int = -1) -> np.ndarray:
        stmt = self.program[self.program.outputs[name]]
        return assemble(stmt.type, self.stages[stage].outputs[name])

    def sent(self, tag: str = "activation", stage: int = -1) -> np.ndarray:
        stmt = next(self.program[s.args[0]] for s in self.program.effects if s.op == "send" and s.attr("tag") == tag)
        return assemble(stmt.type, self.stages[stage].sent[tag])

    def value(self, name: str, stage: int = 0) -> np.ndarray:
        if name not in self.stages[stage].values:
            raise KeyError(f"{name}: not kept after its last reader; run(..., keep_values=True) keeps every value")
        return assemble(self._type(name), self.stages[stage].values[name])

    def observable(self) -> dict[str, np.ndarray]:
        """Everything a step makes visible, as global values: the basis of equivalence."""
        obs: dict[str, np.ndarray] = {}
        for k, st in enumerate(self.stages):
            for name in self.program.updates:
                obs[f"stage{k}.state.{name}"] = assemble(self._type(name), st.state[name])
            for name, src in self.program.outputs.items():
                obs[f"stage{k}.output.{name}"] = assemble(self.program[src].type, st.outputs[name])
            for s in self.program.effects:
                if s.op == "send":
                    tag = s.attr("tag")
                    obs[f"stage{k}.sent.{tag}"] = assemble(self.program[s.args[0]].type, st.sent[tag])
        return obs


def run(
    program: Any,
    world: int,
    sizes: Mapping[str, int] | None = None,
    *,
    seed: int = 0,
    inputs: Mapping[str, Any] | list[Mapping[str, Any]] | None = None,
    stages: int = 1,
    keep_values: bool = False,
    precision: str = "float64",
) -> Result:
    """Run ``program`` on ``world`` simulated ranks (per stage); ``inputs`` override generated ones.

    A value is dropped after its last reader unless ``keep_values``: the oracle of a large step at world R
    would otherwise hold every temporary R times over (Adam at N=2^25, world 4: 22 GB). ``precision``:
    "float64", or "declared" (each value rounded to its dtype, the module doc)."""
    prog = as_ir(program)
    if precision not in ("float64", "declared"):
        raise ValueError(f"precision is 'float64' or 'declared', not {precision!r}")
    if not isinstance(world, int) or world < 1:
        raise SizeError(f"world must be a positive number of ranks, got {world!r}")
    if not isinstance(stages, int) or stages < 1:
        raise SizeError(f"stages must be a positive int, got {stages!r}")
    sizes = dict(sizes or {})
    missing = [d for d in prog.dims if d not in sizes]
    if missing:
        raise SizeError(f"no size given for {', '.join(missing)}")
    if isinstance(inputs, list) and len(inputs) != stages:
        raise SizeError(f"inputs has {len(inputs)} entries for {stages} stages")
    results: list[StageResult] = []
    for k in range(stages):
        given = inputs[k] if isinstance(inputs, list) else (inputs or {})
        # the stage owns the values (it lets go of each once rounded into pieces)
        results.append(
            _run_stage(
                prog,
                world,
                sizes,
                k,
                make_inputs(prog, world, sizes, seed, stage=k) | dict(given),
                results[-1] if results else None,
                keep_values,
                precision == "declared",
            )
        )
    return Result(prog, world, sizes, results)


class _Ctx:
    def __init__(self, prog: Program, world: int, sizes: Mapping[str, int], stage: int):
        self.prog, self.world, self.sizes, self.stage = prog, world, sizes, stage
        self.vals: dict[str, Pieces] = {}

    def shape(self, name: str) -> tuple[int, ...]:
        return concrete_shape(self.prog[name].type, self.sizes)


def _run_stage(
    prog: Program,
    world: int,
    sizes: Mapping[str, int],
    stage: int,
    inputs: dict[str, Any],
    prev: StageResult | None,
    keep_values: bool = True,
    declared: bool = False,
) -> StageResult:
    ctx = _Ctx(prog, world, sizes, stage)
    out = StageResult(values=ctx.vals)
    last = {} if keep_values else _last_readers(prog)
    for i, s in enumerate(prog.stmts):
        try:
            if s.op in ("input", "scalar") or (s.op == "recv" and prev is None):
                ctx.vals[s.name] = _input_pieces(ctx, s, inputs)
            elif s.op == "recv":
                tag = s.attr("tag")
                if tag not in prev.sent:
                    raise ProgramError(f"stage {stage} receives tag {tag!r} that stage {stage - 1} never sent")
                ctx.vals[s.name] = [np.array(p) for p in prev.sent[tag]]
            elif s.op == "update":
                out.state[s.args[0]] = ctx.vals[s.args[1]]
            elif s.op == "output":
                out.outputs[s.attr("name")] = ctx.vals[s.args[0]]
            elif s.op == "send":
                out.sent[s.attr("tag")] = ctx.vals[s.args[0]]
            else:
                ctx.vals[s.name] = _eval(ctx, s)
                if declared:
                    ctx.vals[s.name] = _rounded(ctx.vals[s.name], s.type.dtype or "float32")
        except ProgramError as err:
            if err.statement is None:
                err.statement, err.op, err.location = s.name, s.op, prog.location(s.name)
            raise
        for a in last.get(i, ()):
            ctx.vals.pop(a, None)  # the state, outputs and sends that hold it keep their own reference
    for s in prog.inputs:
        if s.op != "recv" and s.name not in out.state:
            out.state[s.name] = ctx.vals[s.name]
    return out


def _rounded(pieces: Pieces, dtype: str) -> Pieces:
    if dtype not in ("float32", "float16", "bfloat16"):
        return pieces
    done: dict[int, np.ndarray] = {}  # a replicated value's ranks share one array: rounded once
    return [done.setdefault(id(p), round_to(p, dtype)) for p in pieces]


def _last_readers(prog: Program) -> dict[int, list[str]]:
    """Per statement index, the values it is the last to read; inputs are kept (the result's state names
    them all)."""
    last: dict[str, int] = {}
    for i, s in enumerate(prog.stmts):
        for a in s.args:
            last[a] = i
    keep = {s.name for s in prog.inputs}
    out: dict[int, list[str]] = {}
    for name, i in last.items():
        if name not in keep:
            out.setdefault(i, []).append(name)
    return out


def _input_pieces(ctx: _Ctx, s: Stmt, inputs: dict[str, Any]) -> Pieces:
    if s.name not in inputs:
        raise SizeError(f"no value for input {s.name}")
    t = s.type
    shape = ctx.shape(s.name)
    value = np.asarray(inputs.pop(s.name))
    want = ((ctx.world,) if isinstance(t.layout, Local) else ()) + shape
    if value.shape != want:
        raise SizeError(
            f"input {s.name} has shape {value.shape}, expected {want}"
            + (" (a Local tensor is given as one value per rank)" if isinstance(t.layout, Local) else "")
        )
    value = round_to(value, t.dtype)
    return distribute(t, value, shape, ctx.world)


# --- evaluation rules, one per op ---


def _operand_pieces(ctx: _Ctx, s: Stmt, arg: str) -> Pieces:
    """An operand's pieces as a pointwise op consumes them: Replicated operands of a
    Sliced result are cut to each rank's rows (the zero-copy view a backend takes)."""
    pieces = ctx.vals[arg]
    out_t, t = s.type, ctx.prog[arg].type
    if not isinstance(out_t.layout, Sliced) or not isinstance(t.layout, Replicated):
        return pieces
    d = out_t.layout.dim - (out_t.ndim - t.ndim)
    if d < 0 or t.shape[d] != out_t.shape[out_t.layout.dim]:
        return pieces  # the operand broadcasts along the sliced dim
    n = ctx.shape(s.name)[out_t.layout.dim]
    cut = []
    for r, p in enumerate(pieces):
        lo, hi = slice_bounds(n, ctx.world, r)
        cut.append(np.take(p, np.arange(lo, hi), axis=d))
    return cut


def _pointwise(fn: Callable[..., np.ndarray]) -> Callable[[_Ctx, Stmt], Pieces]:
    def rule(ctx: _Ctx, s: Stmt) -> Pieces:
        operands = [_operand_pieces(ctx, s, a) for a in s.args]
        if all(_one_array(op) for op in operands):  # the same operands on every rank: one result serves them all
            return [np.asarray(fn(*(op[0] for op in operands)))] * ctx.world
        return [np.asarray(fn(*(op[r] for op in operands))) for r in range(ctx.world)]

    return rule


def _one_array(pieces: Pieces) -> bool:
    return all(p is pieces[0] for p in pieces)


def _safe_pow(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.power(np.asarray(a, dtype=np.float64), b)


def _quiet(fn: Callable) -> Callable:
    def wrapped(*xs):
        with np.errstate(all="ignore"):  # inf/nan are values like any other; the caller compares them
            return fn(*xs)

    return wrapped


def _const(ctx: _Ctx, s: Stmt) -> Pieces:
    v = np.asarray(s.attr("value"), dtype=np.int64 if isinstance(s.attr("value"), int) else np.float64)
    return [v for _ in range(ctx.world)]


def _cast(ctx: _Ctx, s: Stmt) -> Pieces:
    pieces = ctx.vals[s.args[0]]
    if _one_array(pieces):
        return [round_to(pieces[0], s.attr("dtype"))] * ctx.world
    return [round_to(p, s.attr("dtype")) for p in pieces]


def _dropout(ctx: _Ctx, s: Stmt) -> Pieces:
    p = s.attr("p")
    seed = s.attr("seed")
    if seed is None:
        seed = int(ctx.vals[s.args[1]][0])
    t = s.type
    shape = ctx.shape(s.name)
    out = []
    for r, x in enumerate(ctx.vals[s.args[0]]):
        mask = rng.dropout_mask(seed, p, shape, local_region(t, shape, ctx.world, r))
        out.append(np.where(mask, x / (1.0 - p), 0.0))
    return out


def _matmul(ctx: _Ctx, s: Stmt) -> Pieces:
    a, b = ctx.vals[s.args[0]], ctx.vals[s.args[1]]
    return [np.matmul(np.asarray(a[r], np.float64), np.asarray(b[r], np.float64)) for r in range(ctx.world)]


def _tensordot(ctx: _Ctx, s: Stmt) -> Pieces:
    """Each rank's pieces as they lie: its rows of a free dim by the other operand whole, or its share of a
    contracted pair of both (a partial sum, zeros where it holds none)."""
    a, b = ctx.vals[s.args[0]], ctx.vals[s.args[1]]
    dims = [list(d) for d in s.attr("dims")]
    return [np.tensordot(np.asarray(a[r], np.float64), np.asarray(b[r], np.float64), dims) for r in range(ctx.world)]


def _transpose(ctx: _Ctx, s: Stmt) -> Pieces:
    return [np.swapaxes(np.asarray(x), s.attr("dim0"), s.attr("dim1")) for x in ctx.vals[s.args[0]]]


def conv_reference(
    x: np.ndarray,
    w: np.ndarray,
    stride: tuple[int, ...],
    padding: tuple[int, ...],
    dilation: tuple[int, ...],
    groups: int,
) -> np.ndarray:
    """torch's conv1d/conv2d (no bias) in float64: every kernel tap's strided window of the padded input, and
    a product with the weights per group. Empty channels (a rank's uneven slice) give zeros of the result's
    shape, which is what they add to a partial sum."""
    x = np.pad(np.asarray(x, np.float64), [(0, 0), (0, 0)] + [(p, p) for p in padding])
    w = np.asarray(w, np.float64)
    taps = w.shape[2:]
    out = [(n - d * (k - 1) - 1) // s + 1 for n, k, s, d in zip(x.shape[2:], taps, stride, dilation)]
    windows = np.empty(x.shape[:2] + taps + tuple(out))
    for tap in np.ndindex(*taps):
        window = tuple(slice(t * d, t * d + s * (n - 1) + 1, s) for t, d, s, n in zip(tap, dilation, stride, out))
        windows[(slice(None), slice(None)) + tap] = x[(slice(None), slice(None)) + window]
    b, c, k = x.shape[0], x.shape[1] // groups, w.shape[0] // groups
    windows = windows.reshape((b, groups, c, math.prod(taps)) + tuple(out))
    y = np.einsum("bgct...,gkct->bgk...", windows, w.reshape(groups, k, c, math.prod(taps)))
    return y.reshape((b, w.shape[0]) + tuple(out))


def _conv(ctx: _Ctx, s: Stmt) -> Pieces:
    """Each rank's pieces as they lie: its batch rows, its output channels, or its input channels of both (a
    partial sum); the layout rule says which."""
    x, w = ctx.vals[s.args[0]], ctx.vals[s.args[1]]
    attrs = (s.attr("stride"), s.attr("padding"), s.attr("dilation"), s.attr("groups"))
    if _one_array(x) and _one_array(w):
        return [conv_reference(x[0], w[0], *attrs)] * ctx.world
    return [conv_reference(x[r], w[r], *attrs) for r in range(ctx.world)]


def _sum(ctx: _Ctx, s: Stmt) -> Pieces:
    return [np.asarray(np.sum(p, dtype=np.float64)) for p in ctx.vals[s.args[0]]]


def _norm(ctx: _Ctx, s: Stmt) -> Pieces:
    return [np.asarray(np.sqrt(np.sum(np.square(p, dtype=np.float64)))) for p in ctx.vals[s.args[0]]]


_REDUCE = {
    "sum": lambda xs: np.sum(xs, axis=0),
    "prod": lambda xs: np.prod(xs, axis=0),
    "max": lambda xs: np.max(xs, axis=0),
    "min": lambda xs: np.min(xs, axis=0),
    "avg": lambda xs: np.mean(xs, axis=0),
}


def _allreduce(ctx: _Ctx, s: Stmt) -> Pieces:
    return [_REDUCE[s.attr("op")](np.stack(ctx.vals[s.args[0]]))] * ctx.world


def _reduce_scatter(ctx: _Ctx, s: Stmt) -> Pieces:
    total = _REDUCE[s.attr("op")](np.stack(ctx.vals[s.args[0]]))
    return distribute(s.type, total, total.shape, ctx.world)


def _all_gather(ctx: _Ctx, s: Stmt) -> Pieces:
    return [assemble(ctx.prog[s.args[0]].type, ctx.vals[s.args[0]])] * ctx.world


def _broadcast(ctx: _Ctx, s: Stmt) -> Pieces:
    root = s.attr("root")
    if root >= ctx.world:
        raise ProgramError(f"broadcast root {root} is outside the world of {ctx.world} ranks", rule="0 <= root < world")
    return [ctx.vals[s.args[0]][root]] * ctx.world


def _slice(ctx: _Ctx, s: Stmt) -> Pieces:
    shape = concrete_shape(s.type, ctx.sizes)
    return [piece[local_region(s.type, shape, ctx.world, r)] for r, piece in enumerate(ctx.vals[s.args[0]])]


def _partial_sum(ctx: _Ctx, s: Stmt) -> Pieces:
    return _sum(ctx, s)


_IDENTITY = {"sum": 0.0, "mean": 0.0, "max": -np.inf, "min": np.inf}


def _reduce_piece(x: np.ndarray, kind: str, axis: int | None, keepdim: bool) -> np.ndarray:
    """One rank's reduction; an empty slice (a rank past an uneven last slice) gives the kind's identity."""
    x = np.asarray(x, np.float64)
    if kind in ("max", "min"):
        fn = np.max if kind == "max" else np.min
        return np.asarray(fn(x, axis=axis, keepdims=keepdim, initial=_IDENTITY[kind]))
    return np.asarray(np.sum(x, axis=axis, keepdims=keepdim))


def _reduce(ctx: _Ctx, s: Stmt) -> Pieces:
    """``reduce``, and ``partial_reduce``: the same on each rank's slice, a mean's share divided by the extent of
    the whole (sliced) dim, so that the allreduce's sum is the mean."""
    kind, dim, keep = s.attr("op"), s.attr("dim"), s.attr("keepdim")
    x = s.args[0]
    count = 1
    if kind == "mean":
        shape = ctx.shape(x)
        count = math.prod(shape) if dim is None else shape[dim]
    out = []
    for piece in ctx.vals[x]:
        v = _reduce_piece(piece, kind, dim, keep)
        out.append(v / count if kind == "mean" else v)
    return out


def _softmax(log: bool) -> Callable[[_Ctx, Stmt], Pieces]:
    def rule(ctx: _Ctx, s: Stmt) -> Pieces:
        d = s.attr("dim")
        out = []
        for piece in ctx.vals[s.args[0]]:
            z = np.asarray(piece, np.float64)
            z = z - np.max(z, axis=d, keepdims=True)
            with np.errstate(all="ignore"):
                total = np.sum(np.exp(z), axis=d, keepdims=True)
                out.append(z - np.log(total) if log else np.exp(z) / total)
        return out

    return rule


def _custom(ctx: _Ctx, s: Stmt) -> Pieces:
    op = ctx.prog.custom_ops.get(s.op)
    if op is None:
        raise ProgramError(f"custom op {s.op} has no reference semantics in this program")
    attrs = dict(s.attrs)
    operands = [_operand_pieces(ctx, s, a) if op.kind == "pointwise" else ctx.vals[a] for a in s.args]
    out = []
    for r in range(ctx.world):
        try:
            v = np.asarray(op.reference(*(o[r] for o in operands), **attrs), dtype=np.float64)
        except Exception as e:
            raise ProgramError(f"the reference of custom op {s.op} failed: {e}") from None
        out.append(v)
    return out


EVAL: dict[str, Callable[[_Ctx, Stmt], Pieces]] = {
    "const": _const,
    "neg": _pointwise(np.negative),
    "sqrt": _pointwise(_quiet(np.sqrt)),
    "rsqrt": _pointwise(_quiet(lambda x: 1.0 / np.sqrt(x))),
    "exp": _pointwise(_quiet(np.exp)),
    "log": _pointwise(_quiet(np.log)),
    "abs": _pointwise(np.abs),
    "cast": _cast,
    "add": _pointwise(np.add),
    "sub": _pointwise(np.subtract),
    "mul": _pointwise(np.multiply),
    "div": _pointwise(_quiet(np.true_divide)),
    "pow": _pointwise(_safe_pow),
    "maximum": _pointwise(np.maximum),
    "minimum": _pointwise(np.minimum),
    "lt": _pointwise(np.less),
    "le": _pointwise(np.less_equal),
    "gt": _pointwise(np.greater),
    "ge": _pointwise(np.greater_equal),
    "eq": _pointwise(np.equal),
    "ne": _pointwise(np.not_equal),
    "where": _pointwise(np.where),
    "dropout": _dropout,
    "sum": _sum,
    "norm": _norm,
    "partial_sum": _partial_sum,
    "reduce": _reduce,
    "partial_reduce": _reduce,
    "softmax": _softmax(log=False),
    "log_softmax": _softmax(log=True),
    "matmul": _matmul,
    "tensordot": _tensordot,
    "transpose": _transpose,
    "conv1d": _conv,
    "conv2d": _conv,
    "allreduce": _allreduce,
    "reduce_scatter": _reduce_scatter,
    "all_gather": _all_gather,
    "broadcast": _broadcast,
    "slice": _slice,
}


def _eval(ctx: _Ctx, s: Stmt) -> Pieces:
    rule = EVAL.get(s.op, _custom)
    return rule(ctx, s)
