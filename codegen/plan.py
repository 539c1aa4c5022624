"""The lowering plan: every decision the lowering takes about a schedule on a backend, taken once, before any
code is written, as immutable values. ``coconet.codegen.lower`` renders a plan into a module and
``coconet.tuner.cost`` prices the same plan, so a prediction describes the module that runs
(docs/architecture.md, "Packages and modules").

A plan answers: which units the step runs and in what order (statements and groups, each group one unit);
which statements run inside a unit rather than as units of their own (what a fused collective absorbs or its
chunk kernel computes on every rank's rows, what a fuse kernel computes on this rank's rows or sums as it
goes); which values are computed on this rank's rows alone; which state is written in place, gathered
straight into every copy of it, or computed into at the step's end; which values are computed into buffers
the peers read where they lie; and each fused collective's and fuse kernel's own plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Union

from coconet.codegen.analysis import (
    absorbed_by_collective,
    computed_on_rows,
    custom_group,
    fuse_absorbed,
    fuse_gathers_into,
    fuse_reduced,
    gathers_into_state,
    group_io,
    in_place_outputs,
    needs_copy,
    step_positions,
    step_units,
    updated_in_place,
)
from coconet.codegen.backends import Backend, get
from coconet.codegen.fused import FusedCollective, fused_collective_plan
from coconet.schedules.ir import Group, Program
from coconet.schedules.schedule import Schedule
from coconet.schedules.transforms.bucket import Bucket
from coconet.schedules.transforms.fuse_collective import FuseCollective
from coconet.schedules.transforms.overlap import Overlap
from coconet.schedules.types import Replicated

# the knobs a unit reads, with their defaults as the transforms that make the units declare them
KNOB_DEFAULTS = MappingProxyType(
    {name: default for t in (Overlap, Bucket, FuseCollective) for name, (default, _) in t.knobs.items()}
)

Unit = Union[str, Group]  # a statement run on its own, or a group run as one unit


def _frozen(d: Mapping) -> Mapping:
    return MappingProxyType(dict(d))


@dataclass(frozen=True)
class FuseKernel:
    """A fuse group as one kernel: what it computes besides its members, what it reads and hands on, and where
    its results go."""

    group: Group
    rows: Mapping[str, int]  # statements it computes on this rank's rows, each with the dim cut (fuse_absorbed)
    sums: tuple[str, ...]  # sums and norms of its members it computes as it goes (fuse_reduced)
    ins: tuple[str, ...]  # what it reads from outside: its arguments
    outs: tuple[str, ...]  # its members read outside it
    inplace: Mapping[str, str]  # output -> the state it is written into (in_place_outputs)
    into: Mapping[str, str]  # gather -> the value whose rows it writes into every copy of the state (fuse_gathers_into)
    held: tuple[str, ...]  # outputs stored into the buffer a fused collective reads where it lies (held_source)
    returns: tuple[str, ...]  # what its call hands back
    compiled: bool  # one compiled kernel (a custom op's code runs as written, statement by statement)

    @property
    def computes(self) -> tuple[str, ...]:
        """Every statement the kernel computes, in the order it computes them."""
        return (*self.rows, *self.group.members, *self.sums)


def _fuse_kernel(
    p: Program,
    g: Group,
    rows: Mapping[str, int],
    sums: tuple[str, ...],
    at: Mapping[str, int],
    into: Mapping[str, str],
    held: frozenset[str],
    compiled: bool,
) -> FuseKernel:
    ins, outs = group_io(p, g, (*rows, *sums))
    inplace = in_place_outputs(p, g, outs, at)
    kept = [o for o in outs if o in held and o not in inplace and o not in into.values()]
    rest = [o for o in outs if o not in inplace and o not in into.values() and (into or o not in kept)]
    return FuseKernel(
        group=g,
        rows=_frozen(rows),
        sums=tuple(sums),
        ins=tuple(ins),
        outs=tuple(outs),
        inplace=_frozen(inplace),
        into=_frozen(into),
        held=tuple(kept),
        returns=(*rest, *sums),
        compiled=compiled and not custom_group(p, g),
    )


@dataclass(frozen=True)
class LoweringPlan:
    """What the lowering of ``schedule`` for ``backend`` does (``compiled``: fused groups as compiled kernels,
    else eager statements), decided once. ``of`` makes one."""

    schedule: Schedule
    backend: Backend
    compiled: bool
    units: tuple[Unit, ...]  # what the step runs, in order: inputs and scalars bound first
    absorbed: Mapping[Group, tuple[str, ...]]  # per fused collective, what each chunk computes before its members
    chunk_rows: Mapping[str, Group]  # of those, Replicated statements a chunk computes its own rows of
    pre: Mapping[Group, tuple[str, ...]]  # per fused collective, what its kernel computes on every rank's rows
    rows_only: Mapping[str, int]  # statements computed on this rank's rows only, each with the dim cut
    at_end: Mapping[str, str]  # state -> the value computed straight into it at the step's end (updated_in_place)
    into_state: Mapping[str, str]  # ungrouped all_gather -> the state whose every copy it writes (gathers_into_state)
    held: frozenset[str]  # values computed into the buffer a fused collective reads where it lies
    aliased: tuple[str, ...]  # state another is updated to: copied as the step begins
    copies: frozenset[str]  # allreduces that work on a copy of their operand (needs_copy)
    positions: Mapping[str, int]  # each statement's place in the step's order (inside a unit: the unit's)
    fused_collectives: Mapping[Group, FusedCollective]
    fuse_kernels: Mapping[Group, FuseKernel]
    knobs: Mapping[str, int]  # every unit knob's value: the schedule's, else its transform's default

    @classmethod
    def of(cls, schedule: Schedule, backend: str | Backend, compiled: bool = True) -> "LoweringPlan":
        """The plan of ``schedule`` for ``backend`` (a name of ``BACKENDS``, or a Backend)."""
        backend = backend if isinstance(backend, Backend) else get(backend)
        p = schedule.scheduled
        order = step_units(p)
        # every input bound (and a state another is updated to copied) before any unit runs: a unit may write a
        # state it does not read in the program, a fused collective gathering into it
        first = [u for u in order if not isinstance(u, Group) and p[u].op in ("input", "scalar")]
        bound = set(first)
        steps = first + [u for u in order if isinstance(u, Group) or u not in bound]
        absorbed = absorbed_by_collective(p) if compiled else {}
        collectives = {
            g: fused_collective_plan(p, backend, g, absorbed.get(g, ()), compiled)
            for g in p.groups
            if g.kind == "fused_collective"
        }
        pre = {g: fc.pre for g, fc in collectives.items() if fc.pre}
        skip = {m for ms in (*absorbed.values(), *pre.values()) for m in ms}
        fuse_rows = fuse_absorbed(p, skip)
        sums = fuse_reduced(p) if compiled else {}
        skip.update(m for ms in sums.values() for m in ms)
        rows_only: dict[str, int] = {}
        for ms in fuse_rows.values():
            rows_only.update(ms)
        skip.update(rows_only)
        rows_only.update(computed_on_rows(p, skip))
        into_state: dict[str, str] = {}
        fuse_into: dict[Group, dict[str, str]] = {}
        if backend.gathers_into_state:
            into_state = gathers_into_state(p, steps, absorbed)
            if compiled:
                fuse_into = fuse_gathers_into(p, steps, into_state, absorbed, fuse_rows)
        held = frozenset(fc.sources[0] for fc in collectives.values() if fc.held)
        at_end = updated_in_place(p, skip | set(rows_only))
        skip |= set(at_end.values())
        at = step_positions(steps, absorbed, fuse_rows, sums, pre)
        kernels = {
            g: _fuse_kernel(p, g, fuse_rows.get(g, {}), sums.get(g, ()), at, fuse_into.get(g, {}), held, compiled)
            for g in p.groups
            if g.kind == "fuse"
        }
        return cls(
            schedule=schedule,
            backend=backend,
            compiled=compiled,
            units=tuple(u for u in steps if u not in skip),
            absorbed=_frozen(absorbed),
            chunk_rows=_frozen(
                {m: g for g, ms in absorbed.items() for m in ms if isinstance(p[m].type.layout, Replicated)}
            ),
            pre=_frozen(pre),
            rows_only=_frozen(rows_only),
            at_end=_frozen(at_end),
            into_state=_frozen(into_state),
            held=held,
            aliased=tuple(v for v in dict.fromkeys(p.updates.values()) if p[v].op == "input" and v in p.updates),
            copies=frozenset(s.name for s in p.stmts if s.op == "allreduce" and needs_copy(p, s.name)),
            positions=_frozen(at),
            fused_collectives=_frozen(collectives),
            fuse_kernels=_frozen(kernels),
            knobs=_frozen({**KNOB_DEFAULTS, **schedule.knob_values}),
        )

    @property
    def program(self) -> Program:
        return self.schedule.scheduled

    @property
    def rows(self) -> Mapping[str, int]:
        """Every statement computed on rows of its value rather than all of it, with the dim they cut: this
        rank's rows (``rows_only``), or a chunk's rows of a fused collective's slice (``chunk_rows``)."""
        p = self.program
        out = {m: p[g.members[0]].type.layout.dim for m, g in self.chunk_rows.items()}
        return MappingProxyType({**out, **self.rows_only})

    @property
    def fused_gathers(self) -> frozenset[str]:
        """All_gathers a fuse kernel does itself, writing its rows into every copy of the state: no unit."""
        return frozenset(ag for k in self.fuse_kernels.values() for ag in k.into)

    @property
    def slotless(self) -> frozenset[str]:
        """All_gathers that write into every copy of a state and need no slot of a segment (shm)."""
        return frozenset(self.into_state) | frozenset(m for fc in self.fused_collectives.values() for m in fc.into)

    @property
    def written(self) -> frozenset[str]:
        """State a unit writes (in place, or into every copy of it): no copy into it at the step's end."""
        out = set(self.into_state.values())
        for k in self.fuse_kernels.values():
            out.update(k.inplace.values())
        for fc in self.fused_collectives.values():
            out.update(fc.inplace.values())
            out.update(fc.into.values())
        return frozenset(out)

    @property
    def copied_at_end(self) -> tuple[tuple[str, str], ...]:
        """(state, value) of the updates copied into the state at the step's end: neither written by a unit nor
        computed into the state (``at_end``), which follow these."""
        written = self.written
        return tuple((t, v) for t, v in self.program.updates.items() if t not in written and t not in self.at_end)
