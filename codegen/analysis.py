"""What the lowering decides about a program before it writes any code, as functions of the program alone:
the order the step runs its statements and groups in, what each group reads and writes, which statements a
fused collective computes inside it, which values are computed on this rank's rows only, and which results
are written straight into the state they update.

``coconet.codegen.plan`` takes these decisions once per schedule and backend (``LoweringPlan``), which
``coconet.codegen.lower`` renders and ``coconet.tuner.cost`` prices, so a prediction describes the module
that runs.
"""

from __future__ import annotations

from typing import AbstractSet, Callable, Mapping

from coconet.errors import BackendError
from coconet.schedules.infer import broadcast_shapes
from coconet.schedules.ir import BINARY, COMPARE, EFFECTS, UNARY, VIEWS, Group, Program, Stmt
from coconet.schedules.types import Replicated, Sliced


def step_units(p: Program) -> list:
    """Statements in an order where each group is one contiguous unit (convex groups make this possible)."""
    unit_of = {m: g for g in p.groups for m in g.members}
    deps: dict[object, set] = {}
    order: dict[object, int] = {}
    for i, s in enumerate(p.stmts):
        u = unit_of.get(s.name, s.name)
        order.setdefault(u, i)
        deps.setdefault(u, set())
        for a in s.args:
            ua = unit_of.get(a, a)
            if ua is not u:
                deps[u].add(ua)
    done: set = set()
    out: list = []
    pending = sorted(deps, key=order.__getitem__)
    while pending:
        for u in pending:
            if deps[u] <= done:
                out.append(u)
                done.add(u)
                pending.remove(u)
                break
        else:
            raise BackendError("the schedule's groups form a cycle", kind="compile_error")
    return out


def group_io(p: Program, g: Group, absorbed=()) -> tuple[list[str], list[str]]:
    """What group ``g`` (with the statements it ``absorbed``) reads from outside it, and which of its members
    are read outside it: its kernel's arguments and results."""
    members = set(g.members) | set(absorbed)
    ins: list[str] = []
    for m in (*absorbed, *g.members):
        for a in p[m].args:
            if a not in members and a not in ins:
                ins.append(a)
    outs = [m for m in g.members if any(u not in members for u in p.users[m])]
    return ins, outs


# the ops a fused kernel computes elementwise (emitter.py spells each one in torch)
ELEMENTWISE = BINARY | COMPARE | UNARY | {"where", "const"}


def absorbed_by_collective(p: Program) -> dict[Group, tuple[str, ...]]:
    """Per fused collective, the ungrouped pointwise statements on this rank's slice whose only readers are
    the group (Adam's ``beta1 * m`` on sharded m): computed chunk by chunk inside it rather than as a
    full pass of their own before it, which also lets the group write the state they read in place."""
    out = {}
    for g in p.groups:
        if g.kind != "fused_collective":
            continue
        rs = p[g.members[0]]
        n = rs.type.shape[rs.type.layout.dim]
        inside, taken = set(g.members), set()
        for s in reversed(p.stmts):  # readers before what they read: one pass reaches a fixpoint
            t = s.type
            if not ungrouped_pointwise(p, s):
                continue
            sliced = isinstance(t.layout, Sliced) and t.shape[t.layout.dim] == n
            if not sliced and not rowwise(p, s, rs.type.shape):
                continue
            if p.users[s.name] and all(u in inside or u in taken for u in p.users[s.name]):
                taken.add(s.name)
        if taken:
            out[g] = tuple(s.name for s in p.stmts if s.name in taken)
    return out


def computed_on_rows(p: Program, skip: set[str]) -> dict[str, int]:
    """Replicated pointwise statements whose readers all cut them to this rank's rows (Adam's ``beta1 * m``
    after ``reorder(ag0)``, read only by ``add0`` on the rank's slice), each with the dim they cut: computed on
    those rows alone instead of on every rank's, 1/R of the work and of the memory. A fuse group of them
    whose every member is so (Adafactor's ``rsqrt(r * c / mean)`` fused, read by the update on the rank's
    rows) computes those rows in its kernel."""
    return cut_to_rows(
        p, skip, lambda u: u not in skip and (ungrouped_pointwise(p, p[u]) or fused_pointwise(p, p[u])), groups=True
    )


def cut_to_rows(
    p: Program, skip: AbstractSet[str], reader: Callable[[str], bool], groups: bool = False
) -> dict[str, int]:
    """The ungrouped rowwise Replicated statements not in ``skip`` whose readers are all statements ``reader``
    accepts that are Sliced on the statement's shape, or statements taken so, each with the dim they cut;
    with ``groups``, the members of fuse groups all of whose members are taken so, too."""
    banned: set[Group] = set()
    while True:
        out: dict[str, int] = {}
        for s in reversed(p.stmts):  # readers before what they read
            g = p.group_of.get(s.name)
            member = groups and g is not None and g not in banned and fused_pointwise(p, s)
            if (
                s.name in skip
                or not (member or ungrouped_pointwise(p, s))
                or not s.type.shape
                or not p.users[s.name]
                or not rowwise(p, s, s.type.shape)
            ):
                continue
            dims = set()
            for u in p.users[s.name]:
                ut = p[u].type
                if u in out:  # a broadcast operand of the reader's has its own dim there, or none
                    dims.add(row_dim(ut.shape, out[u], s.type.shape))
                elif reader(u) and isinstance(ut.layout, Sliced) and ut.shape == s.type.shape:
                    dims.add(ut.layout.dim)
                else:
                    dims.add(None)
            only = dims.pop() if len(dims) == 1 else None
            if only is not None:
                out[s.name] = only
        # a group computes on rows whole or not at all; what its members read may then be needed whole
        partial = {p.group_of[m] for m in out if m in p.group_of and any(x not in out for x in p.group_of[m].members)}
        if not partial:
            return out
        banned |= partial


def pointwise_value(s: Stmt) -> bool:
    """A computed elementwise value (not a constant)."""
    return s.op in ELEMENTWISE and s.op != "const" and s.type is not None


def ungrouped_pointwise(p: Program, s: Stmt) -> bool:
    """An elementwise value that no group computes: the step computes it on its own."""
    return s.name not in p.group_of and pointwise_value(s)


def fused_pointwise(p: Program, s: Stmt) -> bool:
    """An elementwise value a fuse group (of built-in ops) computes in its kernel."""
    g = p.group_of.get(s.name)
    return g is not None and g.kind == "fuse" and not custom_group(p, g) and pointwise_value(s)


def rowwise(p: Program, s: Stmt, shape) -> bool:
    """A Replicated pointwise statement of the group's whole shape on scalars and Replicated values of that
    shape or broadcast to it (AdamW's ``wd * w``; Adafactor's ``r * c``, an (M, 1) by a (1, K)): each row
    depends on the same row of its operands only, or on all of a broadcast one, so a chunk can compute its own
    rows of it instead of a full pass over every rank's rows before the group."""
    if not isinstance(s.type.layout, Replicated) or s.type.shape != shape:
        return False
    return all(
        p[a].type.shape == ()
        or (isinstance(p[a].type.layout, Replicated) and broadcast_shapes((p[a].type.shape, shape)) == shape)
        for a in s.args
    )


def row_dim(out_shape, d: int, shape) -> int | None:
    """The dim of an operand of ``shape`` (broadcast to ``out_shape``) that rows cut along ``d`` of the result
    cut: None where the operand has no such dim or a size-1 one there, and is read whole."""
    k = d - (len(out_shape) - len(shape))
    return k if k >= 0 and shape[k] == out_shape[d] else None


def readers_of(p: Program, t: str) -> list[str]:
    """The statements that read state ``t`` before the step's end, bar its own update; a slice or a transpose of
    it is a view, read where its own readers run, so they count too (the view with them)."""
    out = []
    for u in p.users[t]:
        if p[u].op == "update" and p[u].args[0] == t:
            continue
        out.append(u)
        if p[u].op in VIEWS:
            out += readers_of(p, u)
    return out


def step_positions(units: list, *inside) -> dict[str, int]:
    """Each statement's place in ``units`` (the order the step runs them); a statement that runs inside a group
    (``inside``: per group, its absorbed statements) takes the group's."""
    at: dict[str, int] = {}
    for i, u in enumerate(units):
        for m in u.members if isinstance(u, Group) else (u,):
            at[m] = i
    for groups in inside:
        for g, ms in groups.items():
            at.update(dict.fromkeys(ms, at[g.members[0]]))
    return at


def in_place_outputs(p: Program, g: Group, outs: list[str], at: Mapping[str, int]) -> dict[str, str]:
    """Outputs of a pointwise group that can be written straight into the state they update: the value feeds
    only that update, and every reader of the state is in the group (each element is read before it is
    written, by the same kernel) or runs before it (``at``: each statement's place in the step, step_positions)
    into a tensor of its own: a pointwise statement or a reduction, not a view or a cast (``.to`` of the
    same dtype is the state itself), nor an effect (an output or send holds the state until the step ends).
    An error-feedback residual ``e <- (g + e) - q`` whose ``g + e`` is another kernel's before it."""
    members = set(g.members)
    found = {}
    for o in outs:
        targets = [t for t, v in p.updates.items() if v == o]
        if len(targets) != 1 or any(u not in members and p[u].op != "update" for u in p.users[o]):
            continue
        t = targets[0]
        if p[t].type.shape != p[o].type.shape or p[t].type.layout != p[o].type.layout:
            continue
        if all(
            u in members
            or (p[u].op not in EFFECTS and p[u].op not in VIEWS and p[u].op != "cast" and at[u] < at[g.members[0]])
            for u in readers_of(p, t)
        ):
            found[o] = t
    return found


def custom_group(p: Program, g: Group) -> bool:
    """A group with a custom op among its members: run op by op, not compiled as one kernel."""
    return any(p[m].op in p.custom_ops for m in g.members)


def needs_copy(p: Program, name: str) -> bool:
    """An allreduce works in place: on its own buffer unless its operand is dead after it."""
    a = p[name].args[0]
    return p[a].op in ("input", "recv") or len(p.users[a]) > 1


# torch's functions with an ``out=`` for the pointwise ops: how a value is computed into a buffer it is given
# (held_source)
OUT = {
    "add": "torch.add",
    "sub": "torch.sub",
    "mul": "torch.mul",
    "div": "torch.div",
    "pow": "torch.pow",
    "maximum": "torch.maximum",
    "minimum": "torch.minimum",
    "neg": "torch.neg",
    "sqrt": "torch.sqrt",
    "rsqrt": "torch.rsqrt",
    "exp": "torch.exp",
    "log": "torch.log",
    "abs": "torch.abs",
    "where": "torch.where",
}


def updated_in_place(p: Program, skip: set[str]) -> dict[str, str]:
    """State → the value it is updated to, where that value is computed at the end of the step straight into
    the state (``torch.mul(acc, 0.0, out=acc)``) rather than into a new tensor copied into it: a pointwise
    statement torch computes into a buffer (``OUT``), of no group, that nothing else reads. It reads no other
    state (written by then, or about to be), of this state only the same element (the update's type is the
    value's), and of computed values only those of pointwise statements of no group, which are tensors of
    their own, not views of state. One pass and one new tensor fewer (an accumulator cleared, ``w - u``)."""
    out = {}
    for t, v in p.updates.items():
        s = p[v]
        if (
            v in skip
            or s.op not in OUT
            or not ungrouped_pointwise(p, s)
            or len(p.users[v]) != 1
            or s.type != p[t].type
            or not s.type.shape
        ):
            continue
        if all(
            a == t
            or (
                a not in p.updates
                and (
                    p[a].op in ("input", "scalar", "const")
                    or (ungrouped_pointwise(p, p[a]) and p[a].op != "cast" and a not in skip)
                )
            )
            for a in s.args
        ):
            out[t] = v
    return out


def fuse_absorbed(p: Program, skip: AbstractSet[str] = frozenset()) -> dict[Group, dict[str, int]]:
    """Per fuse group, the ungrouped Replicated pointwise statements on Replicated values and scalars whose
    readers are all the group's members on this rank's slice, or such statements (AdamW's ``w * (1 - lr *
    wd)``, Adam's ``beta1 * m`` with m whole after ``reorder(ag0)``), each with the dim those readers cut:
    computed inside the group's kernel on this rank's rows, not as a full pass over every rank's rows before
    it."""
    out = {}
    for g in p.groups:
        if g.kind == "fuse":
            inside = set(g.members)
            taken = cut_to_rows(p, skip, inside.__contains__)
            if taken:
                out[g] = {s.name: taken[s.name] for s in p.stmts if s.name in taken}
    return out


def fuse_reduced(p: Program) -> dict[Group, tuple[str, ...]]:
    """Per fuse group of whole values (Local or Replicated), the ungrouped sums and norms of its members: its
    kernel computes them as it computes what they sum and hands on the number, and what they sum is written
    out only where something else reads it (a loss scaler's count of non-finite elements, ``sum(where(abs(g) >
    t, 1, 0))``: the mask is never written). No member reads them (the group is convex), so the kernel may."""
    out = {}
    for g in p.groups:
        if g.kind != "fuse" or isinstance(p[g.members[0]].type.layout, Sliced) or custom_group(p, g):
            continue
        inside = set(g.members)
        taken = tuple(
            s.name for s in p.stmts if s.op in ("sum", "norm") and s.name not in p.group_of and s.args[0] in inside
        )
        if taken:
            out[g] = taken
    return out


def gathers_into_state(p: Program, units: list, absorbed: dict[Group, tuple[str, ...]]) -> dict[str, str]:
    """Ungrouped all_gathers (shm) whose value is the new value of one Replicated state and read by nothing
    else, where the state is bound and every other reader of it runs before them (``units``: the order the
    step runs its statements; ``absorbed``: statements that run inside their fused collective): each rank
    writes its rows straight into its own copy of the state and every peer's, with no gathered temporary, no
    slot and no copy into the state at the end. Each gather maps to its state."""
    at = step_positions(units, absorbed)
    found = {}
    for s in p.stmts:
        if s.op != "all_gather" or s.name in p.group_of or any(p[u].op != "update" for u in p.users[s.name]):
            continue
        targets = [t for t, v in p.updates.items() if v == s.name]
        if len(targets) != 1 or p[targets[0]].op != "input" or p[targets[0]].type != s.type:
            continue
        t = targets[0]
        # an update, output or send reading the state would see it after the step's end, or hold it
        readers = [t] + readers_of(p, t)
        if isinstance(s.type.layout, Replicated) and all(
            p[u].op not in EFFECTS and at[u] < at[s.name] for u in readers
        ):
            found[s.name] = t
    return found


def fuse_gathers_into(
    p: Program,
    units: list,
    into_state: dict[str, str],
    absorbed: dict[Group, tuple[str, ...]],
    rows: dict[Group, dict[str, int]],
) -> dict[Group, dict[str, str]]:
    """Per compiled fuse group on shm, the gathers into state (``into_state``, see gathers_into_state) of
    values nothing else outside the group reads that its kernel can do itself: it writes each new row into
    its own copy of the state and every peer's as it computes it, so the value is never written out to be
    copied. Each gather maps to the value it gathers. Every reader of the state in the group must read this
    rank's rows of it alone (a member Sliced on the state's shape, or a statement it computes on those rows:
    ``rows``, see fuse_absorbed), and every other reader runs before the group: the peers write their rows
    into this rank's copy while the kernel runs."""
    at = step_positions(units, absorbed, rows)
    out: dict[Group, dict[str, str]] = {}
    for g in p.groups:
        if g.kind != "fuse" or custom_group(p, g):
            continue
        inside = set(g.members) | set(rows.get(g, {}))
        found = {}
        for ag, state in into_state.items():
            o = p[ag].args[0]
            t = p[state].type
            if o not in g.members or any(u != ag and u not in g.members for u in p.users[o]):
                continue
            d = p[o].type.layout.dim

            def rows_of_state(u: str) -> bool:
                if u in rows.get(g, {}):
                    return rows[g][u] == d
                ut = p[u].type
                return isinstance(ut.layout, Sliced) and ut.layout.dim == d and ut.shape == t.shape

            readers = readers_of(p, state)
            if all(rows_of_state(u) if u in inside else at[u] < at[g.members[0]] for u in readers):
                found[ag] = o
        if found:
            out[g] = found
    return out
