"""What a fused collective does, decided from the program before any code is written: what it reads, what
each chunk computes, where each result goes, whether its chunk is one compiled kernel and whether that kernel
reduces every rank's rows as it reads them. ``coconet.codegen.plan`` gathers these per group
(``FusedCollective``); the lowering renders them and the cost model prices them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from coconet.codegen.analysis import ELEMENTWISE, OUT, custom_group, group_io, readers_of, ungrouped_pointwise
from coconet.codegen.backends import Backend
from coconet.schedules.ir import ROWWISE_OPS, Group, Program, Stmt
from coconet.schedules.types import Local, Replicated, Sliced


@dataclass(frozen=True)
class FusedCollective:
    """A fused collective as the lowering emits it and the cost model prices it: what it reads, what each chunk
    computes, and where each result goes."""

    rs: Stmt
    ins: tuple[str, ...]
    outs: tuple[str, ...]  # handed on after it: neither written in place nor gathered into state
    inplace: Mapping[str, str]  # result -> the sliced state each chunk writes it into (sliced_in_place)
    into: Mapping[str, str]  # all_gather -> the replicated state whose every copy it writes (gather_into)
    gathers: tuple[str, ...]
    partials: tuple[str, ...]  # partial sums handed on, each chunk's added up after the last
    sliced_outs: tuple[str, ...]  # values on this rank's rows handed on, whole
    compute: tuple[str, ...]  # what each chunk computes: its absorbed statements, then the members'
    needed: frozenset[str]  # what the chunk's computation must give: for a gather that sends it, or handed on
    direct: bool  # reads_input_in_place
    compiles: bool  # the chunk one compiled kernel (chunk_compiles), where the lowering compiles
    sums_parts: bool  # that kernel takes the rows on every rank unreduced (sums_parts)
    pre: tuple[str, ...] = ()  # what that kernel computes on every rank's rows before it sums them (reduced_in_kernel)
    # whose rows every rank's come from: the reduce_scatter's operand, or the inputs pre reads (program order)
    sources: tuple[str, ...] = ()
    ranked: tuple[str, ...] = ()  # the numbers of every rank's own that pre reads (rank_numbers)
    held: bool = False  # source computed into a buffer the peers read where it lies (held_source)
    # gathers (shm) whose value a compiled chunk kernel writes into this rank's slot, which the peers copy it out
    # of: never returned and copied in
    slotted: tuple[str, ...] = ()


def fused_collective_plan(
    p: Program, backend: Backend, g: Group, absorbed: tuple[str, ...], compiled: bool = True
) -> FusedCollective:
    ins, outs = group_io(p, g, absorbed)
    inplace = sliced_in_place(p, g, outs, absorbed) if compiled else {}
    into = gather_into(p, backend, g, outs, absorbed)
    outs = [o for o in outs if o not in inplace and o not in into]
    gathers = tuple(m for m in g.members if p[m].op == "all_gather")
    partials = tuple(o for o in outs if p[o].op == "partial_sum")
    sliced_outs = tuple(o for o in outs if p[o].op not in ("all_gather", "partial_sum"))
    needed = {p[m].args[0] for m in gathers if m not in into} | set(sliced_outs) | set(partials)
    compute = tuple(m for m in (*absorbed, *g.members[1:]) if p[m].op != "all_gather")
    compiles = compiled and chunk_compiles(p, g, compute)
    sums = compiles and sums_parts(p, backend, g, into)
    rs = p[g.members[0]]
    pre = reduced_in_kernel(p, g) if sums else ()
    read = {a for m in pre for a in p[m].args if p[a].op == "input" and p[a].type.shape}
    sources = tuple(s.name for s in p.stmts if s.name in read) or (rs.args[0],)
    if pre:
        ins, _ = group_io(p, g, (*pre, *absorbed))
    held = not pre and held_source(p, backend, rs)
    direct = held or all(reads_input_in_place(p, backend, x, after=bool(pre)) for x in sources)
    return FusedCollective(
        rs=rs,
        ins=tuple(ins),
        outs=tuple(outs),
        inplace=inplace,
        into=into,
        gathers=gathers,
        partials=partials,
        sliced_outs=sliced_outs,
        compute=compute,
        needed=frozenset(needed),
        direct=direct,
        compiles=compiles,
        sums_parts=sums,
        pre=pre,
        sources=sources,
        ranked=rank_numbers(p, pre),
        held=held,
        slotted=tuple(
            m
            for m in gathers
            if backend.writes_slots and m not in into and p[m].args[0] in compute and p[m].args[0] not in sliced_outs
        ),
    )


def rank_numbers(p: Program, pre: Sequence[str]) -> tuple[str, ...]:
    """The 0-d Local values ``pre`` (reduced_in_kernel) reads: numbers each rank holds its own of (a weight, a
    clip factor from its gradient's norm), which every rank posts at the barrier that begins the collective
    (``_Shm.post``), so that the kernel computes each rank's rows with that rank's."""
    return tuple(
        dict.fromkeys(
            a for m in pre for a in p[m].args if p[a].type.shape == () and isinstance(p[a].type.layout, Local)
        )
    )


def reduced_in_kernel(p: Program, g: Group) -> tuple[str, ...]:
    """The statements before a fused collective's reduce_scatter that its chunk kernel computes on each rank's
    rows as it sums them (where it takes them unreduced, ``sums_parts``): pointwise statements of Local inputs
    of the reduced value's shape (a gradient; a buffer of earlier micro-batches' gradients the step clears once
    reduced), of numbers every rank holds alike (scalars, constants, 0-d Replicated values) and of float32
    numbers each rank holds its own of (``rank_numbers``), that nothing else reads: the gradient predivided or
    unscaled before its allreduce, cast to float32, weighted by the rank's share of the tokens, clipped by its
    own norm, added to the accumulated ones. The reduction then reads those inputs where they lie
    (``reads_input_in_place``), and their value is never written out and published (on a step of N floats: N
    words written and 2N read, per rank; N written and N read where it would have gone into a buffer the peers
    read). Their semantics is unchanged: each rank's rows are computed from its own inputs, then summed."""
    rs = p[g.members[0]]
    x = rs.args[0]
    shape = p[x].type.shape
    pre: set[str] = set()
    leaves: set[str] = set()
    todo = [x]
    while todo:
        s = p[todo.pop()]
        if s.name in pre:
            continue
        if (
            not ungrouped_pointwise(p, s)
            or s.op == "dropout"
            or s.type.shape != shape
            or not isinstance(s.type.layout, Local)
        ):
            return ()
        pre.add(s.name)
        for a in s.args:
            t = p[a]
            if t.op == "input" and isinstance(t.type.layout, Local) and t.type.shape == shape:
                leaves.add(a)
            elif t.type.shape == () and isinstance(t.type.layout, Replicated):
                continue  # the same number on every rank: the kernel's own
            elif t.type.shape == () and isinstance(t.type.layout, Local) and (t.type.dtype or "float32") == "float32":
                continue  # a number of each rank's own (rank_numbers): posted at the barrier
            else:
                todo.append(a)
    if not leaves or any(u not in pre and u != rs.name for m in pre for u in p.users[m]):
        return ()
    return tuple(s.name for s in p.stmts if s.name in pre)


def sliced_in_place(p: Program, g: Group, outs: list[str], absorbed) -> dict[str, str]:
    """Values a fused collective computes on this rank's slice of sharded state that it can write straight
    into that state, chunk by chunk."""
    return collective_in_place(p, g, outs, absorbed, gathered=False)


def gather_into(p: Program, backend: Backend, g: Group, outs: list[str], absorbed) -> dict[str, str]:
    """All_gathers of a fused collective on shm whose value only updates Replicated state that nothing
    outside reads: the chunk writes this rank's rows into the state, then into every peer's copy of it
    (which lives in shared memory). No gathered temporary, no slot, no copy into the state after."""
    return collective_in_place(p, g, outs, absorbed, gathered=True) if backend.gathers_into_state else {}


def collective_in_place(p: Program, g: Group, outs: list[str], absorbed, *, gathered: bool) -> dict[str, str]:
    """Outputs of a fused collective (its all_gathers if ``gathered``, else the others) that are the new
    value of one state tensor of their type (Replicated for a gather, Sliced otherwise), read outside only
    by that update (a gather's not even inside), and every reader of the state is a pointwise statement or
    a slice inside: each reads its chunk's rows before the same kernel writes them."""
    inside = set(g.members) | set(absorbed)
    layout = Replicated if gathered else Sliced
    found = {}
    for o in outs:
        targets = [t for t, v in p.updates.items() if v == o]
        if (p[o].op == "all_gather") != gathered or len(targets) != 1:
            continue
        t = targets[0]
        if p[t].type != p[o].type or not isinstance(p[t].type.layout, layout):
            continue
        readers = [u for u in readers_of(p, t) if p[u].op != "update"]
        if all(p[u].op == "update" or (u in inside and not gathered) for u in p.users[o]) and all(
            u in inside and (p[u].op in ELEMENTWISE or p[u].op == "slice") for u in readers
        ):
            found[o] = t
    return found


def sums_parts(p: Program, backend: Backend, g: Group, into) -> bool:
    """Whether a fused collective's compiled chunk kernel (shm) takes the chunk's rows on every rank unreduced
    and reduces them as it reads them (any of the IR's REDUCE_OPS: sum, avg, prod, max, min): the reduced rows
    are never written out, unless the group outputs them, and then only once, by the kernel. Not where a
    gather outside the kernel sends them. A max allreduce of each rank's |g| (an amax) then reads g where it
    lies too."""
    rs = p[g.members[0]]
    sent = any(p[m].op == "all_gather" and m not in into and p[m].args[0] == rs.name for m in g.members)
    return backend.sums_in_kernel and not sent


def reads_input_in_place(p: Program, backend: Backend, source: str, after: bool = False) -> bool:
    """Whether a fused collective on shm reads its reduce_scatter's operand where it lies on every rank, moved
    into a segment of its own (``_Shm.stage_input``), rather than published into a slot: the operand is an
    input the step leaves as it is (a gradient). The barrier that ends the collective (``_end_collective``,
    its gathers' or its own where it gathers nothing) comes after the peers' last read of it and before any
    rank returns to a caller who may write the next one into it. ``after``: an input the chunk kernel reads
    (``reduced_in_kernel``) may be a Local state, for nothing writes one before the collective has ended: its
    new value is written in place at the step's end or by a kernel that runs after every reader of it
    (``in_place_outputs``), and the collective is one."""
    src = p[source]
    return (
        backend.reads_in_place
        and src.op == "input"
        and (src.name not in p.updates or (after and isinstance(src.type.layout, Local)))
    )


def held_source(p: Program, backend: Backend, rs: Stmt) -> bool:
    """Whether a fused collective on shm reads the value its reduce_scatter reduces where it lies on every
    rank, because the step computes it into a buffer it keeps from step to step (``_Shm.held``), which moves
    into a segment of its own as an input does (``_Shm.stage_input``), rather than into a new tensor that is
    published into a slot: a pointwise statement torch computes into a buffer (``OUT``) that nothing else
    reads and the chunk kernel does not compute (``reduced_in_kernel``), as a gradient accumulated over
    micro-batches added to the last one's (``acc + g``, two inputs). Saved per rank and step: the copy into
    the slot (N words read and written) and a new tensor's first touch of every page. The barrier that ends
    the collective comes after the peers' last read of it, before the next step computes into it again. So
    does a fuse group's output that nothing outside the group but the reduce_scatter reads (the compressed
    gradient of an error-feedback step): the kernel stores it into the buffer, not into a new tensor."""
    s = p[rs.args[0]]
    if not backend.reads_in_place or not s.type.shape:
        return False
    g = p.group_of.get(s.name)
    if g is None:
        return s.op in OUT and ungrouped_pointwise(p, s) and tuple(p.users[s.name]) == (rs.name,)
    # a fuse kernel's output: the kernel writes it into the buffer as it computes it (render_fuse.lower_fuse)
    return g.kind == "fuse" and not custom_group(p, g) and all(u == rs.name or u in g.members for u in p.users[s.name])


def chunk_compiles(p: Program, g: Group, compute: Sequence[str]) -> bool:
    """Whether a fused collective's chunk computes in one compiled kernel: pointwise statements, partial sums
    (the kernel returns the chunk's), slices of replicated values (the chunk's rows of them), dropout on
    values sliced as the chunks are (its mask's counters are global element indices, which the kernel gets
    from the chunk's first row), and reductions or softmaxes along another dim of such values (a LayerNorm's
    means: every row they reduce is whole in the chunk, and Inductor reduces it inside the kernel)."""
    rs = p[g.members[0]]
    d = rs.type.layout.dim
    n = rs.type.shape[d]

    def ok(s: Stmt) -> bool:
        if s.op == "dropout" or s.op in ROWWISE_OPS:
            t = s.type
            return (
                isinstance(t.layout, Sliced)
                and t.layout.dim == d
                and t.shape[d] == n
                and (s.op == "dropout" or s.attr("dim") is not None)
            )
        return s.op in ELEMENTWISE or s.op in ("partial_sum", "slice")  # the chunk's share of the sum; its rows

    return bool(compute) and all(ok(p[m]) for m in compute)
