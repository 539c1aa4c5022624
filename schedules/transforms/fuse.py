"""fuse(stmts): pointwise statements → one kernel (CoCoNet §4.3).

Members compute tensors of one shape and layout (scalars they read are kernel
arguments). A group may also take statements computed along a dim (``reduce``
over one dim, ``softmax``, ``log_softmax``: a LayerNorm's means, an attention
row's softmax); such a group's members share one layout and rank, and their
shapes broadcast to the largest of them (a row's mean of shape (S, 1) beside
the (S, H) rows). Fusion must not create a cycle: no path may leave the group
and come back into it.
"""

from __future__ import annotations

from dataclasses import dataclass

from coconet.schedules.infer import broadcast_shapes
from coconet.schedules.ir import ROWWISE_OPS, Group, Program
from coconet.schedules.transforms.base import Transform, convex, convex_with, is_pointwise, ordered, with_group


def _signature(program: Program, name: str):
    t = program[name].type
    return (t.shape, t.layout)


def rowwise_member(program: Program, name: str) -> bool:
    """A statement computed along one dim that a kernel can take: not a reduction over every dim."""
    s = program[name]
    return s.op in ROWWISE_OPS and (s.op != "reduce" or s.attr("dim") is not None)


def fusable(program: Program, name: str) -> bool:
    s = program[name]
    return (
        (is_pointwise(program, s) or rowwise_member(program, name)) and s.type.ndim > 0 and name not in program.group_of
    )


def one_space(program: Program, members) -> str | None:
    """None if ``members`` can run as one kernel's iteration space, else why not."""
    sigs = {_signature(program, m) for m in members}
    if len(sigs) == 1:
        return None
    if not any(rowwise_member(program, m) for m in members):
        return "members compute tensors of different shapes or layouts: one kernel has one iteration space"
    shapes = [shape for shape, _ in sigs]
    whole = broadcast_shapes(shapes)
    if len({layout for _, layout in sigs}) > 1 or len({len(x) for x in shapes}) > 1 or whole not in shapes:
        return (
            "members along a dim share one layout and rank, and their shapes broadcast to the largest: "
            "one kernel has one iteration space"
        )
    return None


def regions(program: Program) -> list[tuple[str, ...]]:
    """Maximal groups, grown in program order: a statement joins (and merges) the
    groups of its fusable operands of the same signature when the union stays
    convex, else the first such group that stays convex, else starts its own."""
    group_of: dict[str, int] = {}
    groups: dict[int, set[str]] = {}  # by the position of the group's first member
    pos = program.position
    rowwise = any(op in program.of_op for op in ROWWISE_OPS)
    for s in program.stmts:
        if not fusable(program, s.name):
            continue
        sig = _signature(program, s.name)
        if rowwise:  # shapes that broadcast to one another share a kernel beside a statement along a dim
            cands = sorted(
                {
                    group_of[a]
                    for a in s.args
                    if a in group_of and one_space(program, groups[group_of[a]] | {s.name}) is None
                }
            )
        else:
            cands = sorted({group_of[a] for a in s.args if a in group_of and _signature(program, a) == sig})
        options = ([cands] if len(cands) > 1 else []) + [[c] for c in cands]
        for option in options:
            if (
                rowwise
                and len(option) > 1
                and one_space(program, set().union(*(groups[g] for g in option)) | {s.name}) is not None
            ):
                continue
            if len(option) == 1:  # one group, convex already: only a path through s can close a cycle
                why = convex_with(program, groups[option[0]], s.name, (option[0], pos[s.name]))
            else:
                why = convex(program, set().union(*(groups[g] for g in option)) | {s.name})
            if why is None:
                keep = option[0]  # the earliest: it stays the merged group's first member
                for g in option[1:]:
                    for m in groups.pop(g):
                        group_of[m] = keep
                        groups[keep].add(m)
                groups[keep].add(s.name)
                group_of[s.name] = keep
                break
        else:
            # numbered by its first member: ids counted from sizes repeated after three-way merges
            group_of[s.name] = pos[s.name]
            groups[pos[s.name]] = {s.name}
    return [ordered(program, g) for _, g in sorted(groups.items()) if len(g) > 1]


@dataclass(frozen=True)
class Fuse(Transform):
    members: tuple[str, ...]

    name = "fuse"
    kind = "group"

    @classmethod
    def instances(cls, program: Program) -> list[Transform]:
        return [cls(g) for g in regions(program)]

    def apply(self, program: Program) -> Program:
        if len(self.members) < 2:
            raise self.refuse("fusing needs at least two statements")
        self.distinct(self.members)
        for m in self.members:
            if m not in program:
                raise self.refuse(f"the program has no statement {m!r}")
            s = program[m]
            if m in program.group_of:
                raise self.refuse(f"{m} already runs in {program.group_of[m]}")
            if not (is_pointwise(program, s) or rowwise_member(program, m)):
                raise self.refuse(
                    f"{m} is a {s.op}; only pointwise statements and reductions or softmaxes "
                    "along one dim fuse into one kernel"
                )
            if s.type.ndim == 0:
                raise self.refuse(f"{m} computes a scalar; scalars are kernel arguments, not kernel work")
        why = one_space(program, self.members)
        if why is not None:
            raise self.refuse(why)
        witness = convex(program, set(self.members))
        if witness is not None:
            raise self.refuse(f"fusing would create a cycle: a path leaves the group and comes back into {witness}")
        return with_group(program, Group("fuse", ordered(program, self.members)))

    @classmethod
    def describe_many(cls, transforms, program) -> str:
        if len(transforms) == 1:
            return transforms[0].describe(program)
        return f"{len(transforms)} fused pointwise kernels"

    def describe(self, program: Program) -> str:
        kind = "" if any(rowwise_member(program, m) for m in self.members) else "pointwise "
        return f"{len(self.members)} {kind}statements fused into one kernel"
