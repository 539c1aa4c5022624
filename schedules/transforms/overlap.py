"""overlap(producer, collective): chunked pipelining of a matmul, a tensordot or a
convolution with the collective that consumes it (CoCoNet §4.4): chunk k's
collective is in flight while chunk k+1 is computed. ``chunks`` is a knob. A
convolution's chunks are batch rows of its input, or, for a reduce_scatter along
the batch, output channels of its weight; a tensordot's are rows of the result
along a's first free dim, against an allreduce.
"""

from __future__ import annotations

from dataclasses import dataclass

from coconet.schedules.ir import CONVS, Group, Program
from coconet.schedules.transforms.base import Transform, with_group
from coconet.schedules.types import Sliced

COLLECTIVES = ("allreduce", "reduce_scatter")
PRODUCERS = ("matmul", "tensordot", *CONVS)


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
                if (
                    src.op in PRODUCERS
                    and src.name not in program.group_of
                    and src.type.ndim >= 2
                    and program.users[src.name] == (s.name,)
                    and _chunkable(program, src.name, s.name) is None
                ):
                    out.append(cls(src.name, s.name))
        return out

    def apply(self, program: Program) -> Program:
        mm = self.need(program, self.producer, PRODUCERS, "a matmul, a tensordot or a convolution")
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
        why = _chunkable(program, mm.name, coll.name)
        if why is not None:
            raise self.refuse(why)
        return with_group(program, Group("overlap", (mm.name, coll.name), ("chunks",)))

    def describe(self, program: Program) -> str:
        return f"{self.producer} overlapped with {self.collective} in chunks"


def _chunkable(program: Program, producer: str, collective: str) -> str | None:
    """None where the producer's chunks are independent pieces of its result, else why not. A matmul's chunks
    are a's rows by b whole: a batch of products is not chunked. A tensordot is chunked along a's first free dim
    against an allreduce. A convolution is
    chunked along the batch (its input whole along it: a rank's batch slice would be another layout), or, for
    a reduce_scatter along the batch, along its weight's output channels, which must not straddle groups."""
    s = program[producer]
    if s.op == "tensordot":
        return _tensordot_chunkable(program, producer, collective)
    if s.op == "matmul" and program[s.args[1]].type.ndim > 2:
        return f"{producer} is a batch of products: its chunks are a's rows, which a batch of b does not follow"
    if s.op not in CONVS:
        return None
    if program[s.args[0]].type.layout == Sliced(0):
        return f"{producer}'s input is sliced along the batch: its chunks are the ranks' already"
    coll = program[collective]
    if coll.op == "reduce_scatter" and coll.type.layout == Sliced(0) and s.attr("groups") != 1:
        return (
            f"{collective} scatters the batch, so {producer} is chunked along its output channels, which "
            f"would straddle its {s.attr('groups')} groups"
        )
    return None


def _tensordot_chunkable(program: Program, producer: str, collective: str) -> str | None:
    """A tensordot is chunked along a's first free dim, the result's first dim, each chunk's rows allreduced:
    a's free dims come first in the result, so a chunk of them is a band of its rows."""
    s = program[producer]
    a = program[s.args[0]].type
    if program[collective].op != "allreduce":
        return f"{producer} is a tensordot: its chunks are rows of the result, overlapped with an allreduce only"
    if len(s.attr("dims")[0]) == a.ndim:
        return f"{producer} contracts every dim of {s.args[0]}: the result has no rows of a to chunk"
    return None
