"""What every transform is: a frozen dataclass of its parameters with
``instances(program)`` (every legal place to apply it) and ``apply(program)``
(verified; raises ``IllegalTransform`` with the reason when it cannot apply).

Two kinds: *rewrites* change the dataflow (split, reorder, as_slice,
slice_send) and must come before *groupings* (fuse, fuse_collective, overlap,
bucket), which only say which statements a backend runs as one unit.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any, Callable, ClassVar, Iterable

from coconet.errors import IllegalTransform
from coconet.schedules.attrs import ARITY
from coconet.schedules.ir import BINARY, COMPARE, ROWWISE_OPS, UNARY, Group, Program, Stmt
from coconet.schedules.types import Local, Sliced

POINTWISE_OPS = UNARY | BINARY | COMPARE | {"where", "dropout"}


class Transform:
    name: ClassVar[str]
    kind: ClassVar[str] = "rewrite"  # or "group"
    # knob name -> (default, domain); the values live in the Schedule
    knobs: ClassVar[dict[str, tuple[int, tuple[int, ...]]]] = {}

    @classmethod
    def instances(cls, program: Program) -> list["Transform"]:
        raise NotImplementedError

    def apply(self, program: Program) -> Program:
        raise NotImplementedError

    @classmethod
    def apply_all(cls, program: Program, transforms: tuple["Transform", ...]) -> Program | None:
        """``transforms`` (all of this class) applied in one rebuild where that is exactly the program applying
        them one after the other gives, names included; None where it cannot say so."""
        return None

    def describe(self, program: Program) -> str:
        return self.text()

    @classmethod
    def describe_many(cls, transforms: list["Transform"], program: Program) -> str:
        """One phrase for consecutive transforms of this class (``program`` is before the first)."""
        parts = []
        for t in transforms:
            parts.append(t.describe(program))
            program = t.apply(program)
        return "; ".join(parts)

    # --- canonical text: name(a, b, key=value) ---

    def text(self) -> str:
        parts: list[str] = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, tuple):
                parts.extend(v)
            elif isinstance(v, str):
                parts.append(v)
            elif v != f.default:
                parts.append(f"{f.name}={v}")
        return f"{self.name}({', '.join(parts)})"

    @classmethod
    def from_args(cls, args: list[str], kwargs: dict[str, str]) -> "Transform":
        values: dict[str, Any] = {}
        rest = list(args)
        for f in dataclasses.fields(cls):
            if f.type in ("str",):
                if not rest:
                    raise IllegalTransform(f"missing operand {f.name!r}", transform=cls.name)
                values[f.name] = rest.pop(0)
            elif f.type.startswith("tuple"):
                values[f.name], rest = tuple(rest), []
            elif f.name in kwargs:
                try:
                    values[f.name] = int(kwargs.pop(f.name))
                except ValueError:
                    raise IllegalTransform(f"{f.name} must be an integer", transform=cls.name) from None
        if rest or kwargs:
            given = rest + [f"{k}={v}" for k, v in kwargs.items()]
            raise IllegalTransform(f"unexpected arguments {given}", transform=cls.name)
        return cls(**values)

    def refuse(self, reason: str) -> IllegalTransform:
        return IllegalTransform(reason, transform=self.text())

    def distinct(self, names: tuple[str, ...]) -> None:
        # a name given twice would be deduplicated silently, so the group the
        # user wrote would not be the one that runs
        seen: set[str] = set()
        for n in names:
            if n in seen:
                raise self.refuse(f"{n} is named twice")
            seen.add(n)

    def need(self, program: Program, name: str, ops: Iterable[str], what: str) -> Stmt:
        if name not in program:
            raise self.refuse(f"the program has no statement {name!r}")
        s = program[name]
        if s.op not in ops:
            raise self.refuse(f"{name} is a {s.op}, not {what}")
        return s

    def no_groups(self, program: Program) -> None:
        if program.groups:
            raise self.refuse("rewrites come before fuse/fuse_collective/overlap/bucket in a schedule")


def is_pointwise(program: Program, s: Stmt) -> bool:
    if s.op in POINTWISE_OPS:
        return True
    op = program.custom_ops.get(s.op)
    return op is not None and op.kind == "pointwise" and s.op not in ARITY


def consumes_slices(program: Program, s: Stmt, products: bool = False) -> bool:
    """Can ``s`` take a Sliced operand in place of a Replicated one? Pointwise work
    and reductions can (reductions become partial sums + allreduce), unless a
    Local operand would meet the slice; with ``products``, a matmul may too (which
    operand is sliced decides: ``reorder.slices_align``)."""
    if not (
        is_pointwise(program, s) or s.op in ("sum", "norm") or s.op in ROWWISE_OPS or (products and s.op == "matmul")
    ):
        return False
    return not any(isinstance(program[a].type.layout, Local) for a in s.args)


def ancestors(program: Program, name: str) -> set[str]:
    """Every statement ``name`` depends on, itself not included."""
    seen, stack = set(), [name]
    while stack:
        for a in program[stack.pop()].args:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return seen


def reaches(program: Program, sources: Iterable[str], targets: set[str], avoid: set[str]) -> str | None:
    """A target reachable from ``sources`` along data edges through statements not in ``avoid``."""
    users = program.users
    stack = list(sources)
    seen: set[str] = set()
    while stack:
        n = stack.pop()
        for u in users[n]:
            if u in targets:
                return u
            if u not in seen and u not in avoid:
                seen.add(u)
                stack.append(u)
    return None


def convex(program: Program, members: set[str]) -> str | None:
    """None if running ``members`` as one unit creates no cycle; else a witness member. The program's groups
    run as units too: a path that enters one leaves it from any of its members. Two groups convex on their
    own can otherwise need each other first (a bucket of two all_gathers, one feeding a fused collective
    that feeds the other), and then no order runs both."""
    pos = program.position
    # Data edges go forward in program order; only a group can lead back, so past the last member, and past
    # every group that reaches back to it, nothing returns into the members: the search stops there
    # (regions grow one statement at a time, and a search of the whole program each time was quadratic).
    last = max(pos[m] for m in members)
    _, horizon = program.group_reach(last, last)
    unit_of = program.group_of
    stack = [u for m in members for u in program.users[m] if u not in members]
    seen: set[str] = set()
    while stack:
        n = stack.pop()
        if n in members:
            return n
        if n in seen or pos[n] > horizon:
            continue
        group = unit_of.get(n)
        for x in group.members if group is not None else (n,):
            seen.add(x)
            stack.extend(program.users[x])
    return None


def convex_with(program: Program, members: set[str], name: str, span: tuple[int, int] | None = None) -> str | None:
    """``convex(program, members | {name})`` for ``members`` already convex: a path that leaves the grown
    set and comes back into it must then start or end at ``name``, so the search runs from ``name`` alone,
    forward along users and backward along operands. ``span``: the first and last position of the grown
    set, where the caller keeps them (a region grown a statement at a time then costs what it adds)."""
    pos = program.position
    unit_of = program.group_of
    if span is None:
        span = (min(pos[name], *map(pos.__getitem__, members)), max(pos[name], *map(pos.__getitem__, members)))
    # as in convex, groups reach past the grown set's ends: the searches stop where nothing can lead back
    low, high = program.group_reach(*span)

    def inside(n: str) -> bool:
        return n == name or n in members

    operands = lambda n: program[n].args  # noqa: E731
    for step, beyond in ((program.users.__getitem__, lambda p: p > high), (operands, lambda p: p < low)):
        stack = [x for x in step(name) if not inside(x)]
        seen: set[str] = set()
        while stack:
            n = stack.pop()
            if inside(n):
                return n
            if n in seen or beyond(pos[n]):
                continue
            group = unit_of.get(n)
            for x in group.members if group is not None else (n,):
                seen.add(x)
                stack.extend(step(x))
    return None


def with_group(program: Program, group: Group) -> Program:
    witness = convex(program, set(group.members))
    if witness is not None:
        raise IllegalTransform(
            f"running {group} as one unit would create a cycle: a path leaves it and comes back into {witness}"
        )
    return program.with_groups(program.groups + (group,))


def grow_in_order(program: Program, seeds: Iterable[int], join: Callable[[Stmt, int], bool]) -> None:
    """Offer ``join`` the statements at positions ``seeds`` and the readers of every statement it takes, each
    once, in program order: a region grown from a statement by its readers visits only those, not every
    statement after it (which, for each collective of a program of many tensors, was most of a space's
    generation). A reader comes after what it reads, so what ``join`` took is always before what it is
    offered."""
    pos, users = program.position, program.users
    heap = list(seeds)
    heapq.heapify(heap)
    visited: set[int] = set()
    while heap:
        at = heapq.heappop(heap)
        if at in visited:
            continue
        visited.add(at)
        s = program.stmts[at]
        if join(s, at):
            for u in users[s.name]:
                heapq.heappush(heap, pos[u])


def ordered(program: Program, names: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted(set(names), key=program.position.__getitem__))


def sliced_dim(program: Program, name: str) -> int | None:
    layout = program[name].type.layout if program[name].type else None
    return layout.dim if isinstance(layout, Sliced) else None
