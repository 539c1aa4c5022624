"""Custom operations: a user-defined op with its syntax, semantics and code.

As in the paper, a custom op is three things: *syntax* (calling the
``CustomOp`` builds a statement), *semantics* (a shape/dtype/layout rule and a
NumPy reference the interpreter runs) and *code* (torch and CUDA callables the
backends use; optional until a backend needs them).

Two kinds cover the layout rule:

- ``"pointwise"``: elementwise over broadcast operands; layouts follow the
  pointwise rule (R⊕S→S, L⊕S an error, ...), so it can be reordered onto
  slices and fused like any built-in pointwise op. ``reference`` maps NumPy
  arrays to an array of the broadcast shape.
- ``"local"``: any computation on Replicated or Local operands, run by each
  rank on its own values; ``infer`` returns the result shape and dtype.

A program that uses a custom op carries it; loading JSON that names one needs
it passed in (``load(text, ops=[gelu])``) or registered in an ``OpRegistry``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable, Iterable, Mapping

from coconet.errors import ProgramError
from coconet.schedules.dsl import apply_custom
from coconet.schedules.ir import BUILTIN_OPS

_NAME = re.compile(r"[a-z_][a-z0-9_]*\Z")
KINDS = ("pointwise", "local")


@dataclass(frozen=True, eq=False)
class CustomOp:
    name: str
    reference: Callable[..., Any]
    kind: str = "pointwise"
    arity: int = 1
    attrs: tuple[str, ...] = ()
    # "local" ops: (operand types, attrs) -> (shape, dtype); dims are coconet Dim values.
    infer: Callable[..., tuple[tuple, str]] | None = None
    torch: Callable[..., Any] | None = None
    cuda: str | None = None
    doc: str = ""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ProgramError(f"custom op name {self.name!r} must be lower_snake_case")
        if self.name in BUILTIN_OPS:
            raise ProgramError(f"custom op {self.name!r} would shadow the built-in op of that name")
        if self.kind not in KINDS:
            raise ProgramError(f"custom op {self.name}: kind {self.kind!r} is not one of {KINDS}")
        if self.kind == "local" and self.infer is None:
            raise ProgramError(f"custom op {self.name}: a 'local' op needs an infer rule")
        if self.arity < 1:
            raise ProgramError(f"custom op {self.name}: arity must be at least 1")

    def __call__(self, *operands: Any, **attrs: Any):
        return apply_custom(self, operands, attrs)

    def __repr__(self) -> str:
        return f"CustomOp({self.name!r}, kind={self.kind!r}, arity={self.arity})"


def custom_op(
    name: str,
    reference: Callable[..., Any],
    *,
    kind: str = "pointwise",
    arity: int = 1,
    attrs: Iterable[str] = (),
    infer: Callable[..., tuple[tuple, str]] | None = None,
    torch: Callable[..., Any] | None = None,
    cuda: str | None = None,
    doc: str = "",
) -> CustomOp:
    """Declare a custom op; the result is its builder (``gelu = custom_op(...); y = gelu(x)``)."""
    return CustomOp(name, reference, kind, arity, tuple(attrs), infer, torch, cuda, doc)


@dataclass
class OpRegistry:
    """A named set of custom ops, for loading JSON programs that use them."""

    ops: dict[str, CustomOp] = field(default_factory=dict)

    def register(self, op: CustomOp) -> CustomOp:
        known = self.ops.get(op.name)
        if known is not None and known is not op:
            raise ProgramError(f"custom op {op.name!r} is already registered")
        self.ops[op.name] = op
        return op

    def get(self, name: str) -> CustomOp | None:
        return self.ops.get(name)

    @classmethod
    def discover(cls, group: str = "coconet.ops") -> "OpRegistry":
        """Ops published by installed packages under the ``coconet.ops`` entry point group."""
        reg = cls()
        for ep in entry_points(group=group):
            obj = ep.load()
            for op in obj if isinstance(obj, (list, tuple)) else [obj]:
                reg.register(op)
        return reg


def as_op_map(ops: OpRegistry | Mapping[str, CustomOp] | Iterable[CustomOp] | None) -> dict[str, CustomOp]:
    if ops is None:
        return {}
    if isinstance(ops, OpRegistry):
        return dict(ops.ops)
    if isinstance(ops, Mapping):
        return dict(ops)
    return {op.name: op for op in ops}
