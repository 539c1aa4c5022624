"""Lowering a schedule to a readable Python module for torch.distributed.

The module defines ``step(tensors, scalars, *, group=None, stage=0, stages=1,
sizes=None)``: each rank passes its own pieces of the inputs (the whole value
for Replicated and Local tensors, its rows for Sliced ones), updated state is
written in place, and ``step`` returns ``{"outputs": …, "sent": …}``. Nothing
else of the inputs is written. It imports the helpers it calls (``_reduce_scatter``,
``_dropout``, …) from the runtime, ``coconet.kernels`` (``coconet.codegen.runtime``). A statement's name is its
variable's, unless the name could mean something else in the module (``torch``, ``class``, ``_x``,
``d_N``): then ``v_<name>``, with a suffix if the program has that name too.

Groups of the schedule become units: a fused kernel is one function; a fused
collective runs reduce_scatter → computation → all_gather as one function; an
overlap runs the matmul in chunks with each chunk's collective in flight
(async work handles) while the next is computed; a bucket issues its
collectives together.
"""

from __future__ import annotations

import ast
import functools
import marshal
import textwrap
from dataclasses import dataclass
from typing import Sequence

from coconet import __version__
from coconet.codegen import backends, runtime
from coconet.codegen.backends import BACKENDS, DEFAULT, Backend
from coconet.codegen.cache import cache_dir
from coconet.codegen.emitter import Emitter
from coconet.codegen.names import RESERVED, Names, dim_expr, free_names, names_in
from coconet.codegen.plan import LoweringPlan
from coconet.codegen.render_collective import lower_fused_collective
from coconet.codegen.render_fuse import lower_fuse
from coconet.codegen.render_units import lower_bucket, lower_overlap
from coconet.errors import BackendError
from coconet.schedules.dims import Dim
from coconet.schedules.ir import Group, Program
from coconet.schedules.schedule import Schedule
from coconet.schedules.types import ITEMSIZE, Sliced

__all__ = ["BACKENDS", "DROPOUTS", "KERNELS", "RESERVED", "Generated", "Names", "lower"]


@dataclass(frozen=True)
class Generated:
    schedule: Schedule
    backend: str
    source: str
    line_map: dict | None = None  # 1-based line of the module -> the statement it implements
    kernels: str = "compiled"
    dropout: str = "counter"

    def statement_at(self, line: int) -> str | None:
        return (self.line_map or {}).get(line)

    @property
    def key(self) -> str:
        """The module's key in the cache: the schedule, how it is lowered, and the runtime it imports."""
        dropout = "_torchdropout" if self.dropout == "torch" else ""
        return f"{self.schedule.hash}_{self.backend}_{self.kernels}{dropout}_{runtime.digest(self.backend)}"

    @functools.cached_property
    def path(self) -> str:
        """The module's file in the cache (``cache.module_path`` writes it there)."""
        return str(cache_dir() / "codegen" / f"coconet_{self.key}.py")

    @functools.cached_property
    def code(self) -> bytes:
        """The module compiled, as ``marshal`` bytes, under its file's name: compiled once here for every
        rank that runs it (its helpers make a module hundreds of lines; each rank compiling it cost more than
        its checked steps at small sizes)."""
        try:
            return marshal.dumps(compile(self.source, self.path, "exec"))
        except SyntaxError as err:  # a bug of coconet's, but one schedule's: the others can still run
            raise BackendError(
                f"the code generated for schedule {self.schedule.text!r} does not compile: {err}", kind="compile_error"
            ) from err


KERNELS = ("compiled", "eager")
DROPOUTS = ("counter", "torch")


def lower(schedule: Schedule, backend: str = DEFAULT, kernels: str = "compiled", dropout: str = "counter") -> Generated:
    """The Python module for ``schedule`` on ``backend`` (gloo: CPU tensors, nccl: CUDA tensors, shm: CPU
    tensors, the collectives computed in shared memory by the ranks of one node).
    ``kernels``: fused pointwise groups compiled by Inductor on first call (``compiled``) or run as
    plain torch statements (``eager``: no compile time, one kernel per statement).
    ``dropout``: the counter-based mask the reference interpreter draws (``counter``), or torch's own
    ``F.dropout`` (``torch``: what a hand-written PyTorch step calls; its masks cannot be checked, and
    only statements run eagerly can call it)."""
    target = backends.get(backend)
    if kernels not in KERNELS:
        raise BackendError(f"unknown kernels {kernels!r} (use {' or '.join(KERNELS)})", kind="compile_error")
    if dropout not in DROPOUTS:
        raise BackendError(f"unknown dropout {dropout!r} (use {' or '.join(DROPOUTS)})", kind="compile_error")
    if dropout == "torch" and (kernels != "eager" or schedule.scheduled.groups):
        raise BackendError(
            "torch's dropout draws its own mask per call: only an eager, unfused program "
            "can use it, not fused or chunked kernels",
            kind="compile_error",
        )
    plan = LoweringPlan.of(schedule, target, kernels == "compiled")
    e = Emitter(plan, dropout)
    p = e.p
    lowered: list[list[tuple[str, str]]] = []  # per unit: (line, statement it implements)
    for unit in plan.units:
        if isinstance(unit, Group):
            lowered.append([(x, unit.members[0]) for x in _lower_group(e, unit)])
        else:
            s = p[unit]
            lowered.append([(x, s.name) for x in e.stmt(s)])
    aliased = e.aliased
    updates = [(f"{e.ident(t)}.copy_({aliased.get(v) or e.tensor(v, e.ident(v))})", t) for t, v in plan.copied_at_end]
    # after the copies: see updated_in_place
    updates += [(e.into(p[v], e.ident(t)), v) for t, v in plan.at_end.items()]
    kept = set().union(*(free_names([x for x, _ in k]) for k in e.kernels))
    kept |= names_in([x for x, _ in updates] + [e.ident(v) for v in aliased])
    body = _freeing(e, lowered, kept)
    src, line_map = _module(schedule, target, e, body, updates)
    gen = Generated(schedule, backend, src, line_map, kernels, dropout)
    gen.code  # noqa: B018 -- compiled now: code that does not compile is refused here, not on the ranks
    return gen


# names every step binds for its whole length
_STEP_NAMES = {"_c", "_custom", "_outputs", "_sent"}


def _bound(lines) -> set[str]:
    """The names a unit assigns at its own level (``x = …``, ``a, b = …``), not inside its loops or branches."""
    return {
        n.id
        for st in ast.parse("\n".join(lines)).body
        if isinstance(st, ast.Assign)
        for target in st.targets
        for n in ast.walk(target)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }


def _freeing(e: Emitter, lowered: list[list[tuple[str, str]]], kept: set[str]) -> list[tuple[str, str | None]]:
    """The units' lines with each tensor temporary deleted after the last unit that reads it. Otherwise an
    eager step holds every temporary until it returns: Adam as written peaks at 15 arrays of N floats
    instead of 5 (1.9 GB per rank at N=2^25, four ranks on one node). Inputs, scalars, what the step
    returns and what its end or a nested kernel reads are left alone."""
    p = e.p
    tensors = {
        e.ident(s.name)
        for s in p.stmts
        if s.op not in ("input", "scalar", "const") and s.type is not None and s.type.shape
    }
    ir = {e.ident(s.name) for s in p.stmts}
    kept = kept | _STEP_NAMES
    mentions = [names_in(x for x, _ in unit) for unit in lowered]
    binds = [_bound(x for x, _ in unit) for unit in lowered]
    dels: dict[int, list[str]] = {}
    for i, bound in enumerate(binds):
        for name in sorted(bound - kept):
            if name not in tensors and (name in ir or not name.startswith("_")):  # not a temporary
                continue
            last = i
            for j in range(i + 1, len(lowered)):
                if name in binds[j]:
                    break
                if name in mentions[j]:
                    last = j
            if not lowered[last][0][0].startswith(("_outputs[", "_sent[")):  # held on by what the step returns
                dels.setdefault(last, []).append(name)
    body: list[tuple[str, str | None]] = []
    for i, unit in enumerate(lowered):
        body += unit
        if i in dels:
            body.append((f"del {', '.join(dels[i])}", None))
    return body


def _lower_group(e: Emitter, g: Group) -> list[str]:
    knobs = e.plan.knobs
    if g.kind == "overlap":
        return lower_overlap(e, g, knobs["chunks"])
    if g.kind == "bucket":
        return lower_bucket(e, g, knobs["bucket_bytes"])
    if g.kind == "fuse":
        return lower_fuse(e, g)
    return lower_fused_collective(e, g, knobs["fc_chunks"])


def _nbytes_expr(t) -> str:
    return " * ".join([str(ITEMSIZE.get(t.dtype or "float32", 4))] + [f"({dim_expr(d)})" for d in t.shape])


def _shm_segments(p: Program, slotless: set[str], packed: Sequence[tuple[str, ...]] = ()) -> list[str]:
    """The line mapping the group's shared segments: a slot holds the largest collective's buffer (a
    bucket's buffers together; the inputs a chunk kernel sums, ``packed``, where they are published); a
    chunked fused collective keeps its gathers live while it reduces, but for those (``slotless``) that write
    into the peers' state."""
    sizes = [" + ".join(f"{_nbytes_expr(p[x].type)} + 64" for x in xs) for xs in packed]
    for s in p.stmts:
        if s.op in ("allreduce", "reduce_scatter", "broadcast"):
            sizes.append(_nbytes_expr(p[s.args[0]].type))
        elif s.op == "all_gather" and s.name not in slotless:
            sizes.append(_nbytes_expr(s.type))
    for g in p.groups:
        if g.kind == "bucket":
            full = [p[m].type if p[m].op == "all_gather" else p[p[m].args[0]].type for m in g.members]
            sizes.append(" + ".join(f"{_nbytes_expr(t)} + 64" for t in full))
    if not sizes:  # its gathers write into the state alone: the barrier's flags and words
        return ["_c.shm = _Shm.of(group, 2, 64)"] if any(p[m].op == "all_gather" for m in slotless) else []
    gathers = max(
        [
            sum(p[m].op == "all_gather" and m not in slotless for m in g.members)
            for g in p.groups
            if g.kind == "fused_collective"
        ],
        default=0,
    )
    sizes = list(dict.fromkeys(sizes))
    need = sizes[0] if len(sizes) == 1 else f"max({', '.join(sizes)})"
    return [f"_c.shm = _Shm.of(group, {gathers + 2}, {need})"]


def _dims_prologue(p: Program) -> list[str]:
    lines = []
    for dim in p.dims:
        found = None
        for s in p.inputs:
            for k, d in enumerate(s.type.shape):
                sliced = isinstance(s.type.layout, Sliced) and s.type.layout.dim == k
                if d == Dim.var(dim) and not sliced:
                    found = (s.name, k)
                    break
            if found:
                break
        if found:
            lines.append(f"d_{dim} = tensors[{found[0]!r}].shape[{found[1]}] if sizes is None else int(sizes[{dim!r}])")
        else:
            lines.append(f"d_{dim} = _size(sizes, {dim!r})")
    return lines


def _module(schedule: Schedule, backend: Backend, e: Emitter, body, updates: list[tuple[str, str]]):
    p = e.p
    layout_doc = ", ".join(f"{s.name}: {s.type.layout}" for s in p.inputs)
    header = [
        '"""Generated by coconet ' + __version__ + " for " + backend.doc + ".",
        "",
        f"program:  {p.name} (hash {schedule.program.hash})",
        f"schedule: {schedule.text}",
        f"          (hash {schedule.hash})",
        f"inputs:   {layout_doc}",
        "",
        "Call step(tensors, scalars, group=...) on every rank of an initialised process group:",
        "Replicated and Local tensors whole, Sliced ones as this rank's rows. Updated state is",
        "written in place; nothing else of the inputs is. step returns the program's outputs",
        "and what it sent to the next pipeline stage. Custom ops come in custom_ops={name: fn}.",
        "Needs torch and coconet's runtime, coconet.kernels (or a copy of it beside the module).",
        *backend.notes,
        *(
            ["So does a chunk kernel given in C (_native): without a compiler, Inductor's runs."]
            if backend.native_chunks and any(x.startswith("_chunk") and "= _native(" in x for x, _ in e.toplevel)
            else []
        ),
        *(
            ["Dropout is torch's own (F.dropout): its masks are not coconet's counter-based ones."]
            if e.dropout == "torch" and any(s.op == "dropout" for s in p.stmts)
            else []
        ),
        '"""',
        "",
        "import torch",
        "import torch.distributed as dist",
        "",
        "RUNTIME",
        "",
        "",
        "def _t(x):",
        "    return x if isinstance(x, torch.Tensor) else torch.tensor(x)",
        "",
        "",
    ]
    lines: list[tuple[str, str | None]] = [
        (x, None)
        for x in [
            "",
            "def step(tensors, scalars, *, group=None, stage=0, stages=1, sizes=None, custom_ops=None):",
            f"    _c = _Ctx(group, {backend.device})",
            "    _custom = custom_ops or {}",
            "    _outputs, _sent = {}, {}",
        ]
    ]
    rest = [("    " + x, None) for x in _shm_segments(p, e.plan.slotless, e.packed)] if backend.shared_memory else []
    rest += [("    " + x, m) for k in e.kernels for x, m in [("", None)] + k + [("", None)]]
    rest += [("    " + x, m) for x, m in body]
    used = names_in(textwrap.dedent("\n".join(x for x, _ in rest)).split("\n"))
    # a dim the step never reads needs no binding (kernels are nested: they read the dims too)
    lines += [("    " + x, None) for x in _dims_prologue(p) if x.split(" ")[0] in used]
    lines += rest
    lines += [("    " + x, t) for x, t in updates]
    lines.append(('    return {"outputs": _outputs, "sent": _sent}', None))
    lines = e.toplevel + lines
    code = "\n".join(x.rstrip() for x, _ in lines) + "\n"
    # the runtime's names the code calls, imported (coconet.kernels)
    at = header.index("RUNTIME")
    head = header[:at] + "\n".join(runtime.imports(code, backend.name)).split("\n") + header[at + 1 :]
    line_map = {len(head) + i + 1: m for i, (_, m) in enumerate(lines) if m is not None}
    return "\n".join(head) + "\n" + code, line_map
