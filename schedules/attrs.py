"""Each op's arity and attributes, and how an attribute is checked: a validator per kind of value returns its
canonical form or raises ``ValueError`` (``Builder`` turns that into a ``ProgramError`` naming the statement)."""

from __future__ import annotations

import math
import re
from typing import Any, Callable

from coconet.schedules.dims import parse_dim
from coconet.schedules.ir import (
    BINARY,
    COMPARE,
    CONVS,
    MAX_NAME,
    MAX_RANK,
    NEXT_STAGE,
    PREV_STAGE,
    REDUCE_KINDS,
    REDUCE_OPS,
    UNARY,
)
from coconet.schedules.types import DTYPES, FLOAT_DTYPES, as_layout, float_dtype

_CAMEL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _identifier(v: Any) -> str:
    if not isinstance(v, str) or not _CAMEL.match(v) or len(v) > MAX_NAME:
        raise ValueError(f"{v!r} is not an identifier of at most {MAX_NAME} characters")
    return v


def _dtype(v: Any) -> str:
    return float_dtype(v)


def _tensor_dtype(v: Any) -> str:
    if v not in FLOAT_DTYPES:
        raise ValueError(f"tensor dtype {v!r} is not one of {', '.join(FLOAT_DTYPES)}")
    return v


def _scalar_dtype(v: Any) -> str:
    if v not in DTYPES or v == "bool":
        raise ValueError(f"scalar dtype {v!r} is not one of {', '.join(d for d in DTYPES if d != 'bool')}")
    return v


def _layout(v: Any) -> str:
    return str(as_layout(v))


def _shape(v: Any) -> tuple:
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"shape {v!r} must be a list of dims")
    if len(v) > MAX_RANK:
        raise ValueError(f"shape has {len(v)} dims; at most {MAX_RANK} are supported")
    return tuple(parse_dim(d).to_json() for d in v)


def _number(v: Any) -> int | float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{v!r} is not a number")
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"{v!r} is not finite")
    if isinstance(v, int) and abs(v) >= 2**63:
        raise ValueError(f"{v} does not fit in 64 bits")
    return v


def _prob(v: Any) -> float:
    v = _number(v)
    if not 0.0 <= v < 1.0:
        raise ValueError(f"dropout probability {v} must be in [0, 1)")
    return float(v)


def _seed(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**63:
        raise ValueError(f"seed {v!r} must be an int in [0, 2^63)")
    return v


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{v!r} is not an int")
    return v


def _nonneg(v: Any) -> int:
    v = _int(v)
    if v < 0:
        raise ValueError(f"{v} must be >= 0")
    return v


def _reduce_op(v: Any) -> str:
    if v not in REDUCE_OPS:
        raise ValueError(f"reduction {v!r} is not one of {', '.join(REDUCE_OPS)}")
    return v


def _reduce_kind(v: Any) -> str:
    if v not in REDUCE_KINDS:
        raise ValueError(f"{v!r} is not one of {', '.join(REDUCE_KINDS)}")
    return v


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{v!r} is not true or false")
    return v


MAX_WINDOW = 2**20


def _per_dim(nd: int, least: int, what: str) -> Callable[[Any], tuple[int, ...]]:
    """A convolution's stride, padding or dilation: an int for every spatial dim, or one per dim (as torch
    takes them), each at least ``least``; canonical as a tuple of ``nd``."""

    def check(v: Any) -> tuple[int, ...]:
        if isinstance(v, str):
            raise ValueError(f"{what} {v!r} is a string; give an int or {nd} ints ('same'/'valid' are not taken)")
        values = tuple(v) if isinstance(v, (list, tuple)) else (v,) * nd
        if len(values) != nd or not all(isinstance(x, int) and not isinstance(x, bool) for x in values):
            raise ValueError(f"{what} {v!r} is not an int or {nd} ints")
        if any(x < least for x in values):
            raise ValueError(f"{what} {v!r} must be >= {least}")
        if any(x > MAX_WINDOW for x in values):  # a program from outside must not ask for an unbounded output
            raise ValueError(f"{what} {v!r} is larger than 2^20")
        return values

    return check


def _groups(v: Any) -> int:
    v = _int(v)
    if v < 1:
        raise ValueError(f"groups {v} must be >= 1")
    return v


def _conv_schema(nd: int) -> Schema:
    return {
        "stride": (_per_dim(nd, 1, "stride"), (1,) * nd),
        "padding": (_per_dim(nd, 0, "padding"), (0,) * nd),
        "dilation": (_per_dim(nd, 1, "dilation"), (1,) * nd),
        "groups": (_groups, 1),
    }


def _contracted(v: Any) -> int | tuple[tuple[int, ...], tuple[int, ...]]:
    """tensordot's ``dims`` as torch takes them: n (the last n dims of a with the first n of b), or a pair of
    lists of dims, a's and b's, contracted in pairs; the builder makes either a pair of tuples of dims."""
    if isinstance(v, int) and not isinstance(v, bool):
        if not 0 <= v <= MAX_RANK:
            raise ValueError(f"dims {v} must be in [0, {MAX_RANK}]")
        return v
    if not (isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, (list, tuple)) for x in v)):
        raise ValueError(f"dims {v!r} is not an int nor a pair of lists of dims ([a's], [b's])")
    da, db = (tuple(_int(d) for d in x) for x in v)
    if len(da) != len(db):
        raise ValueError(f"dims {v!r} pairs {len(da)} of a's dims with {len(db)} of b's")
    return da, db


def _to(v: Any) -> str:
    if v != NEXT_STAGE:
        raise ValueError(f"send goes to NEXT_STAGE ({NEXT_STAGE!r}), not {v!r}")
    return v


def _frm(v: Any) -> str:
    if v != PREV_STAGE:
        raise ValueError(f"recv comes from PREV_STAGE ({PREV_STAGE!r}), not {v!r}")
    return v


Schema = dict[str, tuple[Callable[[Any], Any], Any]]  # attr -> (validator, default; ... = required)
REQ = ...
SCHEMAS: dict[str, Schema] = {
    "input": {"shape": (_shape, REQ), "dtype": (_tensor_dtype, "float32"), "layout": (_layout, REQ)},
    "scalar": {"dtype": (_scalar_dtype, "float32")},
    "const": {"value": (_number, REQ)},
    "recv": {
        "shape": (_shape, REQ),
        "dtype": (_tensor_dtype, "float32"),
        "layout": (_layout, REQ),
        "tag": (_identifier, "activation"),
        "frm": (_frm, PREV_STAGE),
    },
    "cast": {"dtype": (_dtype, REQ)},
    "dropout": {"p": (_prob, REQ), "seed": (_seed, None)},
    "allreduce": {"op": (_reduce_op, "sum")},
    "reduce_scatter": {"op": (_reduce_op, "sum"), "dim": (_int, 0)},
    "broadcast": {"root": (_nonneg, 0)},
    "slice": {"dim": (_int, 0)},
    "reduce": {"op": (_reduce_kind, REQ), "dim": (_int, None), "keepdim": (_bool, False)},
    "partial_reduce": {"op": (_reduce_kind, REQ), "dim": (_int, None), "keepdim": (_bool, False)},
    "softmax": {"dim": (_int, REQ)},
    "log_softmax": {"dim": (_int, REQ)},
    **{op: _conv_schema(nd) for op, nd in CONVS.items()},
    "transpose": {"dim0": (_int, REQ), "dim1": (_int, REQ)},
    "tensordot": {"dims": (_contracted, REQ)},
    "output": {"name": (_identifier, REQ)},
    "send": {"tag": (_identifier, "activation"), "to": (_to, NEXT_STAGE)},
}
ARITY: dict[str, tuple[int, int]] = {
    **{op: (0, 0) for op in ("input", "scalar", "const", "recv")},
    **{op: (1, 1) for op in UNARY},
    **{op: (2, 2) for op in BINARY | COMPARE},
    "where": (3, 3),
    "dropout": (1, 2),
    "sum": (1, 1),
    "norm": (1, 1),
    "partial_sum": (1, 1),
    "reduce": (1, 1),
    "partial_reduce": (1, 1),
    "softmax": (1, 1),
    "log_softmax": (1, 1),
    "matmul": (2, 2),
    "tensordot": (2, 2),
    "transpose": (1, 1),
    **{op: (2, 2) for op in CONVS},
    "allreduce": (1, 1),
    "reduce_scatter": (1, 1),
    "all_gather": (1, 1),
    "broadcast": (1, 1),
    "slice": (1, 1),
    "update": (2, 2),
    "output": (1, 1),
    "send": (1, 1),
}
