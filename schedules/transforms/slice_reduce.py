"""slice_reduce(r): a norm or sum of a Replicated value computed on each rank's slice of it, a partial
sum per rank and an allreduce of one scalar, where every rank read the whole value before (the norm / sum row
of docs/dsl.md, "Layouts": S→R as ``partial_sum`` + ``allreduce``). LAMB's trust ratio takes ``norm(w)`` of its
replicated weights: whole, each rank reads all of w; sliced, the ranks share the read, and a fused
collective that reads w's rows for the update adds their squares in the same pass (fuse_collective).
"""

from __future__ import annotations

from dataclasses import dataclass

from coconet.schedules.ir import COLLECTIVES, Program, Stmt
from coconet.schedules.rewrite import Rewriter
from coconet.schedules.transforms.base import Transform, ancestors
from coconet.schedules.types import Replicated


def _of_state(program: Program, s: Stmt) -> bool:
    """A reduction of a value computed from what every rank holds alone (state, scalars): one downstream of
    a collective is sliced better by splitting that collective, which reduces only the rows it keeps."""
    x = s.args[0]
    return not any(program[n].op in COLLECTIVES or program[n].op == "recv" for n in {x} | ancestors(program, x))


@dataclass(frozen=True)
class SliceReduce(Transform):
    reduction: str
    dim: int = 0

    name = "slice_reduce"

    @classmethod
    def instances(cls, program: Program) -> list[Transform]:
        if program.groups:
            return []
        return [
            cls(s.name)
            for s in program.stmts
            if s.op in ("norm", "sum")
            and isinstance(program[s.args[0]].type.layout, Replicated)
            and program[s.args[0]].type.ndim > 0
            and _of_state(program, s)
        ]

    def apply(self, program: Program) -> Program:
        self.no_groups(program)
        r = self.need(program, self.reduction, ("norm", "sum"), "a norm or sum")
        x = program[r.args[0]]
        if not isinstance(x.type.layout, Replicated):
            raise self.refuse(
                f"{x.name} is {x.type.layout}: only a value every rank holds whole is sliced where it lies"
            )
        if x.type.ndim == 0:
            raise self.refuse(f"{x.name} is a scalar: there is nothing to slice")
        if not -x.type.ndim <= self.dim < x.type.ndim:
            raise self.refuse(f"dim {self.dim} is out of range for {x.type.shape_text()}")
        # where its first reader is: a reduction written early (before the gradient's allreduce, say) then sits
        # after the collective a fused collective begins with, and its partial sums can join that
        at = min(program.users[r.name], key=program.position.__getitem__)
        rw = Rewriter(program, self.text())
        for s in program.stmts:
            if s.name == at:  # the builder makes a reduction of a slice partial sums and an allreduce
                rw.copy(r, [rw.add("slice", [rw[x.name]], {"dim": self.dim})])
            if s.name != r.name:
                rw.copy(s)
        return rw.finish()

    def describe(self, program: Program) -> str:
        r = program[self.reduction]
        return f"{r.op} of {r.args[0]} from each rank's slice: partial sums and an allreduce"
