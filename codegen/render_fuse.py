"""A fuse group rendered: one pointwise kernel (Inductor's, or C where it streams rows into the peers' copies
of a state), and the kernels whose rows are cut at the call, which fused collectives' chunks use too.
"""

from __future__ import annotations

import ast
import re
import textwrap
from typing import Sequence

from coconet.codegen.analysis import custom_group
from coconet.codegen.emitter import Emitter
from coconet.codegen.names import CUT, TORCH_DTYPE, dim_expr, names_in, tuple_text
from coconet.codegen.render_native import native_chunk
from coconet.schedules.ir import Group


def lower_fuse(e: Emitter, g: Group) -> list[str]:
    """A pointwise group as one module-level function; compiled, Inductor fuses it into one loop (C++ on
    CPU, Triton on CUDA) that writes updated state in place. One that writes its rows into every peer's copy
    of a state (``fuse_gathers_into``) takes its rows cut at the call, so that C may run it (see
    native_chunk): its streamed stores skip the read of every line an ordinary store makes first."""
    p = e.p
    k = e.plan.fuse_kernels[g]
    absorbed, reduced, ins, inplace, into, held = tuple(k.rows), k.sums, k.ins, k.inplace, k.into, k.held
    rest = list(k.returns)
    body: list[tuple[str, str]] = []
    for m in (*absorbed, *g.members, *reduced):
        body.extend(("    " + x, m) for x in e.stmt(p[m]))
    body += [(f"    {e.ident(t)}.copy_({e.ident(o)})", o) for o, t in inplace.items()]
    scope = {e.ident(a) for a in ins}
    # the value a fused collective reduces where it lies (held_source): the kernel stores it into the kept
    # buffer, handed to it as an argument (a kernel writing peers' rows, cut at the call, copies it after)
    buffers = {o: e.ident.fresh(f"_{e.ident(o)}_held", scope) for o in held}
    made = [
        f"{buffers[o]} = _c.shm.held({o!r}, {e.local_shape_expr(p[o].type)}, "
        f"{TORCH_DTYPE[p[o].type.dtype or 'float32']})"
        for o in held
    ]
    if not into:
        body += [(f"    {buffers[o]}.copy_({e.ident(o)})", o) for o in held]
    peers = {}  # gather -> the kernel's parameter: this rank's rows of every peer's copy of the state
    for ag, o in into.items():
        state, peer = e.plan.into_state[ag], e.ident.fresh("_peer", scope)
        peers[ag] = e.ident.fresh(f"{e.ident(state)}_peers", scope)
        body += [
            (f"    {e.operand(p[o], state)}.copy_({e.ident(o)})", ag),
            (f"    for {peer} in {peers[ag]}:", ag),
            (f"        {peer}.copy_({e.ident(o)})", ag),
        ]
    compiled = k.compiled  # a custom op's torch code may not trace; it runs as written
    call = None
    if into and compiled:  # rows cut at the call: the kernel may run as C, streaming into the peers' copies
        doc = (
            f"fuse({', '.join(g.members)}): one pointwise kernel on this rank's rows, state written in place "
            "and into every peer's copy"
        )
        compute = [*absorbed, *g.members]
        args = {x: x for x in peers.values()}  # the peers' rows, bound under the same names at the call
        states = {ag: e.plan.into_state[ag] for ag in into}
        call = cut_kernel(
            e,
            g,
            "_fuse",
            doc,
            list(body),
            compute,
            set(map(e.ident, compute)),
            args,
            scope,
            rest,
            lambda dims: native_chunk(e, compute, inplace, states, peers, {}, None, (), args, dims, rest),
        )
    if call is None:
        call = whole_fuse(e, g, body, ins, inplace, into, peers, rest, compiled, given=list(buffers.values()))
    bound = [f"{e.ident(o)} = {buffers[o]}" + (f".copy_({e.ident(o)})" if into else "") for o in held]
    if not into:
        return [*made, call, *bound]
    # every state's copies mapped at one barrier before the kernel, every one whole at one barrier after it
    specs: list[str] = []
    gathers: list[str] = []
    ends: list[str] = []
    for ag, o in into.items():
        t, state = p[o].type, e.plan.into_state[ag]
        d = t.layout.dim
        specs.append(f"({d}, {dim_expr(t.shape[d])}, {e.ident(state)}, {state!r})")
        gathers.append(e.ident.fresh(f"_{e.ident(ag)}", set()))
        ends.append(f"{gathers[-1]}.into({e.ident(state)}{', end=False' if ends else ''})")
    start = f"({tuple_text(gathers)}), ({tuple_text(peers.values())}) = _into_peers(_c, {', '.join(specs)})"
    return [start, call] + ends + made + bound


def whole_fuse(
    e: Emitter,
    g: Group,
    body: list,
    ins: list[str],
    inplace: dict[str, str],
    into,
    peers,
    rest: list[str],
    compiled: bool,
    given: Sequence[str] = (),
) -> str:
    """The fuse group's function taking whole tensors and ``_c`` (it cuts the rows it reads itself), Inductor's
    where ``compiled``: its call."""
    p = e.p
    if rest:
        body = body + [(f"    return {tuple_text(map(e.ident, rest))}", g.members[-1])]
    used = names_in(textwrap.dedent("\n".join(x for x, _ in body)).split("\n"))
    dims = [f"d_{d}" for d in p.dims if f"d_{d}" in used]
    custom = custom_group(p, g)
    params = ["_c"] + dims + (["_custom"] if custom else []) + [e.ident(a) for a in ins]
    params += [e.ident(t) for t in (*inplace.values(), *(e.plan.into_state[ag] for ag in into)) if t not in ins]
    params = list(dict.fromkeys(params)) + list(peers.values()) + list(given)
    fname = f"_fuse{len([x for x in e.toplevel if x[0].startswith('def ')])}"
    head = [
        (f"def {fname}({', '.join(params)}):", g.members[0]),
        (
            f'    """fuse({", ".join(g.members)}): one pointwise kernel'
            + (", state written in place" if inplace or into else "")
            + (" and into every peer's copy" if into else "")
            + '."""',
            g.members[0],
        ),
    ]
    e.toplevel += head + body + [("", None), ("", None)]
    if compiled:
        e.toplevel += [(f"{fname} = _kernel({fname})", g.members[0]), ("", None)]
    args = list(params)
    if compiled:
        # an int argument would be baked into the compiled code: a new seed would recompile it
        ints = {e.ident(a) for a in ins if p[a].op == "scalar" and p[a].type.dtype == "int64"}
        args = [f"_int64({a})" if a in ints else a for a in args]
    call = f"{fname}({', '.join(args)})"
    if rest:
        call = f"{tuple_text(map(e.ident, rest))} = {call}"
    return call


def cut_kernel(
    e: Emitter,
    g: Group,
    prefix: str,
    doc: str,
    body: list,
    compute: list[str],
    defined: set[str],
    args: dict[str, str],
    scope: set[str],
    results: list[str],
    native,
    given=(),
) -> str | None:
    """A kernel whose rows of each value are cut at the call (``_c.cut``, ``_c.local``: the rank's or the chunk's
    position stays out of the compiled code) as a module-level function, Inductor's, or C where ``native(dims)``
    gives its kinds and source (see native_chunk). ``args``: argument at the call -> parameter, for those the
    body names already; the cut rows, then ``given`` (names passed as they are), then the values it reads join
    it. The call, or None where the body needs ``_c`` itself."""
    p = e.p

    def param(match: re.Match) -> str:
        expr = match.group(0)
        if expr not in args:
            args[expr] = e.ident.fresh(f"{match.group(1)}_k", scope)
        return args[expr]

    body = [(CUT.sub(param, x), m) for x, m in body]
    text = "\n".join(x for x, _ in body)
    tree = ast.parse(textwrap.dedent(text))
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    if "_c" in used:
        return None
    args.update((name, name) for name in given)
    raw = [e.ident(a) for m in compute for a in p[m].args if e.ident(a) not in defined]
    # and values an operand stands for under another name: the chunk's reduced rows for their gather's
    # output (another reduce_scatter's rows read by this one's computation)
    stored = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    ir = {e.ident(x.name) for x in p.stmts}
    raw += [
        n.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in ir and n.id not in defined | stored
    ]
    for name in dict.fromkeys(raw):
        if name in used:
            args.setdefault(name, name)
    dims = [f"d_{x}" for x in p.dims if f"d_{x}" in used]
    if results:
        body.append((f"    return {tuple_text(map(e.ident, results))}", compute[-1]))
    fname = f"{prefix}{len([x for x in e.toplevel if x[0].startswith('def ')])}"
    params = dims + list(args.values())
    e.toplevel += [(f"def {fname}({', '.join(params)}):", g.members[0]), (f'    """{doc}."""', g.members[0])]
    e.toplevel += body + [("", None), ("", None)]
    built = native(dims)
    if built is None:
        e.toplevel += [(f"{fname} = _kernel({fname})", g.members[0]), ("", None)]
    else:
        kinds, source, sums = built
        e.toplevel += [(f'{fname} = _native(_kernel({fname}), {kinds!r}, r"""', g.members[0])]
        e.toplevel += [(x, g.members[0]) for x in source.rstrip("\n").split("\n")]
        e.toplevel += [(f'""", sums={sums})' if sums else '""")', g.members[0]), ("", None)]
    ints = {e.ident(a) for m in compute for a in p[m].args if p[a].op == "scalar" and p[a].type.dtype == "int64"}
    call_args = dims + [f"_int64({a})" if a in ints else a for a in args]
    call = f"{fname}({', '.join(call_args)})"
    if results:
        call = f"{tuple_text(map(e.ident, results))} = {call}"
    return call
