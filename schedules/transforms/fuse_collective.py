"""fuse_collective(rs): reduce_scatter + the computation on its slices + the
all_gathers of the results → one fused collective (FusedAllReduce, CoCoNet §4.3):
each rank reduces its slice, computes on it while it is in registers or
cache, and the gathers send the results. ``fc_chunks`` pipelines it: the slice
is cut in that many chunks, and chunk k+1 is reduced while chunk k computes
and chunk k-1 is gathered.

The partial sums of the slice (a norm over the reduced value, as gradient
clipping and LAMB take it) join too: each chunk adds its rows' share while
they are in cache, so the value they sum is never written out to be read
back. What the total feeds waits for the allreduce of the partials, outside.
So does the work on a ``slice`` of replicated state with the slice's rows
(``slice_reduce``: LAMB's norm of its weights), which reads each chunk's
rows of the state as the update does.

Reductions and softmaxes along a dim other than the scattered one join as
pointwise work does (a LayerNorm after Megatron's sequence-parallel
reduce_scatter): a chunk holds whole rows along every other dim, so it
computes their means and normalises them in the same kernel. Along the
scattered dim a chunk holds part of each row (a ``partial_reduce``, which an
allreduce completes): that stays out, and ``left_out`` says why.
"""

from __future__ import annotations

from dataclasses import dataclass

from coconet.schedules.ir import DIM_REDUCTIONS, ROWWISE_OPS, Group, Program, Stmt
from coconet.schedules.transforms.base import (
    Transform,
    convex_with,
    grow_in_order,
    is_pointwise,
    ordered,
    sliced_dim,
    with_group,
)
from coconet.schedules.transforms.fuse import rowwise_member


def _rows(program: Program, name: str, dim: int):
    """The extent of ``name``'s dim ``dim`` where it is sliced along that dim; None otherwise."""
    return program[name].type.shape[dim] if sliced_dim(program, name) == dim else None


def region(program: Program, rs: str) -> tuple[str, ...]:
    dim = sliced_dim(program, rs)
    rows = program[rs].type.shape[dim]
    members = {rs}
    pos = program.position
    first = pos[rs]
    # the members are rs and statements after it, offered in program order: readers of a member, and slices

    def join(s: Stmt, at: int) -> bool:
        if s.name in program.group_of:
            return False
        if any(a in members for a in s.args):
            # the slice's rows are a chunk's: work sliced along a dim of another extent is cut otherwise
            # a reduction or softmax along another dim (a LayerNorm's means) has its rows whole in every chunk
            work = is_pointwise(program, s) or rowwise_member(program, s.name)
            ok = (
                (work and _rows(program, s.name, dim) == rows)
                or s.op == "all_gather"
                or (s.op == "partial_sum" and _rows(program, s.args[0], dim) == rows)
            )
        else:  # rows of a replicated value that are the slice's rows: each chunk reads its own
            ok = s.op == "slice" and _rows(program, s.name, dim) == rows
        if ok and convex_with(program, members, s.name, (first, at)) is None:
            members.add(s.name)
            return True
        return False

    slices = [pos[x] for x in program.of_op.get("slice", ()) if pos[x] > first]
    grow_in_order(program, [pos[u] for u in program.users[rs]] + slices, join)
    reduced = {rs}  # what reads the reduced rows
    for m in ordered(program, members):
        if reduced & set(program[m].args):
            reduced.add(m)
    if not any(is_pointwise(program, program[m]) for m in reduced):
        return ordered(program, reduced)  # work on slices of state alone gains nothing from the collective
    # a slice that nothing in the unit reads would only be copied out of it
    idle = {m for m in members if program[m].op == "slice" and not members & set(program.users[m])}
    return ordered(program, members - idle)


def left_out(program: Program, rs: str) -> dict[str, str]:
    """Why the statements along a dim that read the fused collective's slices stay out of it: a chunk holds
    whole rows along every dim but the scattered one, so it reduces (or normalises) along another dim alone."""
    dim = sliced_dim(program, rs)
    rows = program[rs].type.shape[dim]
    members = set(region(program, rs))
    why = {}
    for m in ordered(program, members):
        for u in program.users[m]:
            s = program[u]
            if u in members or u in why or s.op not in DIM_REDUCTIONS | ROWWISE_OPS:
                continue
            if s.op == "partial_reduce" or s.attr("dim") is None:
                why[u] = (
                    f"{u} reduces along dim {dim}, the one {rs} scatters: a chunk holds part of each row "
                    "it reduces, which an allreduce completes after the collective"
                )
            elif _rows(program, u, dim) != rows:
                why[u] = (
                    f"{u}'s result is not sliced along dim {dim}, along which {rs}'s chunks are cut: "
                    "the chunk's rows of it are not the chunk's rows of what it reads"
                )
            elif u in program.group_of:
                why[u] = f"{u} already runs in {program.group_of[u]}"
    return why


@dataclass(frozen=True)
class FuseCollective(Transform):
    reduce_scatter: str

    name = "fuse_collective"
    kind = "group"
    knobs = {"fc_chunks": (4, (1, 2, 4, 8))}

    @classmethod
    def instances(cls, program: Program) -> list[Transform]:
        out = []
        for s in program.stmts:
            if s.op == "reduce_scatter" and s.name not in program.group_of:
                members = region(program, s.name)
                if any(program[m].op != "reduce_scatter" and program[m].op != "all_gather" for m in members):
                    out.append(cls(s.name))
        return out

    def members(self, program: Program) -> tuple[str, ...]:
        return region(program, self.reduce_scatter)

    def apply(self, program: Program) -> Program:
        rs = self.need(program, self.reduce_scatter, ("reduce_scatter",), "a reduce_scatter")
        if rs.name in program.group_of:
            raise self.refuse(f"{rs.name} already runs in {program.group_of[rs.name]}")
        members = region(program, rs.name)
        if not any(program[m].op not in ("reduce_scatter", "all_gather") for m in members):
            why = "; ".join(left_out(program, rs.name).values())
            raise self.refuse(f"no pointwise work runs on the slices of {rs.name}: " + (why or "reorder first"))
        return with_group(program, Group("fused_collective", members, ("fc_chunks",)))

    @classmethod
    def describe_many(cls, transforms, program) -> str:
        if len(transforms) == 1:
            return transforms[0].describe(program)
        return f"{', '.join(t.reduce_scatter for t in transforms)} fused with the work on their slices"

    def describe(self, program: Program) -> str:
        members = region(program, self.reduce_scatter)
        ops = [program[m].op for m in members]
        work = sum(1 for op in ops if op not in ("reduce_scatter", "all_gather", "partial_sum"))
        gathers, partials = ops.count("all_gather"), ops.count("partial_sum")
        text = f"{self.reduce_scatter} fused with {work} statement{'s' * (work != 1)}"
        if partials:
            text += f", {partials} partial sum{'s' * (partials != 1)}"
        text += f" and {gathers} all_gather{'s' * (gathers != 1)}"
        out = left_out(program, self.reduce_scatter)
        return text + (f"; {', '.join(out)} outside it" if out else "")
