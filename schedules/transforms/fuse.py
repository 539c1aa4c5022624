"""fuse(stmts): pointwise statements → one kernel (CoCoNet §4.3).

Members compute tensors of one shape and layout (scalars they read are kernel
arguments). Fusion must not create a cycle: no path may leave the group and
come back into it.
"""

from __future__ import annotations

from dataclasses import dataclass

from coconet.schedules.ir import Group, Program
from coconet.schedules.transforms.base import Transform, convex, convex_with, is_pointwise, ordered, with_group


def _signature(program: Program, name: str):
    t = program[name].type
    return (t.shape, t.layout)


def fusable(program: Program, name: str) -> bool:
    s = program[name]
    return is_pointwise(program, s) and s.type.ndim > 0 and name not in program.group_of


def regions(program: Program) -> list[tuple[str, ...]]:
    """Maximal groups, grown in program order: a statement joins (and merges) the
    groups of its fusable operands of the same signature when the union stays
    convex, else the first such group that stays convex, else starts its own."""
    group_of: dict[str, int] = {}
    groups: dict[int, set[str]] = {}  # by the position of the group's first member
    pos = program.position
    for s in program.stmts:
        if not fusable(program, s.name):
            continue
        sig = _signature(program, s.name)
        cands = sorted({group_of[a] for a in s.args if a in group_of and _signature(program, a) == sig})
        options = ([cands] if len(cands) > 1 else []) + [[c] for c in cands]
        for option in options:
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
            if not is_pointwise(program, s):
                raise self.refuse(f"{m} is a {s.op}; only pointwise statements fuse into one kernel")
            if s.type.ndim == 0:
                raise self.refuse(f"{m} computes a scalar; scalars are kernel arguments, not kernel work")
        sigs = {_signature(program, m) for m in self.members}
        if len(sigs) > 1:
            raise self.refuse("members compute tensors of different shapes or layouts: "
                              "one kernel has one iteration space")
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
        return f"{len(self.members)} pointwise statements fused into one kernel"
