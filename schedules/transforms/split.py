"""split(ar): allreduce → reduce_scatter + all_gather (CoCoNet §4.1)."""

from __future__ import annotations

from dataclasses import dataclass

from coconet.schedules.ir import Program
from coconet.schedules.rewrite import Rewriter
from coconet.schedules.transforms.base import Transform


@dataclass(frozen=True)
class Split(Transform):
    allreduce: str
    dim: int = 0

    name = "split"

    @classmethod
    def instances(cls, program: Program) -> list[Transform]:
        if program.groups:
            return []
        return [cls(s.name) for s in program.stmts if s.op == "allreduce" and s.type.ndim > 0]

    def apply(self, program: Program) -> Program:
        self.no_groups(program)
        ar = self.need(program, self.allreduce, ("allreduce",), "an allreduce")
        if ar.type.ndim == 0:
            raise self.refuse(f"{ar.name} reduces a scalar: there is nothing to scatter")
        if not -ar.type.ndim <= self.dim < ar.type.ndim:
            raise self.refuse(f"dim {self.dim} is out of range for {ar.type.shape_text()}")
        rw = Rewriter(program, self.text())
        for s in program.stmts:
            if s.name != ar.name:
                rw.copy(s)
                continue
            rs = rw.add("reduce_scatter", [rw[s.args[0]]], {"op": s.attr("op"), "dim": self.dim})
            rw.new[s.name] = rw.add("all_gather", [rs])
        return rw.finish()

    @classmethod
    def describe_many(cls, transforms, program) -> str:
        names = ", ".join(t.allreduce for t in transforms)
        return f"{names} split into reduce_scatter + all_gather"

    def describe(self, program: Program) -> str:
        return f"{self.allreduce} split into reduce_scatter + all_gather"
