"""as_slice(t): keep updated state Sliced instead of Replicated — ZeRO-style
sharding of optimizer state (CoCoNet §4.2). The update no longer needs its
all_gather; readers that cannot take slices get an all_gather of the state.
"""

from __future__ import annotations

from dataclasses import dataclass

from coconet.errors import IllegalTransform
from coconet.schedules.ir import Program
from coconet.schedules.rewrite import Rewriter
from coconet.schedules.transforms.base import Transform, ancestors, consumes_slices
from coconet.schedules.types import Replicated


def _gathered_update(program: Program, tensor: str):
    for s in program.stmts:
        if s.op == "update" and s.args[0] == tensor:
            value = program[s.args[1]]
            return s, value if value.op == "all_gather" else None
    return None, None


@dataclass(frozen=True)
class AsSlice(Transform):
    tensor: str

    name = "as_slice"

    @classmethod
    def instances(cls, program: Program) -> list[Transform]:
        if program.groups:
            return []
        out = []
        for s in program.stmts:
            if s.op == "input" and isinstance(s.type.layout, Replicated):
                _, ag = _gathered_update(program, s.name)
                if ag is not None:
                    out.append(cls(s.name))
        return out

    @classmethod
    def subsets(cls, program: Program, insts: list["AsSlice"]) -> list[list["AsSlice"]]:
        """Optimizer state alone (ZeRO-1): state whose new value another update reads — moments, which the
        step reads into the parameters' update; not the parameters, whose new value nothing in the step
        reads, whatever their own update reads (weight decay reads the parameter into the moments)."""

        def computed(value: str) -> str:  # the new value itself, under the all_gather that replicates it
            s = program[value]
            return s.args[0] if s.op == "all_gather" else value

        read = set()
        for target, value in program.updates.items():
            above = ancestors(program, value)
            read |= {t for t, v in program.updates.items() if t != target and computed(v) in above}
        return [[t for t in insts if t.tensor in read]]

    def apply(self, program: Program) -> Program:
        return _slice(program, {self.tensor: self._check(program)}, self.text())

    def _check(self, program: Program):
        """The update of the state and the all_gather it drops; refuses where this cannot apply."""
        self.no_groups(program)
        t = self.need(program, self.tensor, ("input",), "a tensor input")
        if not isinstance(t.type.layout, Replicated):
            raise self.refuse(f"{t.name} is {t.type.layout}; only Replicated state can be kept sliced")
        upd, ag = _gathered_update(program, t.name)
        if upd is None:
            raise self.refuse(f"{t.name} is not updated: only updated state is sharded")
        if ag is None:
            raise self.refuse(f"the new value of {t.name} is computed whole; reorder the update onto slices first")
        return upd, ag

    @classmethod
    def apply_all(cls, program: Program, transforms: tuple["AsSlice", ...]) -> Program | None:
        """Every one of ``transforms`` in one rebuild of the program (one rebuild each made a step over k
        tensors cost k programs), where that gives what applying them one after the other gives: each
        applies, and no reader of the sliced state needs it whole, so the rebuild names nothing new.
        None otherwise: apply them one by one."""
        if len({t.tensor for t in transforms}) != len(transforms):
            return None
        try:
            gathered = {t.tensor: t._check(program) for t in transforms}
        except IllegalTransform:
            return None
        own_updates = {upd.name for upd, _ in gathered.values()}
        if any(
            gathered.keys() & set(s.args) and not consumes_slices(program, s)
            for s in program.stmts
            if s.name not in own_updates
        ):
            return None
        result = _slice(program, gathered, "; ".join(t.text() for t in transforms))
        if not {s.name for s in result.stmts} <= {s.name for s in program.stmts}:
            return None  # the builder made statements of its own: their names could differ one by one
        return result

    @classmethod
    def describe_many(cls, transforms, program) -> str:
        return f"{', '.join(t.tensor for t in transforms)} kept sliced (sharded state)"

    def describe(self, program: Program) -> str:
        return f"{self.tensor} kept sliced"


def _slice(program: Program, gathered: dict, text: str) -> Program:
    """``program`` with each state of ``gathered`` (state -> its update and the all_gather that update drops)
    kept sliced: the update takes the slices, and a reader that cannot take them gets the state whole. So does
    a reader that could, but whose sliced result would meet other slices along another dim further on (a
    column factor added to rows a schedule already cut): each try that fails at a statement gives the state
    whole to the readers of it upstream of that statement, until the rewrite holds or no such reader is left."""
    readers = {s.name for s in program.stmts if gathered.keys() & set(s.args) and consumes_slices(program, s)}
    whole: set[str] = set()
    while True:
        failed = _try_slice(program, gathered, text, frozenset(whole))
        if isinstance(failed, Program):
            return failed
        at, error = failed
        culprits = (readers & (ancestors(program, at) | {at})) - whole
        if not culprits:
            raise error
        whole |= culprits


def _try_slice(program: Program, gathered: dict, text: str, whole: frozenset[str]):
    """The rewritten program, or (the statement it failed at, the refusal)."""
    updates = {upd.name: (tensor, ag) for tensor, (upd, ag) in gathered.items()}
    layouts = {t: program[ag.args[0]].type.layout for t, (_, ag) in gathered.items()}
    rw = Rewriter(program, text)
    for s in program.stmts:
        try:
            if s.name in gathered:
                rw.copy(s, attrs={**dict(s.attrs), "layout": str(layouts[s.name])})
            elif s.name in updates:
                tensor, ag = updates[s.name]
                rw.copy(s, [rw[tensor], rw[ag.args[0]]])
            elif s.op == "slice" and s.args[0] in gathered and layouts[s.args[0]].dim == s.attr("dim"):
                rw.copy(s)  # this rank's rows of the state are what it now holds (the builder gives the state)
            elif gathered.keys() & set(s.args) and (s.name in whole or not consumes_slices(program, s)):
                rw.copy(s, [rw.whole(a) if a in gathered else rw[a] for a in s.args])
            else:
                rw.copy(s)
        except IllegalTransform as e:
            return s.name, e
    return rw.finish()
