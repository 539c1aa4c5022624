"""What the lowering decides about a program before it writes any code, as functions of the program alone:
the order the step runs its statements and groups in, what each group reads and writes, which statements a
fused collective computes inside it, which values are computed on this rank's rows only, and which results
are written straight into the state they update.

``coconet.codegen.lower`` emits code from these decisions and ``coconet.tuner.cost`` prices the same ones,
so a prediction describes the module that runs (docs/architecture.md, "Known debts": the rest of the
decisions are still taken in lower.py and again in cost.py).
"""

from __future__ import annotations

from typing import Callable, Mapping

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


# the ops a fused kernel computes elementwise (lower.py spells each one in torch)
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
    return cut_to_rows(p, skip, lambda u: u not in skip and (ungrouped_pointwise(p, p[u]) or
                                                              fused_pointwise(p, p[u])), groups=True)


def cut_to_rows(p: Program, skip: set[str], reader: Callable[[str], bool], groups: bool = False) -> dict[str, int]:
    """The ungrouped rowwise Replicated statements not in ``skip`` whose readers are all statements ``reader``
    accepts that are Sliced on the statement's shape, or statements taken so, each with the dim they cut;
    with ``groups``, the members of fuse groups all of whose members are taken so, too."""
    banned: set[Group] = set()
    while True:
        out: dict[str, int] = {}
        for s in reversed(p.stmts):  # readers before what they read
            g = p.group_of.get(s.name)
            member = groups and g is not None and g not in banned and fused_pointwise(p, s)
            if (s.name in skip or not (member or ungrouped_pointwise(p, s)) or not s.type.shape
                    or not p.users[s.name] or not rowwise(p, s, s.type.shape)):
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
        partial = {p.group_of[m] for m in out if m in p.group_of
                   and any(x not in out for x in p.group_of[m].members)}
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
    return all(p[a].type.shape == () or (isinstance(p[a].type.layout, Replicated)
                                         and broadcast_shapes((p[a].type.shape, shape)) == shape) for a in s.args)


def row_dim(out_shape, d: int, shape) -> int | None:
    """The dim of an operand of ``shape`` (broadcast to ``out_shape``) that rows cut along ``d`` of the result
    cut: None where the operand has no such dim or a size-1 one there, and is read whole."""
    k = d - (len(out_shape) - len(shape))
    return k if k >= 0 and shape[k] == out_shape[d] else None


def readers_of(p: Program, t: str) -> list[str]:
    """The statements that read state ``t`` before the step's end, bar its own update; a slice of it is a view,
    read where its own readers run, so they count too (the slice with them)."""
    out = []
    for u in p.users[t]:
        if p[u].op == "update" and p[u].args[0] == t:
            continue
        out.append(u)
        if p[u].op == "slice":
            out += readers_of(p, u)
    return out


def step_positions(units: list, *inside) -> dict[str, int]:
    """Each statement's place in ``units`` (the order the step runs them); a statement that runs inside a group
    (``inside``: per group, its absorbed statements) takes the group's."""
    at: dict[str, int] = {}
    for i, u in enumerate(units):
        for m in (u.members if isinstance(u, Group) else (u,)):
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
        if all(u in members or (p[u].op not in EFFECTS and p[u].op not in VIEWS and p[u].op != "cast"
                                and at[u] < at[g.members[0]]) for u in readers_of(p, t)):
            found[o] = t
    return found


def custom_group(p: Program, g: Group) -> bool:
    """A group with a custom op among its members: run op by op, not compiled as one kernel."""
    return any(p[m].op in p.custom_ops for m in g.members)


def needs_copy(p: Program, name: str) -> bool:
    """An allreduce works in place: on its own buffer unless its operand is dead after it."""
    a = p[name].args[0]
    return p[a].op in ("input", "recv") or len(p.users[a]) > 1
