"""reorder(ag): run the work that consumes an all_gather's output on the slices
before it (CoCoNet §4.2). Replicated operands of that work become zero-copy
slices; a norm or sum of a now-sliced value becomes a partial reduction plus an
allreduce, and so does a product that contracts the sliced rows (Adafactor's
column sums); a product of the sliced rows by a whole matrix stays on the rows.
Values still needed whole are all-gathered after the work.
"""

from __future__ import annotations

from dataclasses import dataclass

from coconet.schedules.ir import Program, Stmt
from coconet.schedules.rewrite import Rewriter
from coconet.schedules.transforms.base import Transform, consumes_slices, is_pointwise, ordered, sliced_dim
from coconet.schedules.types import Local, Sliced


def slices_align(program: Program, s: Stmt, sliced: dict[str, int]) -> tuple[bool, int | None]:
    """Can ``s`` run on slices when the values in ``sliced`` are sliced along the dims given? Every
    sliced operand must land on one dim of the result (broadcasting aligns trailing dims), and that
    dim must not be a broadcast one. Returns (ok, the result's sliced dim or None)."""
    if s.op == "matmul":
        return _product_slices(program, s, sliced)
    out = s.type
    dims = set()
    for a in s.args:
        t = program[a].type
        d = sliced.get(a, sliced_dim(program, a))
        if d is None:
            continue
        if s.op in ("sum", "norm"):
            continue  # a partial reduction of any slicing
        od = d + out.ndim - t.ndim
        if od < 0 or t.shape[d] != out.shape[od]:
            return False, None
        dims.add(od)
    if len(dims) > 1:
        return False, None
    return True, (dims.pop() if dims else None)


def _product_slices(program: Program, s: Stmt, sliced: dict[str, int]) -> tuple[bool, int | None]:
    """A product with one operand sliced: a's non-contracted rows give the result's; b's columns give its last
    dim; b's rows (the contracted dim) give partial products that an allreduce sums, so the result is whole."""
    (a, da), (b, db) = ((x, sliced.get(x, sliced_dim(program, x))) for x in s.args)
    if da is not None and db is not None:
        return False, None
    if da is not None:
        return (da != program[a].type.ndim - 1), da
    if db is not None:
        return True, (s.type.ndim - 1 if db == 1 else None)
    return True, None


def region(program: Program, ag: str) -> tuple[str, ...]:
    """The largest set of statements downstream of ``ag`` that can run on its slices."""
    members: set[str] = set()
    frontier = {ag}
    sliced = {ag: program[program[ag].args[0]].type.layout.dim}
    for s in program.stmts:
        if any(a in frontier for a in s.args) and consumes_slices(program, s, products=True):
            ok, dim = slices_align(program, s, sliced)
            if not ok:
                continue
            members.add(s.name)
            frontier.add(s.name)
            if dim is not None:
                sliced[s.name] = dim
    return ordered(program, members)


@dataclass(frozen=True)
class Reorder(Transform):
    all_gather: str
    members: tuple[str, ...] = ()  # empty: the largest legal region

    name = "reorder"

    @classmethod
    def instances(cls, program: Program) -> list[Transform]:
        if program.groups:
            return []
        return [cls(s.name) for s in program.stmts if s.op == "all_gather" and region(program, s.name)]

    def apply(self, program: Program) -> Program:
        self.no_groups(program)
        ag = self.need(program, self.all_gather, ("all_gather",), "an all_gather")
        self.distinct(self.members)
        members = set(self.members) if self.members else set(region(program, ag.name))
        if not members:
            raise self.refuse(f"nothing consumes {ag.name} that could run on slices")
        missing = sorted(m for m in members if m not in program)
        if missing:
            raise self.refuse(f"the program has no statement {missing[0]!r}")
        reachable = set(region(program, ag.name))
        sliced = {ag.name: program[ag.args[0]].type.layout.dim}
        for m in ordered(program, members):
            s = program[m]
            ok, dim = slices_align(program, s, sliced)
            if not ok:
                raise self.refuse(f"{m} would combine slices along different dims")
            if dim is not None:
                sliced[m] = dim
            local = [a for a in s.args if isinstance(program[a].type.layout, Local)]
            if local:
                raise self.refuse(f"{m} reads Local {local[0]}: a per-rank value cannot be combined with slices")
            if not (is_pointwise(program, s) or s.op in ("sum", "norm", "matmul")):
                raise self.refuse(f"{m} is a {s.op}; only pointwise work, reductions and products run on slices")
            if not any(a in members or a == ag.name for a in s.args) or m not in reachable:
                raise self.refuse(f"{m} does not consume {ag.name} or the work moved with it")
        source = ag.args[0]
        rw = Rewriter(program, self.text())
        for s in program.stmts:
            if s.name in members:
                rw.copy(s, [rw[source] if a == ag.name else rw[a] for a in s.args])
            elif s.op in ("all_gather", "partial_sum", "update"):
                rw.copy(s)  # these take slices; an update gathers only into Replicated state
            elif any(a in members for a in s.args):
                # a member that was already sliced (it read other slices too) stays as its readers took it
                rw.copy(s, [rw.whole(a) if a in members and not isinstance(program[a].type.layout, Sliced)
                            else rw[a] for a in s.args])
            else:
                rw.copy(s)
        return rw.finish()

    @classmethod
    def describe_many(cls, transforms, program) -> str:
        if len(transforms) == 1:
            return transforms[0].describe(program)
        return f"work after {', '.join(t.all_gather for t in transforms)} runs on slices"

    def describe(self, program: Program) -> str:
        n = len(self.members) if self.members else len(region(program, self.all_gather))
        return f"{n} statements after {self.all_gather} run on slices"
