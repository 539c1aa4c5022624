"""Dtypes, layouts and the type of a statement's value."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

from coconet.schedules.dims import Dim

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
# int64 exists for seeds and step counters; bool is what comparisons produce.
DTYPES = FLOAT_DTYPES + ("int64", "bool")
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int64": 8, "bool": 1}


@dataclass(frozen=True)
class Local:
    """Every rank holds its own whole-shape value (a gradient, a partial sum)."""

    def __str__(self) -> str:
        return "Local"


@dataclass(frozen=True)
class Replicated:
    """Every rank holds the same whole value."""

    def __str__(self) -> str:
        return "Replicated"


@dataclass(frozen=True)
class Sliced:
    """The global value split along ``dim``: rank r holds ``[r*ceil(n/R), (r+1)*ceil(n/R))``."""

    dim: int = 0

    def __str__(self) -> str:
        return f"Sliced({self.dim})"


Layout = Union[Local, Replicated, Sliced]
_LAYOUT_TEXT = re.compile(r"(Local|Replicated|Sliced)(?:\((-?\d+)\))?\Z")


def as_layout(value: object) -> Layout:
    """Accept ``Local``, ``Local()``, ``Sliced``, ``Sliced(1)`` or their text."""
    if value in (Local, Replicated, Sliced):
        return value()  # type: ignore[operator]
    if isinstance(value, (Local, Replicated, Sliced)):
        return value
    if isinstance(value, str):
        m = _LAYOUT_TEXT.match(value.strip())
        if m:
            kind, dim = m.groups()
            if kind == "Sliced":
                return Sliced(int(dim) if dim is not None else 0)
            if dim is None:
                return Local() if kind == "Local" else Replicated()
    raise ValueError(f"{value!r} is not a layout (Local, Replicated or Sliced(dim))")


def float_dtype(value: object) -> str:
    if value not in DTYPES:
        raise ValueError(f"dtype {value!r} is not one of {', '.join(DTYPES[:-1])}")
    return str(value)


@dataclass(frozen=True)
class TensorType:
    """Global shape, dtype and layout of a value. ``dtype`` None marks a weak Python literal."""

    shape: tuple[Dim, ...]
    dtype: str | None
    layout: Layout

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_scalar(self) -> bool:
        return not self.shape

    def shape_text(self) -> str:
        return "(" + ", ".join(str(d) for d in self.shape) + ("," if len(self.shape) == 1 else "") + ")"

    def __str__(self) -> str:
        return f"{self.shape_text()} {self.dtype or 'weak'} {self.layout}"


_FLOAT_RANK = {"float16": 1, "bfloat16": 1, "float32": 2, "float64": 3}


def _category(dtype: str | None, weak_value: object = None) -> int:
    if dtype == "bool":
        return 0
    if dtype == "int64" or (dtype is None and isinstance(weak_value, int)):
        return 1
    return 2


def promote_pair(a: str, b: str) -> str:
    if a == b:
        return a
    if a in _FLOAT_RANK and b in _FLOAT_RANK:
        ra, rb = _FLOAT_RANK[a], _FLOAT_RANK[b]
        if ra == rb:  # float16 with bfloat16: neither holds the other
            return "float32"
        return a if ra > rb else b
    # int64 with a float: the float wins
    return a if a in _FLOAT_RANK else b


def promote(operands: list[tuple[TensorType, object]]) -> str:
    """Result dtype of a pointwise op, by torch's rules.

    ``operands`` pairs each type with the literal value for weak constants. A
    higher category (bool < int < float) wins; within it, tensors with
    dimensions decide before 0-d tensors, which decide before Python literals —
    so ``lr * w`` keeps ``w``'s float16 when ``lr`` is a float32 scalar.
    """
    cats = [_category(t.dtype, v) for t, v in operands]
    top = max(cats)
    chosen = [(t, v) for (t, v), c in zip(operands, cats) if c == top]
    for group in (
        [t.dtype for t, _ in chosen if t.dtype is not None and t.ndim > 0],
        [t.dtype for t, _ in chosen if t.dtype is not None],
    ):
        if group:
            out = group[0]
            for d in group[1:]:
                out = promote_pair(out, d)
            return out
    return {0: "bool", 1: "int64", 2: "float32"}[top]
