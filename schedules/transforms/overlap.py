"""overlap(producer, collective): chunked pipelining of a matmul with the
collective that consumes it (CoCoNet §4.4): chunk k's collective is in flight
while chunk k+1 is computed. ``chunks`` is a knob.
"""

from __future__ import annotations

from dataclasses import dataclass

from coconet.schedules.ir import Group, Program
from coconet.schedules.transforms.base import Transform, with_group

COLLECTIVES = ("allreduce", "reduce_scatter")


@dataclass(frozen=True)
class Overlap(Transform):
    producer: str
    collective: str

    name = "overlap"
    kind = "group"
    knobs = {"chunks": (4, (2, 4, 8, 16))}

    @classmethod
    def instances(cls, program: Program) -> list[Transform]:
        out = []
        for s in program.stmts:
            if s.op in COLLECTIVES and s.name not in program.group_of:
                src = program[s.args[0]]
                if (src.op == "matmul" and src.name not in program.group_of and src.type.ndim >= 2
                        and program.users[src.name] == (s.name,)):
                    out.append(cls(src.name, s.name))
        return out

    def apply(self, program: Program) -> Program:
        mm = self.need(program, self.producer, ("matmul",), "a matmul")
        coll = self.need(program, self.collective, COLLECTIVES, "an allreduce or reduce_scatter")
        if coll.args[0] != mm.name:
            raise self.refuse(f"{coll.name} does not consume {mm.name}")
        if program.users[mm.name] != (coll.name,):
            raise self.refuse(f"{mm.name} is also read elsewhere: its chunks are reduced in place")
        for n in (mm.name, coll.name):
            if n in program.group_of:
                raise self.refuse(f"{n} already runs in {program.group_of[n]}")
        if mm.type.ndim < 2:
            raise self.refuse(f"{mm.name} has a single row dim: nothing to chunk")
        return with_group(program, Group("overlap", (mm.name, coll.name), ("chunks",)))

    def describe(self, program: Program) -> str:
        return f"{self.producer} overlapped with {self.collective} in chunks"
