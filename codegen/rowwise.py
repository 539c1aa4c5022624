"""Code for the statements computed along a dim: ``reduce``, ``partial_reduce``, ``softmax``, ``log_softmax``.

Each is one torch call on this rank's value. A ``partial_reduce`` reduces this rank's rows of a Sliced value
over its sliced dim; past an uneven last slice a rank may hold no rows, and torch's ``amax``/``amin`` refuse an
empty dim, so the code gives the kind's identity there (what the allreduce that follows ignores), and a mean's
share is the rows' sum over the whole dim's extent, so that the allreduce's sum is the mean.
"""

from __future__ import annotations

from typing import Callable

from coconet.schedules.dims import Dim
from coconet.schedules.ir import Stmt
from coconet.schedules.types import TensorType

_METHOD = {"sum": "sum", "mean": "mean", "max": "amax", "min": "amin"}
_IDENTITY = {"max": "float('-inf')", "min": "float('inf')"}


def _dims_args(dim: int | None, ndim: int, keepdim: bool) -> str:
    if dim is not None:
        return f"{dim}, keepdim={keepdim}"
    if keepdim and ndim:
        return f"({', '.join(map(str, range(ndim)))},), keepdim=True"
    return ""


def reduce_text(s: Stmt, x: str, x_type: TensorType, dim_expr: Callable[[Dim], str], out_shape: str) -> str:
    """The expression for ``s`` (a reduce or partial_reduce) of the operand text ``x`` of type ``x_type``;
    ``out_shape``: the text of this rank's result shape, for an empty slice's identity."""
    kind, dim, keep = s.attr("op"), s.attr("dim"), bool(s.attr("keepdim"))
    args = _dims_args(dim, x_type.ndim, keep)
    if s.op != "partial_reduce":
        return f"{x}.{_METHOD[kind]}({args})"
    if kind in ("sum", "mean"):
        total = f"{x}.sum({args})"
        if kind == "sum":
            return total
        extents = x_type.shape if dim is None else (x_type.shape[dim],)
        count = " * ".join(f"({dim_expr(d)})" for d in extents) or "1"
        return f"{total} / ({count})"
    rows = f"{x}.shape[{dim}]" if dim is not None else f"{x}.numel()"
    return f"({x}.{_METHOD[kind]}({args}) if {rows} else {x}.new_full({out_shape}, {_IDENTITY[kind]}))"


def normalize_text(s: Stmt, x: str) -> str:
    return f"torch.{s.op}({x}, {s.attr('dim')})"
