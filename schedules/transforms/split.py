"""split(ar): allreduce → reduce_scatter + all_gather (CoCoNet §4.1)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from coconet.errors import IllegalTransform
from coconet.schedules.builder import PREFIX
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
        out = []
        for s in program.stmts:
            if s.op == "allreduce":
                # along a dim of extent 1 every row would be rank 0's: slice the first dim with more
                dim = next((d for d, n in enumerate(s.type.shape) if n.value != 1), None)
                if dim is not None:
                    out.append(cls(s.name, dim))
        return out

    def apply(self, program: Program) -> Program:
        self._check(program)
        return _split(program, {self.allreduce: self.dim}, self.text())

    def _check(self, program: Program) -> None:
        self.no_groups(program)
        ar = self.need(program, self.allreduce, ("allreduce",), "an allreduce")
        if ar.type.ndim == 0:
            raise self.refuse(f"{ar.name} reduces a scalar: there is nothing to scatter")
        if not -ar.type.ndim <= self.dim < ar.type.ndim:
            raise self.refuse(f"dim {self.dim} is out of range for {ar.type.shape_text()}")

    @classmethod
    def apply_all(cls, program: Program, transforms: tuple["Split", ...]) -> Program | None:
        """Every split of a step in one rebuild, where that gives what splitting one after the other gives:
        each applies, in program order (the new statements are named in the order they are made), and no
        allreduce split bears a name the new statements could take (one by one, a split frees its
        allreduce's name for the next). None otherwise: apply them one by one."""
        dims = {t.allreduce: t.dim for t in transforms}
        if len(dims) != len(transforms) or any(_NEW_NAME.match(n) for n in dims):
            return None
        try:
            for t in transforms:
                t._check(program)
        except IllegalTransform:
            return None
        if list(dims) != sorted(dims, key=program.position.__getitem__):
            return None
        return _split(program, dims, "; ".join(t.text() for t in transforms))

    @classmethod
    def describe_many(cls, transforms, program) -> str:
        names = ", ".join(t.allreduce for t in transforms)
        return f"{names} split into reduce_scatter + all_gather"

    def describe(self, program: Program) -> str:
        return f"{self.allreduce} split into reduce_scatter + all_gather"


# the names a split gives what it makes
_NEW_NAME = re.compile(f"({PREFIX['reduce_scatter']}|{PREFIX['all_gather']})[0-9]+\\Z")


def _split(program: Program, dims: dict[str, int], text: str) -> Program:
    rw = Rewriter(program, text)
    for s in program.stmts:
        if s.name not in dims:
            rw.copy(s)
            continue
        rs = rw.add("reduce_scatter", [rw[s.args[0]]], {"op": s.attr("op"), "dim": dims[s.name]})
        rw.new[s.name] = rw.add("all_gather", [rs])
    return rw.finish()
