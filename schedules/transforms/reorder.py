"""reorder(ag): run the work that consumes an all_gather's output on the slices
before it (CoCoNet §4.2). Replicated operands of that work become zero-copy
slices; a norm or sum of a now-sliced value becomes a partial reduction plus an
allreduce (a reduction along the sliced dim too; along another dim, or a softmax,
stays on the slices), and so does a product that contracts the sliced rows (Adafactor's
column sums); a product of the sliced rows by a whole matrix stays on the rows.
Values still needed whole are all-gathered after the work.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from coconet.errors import IllegalTransform
from coconet.schedules.builder import PREFIX
from coconet.schedules.ir import ROWWISE_OPS, Program, Stmt
from coconet.schedules.rewrite import Rewriter
from coconet.schedules.transforms.base import (
    Transform,
    consumes_slices,
    grow_in_order,
    is_pointwise,
    ordered,
    sliced_dim,
)
from coconet.schedules.types import Local, Sliced


def slices_align(program: Program, s: Stmt, sliced: dict[str, int]) -> tuple[bool, int | None]:
    """Can ``s`` run on slices when the values in ``sliced`` are sliced along the dims given? Every
    sliced operand must land on one dim of the result (broadcasting aligns trailing dims), and that
    dim must not be a broadcast one. Returns (ok, the result's sliced dim or None)."""
    if s.op == "matmul":
        return _product_slices(program, s, sliced)
    if s.op in ROWWISE_OPS:
        return True, _rowwise_slices(s, sliced.get(s.args[0], sliced_dim(program, s.args[0])))
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


def _rowwise_slices(s: Stmt, d: int | None) -> int | None:
    """The result's sliced dim of a statement along a dim whose operand is sliced along ``d``: a reduction over
    ``d`` (or every dim) is partials and an allreduce, whole; over another dim the slicing stays, one dim lower
    where an earlier dim goes; a softmax keeps it (along ``d``: the builder's max and sum through allreduces)."""
    if d is None or s.op != "reduce":
        return d
    dim = s.attr("dim")
    if dim is None or dim == d:
        return None
    return d - 1 if dim < d and not s.attr("keepdim") else d


def _product_slices(program: Program, s: Stmt, sliced: dict[str, int]) -> tuple[bool, int | None]:
    """A product with one operand sliced: a's non-contracted rows (or a batch dim) give the result's; b's
    columns give its last dim, a batch dim of b the same dim of the result (the builder slices a there); b's
    rows (the contracted dim) give partial products that an allreduce sums, so the result is whole."""
    (a, da), (b, db) = ((x, sliced.get(x, sliced_dim(program, x))) for x in s.args)
    if da is not None and db is not None:
        return False, None
    if da is not None:
        return (da != program[a].type.ndim - 1), da
    if db is not None:
        nb = program[b].type.ndim
        if db == nb - 1:
            return True, s.type.ndim - 1
        return True, (None if db == nb - 2 else db)
    return True, None


def region(program: Program, ag: str) -> tuple[str, ...]:
    """The largest set of statements downstream of ``ag`` that can run on its slices."""
    members: set[str] = set()
    sliced = {ag: program[program[ag].args[0]].type.layout.dim}

    def join(s: Stmt, at: int) -> bool:
        if not consumes_slices(program, s, products=True):
            return False
        ok, dim = slices_align(program, s, sliced)
        if not ok:
            return False
        members.add(s.name)
        if dim is not None:
            sliced[s.name] = dim
        return True

    grow_in_order(program, (program.position[u] for u in program.users[ag]), join)
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
        members = self._members(program)
        return _rebuild(program, {program[self.all_gather]: members}, self.text())[0]

    def _members(self, program: Program) -> set[str]:
        """The statements that move onto the slices, or the reason they cannot."""
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
            if not (is_pointwise(program, s) or s.op in ("sum", "norm", "matmul") or s.op in ROWWISE_OPS):
                raise self.refuse(
                    f"{m} is a {s.op}; only pointwise work, reductions, softmaxes and products run on slices"
                )
            if not any(a in members or a == ag.name for a in s.args) or m not in reachable:
                raise self.refuse(f"{m} does not consume {ag.name} or the work moved with it")
        return members

    @classmethod
    def apply_all(cls, program: Program, transforms: tuple["Reorder", ...]) -> Program | None:
        """Every reorder of a step in one rebuild, where their regions leave each other alone: no statement
        is the all_gather, a member or a reader of a member of two of them. One after the other, each
        rebuild names what it makes with the lowest names free in the program before it, the names the
        reorders before it freed included (each frees its all_gather's): so what the batch makes is named
        afterwards, reorder by reorder, as those rebuilds would have. None where the regions meet or a
        reorder would refuse: apply them one by one."""
        if any(t.members for t in transforms) or len({t.all_gather for t in transforms}) != len(transforms):
            return None
        regions, step_of = {}, {}
        try:
            for i, t in enumerate(transforms):
                members = t._members(program)
                touched = {t.all_gather, *members}
                touched |= {u for m in touched for u in program.users[m]}
                if touched & step_of.keys():
                    return None
                step_of.update(dict.fromkeys(touched, i))
                regions[program[t.all_gather]] = members
        except IllegalTransform:
            return None
        result, made = _rebuild(program, regions, "; ".join(t.text() for t in transforms), step_of)
        if made is None:
            return None
        return _named_as_one_by_one(program, result, made, step_of, len(transforms))

    @classmethod
    def describe_many(cls, transforms, program) -> str:
        if len(transforms) == 1:
            return transforms[0].describe(program)
        return f"work after {', '.join(t.all_gather for t in transforms)} runs on slices"

    def describe(self, program: Program) -> str:
        n = len(self.members) if self.members else len(region(program, self.all_gather))
        return f"{n} statements after {self.all_gather} run on slices"


def _rebuild(program: Program, regions: dict[Stmt, set[str]], text: str, step_of: dict[str, int] | None = None):
    """The program with each all_gather's members on its slices, and what the rebuild made beyond the
    statements it copied: (temporary name, op, the reorder it is for) in the order made. With ``step_of``
    (statement -> the reorder that rewrites it) that list is None where a made statement cannot be said
    to be one reorder's."""
    member_of = {m: ag for ag, members in regions.items() for m in members}
    rw = Rewriter(program, text)
    nodes = rw.b.nodes
    made: list | None = []
    made_by: dict[int, int] = {}
    for s in program.stmts:
        before = len(nodes)
        if s.name in member_of:
            ag = member_of[s.name]
            rw.copy(s, [rw[ag.args[0]] if a == ag.name else rw[a] for a in s.args])
        elif s.op in ("all_gather", "partial_sum", "update"):
            rw.copy(s)  # these take slices; an update gathers only into Replicated state
        elif any(a in member_of for a in s.args):
            # a member that was already sliced (it read other slices too) stays as its readers took it
            rw.copy(
                s,
                [
                    rw.whole(a) if a in member_of and not isinstance(program[a].type.layout, Sliced) else rw[a]
                    for a in s.args
                ],
            )
        else:
            rw.copy(s)
        if step_of is None or made is None:
            continue
        step = step_of.get(s.name)
        fresh = [i for i in range(before, len(nodes)) if nodes[i].name != s.name]
        reads = {a for i in (*range(before, len(nodes)), rw.new[s.name]) for a in nodes[i].args} | {rw.new[s.name]}
        if (fresh and step is None) or any(made_by.get(i, step) != step for i in reads):
            made = None  # made outside every region, or one region's statement shared with another's
            continue
        made_by.update(dict.fromkeys(fresh, step))
        made += [(nodes[i].name, nodes[i].op, step) for i in fresh]
    return rw.finish(), made


def _named_as_one_by_one(
    before: Program, after: Program, made: list, step_of: dict[str, int], steps: int
) -> Program | None:
    """``after`` with what the batch made renamed as the reorders one after the other would have named it;
    None where that cannot be said."""
    kept = set(after.by_name)
    # a reduction along a dim is named by its kind (the builder's mean0, pmax0), which only a rebuild knows
    if any(name not in kept or op in ("update", "output", "reduce", "partial_reduce") for name, op, _ in made):
        return None  # each reorder's rebuild keeps what it makes: a statement made and dropped is not modelled
    # the reorder whose rebuild drops each statement that goes: the last to take a reader off it (by
    # rewriting the reader, or dropping it)
    dropped: dict[str, int] = {}
    for s in reversed(before.stmts):
        if s.name in kept:
            continue
        when = []
        for r in before.users[s.name]:
            if r not in kept:
                when.append(dropped[r])
            elif r in step_of:
                when.append(step_of[r])
            else:
                return None
        if not when:
            return None
        dropped[s.name] = max(when)
    occupied = {s.name for s in before.stmts}
    rename: dict[str, str] = {}
    for step in range(steps):
        counters: dict[str, int] = {}
        for name, op, at in made:
            if at != step:
                continue
            prefix = PREFIX.get(op, op)
            k = counters.get(prefix, 0)
            while f"{prefix}{k}" in occupied:
                k += 1
            counters[prefix] = k + 1
            rename[name] = f"{prefix}{k}"
            occupied.add(rename[name])
        occupied -= {n for n, at in dropped.items() if at == step}
    if not rename:
        return after
    new = lambda n: rename.get(n, n)  # noqa: E731
    stmts = tuple(Stmt(new(s.name), s.op, tuple(map(new, s.args)), s.attrs, s.type) for s in after.stmts)
    return dataclasses.replace(after, stmts=stmts, locations={new(k): v for k, v in after.locations.items()})
