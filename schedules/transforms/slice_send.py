"""slice_send(send): the pipeline rewrite of CoCoNet §6.3. Instead of sending the
whole replicated value, each rank sends its slice to the same rank of the next
stage, which all-gathers it only where it needs the whole value — with
split + reorder this turns allreduce + send into reduce_scatter, send of
slices, all_gather on the receiving stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from coconet.schedules.ir import Program
from coconet.schedules.rewrite import Rewriter
from coconet.schedules.transforms.base import Transform, consumes_slices
from coconet.schedules.types import Replicated


@dataclass(frozen=True)
class SliceSend(Transform):
    send: str

    name = "slice_send"

    @classmethod
    def instances(cls, program: Program) -> list[Transform]:
        if program.groups:
            return []
        return [cls(s.name) for s in program.stmts if s.op == "send" and program[s.args[0]].op == "all_gather"]

    def apply(self, program: Program) -> Program:
        self.no_groups(program)
        send = self.need(program, self.send, ("send",), "a send")
        ag = program[send.args[0]]
        if ag.op != "all_gather":
            raise self.refuse(
                f"{send.name} sends {ag.name}, a {ag.op}: split and reorder so that it sends gathered slices"
            )
        layout = program[ag.args[0]].type.layout
        tag = send.attr("tag")
        recvs = [s for s in program.stmts if s.op == "recv" and s.attr("tag") == tag]
        for r in recvs:
            if not isinstance(r.type.layout, Replicated):
                raise self.refuse(f"{r.name} already receives {r.type.layout}")
        rw = Rewriter(program, self.text())
        received = {r.name for r in recvs}
        for s in program.stmts:
            if s in recvs:
                rw.copy(s, attrs={**dict(s.attrs), "layout": str(layout)})
            elif s.name == send.name:
                rw.copy(s, [rw[ag.args[0]]])
            elif received & set(s.args) and not consumes_slices(program, s):
                rw.copy(s, [rw.whole(a) if a in received else rw[a] for a in s.args])
            else:
                rw.copy(s)
        return rw.finish()

    def describe(self, program: Program) -> str:
        return f"{self.send} sends slices; the next stage gathers them"
