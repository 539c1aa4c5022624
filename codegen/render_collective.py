"""A fused collective rendered: reduce_scatter, the computation on this rank's slice and the all_gathers as a
pipeline over chunks, each chunk's computation one compiled kernel where the plan compiles it.
"""

from __future__ import annotations

from coconet.codegen.emitter import Emitter
from coconet.codegen.fused import FusedCollective, chunk_compiles
from coconet.codegen.names import TORCH_DTYPE, dim_expr, holder_rows, tuple_text
from coconet.codegen.render_fuse import cut_kernel
from coconet.codegen.render_native import native_chunk
from coconet.schedules.ir import Group, Stmt


def lower_fused_collective(e: Emitter, g: Group, chunks: int) -> list[str]:
    p = e.p
    fc = e.plan.fused_collectives[g]
    fname = f"_{g.kind}{len(e.kernels)}"
    ops = [p[m].op for m in g.members]
    parts = ["reduce_scatter", "the computation on this rank's slice"]
    parts += ["its partial sums"] * ("partial_sum" in ops) + ["the all_gathers"] * ("all_gather" in ops)
    lines = [
        (f"def {fname}(_rank, {', '.join(e.ident(a) for a in fc.ins)}):", g.members[0]),
        (f'    """fused_collective: {", ".join(parts)}, as one unit."""', g.members[0]),
    ]
    lines += chunked_body(e, g, fc, chunks)
    if fc.outs:
        lines.append((f"    return {tuple_text(map(e.ident, fc.outs))}", g.members[-1]))
    e.kernels.append(lines)
    call = f"{fname}(_c, {', '.join(e.ident(a) for a in fc.ins)})"
    return [f"{tuple_text(map(e.ident, fc.outs))} = {call}" if fc.outs else call]


def chunked_body(e: Emitter, g: Group, fc: FusedCollective, chunks: int) -> list:
    """A fused collective as a pipeline over chunks of this rank's slice: chunk k computes as soon as its
    rows are reduced, its all_gathers start while chunk k+1 computes. The statements of a chunk see a
    _Chunk as their context ``_c``; compiled, its pointwise statements are one kernel."""
    p = e.p
    rs, into = fc.rs, fc.into
    d = rs.type.layout.dim
    n = dim_expr(rs.type.shape[d])
    words = {m: i for i, m in enumerate(into)}
    scope: set[str] = set()  # what the function binds besides the program's values
    tmp = {m: e.ident.fresh(f"_{e.ident(m)}", scope) for m in (*fc.gathers, *fc.sliced_outs, *fc.partials)}
    lines: list[tuple[str, str]] = [
        (
            f"    {tmp[m]} = _Gather(_rank, {d}, {n}"
            + (f", {e.ident(into[m])}, {into[m]!r}, {words[m]})" if m in into else ")"),
            m,
        )
        for m in fc.gathers
    ]
    e.chunked = set(g.members) | set(fc.compute)
    try:
        # shm: the kernel reduces the chunk's rows on every rank as it reads them (sums_parts)
        # the chunk's rows on every rank, of each input pre reads where there are several
        parts = (
            ()
            if not fc.sums_parts
            else (e.ident.fresh(f"{e.ident(rs.name)}_parts", scope),)
            if len(fc.sources) == 1
            else tuple(e.ident.fresh(f"{e.ident(x)}_parts", scope) for x in fc.sources)
        )
        # compiled, the kernel writes this rank's rows of a gathered state into every peer's copy as it computes
        # them: a push after it would read them back from memory (shm.py's module doc)
        peers = {m: f"{tmp[m]}.peer_rows(_c)" for m in into}
        # compiled, the kernel writes each chunk's rows of a sliced output into the whole output, made before
        # the first chunk: no list of chunks to concatenate after the last
        buffers = {o: tmp[o] for o in fc.sliced_outs}
        # the rows of this rank's slot the kernel writes a gathered value into (FusedCollective.slotted)
        slots = {
            p[m].args[0]: (f"{tmp[m]}.own(_c, {TORCH_DTYPE[p[m].type.dtype or 'float32']}, {e.shape_expr(p[m].type)})")
            for m in fc.slotted
        }
        # every rank's of each of the numbers that pre reads, one tensor per number, in the order of the parts
        ranked = {x: e.ident.fresh(f"{e.ident(x)}_ranks", scope) for x in fc.ranked} if parts else {}
        kernel = (
            chunk_kernel(
                e,
                g,
                list(fc.compute),
                fc.inplace,
                fc.needed,
                rs if parts else None,
                into,
                parts,
                peers,
                buffers,
                fc.pre,
                fc.sources,
                ranked,
                slots,
            )
            if e.compile
            else None
        )
        sources, direct = fc.sources, fc.direct
        if kernel is None and fc.pre:  # no kernel to compute them on every rank's rows: computed here, published
            lines[:0] = [("    " + x, m) for m in fc.pre for x in e.stmt(p[m])]
            sources, direct = (rs.args[0],), False
        lines += _holders(e, fc, tmp, kernel is not None)
        lines.append(_loop_head(e, fc, chunks, sources, direct, parts if kernel is not None else (), ranked))
        lines += kernel if kernel is not None else _eager_chunk(e, fc)
        lines += _chunk_gathers(e, fc, tmp, kernel is not None, slots)
    finally:
        e.chunked = None
    lines += _after_chunks(e, fc, tmp, kernel is not None, direct)
    how = (
        "chunk k+1 is reduced while chunk k computes and chunk k-1 is gathered"
        if not e.backend.shared_memory
        else f"{'read where it lies once moved into a segment' if direct else 'published once'}, each chunk "
        "reduced out of the peers' segments just before it computes"
    )
    return [(f"    # {chunks} chunk{'s' if chunks > 1 else ''}: {how}", rs.name)] + lines


def _holders(e: Emitter, fc: FusedCollective, tmp: dict[str, str], kernel: bool) -> list:
    """What holds the chunks' results handed on: the whole sliced output a kernel writes each chunk's rows into
    (else a list of the chunks, concatenated after the last), and each chunk's partial sums, added up then."""
    p = e.p
    if kernel:
        lines = [
            (
                f"    {tmp[o]} = torch.empty({e.local_shape_expr(p[o].type).replace('_c.', '_rank.')}, "
                f"dtype={TORCH_DTYPE[p[o].type.dtype or 'float32']}, device=_rank.device)",
                o,
            )
            for o in fc.sliced_outs
        ]
    else:
        lines = [(f"    {tmp[o]} = []", o) for o in fc.sliced_outs]
    return [(f"    {tmp[o]} = []", o) for o in fc.partials] + lines


def _loop_head(
    e: Emitter,
    fc: FusedCollective,
    chunks: int,
    sources: tuple[str, ...],
    direct: bool,
    parts: tuple[str, ...],
    ranked: dict[str, str],
) -> tuple[str, str]:
    """The loop over the chunks: each chunk's rows reduced (or, for a kernel that sums them, every rank's)."""
    rs = fc.rs
    d = rs.type.layout.dim
    n = dim_expr(rs.type.shape[d])
    source = e.ident(sources[0]) if len(sources) == 1 else f"({', '.join(map(e.ident, sources))})"
    names = repr(sources[0]) if len(sources) == 1 else repr(sources)
    where = f", {names}, {len(fc.into)}" if direct else ""
    if not parts:
        return (
            f"    for _c, {e.ident(rs.name)} in _reduce_scatter_chunks(_rank, {source}, "
            f"{d}, {n}, {chunks}, {rs.attr('op')!r}{where}):",
            rs.name,
        )
    if ranked:  # posted after the words of the gathers' states and of the inputs (_scatter_parts)
        words = where or f", None, {len(fc.into)}"
        where = f"{words}, numbers=({''.join(f'{e.ident(x)}, ' for x in ranked)})"
    targets = "".join(f", {v}" for v in ranked.values())
    if len(sources) > 1:
        e.packed.append(sources)
    return (
        f"    for _c, {', '.join(parts)}{targets} in _reduce_scatter_parts(_rank, {source}, "
        f"{d}, {n}, {chunks}{where}):",
        rs.name,
    )


def _eager_chunk(e: Emitter, fc: FusedCollective) -> list:
    """A chunk's computation statement by statement, its results written into the state they update."""
    p = e.p
    lines: list[tuple[str, str]] = []
    for m in fc.compute:
        lines.extend(("        " + x, m) for x in e.stmt(p[m]))
    for o, t in fc.inplace.items():
        lines.append((f"        {e.operand(p[o], t)}.copy_({e.ident(o)})", o))
    for m, t in fc.into.items():
        src = p[m].args[0]
        lines.append((f"        {e.operand(p[src], t)}.copy_({e.ident(src)})", m))
    return lines


def _chunk_gathers(e: Emitter, fc: FusedCollective, tmp: dict[str, str], kernel: bool, slots: dict) -> list:
    """Each chunk's rows handed to its gathers: added, or pushed where they are in place already."""
    p = e.p
    lines: list[tuple[str, str]] = []
    for m in fc.gathers:
        if m not in fc.into and not (kernel and p[m].args[0] in slots):
            src = p[m].args[0]
            # a value the kernel wrote into its holder (used again after the collective) is not bound
            # in the loop: the chunk's rows of the holder are what it gathers
            rows = holder_rows(p, src, tmp[src]) if kernel and src in fc.sliced_outs else e.ident(src)
            lines.append((f"        {tmp[m]}.add(_c, {rows})", m))
        elif not kernel:
            lines.append((f"        {tmp[m]}.push(_c)", m))
    return lines


def _after_chunks(e: Emitter, fc: FusedCollective, tmp: dict[str, str], kernel: bool, direct: bool) -> list:
    """After the last chunk: its results kept, the gathers ended (on shm at one barrier for all), and what the
    group hands on bound."""
    p = e.p
    lines = [(f"        {tmp[o]}.append({e.ident(o)})", o) for o in fc.partials]
    if not kernel:
        lines += [(f"        {tmp[o]}.append({e.ident(o)})", o) for o in fc.sliced_outs]
    for i, m in enumerate(fc.gathers):  # on shm the first ends the collective, at one barrier for all
        later = i and e.backend.shared_memory
        lines.append(
            (
                f"    {tmp[m]}.into({e.ident(fc.into[m])}{', end=False' if later else ''})"
                if m in fc.into
                else f"    {e.ident(m)} = {tmp[m]}.result({'end=False' if later else ''})",
                m,
            )
        )
    if direct and not fc.gathers:  # nothing gathered: the peers' reads of the input end at a barrier of its own
        lines.append(("    _end_collective(_rank)", fc.rs.name))
    lines += [
        (
            f"    {e.ident(o)} = {tmp[o]}"
            if kernel
            else f"    {e.ident(o)} = torch.cat({tmp[o]}, dim={p[o].type.layout.dim})",
            o,
        )
        for o in fc.sliced_outs
    ]
    lines += [(f"    {e.ident(o)} = torch.stack({tmp[o]}).sum()", o) for o in fc.partials]
    return lines


def _summed_parts(
    e: Emitter,
    parts: Stmt,
    parts_names: tuple[str, ...],
    pre: tuple[str, ...],
    sources: tuple[str, ...],
    ranked: dict,
    scope: set,
) -> list[tuple[str, str]]:
    """The chunk kernel's statements that sum every rank's unreduced rows of a fused reduce_scatter (each rank's
    computed first from its rows of ``sources`` by ``pre``, where there are such)."""
    p = e.p
    body: list[tuple[str, str]] = []
    summed = parts_names[0]
    if pre:  # each rank's rows of the value it reduces, from its rows of the inputs it is computed from
        summed = e.ident.fresh(f"_{e.ident(parts.args[0])}", scope)
        each = ", ".join([*map(e.ident, sources), *map(e.ident, ranked)])
        lists = [*parts_names, *ranked.values()]
        rows = f"zip({', '.join(lists)})" if len(lists) > 1 else lists[0]
        body += [(f"    {summed} = []", parts.name), (f"    for {each} in {rows}:", parts.name)]
        body += [("        " + x, m) for m in pre for x in e.stmt(p[m])]
        body.append((f"        {summed}.append({e.ident(parts.args[0])})", parts.name))
    body.append(
        (
            f"    {e.ident(parts.name)} = _reduce_all({summed}, {parts.attr('op')!r})"
            + (f" / len({parts_names[0]})" if parts.attr("op") == "avg" else ""),
            parts.name,
        )
    )
    return body


def _written_rows(
    e: Emitter, inplace: dict[str, str], into: dict, peers, buffers: dict, slots: dict, args: dict[str, str], scope: set
) -> list[tuple[str, str]]:
    """The chunk kernel's statements that write its results in place: into state, into every peer's copy of
    gathered state, into ``buffers`` and into gather ``slots`` (the parameters for peers' rows and slots go
    into ``args``)."""
    p = e.p
    body: list[tuple[str, str]] = []
    for o, t in inplace.items():
        body.append((f"    {e.operand(p[o], t)}.copy_({e.ident(o)})", o))
    for m, t in into.items():  # this rank's rows of the gathered state, in place and in every peer's copy
        src = p[m].args[0]
        body.append((f"    {e.operand(p[src], t)}.copy_({e.ident(src)})", m))
        rows, peer = e.ident.fresh(f"{e.ident(t)}_peers", scope), e.ident.fresh("_peer", scope)
        args[peers[m]] = rows
        body += [(f"    for {peer} in {rows}:", m), (f"        {peer}.copy_({e.ident(src)})", m)]
    for o, buf in buffers.items():
        body.append((f"    {holder_rows(p, o, buf)}.copy_({e.ident(o)})", o))
    for o, rows in slots.items():
        args[rows] = e.ident.fresh(f"{e.ident(o)}_slot", scope)
        body.append((f"    {args[rows]}.copy_({e.ident(o)})", o))
    return body


def chunk_kernel(
    e: Emitter,
    g: Group,
    compute: list[str],
    inplace: dict[str, str],
    needed: set,
    parts: Stmt | None = None,
    into=None,
    parts_names: tuple[str, ...] = (),
    peers=None,
    buffers=None,
    pre: tuple[str, ...] = (),
    sources: tuple[str, ...] = (),
    ranked=None,
    slots=None,
) -> list | None:
    """The pointwise statements of a fused collective's chunk as one module-level function compiled by
    Inductor, called once per chunk with the chunk's rows of what it reads (cut at the call: the chunk's
    position stays out of the compiled code; dropout gets the chunk's first row as a tensor). None when a
    statement needs the chunk itself or is not pointwise: the chunk then runs statement by statement.
    ``buffers``: outputs the kernel writes into (their chunk's rows of a tensor of this rank's rows, by name)
    rather than returns; ``slots`` the same of values written into the chunk's rows of this rank's slot of
    their gather (by name: the call that gives those rows). ``pre``: statements computed on every rank's rows
    of ``sources`` (each in the parameter of ``parts_names`` at its place) before they are summed
    (reduced_in_kernel), with every rank's of the numbers in ``ranked`` (number -> the parameter holding every
    rank's)."""
    p = e.p
    if not chunk_compiles(p, g, compute):
        return None
    rs = p[g.members[0]]
    d, n = rs.type.layout.dim, rs.type.shape[rs.type.layout.dim]
    body: list[tuple[str, str]] = []
    ranked = ranked or {}
    # the kernel's parameters but the program's values
    scope = (set(parts_names) | set(ranked.values())) if parts is not None else set()
    if parts is not None:  # the reduce_scatter's sum, fused: its rows on every rank come in unreduced
        body += _summed_parts(e, parts, parts_names, pre, sources, ranked, scope)
    args: dict[str, str] = {}  # argument at the call -> parameter of the kernel
    for m in compute:
        s = p[m]
        if s.op != "dropout":
            body.extend(("    " + x, m) for x in e.stmt(s))
            continue
        row0 = f"_int64(_c.rows({dim_expr(n)})[0])"
        if row0 not in args:
            args[row0] = e.ident.fresh("row0_k", scope)
        body.append(
            (f"    {e.ident(m)} = _dropout_rows({e.operand(s, s.args[0])}, {e.dropout_args(s)}, {d}, {args[row0]})", m)
        )
    buffers, slots = buffers or {}, slots or {}
    body += _written_rows(e, inplace, into or {}, peers, buffers, slots, args, scope)

    defined = {e.ident(m) for m in compute} | ({e.ident(parts.name)} if parts is not None else set())
    results = [m for m in compute if m in needed and m not in buffers and m not in slots]
    doc = f"{len(compute)} statements of {g} on one chunk" + (", state written in place" if inplace or into else "")
    call = cut_kernel(
        e,
        g,
        "_chunk",
        doc,
        body,
        compute,
        defined,
        args,
        scope,
        results,
        lambda dims: native_chunk(
            e,
            compute,
            inplace,
            into or {},
            peers,
            buffers,
            parts,
            parts_names,
            args,
            dims,
            results,
            pre,
            sources,
            ranked,
            slots,
        ),
        (*parts_names, *ranked.values()) if parts is not None else (),
    )
    return None if call is None else [(f"        {call}", compute[0])]
