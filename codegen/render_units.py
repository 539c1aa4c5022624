"""The units that run no kernel of their own making: an overlap (the matmul, tensordot or convolution in chunks,
each chunk's collective in flight while the next multiplies) and a bucket (its collectives issued together, at most
a cap of bytes per launch).
"""

from __future__ import annotations

from coconet.codegen.emitter import Emitter, conv_call
from coconet.codegen.names import dim_expr
from coconet.schedules.ir import CONVS, Group, Stmt


def lower_overlap(e: Emitter, g: Group, chunks: int) -> list[str]:
    p = e.p
    mm, coll = p[g.members[0]], p[g.members[1]]
    if mm.op in CONVS:
        return _lower_conv_overlap(e, mm, coll, chunks)
    if mm.op == "tensordot":
        return _lower_tensordot_overlap(e, mm, coll, chunks)
    a, b = e.ident(mm.args[0]), e.ident(mm.args[1])
    out = e.ident(coll.name)
    lines = [f"# overlap({mm.name}, {coll.name}): {chunks} chunks, chunk k's collective in flight while k+1 multiplies"]
    if coll.op == "allreduce":
        lines += [
            # rows by contraction, spelled out: a rank may hold none of the contraction dim (uneven slices)
            f"_a = {a}.reshape({a}.shape[:-1].numel(), {a}.shape[-1])",
            "_parts, _works = [], []",
            f"for _ak in torch.tensor_split(_a, {chunks}, dim=0):",
            f"    _yk = {e.matmul}(_ak, {b})",
            f"    _works.append(_allreduce(_c, _yk, {coll.attr('op')!r}, async_op=True))",
            "    _parts.append(_yk)",
            "for _w in _works:",
            "    if _w is not None:",
            "        _w.wait()",
            f"{out} = torch.cat(_parts).reshape({a}.shape[:-1] + ({b}.shape[-1],))",
        ]
    elif coll.type.layout.dim == coll.type.ndim - 1:
        # scattered along the columns: every chunk is a band of rows whose columns the ranks share out
        n, op = dim_expr(coll.type.shape[-1]), coll.attr("op")
        lines += [
            f"_a = {a}.reshape({a}.shape[:-1].numel(), {a}.shape[-1])",
            "_pending = []",
            f"for _ak in torch.tensor_split(_a, {chunks}, dim=0):",
            f"    _pending.append(_reduce_scatter(_c, {e.matmul}(_ak, {b}), 1, {n}, {op!r}, async_op=True))",
            "_parts = [_finish() for _finish in _pending]",
            f"{out} = torch.cat(_parts).reshape({a}.shape[:-1] + (_parts[0].shape[-1],))",
        ]
    else:
        d = coll.type.layout.dim
        n = dim_expr(coll.type.shape[d])
        lines += [
            "_pending = []",
            f"for _bk in torch.tensor_split({b}, {chunks}, dim=1):",
            f"    _pending.append(_reduce_scatter(_c, {e.matmul}({a}, _bk), {d}, {n}, {coll.attr('op')!r}, "
            "async_op=True))",
            f"{out} = torch.cat([_finish() for _finish in _pending], dim=-1)",
        ]
    return lines


def _lower_tensordot_overlap(e: Emitter, td: Stmt, coll: Stmt, chunks: int) -> list[str]:
    """A tensordot in chunks of a's first free dim (bands of the result's rows), each band's allreduce in flight
    while the next is contracted."""
    a, b = e.ident(td.args[0]), e.ident(td.args[1])
    dims = tuple(list(d) for d in td.attr("dims"))
    free = next(i for i in range(e.p[td.args[0]].type.ndim) if i not in dims[0])
    return [
        f"# overlap({td.name}, {coll.name}): {chunks} chunks, chunk k's allreduce in flight while k+1 contracts",
        "_parts, _works = [], []",
        f"for _ak in torch.tensor_split({a}, {chunks}, dim={free}):",
        f"    _yk = torch.tensordot(_ak, {b}, dims={dims})",
        f"    _works.append(_allreduce(_c, _yk, {coll.attr('op')!r}, async_op=True))",
        "    _parts.append(_yk)",
        "for _w in _works:",
        "    if _w is not None:",
        "        _w.wait()",
        f"{e.ident(coll.name)} = torch.cat(_parts)",
    ]


def _lower_conv_overlap(e: Emitter, conv: Stmt, coll: Stmt, chunks: int) -> list[str]:
    """A convolution in chunks of its input's batch, each chunk's collective in flight while the next is
    convolved; for a reduce_scatter along the batch, in chunks of its weight's output channels."""
    x, w = (e.ident(a) for a in conv.args)
    out, op = e.ident(coll.name), coll.attr("op")
    head = f"# overlap({conv.name}, {coll.name}): {chunks} chunks, chunk k's collective in flight while k+1 convolves"
    if coll.op == "allreduce":
        return [
            head,
            "_parts, _works = [], []",
            f"for _ak in torch.tensor_split({x}, {chunks}, dim=0):",
            f"    _yk = {conv_call(conv, '_ak', w)}",
            f"    _works.append(_allreduce(_c, _yk, {op!r}, async_op=True))",
            "    _parts.append(_yk)",
            "for _w in _works:",
            "    if _w is not None:",
            "        _w.wait()",
            f"{out} = torch.cat(_parts)",
        ]
    d = coll.type.layout.dim
    n = dim_expr(coll.type.shape[d])
    if d == 0:  # scattered along the batch: chunks of the output channels, each scattered along the batch
        loop, call, cat = f"for _bk in torch.tensor_split({w}, {chunks}, dim=0):", conv_call(conv, x, "_bk"), 1
    else:
        loop, call, cat = f"for _ak in torch.tensor_split({x}, {chunks}, dim=0):", conv_call(conv, "_ak", w), 0
    return [
        head,
        "_pending = []",
        loop,
        f"    _pending.append(_reduce_scatter(_c, {call}, {d}, {n}, {op!r}, async_op=True))",
        f"{out} = torch.cat([_finish() for _finish in _pending], dim={cat})",
    ]


def lower_bucket(e: Emitter, g: Group, cap: int) -> list[str]:
    """One launch per ``cap`` bytes for the bucket's collectives: NCCL groups them with no copy, gloo runs
    its coalesced form, which flattens them in C++."""
    p = e.p
    first = p[g.members[0]]
    names = ", ".join(e.ident(m) for m in g.members)
    srcs = "[" + ", ".join(e.operand(p[m], p[m].args[0]) for m in g.members) + "]"
    lines = [f"# bucket({', '.join(g.members)}): at most {cap} bytes per launch"]
    if first.op == "allreduce":
        keep = [m in e.plan.copies for m in g.members]
        return lines + [f"[{names}] = _bucket_allreduce(_c, {srcs}, {first.attr('op')!r}, {cap}, {keep})"]
    if first.op == "reduce_scatter":
        dims = [p[m].type.layout.dim for m in g.members]
        ns = [dim_expr(p[m].type.shape[d]) for m, d in zip(g.members, dims)]
        return lines + [
            f"{names} = _bucket_reduce_scatter(_c, {srcs}, {dims}, [{', '.join(ns)}], {first.attr('op')!r}, {cap})"
        ]
    dims = [p[p[m].args[0]].type.layout.dim for m in g.members]
    ns = [dim_expr(p[p[m].args[0]].type.shape[d]) for m, d in zip(g.members, dims)]
    return lines + [f"{names} = _bucket_all_gather(_c, {srcs}, {dims}, [{', '.join(ns)}], {cap})"]
