"""The embedded DSL (docs/dsl.md): ``Program``, expressions, collectives.

Expressions are handles onto statements of one program's builder; each
operator or function call adds (or finds, by hash-consing) a statement and
checks it at once, so an error points at the line that wrote it.
"""

from __future__ import annotations

import math
import os
import sys
from types import FrameType
from typing import Any, Callable, Iterable

from coconet.errors import ProgramError
from coconet.schedules.builder import Builder, CustomSpec
from coconet.schedules.ir import NEXT_STAGE, PREV_STAGE
from coconet.schedules.ir import Program as IRProgram
from coconet.schedules.types import TensorType, as_layout

_PKG_ROOTS = tuple(
    os.path.dirname(os.path.abspath(m)) + os.sep
    for m in (__file__, os.path.join(os.path.dirname(__file__), "..", "coconet", "__init__.py"))
)


def _caller() -> str | None:
    """``file:line`` of the first frame outside coconet: where the user wrote the statement."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        fname = os.path.abspath(frame.f_code.co_filename)
        if not fname.startswith(_PKG_ROOTS):
            rel = os.path.relpath(fname)
            return f"{fname if rel.startswith('..') else rel}:{frame.f_lineno}"
        frame = frame.f_back
    return None


class Program:
    """A distributed program under construction. ``program.ir`` is its verified, immutable IR."""

    def __init__(self, name: str, dims: Iterable[str] | str = ()):
        if isinstance(dims, str):
            dims = dims.replace(",", " ").split()
        self._b = Builder(name, tuple(dims))
        self._ir: IRProgram | None = None

    @property
    def name(self) -> str:
        return self._b.name

    @property
    def dims(self) -> tuple[str, ...]:
        return self._b.dims

    def _add(self, op: str, args: tuple[int, ...] = (), attrs: dict | None = None, name: str | None = None) -> int:
        self._ir = None
        return self._b.add(op, args, attrs, name=name, location=_caller())

    def tensor(self, name: str, shape: Iterable[Any], layout: Any = None, dtype: str = "float32") -> "Expr":
        if layout is None:
            raise ProgramError(
                f"tensor {name!r} needs a layout: Local, Replicated or Sliced(dim)", statement=name, location=_caller()
            )
        if isinstance(shape, (str, int)):
            shape = (shape,)
        attrs = {"shape": list(shape), "layout": _layout_text(layout, name), "dtype": dtype}
        return Expr(self, self._add("input", (), attrs, name))

    def scalar(self, name: str, dtype: str = "float32") -> "Expr":
        return Expr(self, self._add("scalar", (), {"dtype": dtype}, name))

    def scalars(self, names: str | Iterable[str], dtype: str = "float32") -> tuple["Expr", ...]:
        if isinstance(names, str):
            names = names.replace(",", " ").split()
        return tuple(self.scalar(n, dtype) for n in names)

    def update(self, tensor: "Expr", value: Any) -> None:
        target = self._own(tensor, "update")
        self._add("update", (target.idx, self._operand(value).idx))

    def output(self, name: str, value: Any) -> None:
        self._add("output", (self._operand(value).idx,), {"name": name})

    def recv(
        self,
        name: str,
        shape: Iterable[Any],
        layout: Any = None,
        dtype: str = "float32",
        frm: str = PREV_STAGE,
        tag: str = "activation",
    ) -> "Expr":
        if layout is None:
            raise ProgramError(f"recv {name!r} needs a layout", statement=name, location=_caller())
        if isinstance(shape, (str, int)):
            shape = (shape,)
        attrs = {"shape": list(shape), "layout": _layout_text(layout, name), "dtype": dtype, "frm": frm, "tag": tag}
        return Expr(self, self._add("recv", (), attrs, name))

    @property
    def ir(self) -> IRProgram:
        if self._ir is None:
            self._ir = self._b.finish()
        return self._ir

    def __getitem__(self, name: str) -> "Expr":
        return Expr(self, self._b.index[name])

    def _own(self, x: Any, what: str) -> "Expr":
        if not isinstance(x, Expr):
            raise ProgramError(f"{what} needs a tensor of this program, got {x!r}", location=_caller())
        if x.program is not self:
            raise ProgramError(
                f"{what}: {x.name} belongs to program {x.program.name}, not {self.name}", location=_caller()
            )
        return x

    def _operand(self, x: Any) -> "Expr":
        if isinstance(x, Expr):
            return self._own(x, "operand")
        return const(self, x)

    def __repr__(self) -> str:
        return f"Program({self.name!r}, dims={self.dims}, statements={len(self._b.nodes)})"


def _layout_text(layout: Any, name: str) -> str:
    try:
        return str(as_layout(layout))
    except ValueError as e:
        raise ProgramError(str(e), statement=name, location=_caller()) from None


def const(program: Program, value: Any) -> "Expr":
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProgramError(f"{value!r} is neither an expression nor a number", location=_caller())
    return Expr(program, program._add("const", (), {"value": value}))


class Expr:
    """A value of a program: an operand for operators, functions and collectives."""

    __slots__ = ("program", "idx")
    __array_priority__ = 1000  # numpy scalars on the left defer to our reflected operators

    def __init__(self, program: Program, idx: int):
        self.program = program
        self.idx = idx

    @property
    def name(self) -> str:
        return self.program._b.nodes[self.idx].name

    @property
    def type(self) -> TensorType:
        return self.program._b.type_of(self.idx)

    @property
    def shape(self):
        return self.type.shape

    @property
    def layout(self):
        return self.type.layout

    @property
    def dtype(self):
        return self.type.dtype

    def named(self, name: str) -> "Expr":
        """Give this statement a name (used in listings and schedule text)."""
        self.program._b.rename(self.idx, name)
        self.program._ir = None
        return self

    def __repr__(self) -> str:
        return f"<{self.name}: {self.type}>"

    def __bool__(self) -> bool:
        raise ProgramError(
            f"{self.name} is a symbolic value and has no truth value; use where(cond, a, b)", location=_caller()
        )

    __hash__ = object.__hash__

    def __add__(self, o):
        return _binary("add", self, o)

    def __radd__(self, o):
        return _binary("add", o, self)

    def __sub__(self, o):
        return _binary("sub", self, o)

    def __rsub__(self, o):
        return _binary("sub", o, self)

    def __mul__(self, o):
        return _binary("mul", self, o)

    def __rmul__(self, o):
        return _binary("mul", o, self)

    def __truediv__(self, o):
        return _binary("div", self, o)

    def __rtruediv__(self, o):
        return _binary("div", o, self)

    def __pow__(self, o):
        return _binary("pow", self, o)

    def __rpow__(self, o):
        return _binary("pow", o, self)

    def __matmul__(self, o):
        return matmul(self, o)

    def __rmatmul__(self, o):
        return matmul(o, self)

    def __neg__(self):
        return _unary("neg", self)

    def __pos__(self):
        return self

    def __abs__(self):
        return _unary("abs", self)

    def __lt__(self, o):
        return _binary("lt", self, o)

    def __le__(self, o):
        return _binary("le", self, o)

    def __gt__(self, o):
        return _binary("gt", self, o)

    def __ge__(self, o):
        return _binary("ge", self, o)

    def __eq__(self, o):
        return _binary("eq", self, o)  # type: ignore[override]

    def __ne__(self, o):
        return _binary("ne", self, o)  # type: ignore[override]


def _program_of(*xs: Any) -> Program | None:
    prog = None
    for x in xs:
        if isinstance(x, Expr):
            if prog is not None and x.program is not prog:
                raise ProgramError(
                    f"operands come from two programs ({prog.name} and {x.program.name})", location=_caller()
                )
            prog = x.program
    return prog


def _apply(op: str, operands: tuple, attrs: dict | None = None) -> Expr:
    prog = _program_of(*operands)
    if prog is None:
        raise ProgramError(f"{op} needs at least one tensor or scalar of a program", location=_caller())
    idxs = tuple(prog._operand(x).idx for x in operands)
    return Expr(prog, prog._add(op, idxs, attrs))


def _binary(op: str, a: Any, b: Any) -> Expr:
    return _apply(op, (a, b))


_MATH: dict[str, Callable[[float], float]] = {
    "sqrt": math.sqrt,
    "exp": math.exp,
    "log": math.log,
    "abs": abs,
    "neg": lambda v: -v,
    "rsqrt": lambda v: 1.0 / math.sqrt(v),
}


def _unary(op: str, x: Any) -> Any:
    if not isinstance(x, Expr) and op in _MATH and isinstance(x, (int, float)) and not isinstance(x, bool):
        return _MATH[op](x)  # plain numbers fold, like math.sqrt
    return _apply(op, (x,))


def sqrt(x: Any) -> Any:
    return _unary("sqrt", x)


def rsqrt(x: Any) -> Any:
    return _unary("rsqrt", x)


def exp(x: Any) -> Any:
    return _unary("exp", x)


def log(x: Any) -> Any:
    return _unary("log", x)


def abs(x: Any) -> Any:
    return _unary("abs", x)  # noqa: A001 - the DSL's name, like torch.abs


def maximum(a: Any, b: Any) -> Expr:
    return _binary("maximum", a, b)


def minimum(a: Any, b: Any) -> Expr:
    return _binary("minimum", a, b)


def where(cond: Any, a: Any, b: Any) -> Expr:
    return _apply("where", (cond, a, b))


def cast(x: Any, dtype: str) -> Expr:
    return _apply("cast", (x,), {"dtype": dtype})


def norm(x: Expr) -> Expr:
    """L2 norm over all elements: a scalar (Sliced inputs: partial sums + allreduce)."""
    return _apply("norm", (x,))


def sum(x: Expr, dim: int | None = None, keepdim: bool = False) -> Expr:  # noqa: A001 - like torch.sum
    """Sum over ``dim`` (None: every element, a scalar). Over a Sliced value's sliced dim (or every dim) it is
    each rank's partial sum and an allreduce."""
    if dim is None and not keepdim:
        return _apply("sum", (x,))
    return _reduce("sum", x, dim, keepdim)


def _reduce(kind: str, x: Any, dim: Any, keepdim: Any) -> Expr:
    if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)):
        raise ProgramError(f"{kind}: dim must be an int or None, got {dim!r}", op=kind, location=_caller())
    if not isinstance(keepdim, bool):
        raise ProgramError(f"{kind}: keepdim must be True or False, got {keepdim!r}", op=kind, location=_caller())
    return _apply("reduce", (x,), {"op": kind, "dim": dim, "keepdim": keepdim})


def mean(x: Expr, dim: int | None = None, keepdim: bool = False) -> Expr:
    """Mean over ``dim`` (None: every element). Over a sliced dim: partial sums divided by the full extent,
    then an allreduce (sum)."""
    return _reduce("mean", x, dim, keepdim)


def max(x: Expr, dim: int | None = None, keepdim: bool = False) -> Expr:  # noqa: A001 - like torch.amax
    """Largest element along ``dim`` (the values, not the indices; None: every element). Over a sliced dim:
    each rank's maximum, then an allreduce with op "max"."""
    return _reduce("max", x, dim, keepdim)


def min(x: Expr, dim: int | None = None, keepdim: bool = False) -> Expr:  # noqa: A001 - like torch.amin
    """Smallest element along ``dim`` (None: every element). Over a sliced dim: allreduce with op "min"."""
    return _reduce("min", x, dim, keepdim)


def _normalizer(op: str, x: Any, dim: Any) -> Expr:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ProgramError(f"{op}: dim must be an int, got {dim!r}", op=op, location=_caller())
    return _apply(op, (x,), {"dim": dim})


def softmax(x: Expr, dim: int) -> Expr:
    """``exp(x) / sum(exp(x), dim)``, computed stably. Along a Sliced value's sliced dim it is written as the
    dim's max and sum of exponentials (partials + allreduces) and pointwise work on the slices."""
    return _normalizer("softmax", x, dim)


def log_softmax(x: Expr, dim: int) -> Expr:
    """``x - log(sum(exp(x), dim))``, computed stably; along a sliced dim, as ``softmax``."""
    return _normalizer("log_softmax", x, dim)


def layer_norm(x: Expr, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> Expr:
    """LayerNorm over the last dim (torch.nn.functional.layer_norm with one normalized dim, biased variance):
    ``(x - mean) * rsqrt(var + eps) * weight + bias``; ``weight``/``bias`` None leave that step out."""
    mu = mean(x, -1, keepdim=True)
    xc = x - mu
    y = xc * rsqrt(mean(xc * xc, -1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    return y + bias if bias is not None else y


def rms_norm(x: Expr, weight: Any = None, eps: float = 1e-6) -> Expr:
    """RMSNorm over the last dim: ``x * rsqrt(mean(x * x) + eps) * weight`` (torch.nn.functional.rms_norm)."""
    y = x * rsqrt(mean(x * x, -1, keepdim=True) + eps)
    return y * weight if weight is not None else y


def matmul(a: Expr, b: Expr) -> Expr:
    """``torch.matmul``: a (..., K) by a matrix b (K, N), or a batch of products a (..., M, K) by b (..., K, N)
    with the same batch dims (attention's ``q @ k^T`` per head). Layout rules: docs/dsl.md, "Layouts"."""
    return _apply("matmul", (a, b))


def transpose(x: Expr, dim0: int, dim1: int) -> Expr:
    """``torch.transpose``: ``x`` with dims ``dim0`` and ``dim1`` swapped (a view); a Sliced dim moves with them."""
    return _apply("transpose", (x,), {"dim0": dim0, "dim1": dim1})


def tensordot(a: Expr, b: Expr, dims: Any) -> Expr:
    """``torch.tensordot``: a and b contracted over ``dims`` (n: a's last n dims with b's first n; or a pair of
    lists, a's dims and b's, contracted in pairs), the result's dims a's others then b's others. Both sliced
    along a pair of contracted dims give partial sums (Local) for an allreduce: Megatron's row-parallel output
    projection over each rank's heads, ``tensordot(ctx, w_o, ([0, 2], [0, 1]))``, with no reshape."""
    return _apply("tensordot", (a, b), {"dims": dims})


def conv2d(x: Expr, w: Expr, stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1) -> Expr:
    """``torch.nn.functional.conv2d`` without a bias: x (B, C, H, W) by w (K, C/groups, kh, kw) into
    (B, K, H', W'); ``stride``, ``padding``, ``dilation`` an int or a pair. Batch slices of x, output-channel
    slices of w, or both sliced along their input channels (partial sums for an allreduce): docs/dsl.md."""
    return _apply("conv2d", (x, w), {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups})


def conv1d(x: Expr, w: Expr, stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1) -> Expr:
    """``torch.nn.functional.conv1d`` without a bias: x (B, C, L) by w (K, C/groups, k); as ``conv2d``."""
    return _apply("conv1d", (x, w), {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups})


def dropout(x: Expr, p: float, seed: Any) -> Expr:
    """Inverted dropout; the mask depends only on (seed, global element index) — see coconet.schedules.rng."""
    if isinstance(seed, Expr):
        return _apply("dropout", (x, seed), {"p": p})
    return _apply("dropout", (x,), {"p": p, "seed": seed})


def allreduce(x: Expr, op: str = "sum") -> Expr:
    return _apply("allreduce", (x,), {"op": op})


def reduce_scatter(x: Expr, op: str = "sum", dim: int = 0) -> Expr:
    return _apply("reduce_scatter", (x,), {"op": op, "dim": dim})


def all_gather(x: Expr) -> Expr:
    return _apply("all_gather", (x,))


def broadcast(x: Expr, root: int = 0) -> Expr:
    return _apply("broadcast", (x,), {"root": root})


def send(x: Expr, to: str = NEXT_STAGE, tag: str = "activation") -> None:
    """Send ``x`` to the same rank of the next pipeline stage (pairs with ``recv`` of the same tag)."""
    _apply("send", (x,), {"to": to, "tag": tag})


def recv(
    program: Program,
    name: str,
    shape: Iterable[Any],
    layout: Any = None,
    dtype: str = "float32",
    frm: str = PREV_STAGE,
    tag: str = "activation",
) -> Expr:
    """Receive the previous stage's ``send`` of the same tag; on stage 0, an input."""
    return program.recv(name, shape, layout=layout, dtype=dtype, frm=frm, tag=tag)


def apply_custom(op: CustomSpec, operands: tuple, attrs: dict) -> Expr:
    prog = _program_of(*operands)
    if prog is None:
        raise ProgramError(f"custom op {op.name} needs at least one tensor of a program", location=_caller())
    known = prog._b.custom_ops.get(op.name)
    if known is not None and known is not op:
        raise ProgramError(
            f"program {prog.name} already uses a different custom op named {op.name!r}", location=_caller()
        )
    prog._b.custom_ops[op.name] = op
    return _apply(op.name, operands, attrs)


def as_ir(program: Any) -> IRProgram:
    """Accept a DSL ``Program`` or an IR program."""
    if isinstance(program, Program):
        return program.ir
    if isinstance(program, IRProgram):
        return program
    raise ProgramError(f"expected a coconet Program, got {type(program).__name__}")
