"""The immutable IR: a program is a tuple of statements in dependency order.

A statement names its operands by statement name, so the IR is a DAG that
prints, serialises and diffs as a list. Values are single-assignment; effects
(``update``, ``output``, ``send``) carry no value. Statements are hash-consed
when built (identical op, operands and attributes give one statement) and the
program's structural hash ignores the names of intermediate statements.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import itertools
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterator, Mapping

from coconet.errors import ProgramError
from coconet.schedules.types import TensorType

SCHEMA_VERSION = 1

SOURCES = frozenset({"input", "scalar", "const", "recv"})
UNARY = frozenset({"neg", "sqrt", "rsqrt", "exp", "log", "abs", "cast"})
BINARY = frozenset({"add", "sub", "mul", "div", "pow", "maximum", "minimum"})
COMPARE = frozenset({"lt", "le", "gt", "ge", "eq", "ne"})
POINTWISE = UNARY | BINARY | COMPARE | {"where", "dropout"}
REDUCTIONS = frozenset({"sum", "norm", "partial_sum"})
# along a dim (or over all elements): ``reduce`` (attrs op, dim, keepdim) and its share on one rank's slice
DIM_REDUCTIONS = frozenset({"reduce", "partial_reduce"})
NORMALIZERS = frozenset({"softmax", "log_softmax"})
# statements computed row by row along a dim: a kernel can fuse them, a chunk of flat elements cannot
ROWWISE_OPS = frozenset({"reduce", "softmax", "log_softmax"})
REDUCE_KINDS = ("sum", "mean", "max", "min")
# the collective that completes a partial_reduce of each kind (mean's partial is divided by the full extent)
PARTIAL_COLLECTIVE = {"sum": "sum", "mean": "sum", "max": "max", "min": "min"}
# convolutions of (B, C, *spatial) inputs by (K, C/groups, *kernel) weights, spatial dims by op
CONVS = {"conv1d": 1, "conv2d": 2}
COLLECTIVES = frozenset({"allreduce", "reduce_scatter", "all_gather", "broadcast"})
EFFECTS = frozenset({"update", "output", "send"})
# views of their operand, no copy: ``slice`` (R→S with no communication, each rank's rows of its own copy;
# slice_reduce makes it) and ``transpose``
VIEWS = frozenset({"slice", "transpose"})
# products: a (batched) matmul, and a contraction over any dims (``tensordot``)
PRODUCTS = frozenset({"matmul", "tensordot"})
BUILTIN_OPS = (
    SOURCES
    | POINTWISE
    | REDUCTIONS
    | DIM_REDUCTIONS
    | NORMALIZERS
    | COLLECTIVES
    | EFFECTS
    | VIEWS
    | PRODUCTS
    | frozenset(CONVS)
)

REDUCE_OPS = ("sum", "prod", "max", "min", "avg")
NEXT_STAGE = "next"
PREV_STAGE = "prev"

# Bounds that keep a program from the outside (JSON, REST) from exhausting memory or time.
MAX_STATEMENTS = 10_000
MAX_NAME = 64
MAX_DIMS = 16
MAX_RANK = 8


Attrs = tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Stmt:
    name: str
    op: str
    args: tuple[str, ...]
    attrs: Attrs
    type: TensorType | None  # None for effects

    def attr(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    @property
    def is_effect(self) -> bool:
        return self.op in EFFECTS


GROUP_KINDS = ("fuse", "fused_collective", "overlap", "bucket")


@dataclass(frozen=True)
class Group:
    """Statements a schedule runs as one unit: a fused kernel, a fused collective,
    an overlapped producer/collective pair or a bucket of collectives. Grouping
    never changes what a program computes, only how a backend runs it; ``knobs``
    names the schedule knobs (chunks, bucket_bytes) that tune the unit."""

    kind: str
    members: tuple[str, ...]
    knobs: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.kind}({', '.join(self.members)})"


@dataclass(frozen=True)
class Program:
    """A verified program. Build one with ``coconet.Program`` (the DSL) or ``load``."""

    name: str
    dims: tuple[str, ...]
    stmts: tuple[Stmt, ...]
    groups: tuple[Group, ...] = ()
    # Custom ops used by the program, by name; semantics live in Python, so not part of identity.
    custom_ops: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)
    # Where each statement was written (file:line), for error messages only.
    locations: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def with_groups(self, groups: tuple[Group, ...]) -> Program:
        """This program with other groups. The statements are the same objects, so what is computed from them
        alone is handed over rather than computed again: a schedule adds its groups one transform at a time,
        and each had cost a pass over every statement."""
        out = dataclasses.replace(self, groups=groups)
        for key in _OF_STATEMENTS:
            if key in self.__dict__:
                out.__dict__[key] = self.__dict__[key]
        return out

    @cached_property
    def by_name(self) -> dict[str, Stmt]:
        return {s.name: s for s in self.stmts}

    def __getitem__(self, name: str) -> Stmt:
        return self.by_name[name]

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def __iter__(self) -> Iterator[Stmt]:
        return iter(self.stmts)

    def __len__(self) -> int:
        return len(self.stmts)

    @cached_property
    def users(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, list[str]] = {s.name: [] for s in self.stmts}
        for s in self.stmts:
            for a in s.args:
                out[a].append(s.name)
        return {k: tuple(v) for k, v in out.items()}

    @property
    def inputs(self) -> tuple[Stmt, ...]:
        return tuple(s for s in self.stmts if s.op in ("input", "scalar", "recv"))

    @property
    def effects(self) -> tuple[Stmt, ...]:
        return tuple(s for s in self.stmts if s.is_effect)

    @property
    def updates(self) -> dict[str, str]:
        """target input name -> statement holding its new value"""
        return {s.args[0]: s.args[1] for s in self.stmts if s.op == "update"}

    @property
    def outputs(self) -> dict[str, str]:
        return {s.attr("name"): s.args[0] for s in self.stmts if s.op == "output"}

    @property
    def is_pipeline(self) -> bool:
        return any(s.op in ("send", "recv") for s in self.stmts)

    @property
    def least_world(self) -> int:
        """The fewest ranks the program runs on: one more than its highest broadcast root."""
        return 1 + max((int(s.attr("root")) for s in self.stmts if s.op == "broadcast"), default=0)

    def require_world(self, world: int) -> None:
        root = self.least_world - 1
        if world <= root:
            where = next(s.name for s in self.stmts if s.op == "broadcast" and int(s.attr("root")) == root)
            raise ProgramError(
                f"broadcasts from rank {root}: it needs {root + 1} ranks at least, not {world}",
                statement=where,
                op="broadcast",
                rule="0 <= root < world",
                location=self.location(where),
            )

    @cached_property
    def stmt_hashes(self) -> dict[str, str]:
        hashes: dict[str, str] = {}
        for s in self.stmts:
            ident = s.name if s.op in ("input", "scalar", "recv") else None
            payload = [s.op, _jsonable(s.attrs), [hashes[a] for a in s.args], ident]
            hashes[s.name] = _sha(payload)
        return hashes

    @cached_property
    def hash(self) -> str:
        """Structural hash: independent of statement order and intermediate names."""
        h = self.stmt_hashes
        roots = sorted(h[s.name] for s in self.stmts if s.is_effect or s.op in ("input", "scalar", "recv"))
        groups = sorted([g.kind, sorted(h[m] for m in g.members), list(g.knobs)] for g in self.groups)
        return _sha([SCHEMA_VERSION, self.name, list(self.dims), roots] + ([groups] if groups else []))[:16]

    @cached_property
    def group_of(self) -> dict[str, Group]:
        return {m: g for g in self.groups for m in g.members}

    @cached_property
    def of_op(self) -> dict[str, tuple[str, ...]]:
        """The statements of each op, in program order."""
        out: dict[str, list[str]] = {}
        for s in self.stmts:
            out.setdefault(s.op, []).append(s.name)
        return {op: tuple(names) for op, names in out.items()}

    @cached_property
    def position(self) -> dict[str, int]:
        """Each statement's index: statements come after their operands."""
        return {s.name: i for i, s in enumerate(self.stmts)}

    @cached_property
    def group_spans(self) -> tuple[tuple[int, int], ...]:
        """(first, last) position of each group's members, by first position."""
        pos = self.position
        return tuple(sorted((min(pos[m] for m in g.members), max(pos[m] for m in g.members)) for g in self.groups))

    def group_reach(self, low: int, high: int) -> tuple[int, int]:
        """The positions ``[low, high]`` widened by every group that straddles an end, until none does: past
        them no path through a group (a unit: entered at one member, left from any) leads back inside."""
        firsts, furthest, lasts, earliest = self._reach_tables
        while True:
            i = bisect.bisect_right(firsts, high)  # groups starting at or before high: the furthest they end
            j = bisect.bisect_left(lasts, low)  # groups ending at or after low: the earliest they start
            wider = (min(low, earliest[j]) if j < len(lasts) else low, max(high, furthest[i - 1]) if i else high)
            if wider == (low, high):
                return low, high
            low, high = wider

    @cached_property
    def _reach_tables(self) -> tuple[list[int], list[int], list[int], list[int]]:
        by_first = self.group_spans
        by_last = sorted(self.group_spans, key=lambda span: span[1])
        firsts, lasts = [f for f, _ in by_first], [last for _, last in by_last]
        furthest = list(itertools.accumulate((last for _, last in by_first), max))
        earliest = list(itertools.accumulate((f for f, _ in reversed(by_last)), min))[::-1]
        return firsts, furthest, lasts, earliest

    def location(self, name: str) -> str | None:
        return self.locations.get(name)


# the cached properties of a Program that read its statements alone (not its groups)
_OF_STATEMENTS = ("by_name", "users", "stmt_hashes", "position", "of_op")


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


def _sha(payload: Any) -> str:
    text = json.dumps(payload, separators=(",", ":"), sort_keys=True, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()
