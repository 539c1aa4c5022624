"""bucket(collectives): one collective over several buffers without a
flattening copy (CoCoNet §3, interface optimisation). ``bucket_bytes`` caps
how many bytes one launch carries.
"""

from __future__ import annotations

from dataclasses import dataclass

from coconet.schedules.ir import Group, Program
from coconet.schedules.transforms.base import Transform, convex, ordered, reaches, with_group

KINDS = ("allreduce", "reduce_scatter", "all_gather")


def _key(program: Program, name: str):
    s = program[name]
    return (s.op, s.attr("op"), s.type.dtype, str(s.type.layout) if s.op == "reduce_scatter" else None)


def independent(program: Program, names: set[str]) -> str | None:
    for n in names:
        hit = reaches(program, [n], names - {n}, set())
        if hit is not None:
            return f"{hit} depends on {n}"
    return None


@dataclass(frozen=True)
class Bucket(Transform):
    collectives: tuple[str, ...]

    name = "bucket"
    kind = "group"
    knobs = {"bucket_bytes": (2**22, (2**20, 2**22, 2**24, 2**26))}

    @classmethod
    def instances(cls, program: Program) -> list[Transform]:
        by_key: dict[tuple, list[str]] = {}
        for s in program.stmts:
            if s.op in KINDS and s.type.ndim > 0 and s.name not in program.group_of:
                by_key.setdefault(_key(program, s.name), []).append(s.name)
        out = []
        for names in by_key.values():
            if len(names) > 1 and independent(program, set(names)) is None and convex(program, set(names)) is None:
                out.append(cls(tuple(names)))
        return out

    def apply(self, program: Program) -> Program:
        if len(self.collectives) < 2:
            raise self.refuse("a bucket holds at least two collectives")
        self.distinct(self.collectives)
        for n in self.collectives:
            s = self.need(program, n, KINDS, "a collective")
            if n in program.group_of:
                raise self.refuse(f"{n} already runs in {program.group_of[n]}")
            if s.type.ndim == 0:
                raise self.refuse(f"{n} moves a scalar")
        if len({_key(program, n) for n in self.collectives}) > 1:
            raise self.refuse("bucketed collectives must be of one kind, reduction and dtype")
        why = independent(program, set(self.collectives))
        if why:
            raise self.refuse(f"collectives in one bucket must be independent: {why}")
        return with_group(program, Group("bucket", ordered(program, self.collectives), ("bucket_bytes",)))

    def describe(self, program: Program) -> str:
        return f"{len(self.collectives)} {program[self.collectives[0]].op}s bucketed"
