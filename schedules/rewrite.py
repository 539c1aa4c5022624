"""Rebuilding a program statement by statement: the engine under every rewrite.

A rewrite copies the statements it does not touch and adds new ones through a
fresh ``Builder``, so the result is verified like a user's program — and the
semantics the builder makes explicit (partial norms of Sliced values, the
all_gather of a Replicated update from Sliced data) are re-derived for the new
layouts. A copy whose operands are typed as before is the statement the builder
verified already and is taken as it is. A ``ProgramError`` on the way means the
rewrite is illegal here.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from coconet.errors import IllegalTransform, ProgramError
from coconet.schedules.builder import Builder, typed_attrs
from coconet.schedules.ir import Group, Program, Stmt
from coconet.schedules.types import Sliced


class Rewriter:
    def __init__(self, program: Program, transform: str):
        self.src = program
        self.transform = transform
        self.b = Builder(program.name, program.dims, program.custom_ops)
        self.b.reserve(s.name for s in program.stmts)
        self.new: dict[str, int] = {}
        self._whole: dict[str, int] = {}

    def __getitem__(self, old: str) -> int:
        return self.new[old]

    def name(self, idx: int) -> str:
        return self.b.nodes[idx].name

    def type(self, idx: int):
        return self.b.type_of(idx)

    def copy(self, s: Stmt, args: Iterable[int] | None = None, attrs: Mapping[str, Any] | None = None) -> int:
        """Re-add ``s`` under its own name, operands mapped (or given)."""
        new_args = tuple(self.new[a] for a in s.args) if args is None else tuple(args)
        name, location = None if s.name in self.b.index else s.name, self.src.location(s.name)
        if attrs is None and all(self._as_before(n, a) for n, a in zip(new_args, s.args)):
            # operands as before: the statement is what it was (the builder's rules gave it its type)
            idx = self._guard(
                lambda: self.b.add_verified(s.op, new_args, s.attrs, s.type, name=name, location=location)
            )
        else:
            idx = self._guard(
                lambda: self.b.add(
                    s.op, new_args, dict(s.attrs) if attrs is None else dict(attrs), name=name, location=location
                )
            )
        self.new[s.name] = idx
        return idx

    def _as_before(self, idx: int, old: str) -> bool:
        """Typed as ``old`` was, and the same literal where either is one (literals promote by their value)."""
        o, node = self.src[old], self.b.nodes[idx]
        if node.type != o.type or (node.op == "const") != (o.op == "const"):
            return False
        return o.op != "const" or typed_attrs(node.attrs) == typed_attrs(o.attrs)

    def whole(self, old: str) -> int:
        """The rewritten value of ``old`` as a Replicated value: one all_gather, shared, if it is now Sliced."""
        idx = self.new[old]
        if not isinstance(self.type(idx).layout, Sliced):
            return idx
        if old not in self._whole:
            self._whole[old] = self.add("all_gather", [idx])
        return self._whole[old]

    def add(self, op: str, args: Iterable[int], attrs: Mapping[str, Any] | None = None) -> int:
        return self._guard(lambda: self.b.add(op, tuple(args), dict(attrs or {})))

    def _guard(self, fn):
        try:
            return fn()
        except ProgramError as e:
            raise IllegalTransform(f"the rewritten program is not legal: {e}", transform=self.transform) from None

    def finish(self, groups: Iterable[Group] = ()) -> Program:
        try:
            return self.b.finish(tuple(groups))
        except ProgramError as e:
            raise IllegalTransform(f"the rewritten program is not legal: {e}", transform=self.transform) from None


def require(cond: bool, reason: str, transform: str) -> None:
    if not cond:
        raise IllegalTransform(reason, transform=transform)
