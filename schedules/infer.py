"""Shape, dtype and layout inference: the table of docs/dsl.md, "Layouts", one rule per op kind.

Each rule takes the operands' types and the statement's attributes and returns
the result type or raises ``ProgramError`` naming the rule and the operands.
The builder adds the statement's name and source location.
"""

from __future__ import annotations

from typing import Any, Sequence

from coconet.errors import ProgramError
from coconet.schedules.dims import Dim
from coconet.schedules.types import FLOAT_DTYPES, Layout, Local, Replicated, Sliced, TensorType, promote

ONE = Dim.const(1)
SCALAR_SHAPE: tuple[Dim, ...] = ()


def operands_text(names: Sequence[str], types: Sequence[TensorType]) -> str:
    """Operands as an error names them: ``a: (N, M) Sliced(0), b: ...``."""
    return ", ".join(f"{n}: {t.shape_text()} {t.layout}" for n, t in zip(names, types))


def need_numbers(op: str, types: Sequence[TensorType], names: Sequence[str]) -> None:
    """A product's operands are numbers: a comparison's result (bool) is refused, naming the operand."""
    for n, t in zip(names, types):
        if t.dtype == "bool":
            raise ProgramError(f"{op} operand {n} is bool", rule=f"{op} needs numbers")


def broadcast_shapes(shapes: Sequence[tuple[Dim, ...]]) -> tuple[Dim, ...] | None:
    ndim = max((len(s) for s in shapes), default=0)
    out: list[Dim] = []
    for i in range(ndim):
        dim = ONE
        for s in shapes:
            k = i - (ndim - len(s))
            if k < 0:
                continue
            d = s[k]
            if d == ONE or d == dim:
                continue
            if dim == ONE:
                dim = d
            else:
                return None
        out.append(dim)
    return tuple(out)


def pointwise_layout(types: Sequence[TensorType], out_shape: tuple[Dim, ...], names: Sequence[str]) -> Layout:
    """R⊕R→R · R⊕L→L · R⊕S→S · L⊕L→L · S⊕S→S (same dim) · L⊕S: error."""
    ndim = len(out_shape)
    has_local = any(isinstance(t.layout, Local) for t in types)
    sliced_dims = set()
    for t in types:
        if isinstance(t.layout, Sliced):
            d = t.layout.dim + (ndim - t.ndim)
            if t.shape[t.layout.dim] != out_shape[d]:
                raise ProgramError(
                    f"a Sliced operand cannot be broadcast along its sliced dim ({operands_text(names, types)})",
                    rule="pointwise: a sliced dim keeps its extent",
                )
            sliced_dims.add(d)
    if sliced_dims and has_local:
        raise ProgramError(
            f"cannot combine Local and Sliced operands ({operands_text(names, types)}); "
            "reduce the Local value first (reduce_scatter or allreduce)",
            rule="pointwise L⊕S is an error",
        )
    if len(sliced_dims) > 1:
        raise ProgramError(
            f"operands are Sliced along different dims ({operands_text(names, types)})",
            rule="pointwise S⊕S needs the same sliced dim",
        )
    if sliced_dims:
        return Sliced(sliced_dims.pop())
    if has_local:
        return Local()
    return Replicated()


def pointwise(types: Sequence[TensorType], names: Sequence[str], weak: Sequence[Any], op: str) -> TensorType:
    shape = broadcast_shapes([t.shape for t in types])
    if shape is None:
        raise ProgramError(
            f"shapes do not broadcast ({', '.join(f'{n}: {t.shape_text()}' for n, t in zip(names, types))})",
            rule="pointwise shapes broadcast (trailing dims equal or 1)",
        )
    layout = pointwise_layout(types, shape, names)
    if op == "where":
        cond, *vals = types
        if cond.dtype != "bool":
            raise ProgramError(
                f"where's condition {names[0]} is {cond.dtype}, not a comparison",
                rule="where(cond, a, b) takes a bool condition",
            )
        dtype = promote(list(zip(vals, weak[1:])))
    else:
        for n, t in zip(names, types):
            if t.dtype == "bool":
                raise ProgramError(
                    f"operand {n} is a comparison result (bool); use where(...) or cast(...)",
                    rule="arithmetic needs numbers",
                )
        dtype = promote(list(zip(types, weak)))
        if op in ("lt", "le", "gt", "ge", "eq", "ne"):
            dtype = "bool"
        elif op in ("div", "sqrt", "rsqrt", "exp", "log") and dtype not in FLOAT_DTYPES:  # true division, as torch's
            dtype = "float32"
    return TensorType(shape, dtype, layout)


def cast(t: TensorType, dtype: str) -> TensorType:
    return TensorType(t.shape, dtype, t.layout)


def dropout(x: TensorType, names: Sequence[str], seed: TensorType | None = None) -> TensorType:
    if x.dtype not in FLOAT_DTYPES and x.dtype is not None:
        raise ProgramError(f"dropout of {names[0]} ({x.dtype}) needs a float tensor", rule="dropout(x: float)")
    if seed is not None:
        if seed.dtype != "int64" or not seed.is_scalar or not isinstance(seed.layout, Replicated):
            raise ProgramError(
                f"dropout seed {names[1]} is {seed}; it must be an int64 Replicated scalar "
                "(p.scalar(name, dtype='int64')) or an int",
                rule="dropout seed is shared by all ranks",
            )
    return x


def reduction(x: TensorType, op: str, names: Sequence[str]) -> TensorType:
    if x.dtype == "bool":
        raise ProgramError(f"{op} of a comparison result {names[0]}", rule=f"{op} needs numbers")
    if op == "partial_sum":
        if not isinstance(x.layout, Sliced):
            raise ProgramError(
                f"partial_sum of {names[0]} ({x.layout}) — partial sums are of Sliced values",
                rule="partial_sum: S→L scalar",
            )
        return TensorType(SCALAR_SHAPE, x.dtype, Local())
    if isinstance(x.layout, Sliced):  # the builder expands these into partials + allreduce
        raise ProgramError(f"{op} of Sliced {names[0]} must be partial_sum + allreduce", rule=f"{op}: S→R via partials")
    return TensorType(SCALAR_SHAPE, x.dtype, x.layout)


def matmul(a: TensorType, b: TensorType, names: Sequence[str]) -> TensorType:
    """R×R→R · L×R→L · S(d)×R→S(d) for a non-contracted d · R×S(last)→S(last) · S(last)×S(0)→L. (R×S(0)
    never arrives here: the builder makes it S(last)×S(0) partials and an allreduce.)"""
    if b.ndim != 2 or a.ndim < 1:
        raise ProgramError(
            f"matmul({operands_text(names, (a, b))}) needs a (..., K) and b (K, M)",
            rule="matmul shapes (..., K) x (K, M)",
        )
    if a.shape[-1] != b.shape[0]:
        raise ProgramError(
            f"contracted dims differ: {names[0]}{a.shape_text()} and {names[1]}{b.shape_text()}",
            rule="matmul shapes (..., K) x (K, M)",
        )
    need_numbers("matmul", (a, b), names)
    shape = a.shape[:-1] + (b.shape[1],)
    dtype = promote([(a, None), (b, None)])
    la, lb = a.layout, b.layout
    last_a = a.ndim - 1
    layout: Layout | None = None
    if isinstance(la, Replicated) and isinstance(lb, Replicated):
        layout = Replicated()
    elif isinstance(la, Local) and isinstance(lb, Replicated):
        layout = Local()
    elif isinstance(la, Sliced) and la.dim != last_a and isinstance(lb, Replicated):
        layout = Sliced(la.dim)
    elif isinstance(la, Replicated) and isinstance(lb, Sliced) and lb.dim == 1:
        layout = Sliced(len(shape) - 1)
    elif isinstance(la, Sliced) and la.dim == last_a and isinstance(lb, Sliced) and lb.dim == 0:
        layout = Local()
    if layout is None:
        raise ProgramError(
            f"no matmul rule for {la} x {lb} ({operands_text(names, (a, b))}); allowed: R×R→R, L×R→L, "
            "S(d)×R→S(d) for d not contracted, R×S(last)→S(last), S(last)×S(0)→L, R×S(0)→R (partials + allreduce)",
            rule="matmul layouts",
        )
    return TensorType(shape, dtype, layout)


def allreduce(x: TensorType, names: Sequence[str]) -> TensorType:
    _need_local(x, names, "allreduce: L→R")
    return TensorType(x.shape, x.dtype, Replicated())


def reduce_scatter(x: TensorType, dim: int, names: Sequence[str]) -> TensorType:
    _need_local(x, names, "reduce_scatter: L→S")
    if x.is_scalar:
        raise ProgramError(f"reduce_scatter of scalar {names[0]}: nothing to slice", rule="reduce_scatter: L→S")
    return TensorType(x.shape, x.dtype, Sliced(normalize_dim(dim, x.ndim, names[0])))


def all_gather(x: TensorType, names: Sequence[str]) -> TensorType:
    if not isinstance(x.layout, Sliced):
        raise ProgramError(
            f"all_gather of {names[0]} ({x.layout}); only Sliced values are gathered", rule="all_gather: S→R"
        )
    return TensorType(x.shape, x.dtype, Replicated())


def broadcast(x: TensorType, names: Sequence[str]) -> TensorType:
    _need_local(x, names, "broadcast: L→R")
    return TensorType(x.shape, x.dtype, Replicated())


def slice_view(x: TensorType, dim: int, names: Sequence[str]) -> TensorType:
    """Each rank's rows of a value it holds whole: no communication, so only a value every rank holds the same."""
    if not isinstance(x.layout, Replicated):
        raise ProgramError(
            f"slice of {names[0]} ({x.layout}); only Replicated values are sliced where they lie", rule="slice: R→S"
        )
    if x.is_scalar:
        raise ProgramError(f"slice of scalar {names[0]}: nothing to slice", rule="slice: R→S")
    return TensorType(x.shape, x.dtype, Sliced(normalize_dim(dim, x.ndim, names[0])))


def _need_local(x: TensorType, names: Sequence[str], rule: str) -> None:
    if not isinstance(x.layout, Local):
        hint = " (it is already the same on every rank)" if isinstance(x.layout, Replicated) else ""
        raise ProgramError(
            f"{rule.split(':')[0]} of {names[0]} ({x.layout}){hint}; the operand must be Local", rule=rule
        )


def normalize_dim(dim: int, ndim: int, name: str) -> int:
    if not -ndim <= dim < ndim:
        raise ProgramError(f"dim {dim} is out of range for {name} with {ndim} dims", rule="dims index the shape")
    return dim % ndim


def update(target: TensorType, value: TensorType, names: Sequence[str]) -> None:
    if target.shape != value.shape:
        raise ProgramError(
            f"shape of {names[1]}{value.shape_text()} differs from {names[0]}{target.shape_text()}",
            rule="update(t, e): e has t's shape",
        )
    if value.dtype is not None and value.dtype != target.dtype:
        raise ProgramError(
            f"{names[1]} is {value.dtype} but {names[0]} is {target.dtype}; write cast({names[1]}, {target.dtype!r})",
            rule="update(t, e): e has t's dtype",
        )
    if value.layout != target.layout:
        raise ProgramError(
            f"{names[0]} is {target.layout} but the new value {names[1]} is {value.layout}",
            rule="update(t, e): e has t's layout, except Replicated t <- Sliced e (an implied all_gather)",
        )


def dim_index(x: TensorType, dim: int, op: str, name: str) -> int:
    if not -x.ndim <= dim < x.ndim:
        valid = f"in [{-x.ndim}, {x.ndim - 1}]" if x.ndim else "none: it is a scalar"
        raise ProgramError(
            f"{op} over dim {dim} of {name} with shape {x.shape_text()}: dims are {valid}",
            rule=f"{op}(x, dim): dim indexes x's shape",
        )
    return dim % x.ndim


def reduce_dim(
    x: TensorType, kind: str, dim: int | None, keepdim: bool, names: Sequence[str], partial: bool = False
) -> TensorType:
    """``kind`` (sum, mean, max, min) over ``dim`` (None: every dim): the dim goes, or stays with extent 1 under
    ``keepdim``. R→R, L→L; S(k) over another dim stays Sliced (along k, or k-1 where an earlier dim goes); S(k)
    over k (or every dim) is this rank's share of the result, Local (``partial_reduce``), that an allreduce
    completes (the builder writes both)."""
    if x.dtype == "bool":
        raise ProgramError(f"{kind} of a comparison result {names[0]}", rule=f"{kind} needs numbers")
    if kind == "mean" and x.dtype == "int64":
        raise ProgramError(f"mean of {names[0]} (int64); cast it to a float dtype first", rule="mean needs floats")
    dims = tuple(range(x.ndim)) if dim is None else (dim_index(x, dim, kind, names[0]),)
    shape = tuple(ONE if k in dims else d for k, d in enumerate(x.shape) if keepdim or k not in dims)
    dtype = x.dtype
    layout = x.layout
    over_slices = isinstance(layout, Sliced) and layout.dim in dims
    if partial:
        if not over_slices:
            raise ProgramError(
                f"partial_reduce of {names[0]} ({layout}) over dim {dim}: a partial reduction reduces a Sliced "
                "value over its sliced dim",
                rule="partial_reduce: S(k) over k → L",
            )
        return TensorType(shape, dtype, Local())
    if over_slices:
        raise ProgramError(
            f"{kind} of {names[0]} ({layout}) over its sliced dim must be partial_reduce + allreduce",
            rule=f"{kind} over a sliced dim: partials + allreduce",
        )
    if isinstance(layout, Sliced) and not keepdim:
        layout = Sliced(layout.dim - len([k for k in dims if k < layout.dim]))
    return TensorType(shape, dtype, layout)


def normalize(x: TensorType, op: str, dim: int, names: Sequence[str]) -> TensorType:
    """softmax / log_softmax along ``dim``: the shape and layout of ``x``; along a sliced dim the builder
    writes it as max and sum along the dim (partials + allreduces) and pointwise work on the slices."""
    if x.dtype == "bool" or x.dtype == "int64":
        raise ProgramError(f"{op} of {names[0]} ({x.dtype}) needs a float tensor", rule=f"{op}(x: float)")
    d = dim_index(x, dim, op, names[0])
    if isinstance(x.layout, Sliced) and x.layout.dim == d:
        raise ProgramError(
            f"{op} of {names[0]} ({x.layout}) along its sliced dim must be written as max and sum along the dim",
            rule=f"{op} along a sliced dim: max, sum and allreduces",
        )
    return TensorType(x.shape, x.dtype or "float32", x.layout)


def _exact_quotient(d: Dim, k: int) -> Dim | None:
    """``d // k`` as a polynomial where every coefficient but the constant's divides by ``k`` (the constant
    rounds down), else None: a floor of another polynomial is none."""
    if any(c % k for mono, c in d.terms if mono):
        return None
    const = next((c for mono, c in d.terms if not mono), 0)
    return Dim(tuple((mono, c // k) for mono, c in d.terms if mono)) + Dim.const(const // k)


def _conv_extent(
    n: Dim, k: Dim, stride: int, padding: int, dilation: int, op: str, names: Sequence[str], i: int
) -> Dim:
    """torch's output size ``(n + 2·padding - dilation·(k - 1) - 1) // stride + 1`` of one spatial dim."""
    span = n + Dim.const(2 * padding) - Dim.const(dilation) * (k - ONE) - ONE
    out = _exact_quotient(span, stride)
    rule = f"{op}: output size (n + 2*padding - dilation*(k - 1) - 1) // stride + 1"
    if out is None:
        raise ProgramError(
            f"spatial dim {i} of {names[0]} is {n} with kernel {k} and stride {stride}: the output size "
            f"({span}) // {stride} + 1 is not a polynomial of the dims; give {n} as an integer, a multiple of "
            f"{stride}, or stride 1",
            rule=rule,
        )
    out = out + ONE
    if out.value is not None and out.value <= 0:
        raise ProgramError(
            f"spatial dim {i} of {names[0]} ({n}, padded by {padding}) is smaller than the "
            f"kernel's reach ({k} taps, dilation {dilation}): the output would be empty",
            rule=rule,
        )
    return out


def conv(x: TensorType, w: TensorType, op: str, attrs: dict, names: Sequence[str]) -> TensorType:
    """conv1d/conv2d of x (B, C, *spatial) by w (K, C/groups, *kernel) into (B, K, *out). Layouts: R×R→R ·
    L×R→L · S(0)×R→S(0) (batch slices) · R×S(0)→S(1) (output channels; groups=1) · S(1)×S(1)→L (each rank's
    input channels: partial sums an allreduce or reduce_scatter completes; groups=1)."""
    nd = 1 if op == "conv1d" else 2
    spatial, taps = ("L", "k") if nd == 1 else ("H, W", "kh, kw")
    if x.ndim != nd + 2 or w.ndim != nd + 2:
        raise ProgramError(
            f"{op}({operands_text(names, (x, w))}) takes x (B, C, {spatial}) and w (K, C/groups, {taps})",
            rule=f"{op} shapes",
        )
    for n, t in zip(names, (x, w)):
        if t.dtype not in FLOAT_DTYPES:
            raise ProgramError(
                f"{op} operand {n} is {t.dtype}; a convolution needs float tensors", rule=f"{op} needs floats"
            )
    if x.dtype != w.dtype:
        raise ProgramError(
            f"{op} of {names[0]} ({x.dtype}) by {names[1]} ({w.dtype}); cast one to the other's dtype",
            rule=f"{op}: x and w have one dtype",
        )
    groups = attrs["groups"]
    if Dim.const(groups) * w.shape[1] != x.shape[1]:
        raise ProgramError(
            f"{names[0]} has {x.shape[1]} channels but {names[1]}{w.shape_text()} with groups={groups} takes "
            f"{groups} x {w.shape[1]}",
            rule=f"{op}: x's channels = groups x w.shape[1]",
        )
    if any(c % groups for _, c in w.shape[0].terms):
        k = w.shape[0]
        why = (
            f"do not divide into groups={groups}"
            if k.value is not None
            else f"are not a multiple of groups={groups} for every size (write them as {groups}*G)"
        )
        raise ProgramError(f"{names[1]}'s {k} output channels {why}", rule=f"{op}: groups divides the output channels")
    out = tuple(
        _conv_extent(
            x.shape[2 + i], w.shape[2 + i], attrs["stride"][i], attrs["padding"][i], attrs["dilation"][i], op, names, i
        )
        for i in range(nd)
    )
    layout = _conv_layout(x.layout, w.layout, groups, op, names, (x, w))
    return TensorType((x.shape[0], w.shape[0]) + out, x.dtype, layout)


def _conv_layout(
    lx: Layout, lw: Layout, groups: int, op: str, names: Sequence[str], types: Sequence[TensorType]
) -> Layout:
    rule = f"{op} layouts"
    if isinstance(lw, Replicated) and not isinstance(lx, Sliced):
        return lx  # R×R→R, L×R→L
    if isinstance(lw, Replicated) and lx == Sliced(0):
        return lx
    channels = (isinstance(lx, Replicated) and lw == Sliced(0)) or (lx == Sliced(1) and lw == Sliced(1))
    if channels and groups != 1:
        raise ProgramError(
            f"{op} of {lx} x {lw} ({operands_text(names, types)}) with groups={groups}: "
            "slicing channels needs groups=1 "
            "(a rank's channels may straddle groups)",
            rule=rule,
        )
    if channels:
        return Sliced(1) if isinstance(lx, Replicated) else Local()
    hint = ""
    if isinstance(lx, Sliced) and lx.dim >= 2:
        hint = "; a spatial slice would need its neighbours' rows (a halo exchange), which no collective gives"
    elif lx == Sliced(1) or lw == Sliced(1):
        hint = "; partial sums slice both x and w along their input channels (dim 1)"
    raise ProgramError(
        f"no {op} rule for {lx} x {lw} ({operands_text(names, types)}); allowed: R×R→R, L×R→L, S(0)×R→S(0), "
        f"R×S(0)→S(1), S(1)×S(1)→L (partial sums)" + hint,
        rule=rule,
    )
