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
import keyword
import marshal
import re
import textwrap
from dataclasses import dataclass
from typing import Mapping, Sequence

from coconet import __version__
from coconet.codegen import runtime
from coconet.codegen.analysis import (
    ELEMENTWISE,
    absorbed_by_collective,
    computed_on_rows,
    custom_group,
    cut_to_rows,
    group_io,
    in_place_outputs,
    needs_copy,
    readers_of,
    row_dim,
    step_positions,
    step_units,
    ungrouped_pointwise,
)
from coconet.codegen.cache import cache_dir
from coconet.codegen.rowwise import normalize_text, reduce_text
from coconet.errors import BackendError
from coconet.kernels.native import FACTORS, HALF, ChunkKernel, Untranslatable, c_source
from coconet.schedules.dims import Dim
from coconet.schedules.ir import COMPARE, CONVS, EFFECTS, ROWWISE_OPS, Group, Program, Stmt
from coconet.schedules.schedule import Schedule
from coconet.schedules.types import ITEMSIZE, Local, Replicated, Sliced

BACKENDS = ("gloo", "nccl", "shm")
TORCH_DTYPE = {"float16": "torch.float16", "bfloat16": "torch.bfloat16", "float32": "torch.float32",
               "float64": "torch.float64", "int64": "torch.int64", "bool": "torch.bool"}
BINARY = {"add": "{} + {}", "sub": "{} - {}", "mul": "{} * {}", "div": "{} / {}", "pow": "{} ** {}",
          "lt": "{} < {}", "le": "{} <= {}", "gt": "{} > {}", "ge": "{} >= {}", "eq": "{} == {}", "ne": "{} != {}",
          "maximum": "torch.maximum(_t({}), _t({}))", "minimum": "torch.minimum(_t({}), _t({}))"}
UNARY = {"neg": "-{}", "sqrt": "torch.sqrt({})", "rsqrt": "torch.rsqrt({})", "exp": "torch.exp({})",
         "log": "torch.log({})", "abs": "torch.abs({})"}
# torch's functions with an ``out=`` for the pointwise ops: how a value is computed into a buffer it is given
# (held_source)
OUT = {"add": "torch.add", "sub": "torch.sub", "mul": "torch.mul", "div": "torch.div", "pow": "torch.pow",
       "maximum": "torch.maximum", "minimum": "torch.minimum", "neg": "torch.neg", "sqrt": "torch.sqrt",
       "rsqrt": "torch.rsqrt", "exp": "torch.exp", "log": "torch.log", "abs": "torch.abs", "where": "torch.where"}
# what the step and its kernels read besides the program's values and coconet's own ``_`` names: the
# module's imports and step, step's parameters, the builtins the lowering calls
RESERVED = frozenset({"torch", "dist", "math", "step", "tensors", "scalars", "group", "stage", "stages", "sizes",
                      "custom_ops", "int", "float", "len", "max"})
# the names generated code binds in step and its kernels besides those of the program (the module's
# functions come from _module_names): a derived name that the lowering makes up (``_<name>``) avoids them
_LOCALS = frozenset({"_c", "_custom", "_outputs", "_sent", "_rank", "_a", "_ak", "_yk", "_parts", "_works", "_w",
                     "_pending", "_bk", "_finish", "_t"})


@functools.cache
def _module_names() -> frozenset[str]:
    """The names a generated module binds at its top level, whatever its backend and program: torch, dist,
    ``_t``, ``step`` and what it may import of the runtime (``coconet.codegen.runtime``)."""
    return frozenset({"torch", "dist", "_t", "step"}) | runtime.names()


class _Names:
    """The Python identifiers of a program's statements, one to one: a statement's own name where it can
    mean nothing else in the module, else ``v_<name>`` (``v_<name>_1``, … where the program has that name
    too). A dim is ``d_<dim>``, which no statement's identifier starts with, nor anything coconet names."""

    def __init__(self, p: Program):
        names = [s.name for s in p.stmts]
        kernels = {f"_{kind}{i}" for kind in ("fuse", "chunk", "fused_collective") for i in range(len(p.groups) + 1)}
        # a statement keeps its name unless it could be (or be mistaken for) a name the lowering makes up:
        # those all start with _ or d_, or are reserved
        plain = [n for n in names
                 if not (keyword.iskeyword(n) or n in RESERVED or n in _module_names() or n.startswith(("_", "d_")))]
        self.taken = set(plain) | RESERVED | _module_names() | _LOCALS | kernels | {f"d_{d}" for d in p.dims}
        self.of = {n: n for n in plain}
        for n in names:
            if n not in self.of:
                self.of[n] = self.fresh(f"v_{n}", self.taken)

    def __call__(self, name: str) -> str:
        return self.of[name]

    def fresh(self, base: str, scope: set[str]) -> str:
        """``base``, else ``base_1``, …: a name that is no statement's, no dim's, nothing coconet's, and not yet
        in ``scope`` (what the function it is bound in binds), which it then joins."""
        name, k = base, 1
        while name in self.taken or name in scope:
            name, k = f"{base}_{k}", k + 1
        scope.add(name)
        return name


def dim_expr(d: Dim) -> str:
    terms = []
    for mono, coeff in d.terms:
        factors = ([str(coeff)] if coeff != 1 or not mono else []) + [f"d_{n}" for n in mono]
        terms.append(" * ".join(factors))
    return " + ".join(terms) if terms else "0"


@dataclass(frozen=True)
class Generated:
    schedule: Schedule
    backend: str
    source: str
    line_map: dict = None  # 1-based line of the module -> the statement it implements
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
            raise BackendError(f"the code generated for schedule {self.schedule.text!r} does not compile: {err}",
                               kind="compile_error") from err


class _Emitter:
    def __init__(self, schedule: Schedule, backend: str, kernels: str, dropout: str = "counter"):
        self.s = schedule
        self.dropout = dropout
        self.p: Program = schedule.scheduled
        self.backend = backend
        self.compile = kernels == "compiled"
        self.ident = _Names(self.p)
        # coconet's GEMM with its compiled kernels; the eager form (the eager baseline too) is plain torch
        self.matmul = "_matmul" if self.compile else "torch.matmul"
        self.kernels: list[str] = []  # nested in step: they read its dims
        self.toplevel: list[tuple[str, str | None]] = []  # fused pointwise kernels, at module level
        self.written: set[str] = set()  # state a kernel writes in place
        self.at: dict[str, int] = {}  # each statement's place in the step (step_positions)
        self.chunked: set[str] | None = None  # members of the chunked unit being emitted
        self.absorbed: dict[Group, tuple[str, ...]] = {}  # see absorbed_by_collective
        self.slotless: set[str] = set()  # shm all_gathers written straight into the peers' state (gather_into)
        self.packed: list[tuple[str, ...]] = []  # inputs a chunk kernel sums from one slot (_shm_segments)
        self.into_state: dict[str, str] = {}  # see gathers_into_state: all_gather → the state it writes
        self.fuse_into: dict[Group, dict[str, str]] = {}  # see fuse_gathers_into
        self.rowwise: dict[str, Group] = {}  # absorbed Replicated statements: a chunk computes its own rows
        self.rows_only: dict[str, int] = {}  # see computed_on_rows: statement → the dim its readers cut
        self.fuse_absorbed: dict[Group, dict[str, int]] = {}  # see fuse_absorbed
        self.fuse_reduced: dict[Group, tuple[str, ...]] = {}  # see fuse_reduced
        self.held: set[str] = set()  # see held_source: computed into the buffer _Shm.held keeps for them
        self.aliased: dict[str, str] = {}  # state another is updated to → its copy from before the step

    # --- expressions for one statement's local value ---

    def operand(self, s: Stmt, a: str) -> str:
        """``a`` as ``s`` consumes it: a Replicated operand of a Sliced pointwise result is cut to this rank's
        rows; in a chunked unit, a slice computed outside it is cut to the chunk."""
        out_t, t = s.type, self.p[a].type
        name = self.ident(a)
        if a in self.rows_only:
            return name  # this rank's rows already
        if s.name in self.rows_only and t.shape:
            d = row_dim(out_t.shape, self.rows_only[s.name], t.shape)
            return name if d is None else f"_c.cut({name}, {d}, {dim_expr(t.shape[d])})"
        if self.chunked is not None and a in self.rowwise:
            return name  # computed on the chunk's rows already
        if self.chunked is not None and s.name in self.rowwise and t.shape:
            rs = self.p[self.rowwise[s.name].members[0]].type
            d = row_dim(out_t.shape, rs.layout.dim, t.shape)
            return name if d is None else f"_c.cut({name}, {d}, {dim_expr(t.shape[d])})"
        if self.chunked is not None and a not in self.chunked and isinstance(t.layout, Sliced):
            return f"_c.local({name}, {t.layout.dim})"
        if self.chunked is not None and a in self.chunked and self.p[a].op == "all_gather":
            # this rank's rows of a gather are the rows it sent: the chunk at hand, gathered or not
            return self.ident(self.p[a].args[0])
        if out_t is None or not isinstance(out_t.layout, Sliced) or not isinstance(t.layout, Replicated):
            return name
        d = row_dim(out_t.shape, out_t.layout.dim, t.shape)
        return name if d is None else f"_c.cut({name}, {d}, {dim_expr(t.shape[d])})"

    def shape_expr(self, t) -> str:
        return "(" + "".join(f"{dim_expr(d)}, " for d in t.shape) + ")"

    def local_shape_expr(self, t) -> str:
        dims = []
        for k, d in enumerate(t.shape):
            if isinstance(t.layout, Sliced) and t.layout.dim == k:
                dims.append(f"_c.rows({dim_expr(d)})[1] - _c.rows({dim_expr(d)})[0]")
            else:
                dims.append(dim_expr(d))
        return "(" + "".join(f"{x}, " for x in dims) + ")"

    def number(self, name: str) -> bool:
        """Whether the value is a Python number in the generated code: int64 scalars are ints on the host (so a
        seed never recompiles a kernel), constants literals, and arithmetic of those alone stays a number."""
        s = self.p[name]
        if s.op == "const" or (s.op == "scalar" and s.type.dtype == "int64"):
            return True
        arithmetic = s.op == "neg" or (s.op in BINARY and s.op not in ("maximum", "minimum"))
        return arithmetic and all(self.number(a) for a in s.args)

    def tensor(self, name: str, text: str) -> str:
        """``text``, the operand ``name``, as a tensor where torch's function wants one and it may be a number."""
        return f"_t({text})" if self.number(name) else text

    def dropout_args(self, s: Stmt) -> str:
        seed = s.attr("seed") if s.attr("seed") is not None else self.ident(s.args[1])
        return f"{s.attr('p')!r}, {seed}, {self.shape_expr(s.type)}"

    def kept(self, name: str, text: str) -> str:
        """``text``, the value ``name`` that the step returns, as a copy where it is (a view of) state the step
        updates: what it returns is the value before the update, which the state's end of step overwrites."""
        s = self.p[name]
        while s.op == "slice":
            s = self.p[s.args[0]]
        return f"{text}.clone()" if s.op == "input" and s.name in self.p.updates else text

    def into(self, s: Stmt, out: str) -> str:
        """Pointwise statement ``s`` computed into the tensor ``out`` (an op of ``OUT``). A number stays one where
        torch takes it (as the operator the statement is written with otherwise passes it)."""
        if s.op == "div" and self.number(s.args[0]):
            # ``c / x`` is x's reciprocal times c in torch (Tensor.__rtruediv__), at times an ulp from the quotient
            # that ``torch.div(c, x)`` gives: the bits of the same statement computed into a new tensor
            return (f"torch.mul(torch.reciprocal({self.operand(s, s.args[1])}, out={out}), "
                    f"{self.operand(s, s.args[0])}, out={out})")
        wrap = s.op in ("maximum", "minimum", "where")  # tensors only
        args = [self.tensor(a, self.operand(s, a)) if k == 0 or wrap else self.operand(s, a)
                for k, a in enumerate(s.args)]
        return f"{OUT[s.op]}({', '.join(args)}, out={out})"

    def stmt(self, s: Stmt) -> list[str]:
        n, op = self.ident(s.name), s.op
        args = [self.operand(s, a) for a in s.args]
        if s.name in self.held and s.name not in self.p.group_of:
            dtype = TORCH_DTYPE[s.type.dtype or "float32"]
            return [f"{n} = {self.into(s, f'_c.shm.held({s.name!r}, {self.local_shape_expr(s.type)}, {dtype})')}"]
        if op == "input":
            return [f"{n} = tensors[{s.name!r}]"] + ([f"{self.aliased[s.name]} = {n}.clone()"]
                                                     if s.name in self.aliased else [])
        if op == "scalar":
            if s.type.dtype == "int64":
                return [f"{n} = int(scalars[{s.name!r}])"]
            # on the host whatever the backend: CUDA ops and compiled kernels take a 0-d CPU tensor as a plain
            # argument, where a 0-d CUDA tensor costs a host-to-device copy per step and every statement of
            # scalars alone a kernel launch (an H100's Adam step at N=2^24 spent 230 us of 840 on both)
            return [f"{n} = torch.tensor(float(scalars[{s.name!r}]), dtype={TORCH_DTYPE[s.type.dtype]})"]
        if op == "recv":
            peer = "_c.global_rank - _c.world"
            return [
                "if stage == 0:",
                f"    {n} = tensors[{s.name!r}]",
                "else:",
                f"    {n} = torch.empty({self.local_shape_expr(s.type)}, dtype={TORCH_DTYPE[s.type.dtype]}, "
                "device=_c.device)",
                f"    dist.recv({n}, src={peer})",
            ]
        if op == "const":
            return [f"{n} = {s.attr('value')!r}"]
        if op in BINARY:
            return [f"{n} = {BINARY[op].format(*args)}"]
        if op in UNARY:
            return [f"{n} = {UNARY[op].format(self.tensor(s.args[0], args[0]) if op != 'neg' else _paren(args[0]))}"]
        if op == "cast":
            # .to of a tensor's own dtype is that tensor: of state the step updates, a copy (see kept)
            same = (self.p[s.args[0]].type.dtype or "float32") == s.attr("dtype")
            text = f"_t({args[0]}).to({TORCH_DTYPE[s.attr('dtype')]})"
            return [f"{n} = {self.kept(s.args[0], text) if same else text}"]
        if op == "where":
            return [f"{n} = torch.where({', '.join(self.tensor(a, x) for a, x in zip(s.args, args))})"]
        if op == "dropout" and self.dropout == "torch":
            return [f"{n} = torch.nn.functional.dropout({args[0]}, p={s.attr('p')!r}, training=True)"]
        if op == "dropout":
            dim = s.type.layout.dim if isinstance(s.type.layout, Sliced) else -1
            return [f"{n} = _dropout(_c, {args[0]}, {self.dropout_args(s)}, {dim})"]
        if op in ("sum", "partial_sum"):
            return [f"{n} = {args[0]}.sum()"]
        if op == "norm":
            return [f"{n} = _norm({args[0]})"]
        if op in ("reduce", "partial_reduce"):
            x = self.tensor(s.args[0], args[0])
            return [f"{n} = {reduce_text(s, x, self.p[s.args[0]].type, dim_expr, self.local_shape_expr(s.type))}"]
        if op in ("softmax", "log_softmax"):
            return [f"{n} = {normalize_text(s, self.tensor(s.args[0], args[0]))}"]
        if op == "matmul":
            return [f"{n} = {self.matmul}({args[0]}, {args[1]})"]
        if op in CONVS:
            # the operands as they lie: a batch, channel or whole piece is what the layout rule convolves (a
            # Replicated weight is never cut to a Sliced result's rows, as a pointwise operand is)
            return [f"{n} = {conv_call(s, *map(self.ident, s.args))}"]
        if op == "allreduce":
            if needs_copy(self.p, s.name):
                return [f"{n} = _allreduced(_c, {args[0]}, {s.attr('op')!r})"]
            return [f"{n} = {args[0]}", f"_allreduce(_c, {n}, {s.attr('op')!r})"]
        if op == "reduce_scatter":
            d = s.type.layout.dim
            return [f"{n} = _reduce_scatter(_c, {args[0]}, {d}, {dim_expr(s.type.shape[d])}, {s.attr('op')!r})"]
        if op == "all_gather":
            t = self.p[s.args[0]].type
            d = t.layout.dim
            state = self.into_state.get(s.name)
            if any(s.name in into for into in self.fuse_into.values()):
                return []  # the kernel that computes its rows writes them into every copy of the state
            if state is not None:
                return [f"_gather_into(_c, {args[0]}, {d}, {dim_expr(t.shape[d])}, {self.ident(state)}, {state!r})"]
            return [f"{n} = _all_gather(_c, {args[0]}, {d}, {dim_expr(t.shape[d])})"]
        if op == "broadcast":
            return [f"{n} = _broadcast(_c, {args[0]}.clone(), {s.attr('root')})"]
        if op == "slice":
            return [f"{n} = {args[0]}"]  # the operand, cut to this rank's rows (or the chunk's)
        if op == "send":
            return [f"_sent[{s.attr('tag')!r}] = {self.kept(s.args[0], args[0])}",
                    "if stage + 1 < stages:",
                    f"    dist.send({args[0]}.contiguous(), dst=_c.global_rank + _c.world)"]
        if op == "output":
            return [f"_outputs[{s.attr('name')!r}] = {self.kept(s.args[0], self.tensor(s.args[0], args[0]))}"]
        if op == "update":
            return []  # written at the end: every statement reads the state from before the step
        custom = self.p.custom_ops.get(op)
        if custom is not None:
            if custom.torch is None:
                raise BackendError(f"custom op {op} has no torch implementation (custom_op(..., torch=fn))",
                                   kind="compile_error")
            attrs = "".join(f", {k}={v!r}" for k, v in s.attrs)
            return [f"{n} = _custom[{op!r}]({', '.join(args)}{attrs})"]
        raise BackendError(f"the torch backend cannot lower {op} ({s.name})", kind="compile_error")


def conv_call(s: Stmt, x: str, w: str) -> str:
    return f"_conv({x}, {w}, {s.attr('stride')}, {s.attr('padding')}, {s.attr('dilation')}, {s.attr('groups')})"


def _paren(x: str) -> str:
    return x if x.isidentifier() else f"({x})"


KERNELS = ("compiled", "eager")
DROPOUTS = ("counter", "torch")


def lower(schedule: Schedule, backend: str = "gloo", kernels: str = "compiled", dropout: str = "counter") -> Generated:
    """The Python module for ``schedule`` on ``backend`` (gloo: CPU tensors, nccl: CUDA tensors, shm: CPU
    tensors, the collectives computed in shared memory by the ranks of one node).
    ``kernels``: fused pointwise groups compiled by Inductor on first call (``compiled``) or run as
    plain torch statements (``eager``: no compile time, one kernel per statement).
    ``dropout``: the counter-based mask the reference interpreter draws (``counter``), or torch's own
    ``F.dropout`` (``torch``: what a hand-written PyTorch step calls; its masks cannot be checked, and
    only statements run eagerly can call it)."""
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r} (use {', '.join(BACKENDS)})",
                           kind="compile_error")
    if kernels not in KERNELS:
        raise BackendError(f"unknown kernels {kernels!r} (use {' or '.join(KERNELS)})", kind="compile_error")
    if dropout not in DROPOUTS:
        raise BackendError(f"unknown dropout {dropout!r} (use {' or '.join(DROPOUTS)})", kind="compile_error")
    if dropout == "torch" and (kernels != "eager" or schedule.scheduled.groups):
        raise BackendError("torch's dropout draws its own mask per call: only an eager, unfused program "
                           "can use it, not fused or chunked kernels", kind="compile_error")
    e = _Emitter(schedule, backend, kernels, dropout)
    p = e.p
    units = step_units(p)
    # every input bound (and a state another is updated to copied) before any unit runs: a unit may write a
    # state it does not read in the program, a fused collective gathering into it
    first = [u for u in units if not isinstance(u, Group) and p[u].op in ("input", "scalar")]
    bound = set(first)
    units = first + [u for u in units if isinstance(u, Group) or u not in bound]
    e.absorbed = absorbed_by_collective(p) if e.compile else {}
    e.rowwise = {m: g for g, ms in e.absorbed.items() for m in ms if isinstance(p[m].type.layout, Replicated)}
    skip = {m for ms in e.absorbed.values() for m in ms}
    if e.compile:
        skip.update(m for ms in kernel_reduced(p, backend, e.absorbed).values() for m in ms)
    e.fuse_absorbed = fuse_absorbed(p, skip)
    e.fuse_reduced = fuse_reduced(p) if e.compile else {}
    for ms in e.fuse_reduced.values():
        skip.update(ms)
    for ms in e.fuse_absorbed.values():
        e.rows_only.update(ms)
        skip.update(ms)
    e.rows_only.update(computed_on_rows(p, skip))
    if backend == "shm":
        e.into_state = gathers_into_state(p, units, e.absorbed)
        e.written.update(e.into_state.values())
        e.slotless.update(e.into_state)
        if e.compile:
            e.fuse_into = fuse_gathers_into(p, units, e.into_state, e.absorbed, e.fuse_absorbed)
        e.held = held_sources(p, backend, e.absorbed, e.compile)
    # a state another is updated to (a swap, a moment kept from the step before) is copied as the step begins,
    # before a kernel may write it, into a name of its own: the state's name stays the caller's tensor
    e.aliased = aliased = {v: e.ident.fresh(f"_{e.ident(v)}_before", set())
                           for v in dict.fromkeys(p.updates.values()) if p[v].op == "input" and v in p.updates}
    at_end = updated_in_place(p, skip | set(e.rows_only))
    skip |= set(at_end.values())
    e.at = step_positions(units, e.absorbed, e.fuse_absorbed, e.fuse_reduced,
                      kernel_reduced(p, backend, e.absorbed) if e.compile else {})
    lowered: list[list[tuple[str, str]]] = []  # per unit: (line, statement it implements)
    for unit in units:
        if unit in skip:
            continue
        if isinstance(unit, Group):
            lowered.append([(x, unit.members[0]) for x in _lower_group(e, unit)])
        else:
            s = p[unit]
            lowered.append([(x, s.name) for x in e.stmt(s)])
    updates = [(f"{e.ident(t)}.copy_({aliased.get(v) or e.tensor(v, e.ident(v))})", t) for t, v in p.updates.items()
               if t not in e.written and t not in at_end]
    updates += [(e.into(p[v], e.ident(t)), v) for t, v in at_end.items()]  # after the copies: see updated_in_place
    kept = set().union(*(_free_names([x for x, _ in k]) for k in e.kernels))
    kept |= _names([x for x, _ in updates] + [e.ident(v) for v in aliased])
    body = _freeing(e, lowered, kept)
    src, line_map = _module(schedule, backend, e, body, updates)
    gen = Generated(schedule, backend, src, line_map, kernels, dropout)
    gen.code  # noqa: B018 -- compiled now: code that does not compile is refused here, not on the ranks
    return gen


# names every step binds for its whole length
_STEP_NAMES = {"_c", "_custom", "_outputs", "_sent"}


def _names(lines) -> set[str]:
    """The names a piece of generated code mentions (not attributes, strings or comments)."""
    return {n.id for n in ast.walk(ast.parse("\n".join(lines))) if isinstance(n, ast.Name)}


def _free_names(lines) -> set[str]:
    """The names a function nested in ``step`` reads from it: what it loads and neither takes nor binds."""
    fn = ast.parse(textwrap.dedent("\n".join(lines))).body[0]
    params = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
    names = [n for n in ast.walk(fn) if isinstance(n, ast.Name)]
    bound = {n.id for n in names if not isinstance(n.ctx, ast.Load)}
    return {n.id for n in names if isinstance(n.ctx, ast.Load)} - params - bound


def _bound(lines) -> set[str]:
    """The names a unit assigns at its own level (``x = …``, ``a, b = …``), not inside its loops or branches."""
    return {n.id for st in ast.parse("\n".join(lines)).body if isinstance(st, ast.Assign)
            for target in st.targets for n in ast.walk(target)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _freeing(e: _Emitter, lowered: list[list[tuple[str, str]]], kept: set[str]) -> list[tuple[str, str | None]]:
    """The units' lines with each tensor temporary deleted after the last unit that reads it. Otherwise an
    eager step holds every temporary until it returns: Adam as written peaks at 15 arrays of N floats
    instead of 5 (1.9 GB per rank at N=2^25, four ranks on one node). Inputs, scalars, what the step
    returns and what its end or a nested kernel reads are left alone."""
    p = e.p
    tensors = {e.ident(s.name) for s in p.stmts
               if s.op not in ("input", "scalar", "const") and s.type is not None and s.type.shape}
    ir = {e.ident(s.name) for s in p.stmts}
    kept = kept | _STEP_NAMES
    mentions = [_names(x for x, _ in unit) for unit in lowered]
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


def _lower_group(e: _Emitter, g: Group) -> list[str]:
    knobs = e.s.knob_values
    if g.kind == "overlap":
        return _lower_overlap(e, g, knobs.get("chunks", 4))
    if g.kind == "bucket":
        return _lower_bucket(e, g, knobs.get("bucket_bytes", 2**22))
    if g.kind == "fuse":
        return _lower_fuse(e, g)
    return _lower_fused_collective(e, g, knobs.get("fc_chunks", 1))


@dataclass(frozen=True)
class FusedCollective:
    """A fused collective as the lowering emits it and the cost model prices it: what it reads, what each chunk
    computes, and where each result goes."""
    rs: Stmt
    ins: tuple[str, ...]
    outs: tuple[str, ...]  # handed on after it: neither written in place nor gathered into state
    inplace: Mapping[str, str]  # result -> the sliced state each chunk writes it into (_fc_in_place)
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


def fused_collective_plan(p: Program, backend: str, g: Group, absorbed: tuple[str, ...],
                          compiled: bool = True) -> FusedCollective:
    ins, outs = group_io(p, g, absorbed)
    inplace = _fc_in_place(p, g, outs, absorbed) if compiled else {}
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
        rs=rs, ins=tuple(ins), outs=tuple(outs), inplace=inplace, into=into, gathers=gathers,
        partials=partials, sliced_outs=sliced_outs, compute=compute, needed=frozenset(needed),
        direct=direct, compiles=compiles, sums_parts=sums, pre=pre, sources=sources,
        ranked=rank_numbers(p, pre), held=held)


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
        if (v in skip or s.op not in OUT or not ungrouped_pointwise(p, s) or len(p.users[v]) != 1
                or s.type != p[t].type or not s.type.shape):
            continue
        if all(a == t or (a not in p.updates and (p[a].op in ("input", "scalar", "const") or (
                ungrouped_pointwise(p, p[a]) and p[a].op != "cast" and a not in skip))) for a in s.args):
            out[t] = v
    return out


def held_sources(p: Program, backend: str, absorbed: Mapping[Group, tuple[str, ...]],
                 compiled: bool = True) -> set[str]:
    """The values fused collectives reduce that the step computes into buffers of their own (held_source)."""
    return {fc.sources[0] for g in p.groups if g.kind == "fused_collective"
            for fc in [fused_collective_plan(p, backend, g, absorbed.get(g, ()), compiled)] if fc.held}


def kernel_reduced(p: Program, backend: str, absorbed: Mapping[Group, tuple[str, ...]],
                   compiled: bool = True) -> dict[Group, tuple[str, ...]]:
    """Per fused collective, the statements before it that its chunk kernel computes (``reduced_in_kernel``):
    no unit of their own."""
    out = {}
    for g in p.groups:
        if g.kind == "fused_collective":
            pre = fused_collective_plan(p, backend, g, absorbed.get(g, ()), compiled).pre
            if pre:
                out[g] = pre
    return out


def rank_numbers(p: Program, pre: Sequence[str]) -> tuple[str, ...]:
    """The 0-d Local values ``pre`` (reduced_in_kernel) reads: numbers each rank holds its own of (a weight, a
    clip factor from its gradient's norm), which every rank posts at the barrier that begins the collective
    (``_Shm.post``), so that the kernel computes each rank's rows with that rank's."""
    return tuple(dict.fromkeys(a for m in pre for a in p[m].args
                               if p[a].type.shape == () and isinstance(p[a].type.layout, Local)))


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
        if (not ungrouped_pointwise(p, s) or s.op == "dropout" or s.type.shape != shape
                or not isinstance(s.type.layout, Local)):
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


def _lower_fused_collective(e: _Emitter, g: Group, chunks: int) -> list[str]:
    p = e.p
    absorbed = e.absorbed.get(g, ())
    fc = fused_collective_plan(p, e.backend, g, absorbed, e.compile)
    e.written.update(fc.inplace.values())
    e.written.update(fc.into.values())
    e.slotless.update(fc.into)
    fname = f"_{g.kind}{len(e.kernels)}"
    ops = [p[m].op for m in g.members]
    parts = ["reduce_scatter", "the computation on this rank's slice"]
    parts += ["its partial sums"] * ("partial_sum" in ops) + ["the all_gathers"] * ("all_gather" in ops)
    lines = [(f"def {fname}(_rank, {', '.join(e.ident(a) for a in fc.ins)}):", g.members[0]),
             (f'    """fused_collective: {", ".join(parts)}, as one unit."""', g.members[0])]
    lines += _chunked_body(e, g, fc, chunks)
    if fc.outs:
        lines.append((f"    return {_tuple_text(map(e.ident, fc.outs))}",
                      g.members[-1]))
    e.kernels.append(lines)
    call = f"{fname}(_c, {', '.join(e.ident(a) for a in fc.ins)})"
    return [f"{_tuple_text(map(e.ident, fc.outs))} = {call}" if fc.outs else call]


def fuse_absorbed(p: Program, skip: set[str] = frozenset()) -> dict[Group, dict[str, int]]:
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
        taken = tuple(s.name for s in p.stmts
                      if s.op in ("sum", "norm") and s.name not in p.group_of and s.args[0] in inside)
        if taken:
            out[g] = taken
    return out


def _fc_in_place(p: Program, g: Group, outs: list[str], absorbed) -> dict[str, str]:
    """Values a fused collective computes on this rank's slice of sharded state that it can write straight
    into that state, chunk by chunk."""
    return _updated_in_place(p, g, outs, absorbed, gathered=False)


def gather_into(p: Program, backend: str, g: Group, outs: list[str], absorbed) -> dict[str, str]:
    """All_gathers of a fused collective on shm whose value only updates Replicated state that nothing
    outside reads: the chunk writes this rank's rows into the state, then into every peer's copy of it
    (which lives in shared memory). No gathered temporary, no slot, no copy into the state after."""
    return _updated_in_place(p, g, outs, absorbed, gathered=True) if backend == "shm" else {}


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
        if isinstance(s.type.layout, Replicated) and all(p[u].op not in EFFECTS and at[u] < at[s.name]
                                                         for u in readers):
            found[s.name] = t
    return found


def fuse_gathers_into(p: Program, units: list, into_state: dict[str, str], absorbed: dict[Group, tuple[str, ...]],
                      rows: dict[Group, dict[str, int]]) -> dict[Group, dict[str, str]]:
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


def _updated_in_place(p: Program, g: Group, outs: list[str], absorbed, *, gathered: bool) -> dict[str, str]:
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
        if all(p[u].op == "update" or (u in inside and not gathered) for u in p.users[o]) and \
                all(u in inside and (p[u].op in ELEMENTWISE or p[u].op == "slice") for u in readers):
            found[o] = t
    return found


def _lower_fuse(e: _Emitter, g: Group) -> list[str]:
    """A pointwise group as one module-level function; compiled, Inductor fuses it into one loop (C++ on
    CPU, Triton on CUDA) that writes updated state in place. One that writes its rows into every peer's copy
    of a state (``fuse_gathers_into``) takes its rows cut at the call, so that C may run it (see
    _native_chunk): its streamed stores skip the read of every line an ordinary store makes first."""
    p = e.p
    absorbed = tuple(e.fuse_absorbed.get(g, ()))
    reduced = e.fuse_reduced.get(g, ())
    ins, outs = group_io(p, g, (*absorbed, *reduced))
    inplace = in_place_outputs(p, g, outs, e.at)
    e.written.update(inplace.values())
    into = e.fuse_into.get(g, {})  # gather -> the value whose rows the kernel writes into every copy of the state
    held = [o for o in outs if o in e.held and o not in inplace and o not in into.values()]
    rest = [o for o in outs if o not in inplace and o not in into.values() and (into or o not in held)]
    rest += list(reduced)
    body = []
    for m in (*absorbed, *g.members, *reduced):
        body.extend(("    " + x, m) for x in e.stmt(p[m]))
    body += [(f"    {e.ident(t)}.copy_({e.ident(o)})", o) for o, t in inplace.items()]
    scope = {e.ident(a) for a in ins}
    # the value a fused collective reduces where it lies (held_source): the kernel stores it into the kept
    # buffer, handed to it as an argument (a kernel writing peers' rows, cut at the call, copies it after)
    buffers = {o: e.ident.fresh(f"_{e.ident(o)}_held", scope) for o in held}
    made = [f"{buffers[o]} = _c.shm.held({o!r}, {e.local_shape_expr(p[o].type)}, "
            f"{TORCH_DTYPE[p[o].type.dtype or 'float32']})" for o in held]
    if not into:
        body += [(f"    {buffers[o]}.copy_({e.ident(o)})", o) for o in held]
    peers = {}  # gather -> the kernel's parameter: this rank's rows of every peer's copy of the state
    for ag, o in into.items():
        state, peer = e.into_state[ag], e.ident.fresh("_peer", scope)
        peers[ag] = e.ident.fresh(f"{e.ident(state)}_peers", scope)
        body += [(f"    {e.operand(p[o], state)}.copy_({e.ident(o)})", ag),
                 (f"    for {peer} in {peers[ag]}:", ag), (f"        {peer}.copy_({e.ident(o)})", ag)]
    compiled = e.compile and not custom_group(p, g)  # a custom op's torch code may not trace; it runs as written
    call = None
    if into and compiled:  # rows cut at the call: the kernel may run as C, streaming into the peers' copies
        doc = (f"fuse({', '.join(g.members)}): one pointwise kernel on this rank's rows, state written in place "
               "and into every peer's copy")
        compute = [*absorbed, *g.members]
        args = {x: x for x in peers.values()}  # the peers' rows, bound under the same names at the call
        states = {ag: e.into_state[ag] for ag in into}
        call = _cut_kernel(e, g, "_fuse", doc, list(body), compute, set(map(e.ident, compute)), args, scope, rest,
                           lambda dims: _native_chunk(e, compute, inplace, states, peers, {}, None, (), args, dims,
                                                      rest))
    if call is None:
        call = _whole_fuse(e, g, body, ins, inplace, into, peers, rest, compiled, given=list(buffers.values()))
    bound = [f"{e.ident(o)} = {buffers[o]}" + (f".copy_({e.ident(o)})" if into else "") for o in held]
    if not into:
        return [*made, call, *bound]
    # every state's copies mapped at one barrier before the kernel, every one whole at one barrier after it
    specs, gathers, ends = [], [], []
    for ag, o in into.items():
        t, state = p[o].type, e.into_state[ag]
        d = t.layout.dim
        specs.append(f"({d}, {dim_expr(t.shape[d])}, {e.ident(state)}, {state!r})")
        gathers.append(e.ident.fresh(f"_{e.ident(ag)}", set()))
        ends.append(f"{gathers[-1]}.into({e.ident(state)}{', end=False' if ends else ''})")
    start = f"({_tuple_text(gathers)}), ({_tuple_text(peers.values())}) = _into_peers(_c, {', '.join(specs)})"
    return [start, call] + ends + made + bound


def _tuple_text(names) -> str:
    """Names as the targets or value of a tuple in Python text: ``a, b``, and ``a,`` for one."""
    names = list(names)
    return ", ".join(names) + ("," if len(names) == 1 else "")


def _whole_fuse(e: _Emitter, g: Group, body: list, ins: list[str], inplace: dict[str, str], into, peers,
                rest: list[str], compiled: bool, given: Sequence[str] = ()) -> str:
    """The fuse group's function taking whole tensors and ``_c`` (it cuts the rows it reads itself), Inductor's
    where ``compiled``: its call."""
    p = e.p
    if rest:
        body = body + [(f"    return {_tuple_text(map(e.ident, rest))}",
                        g.members[-1])]
    used = _names(textwrap.dedent("\n".join(x for x, _ in body)).split("\n"))
    dims = [f"d_{d}" for d in p.dims if f"d_{d}" in used]
    custom = custom_group(p, g)
    params = ["_c"] + dims + (["_custom"] if custom else []) + [e.ident(a) for a in ins]
    params += [e.ident(t) for t in (*inplace.values(), *(e.into_state[ag] for ag in into)) if t not in ins]
    params = list(dict.fromkeys(params)) + list(peers.values()) + list(given)
    fname = f"_fuse{len([x for x in e.toplevel if x[0].startswith('def ')])}"
    head = [(f"def {fname}({', '.join(params)}):", g.members[0]),
            (f'    """fuse({", ".join(g.members)}): one pointwise kernel'
             + (", state written in place" if inplace or into else "")
             + (" and into every peer's copy" if into else "") + '."""', g.members[0])]
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
        call = f"{_tuple_text(map(e.ident, rest))} = {call}"
    return call


def _chunked_body(e: _Emitter, g: Group, fc: FusedCollective, chunks: int) -> list:
    """A fused collective as a pipeline over chunks of this rank's slice: chunk k computes as soon as its
    rows are reduced, its all_gathers start while chunk k+1 computes. The statements of a chunk see a
    _Chunk as their context ``_c``; compiled, its pointwise statements are one kernel."""
    p = e.p
    rs, inplace, into = fc.rs, fc.inplace, fc.into
    gathers, partials, sliced_outs = fc.gathers, fc.partials, fc.sliced_outs
    d = rs.type.layout.dim
    n = dim_expr(rs.type.shape[d])
    lines: list[tuple[str, str]] = []
    words = {m: i for i, m in enumerate(into)}
    scope: set[str] = set()  # what the function binds besides the program's values
    tmp = {m: e.ident.fresh(f"_{e.ident(m)}", scope) for m in (*gathers, *sliced_outs, *partials)}
    lines += [(f"    {tmp[m]} = _Gather(_rank, {d}, {n}"
               + (f", {e.ident(into[m])}, {into[m]!r}, {words[m]})" if m in into else ")"), m) for m in gathers]
    at = len(lines)  # where the sliced outputs' holders are made, once it is known whether a kernel fills them
    compute = list(fc.compute)
    e.chunked = set(g.members) | set(fc.compute)
    try:
        # shm: the kernel reduces the chunk's rows on every rank as it reads them (sums_parts)
        # the chunk's rows on every rank, of each input pre reads where there are several
        parts = (() if not fc.sums_parts else (e.ident.fresh(f"{e.ident(rs.name)}_parts", scope),)
                 if len(fc.sources) == 1 else tuple(e.ident.fresh(f"{e.ident(x)}_parts", scope) for x in fc.sources))
        # compiled, the kernel writes this rank's rows of a gathered state into every peer's copy as it computes
        # them: a push after it would read them back from memory (shm.py's module doc)
        peers = {m: f"{tmp[m]}.peer_rows(_c)" for m in into}
        # compiled, the kernel writes each chunk's rows of a sliced output into the whole output, made before
        # the first chunk: no list of chunks to concatenate after the last
        buffers = {o: tmp[o] for o in sliced_outs}
        # shm, compiled: a value gathered and not handed on is written by the kernel into this rank's slot,
        # which the peers copy it out of: it is never returned and copied in
        slots = {p[m].args[0]: (f"{tmp[m]}.own(_c, {TORCH_DTYPE[p[m].type.dtype or 'float32']}, "
                                f"{e.shape_expr(p[m].type)})")
                 for m in gathers if e.backend == "shm" and m not in into and p[m].args[0] in compute
                 and p[m].args[0] not in buffers}
        # every rank's of each of the numbers that pre reads, one tensor per number, in the order of the parts
        ranked = {x: e.ident.fresh(f"{e.ident(x)}_ranks", scope) for x in fc.ranked} if parts else {}
        kernel = (_chunk_kernel(e, g, compute, inplace, fc.needed, rs if parts else None, into, parts, peers, buffers,
                                fc.pre, fc.sources, ranked, slots) if e.compile else None)
        sources, direct = fc.sources, fc.direct
        if kernel is None and fc.pre:  # no kernel to compute them on every rank's rows: computed here, published
            computed = [("    " + x, m) for m in fc.pre for x in e.stmt(p[m])]
            lines[:0], at = computed, at + len(computed)
            sources, direct = (rs.args[0],), False
        if kernel is not None:
            lines[at:at] = [(f"    {tmp[o]} = torch.empty({e.local_shape_expr(p[o].type).replace('_c.', '_rank.')}, "
                             f"dtype={TORCH_DTYPE[p[o].type.dtype or 'float32']}, device=_rank.device)", o)
                            for o in sliced_outs]
        else:
            lines[at:at] = [(f"    {tmp[o]} = []", o) for o in sliced_outs]
        lines[at:at] = [(f"    {tmp[o]} = []", o) for o in partials]  # each chunk's, added up after the last
        source = e.ident(sources[0]) if len(sources) == 1 else f"({', '.join(map(e.ident, sources))})"
        names = repr(sources[0]) if len(sources) == 1 else repr(sources)
        where = f", {names}, {len(into)}" if direct else ""
        if kernel is not None and parts:
            if ranked:  # posted after the words of the gathers' states and of the inputs (_scatter_parts)
                words = where or f", None, {len(into)}"
                where = f"{words}, numbers=({''.join(f'{e.ident(x)}, ' for x in ranked)})"
            targets = "".join(f", {v}" for v in ranked.values())
            if len(sources) > 1:
                e.packed.append(sources)
            lines.append((f"    for _c, {', '.join(parts)}{targets} in _reduce_scatter_parts(_rank, {source}, "
                          f"{d}, {n}, {chunks}{where}):", rs.name))
        else:
            lines.append((f"    for _c, {e.ident(rs.name)} in _reduce_scatter_chunks(_rank, {source}, "
                          f"{d}, {n}, {chunks}, {rs.attr('op')!r}{where}):", rs.name))
        if kernel is not None:
            lines += kernel
        else:
            for m in compute:
                lines.extend(("        " + x, m) for x in e.stmt(p[m]))
            for o, t in inplace.items():
                lines.append((f"        {e.operand(p[o], t)}.copy_({e.ident(o)})", o))
            for m, t in into.items():
                src = p[m].args[0]
                lines.append((f"        {e.operand(p[src], t)}.copy_({e.ident(src)})", m))
        for m in gathers:
            if m not in into and not (kernel is not None and p[m].args[0] in slots):
                src = p[m].args[0]
                # a value the kernel wrote into its holder (used again after the collective) is not bound
                # in the loop: the chunk's rows of the holder are what it gathers
                rows = (_holder_rows(p, src, tmp[src]) if kernel is not None and src in buffers
                        else e.ident(src))
                lines.append((f"        {tmp[m]}.add(_c, {rows})", m))
            elif kernel is None:
                lines.append((f"        {tmp[m]}.push(_c)", m))
    finally:
        e.chunked = None
    lines += [(f"        {tmp[o]}.append({e.ident(o)})", o) for o in partials]
    if kernel is None:
        lines += [(f"        {tmp[o]}.append({e.ident(o)})", o) for o in sliced_outs]
    for i, m in enumerate(gathers):  # on shm the first ends the collective, at one barrier for all
        later = i and e.backend == "shm"
        lines.append((f"    {tmp[m]}.into({e.ident(into[m])}{', end=False' if later else ''})" if m in into else
                      f"    {e.ident(m)} = {tmp[m]}.result({'end=False' if later else ''})", m))
    if direct and not gathers:  # nothing gathered: the peers' reads of the input end at a barrier of its own
        lines.append(("    _end_collective(_rank)", rs.name))
    lines += [(f"    {e.ident(o)} = {tmp[o]}" if kernel is not None else
               f"    {e.ident(o)} = torch.cat({tmp[o]}, dim={p[o].type.layout.dim})", o) for o in sliced_outs]
    lines += [(f"    {e.ident(o)} = torch.stack({tmp[o]}).sum()", o) for o in partials]
    how = ("chunk k+1 is reduced while chunk k computes and chunk k-1 is gathered" if e.backend != "shm" else
           f"{'read where it lies once moved into a segment' if direct else 'published once'}, each chunk "
           "reduced out of the peers' segments just before it computes")
    return [(f"    # {chunks} chunk{'s' if chunks > 1 else ''}: {how}", rs.name)] + lines


def _holder_rows(p: Program, o: str, holder: str) -> str:
    """The chunk's rows of ``holder``, the tensor of this rank's rows a compiled chunk kernel writes the sliced
    output ``o`` into: where the kernel writes them, and what a gather of ``o`` sends."""
    return f"_c.local({holder}, {p[o].type.layout.dim})"


def sums_parts(p: Program, backend: str, g: Group, into) -> bool:
    """Whether a fused collective's compiled chunk kernel (shm) takes the chunk's rows on every rank unreduced
    and reduces them as it reads them (any of the IR's REDUCE_OPS: sum, avg, prod, max, min): the reduced rows
    are never written out, unless the group outputs them, and then only once, by the kernel. Not where a
    gather outside the kernel sends them. A max allreduce of each rank's |g| (an amax) then reads g where it
    lies too."""
    rs = p[g.members[0]]
    sent = any(p[m].op == "all_gather" and m not in into and p[m].args[0] == rs.name for m in g.members)
    return backend == "shm" and not sent


def reads_input_in_place(p: Program, backend: str, source: str, after: bool = False) -> bool:
    """Whether a fused collective on shm reads its reduce_scatter's operand where it lies on every rank, moved
    into a segment of its own (``_Shm.stage_input``), rather than published into a slot: the operand is an
    input the step leaves as it is (a gradient). The barrier that ends the collective (``_end_collective``,
    its gathers' or its own where it gathers nothing) comes after the peers' last read of it and before any
    rank returns to a caller who may write the next one into it. ``after``: an input the chunk kernel reads
    (``reduced_in_kernel``) may be a Local state, for nothing writes one before the collective has ended: its
    new value is written in place at the step's end or by a kernel that runs after every reader of it
    (``in_place_outputs``), and the collective is one."""
    src = p[source]
    return (backend == "shm" and src.op == "input"
            and (src.name not in p.updates or (after and isinstance(src.type.layout, Local))))


def held_source(p: Program, backend: str, rs: Stmt) -> bool:
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
    if backend != "shm" or not s.type.shape:
        return False
    g = p.group_of.get(s.name)
    if g is None:
        return s.op in OUT and ungrouped_pointwise(p, s) and tuple(p.users[s.name]) == (rs.name,)
    # a fuse kernel's output: the kernel writes it into the buffer as it computes it (_lower_fuse)
    return (g.kind == "fuse" and not custom_group(p, g)
            and all(u == rs.name or u in g.members for u in p.users[s.name]))


_CUT = re.compile(r"_c\.(?:local|cut)\((\w+), [^()]*\)")


def chunk_compiles(p: Program, g: Group, compute: Sequence[str]) -> bool:
    """Whether a fused collective's chunk computes in one compiled kernel: pointwise statements, partial sums
    (the kernel returns the chunk's), slices of replicated values (the chunk's rows of them), and dropout on
    values sliced as the chunks are (its mask's counters are global element indices, which the kernel gets
    from the chunk's first row)."""
    rs = p[g.members[0]]
    d = rs.type.layout.dim
    n = rs.type.shape[d]

    def ok(s: Stmt) -> bool:
        if s.op == "dropout":
            t = s.type
            return isinstance(t.layout, Sliced) and t.layout.dim == d and t.shape[d] == n
        return s.op in ELEMENTWISE or s.op in ("partial_sum", "slice")  # the chunk's share of the sum; its rows

    return bool(compute) and all(ok(p[m]) for m in compute)


def _chunk_kernel(e: _Emitter, g: Group, compute: list[str], inplace: dict[str, str], needed: set,
                  parts: Stmt | None = None, into=None, parts_names: tuple[str, ...] = (), peers=None,
                  buffers=None, pre: tuple[str, ...] = (), sources: tuple[str, ...] = (), ranked=None,
                  slots=None) -> list | None:
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
        summed = parts_names[0]
        if pre:  # each rank's rows of the value it reduces, from its rows of the inputs it is computed from
            summed = e.ident.fresh(f"_{e.ident(parts.args[0])}", scope)
            each = ", ".join([*map(e.ident, sources), *map(e.ident, ranked)])
            lists = [*parts_names, *ranked.values()]
            rows = f"zip({', '.join(lists)})" if len(lists) > 1 else lists[0]
            body += [(f"    {summed} = []", parts.name), (f"    for {each} in {rows}:", parts.name)]
            body += [("        " + x, m) for m in pre for x in e.stmt(p[m])]
            body.append((f"        {summed}.append({e.ident(parts.args[0])})", parts.name))
        body.append((f"    {e.ident(parts.name)} = _reduce_all({summed}, {parts.attr('op')!r})"
                     + (f" / len({parts_names[0]})" if parts.attr("op") == "avg" else ""), parts.name))
    args: dict[str, str] = {}  # argument at the call -> parameter of the kernel
    for m in compute:
        s = p[m]
        if s.op != "dropout":
            body.extend(("    " + x, m) for x in e.stmt(s))
            continue
        row0 = f"_int64(_c.rows({dim_expr(n)})[0])"
        if row0 not in args:
            args[row0] = e.ident.fresh("row0_k", scope)
        body.append((f"    {e.ident(m)} = _dropout_rows({e.operand(s, s.args[0])}, {e.dropout_args(s)}, {d}, "
                     f"{args[row0]})", m))
    for o, t in inplace.items():
        body.append((f"    {e.operand(p[o], t)}.copy_({e.ident(o)})", o))
    for m, t in (into or {}).items():  # this rank's rows of the gathered state, in place and in every peer's copy
        src = p[m].args[0]
        body.append((f"    {e.operand(p[src], t)}.copy_({e.ident(src)})", m))
        rows, peer = e.ident.fresh(f"{e.ident(t)}_peers", scope), e.ident.fresh("_peer", scope)
        args[peers[m]] = rows
        body += [(f"    for {peer} in {rows}:", m), (f"        {peer}.copy_({e.ident(src)})", m)]
    buffers = buffers or {}
    for o, buf in buffers.items():
        body.append((f"    {_holder_rows(p, o, buf)}.copy_({e.ident(o)})", o))
    slots = slots or {}
    for o, rows in slots.items():
        args[rows] = e.ident.fresh(f"{e.ident(o)}_slot", scope)
        body.append((f"    {args[rows]}.copy_({e.ident(o)})", o))

    defined = {e.ident(m) for m in compute} | ({e.ident(parts.name)} if parts is not None else set())
    results = [m for m in compute if m in needed and m not in buffers and m not in slots]
    doc = f"{len(compute)} statements of {g} on one chunk" + (", state written in place" if inplace or into else "")
    call = _cut_kernel(e, g, "_chunk", doc, body, compute, defined, args, scope, results,
                       lambda dims: _native_chunk(e, compute, inplace, into or {}, peers, buffers, parts, parts_names,
                                                  args, dims, results, pre, sources, ranked, slots),
                       (*parts_names, *ranked.values()) if parts is not None else ())
    return None if call is None else [(f"        {call}", compute[0])]


def _cut_kernel(e: _Emitter, g: Group, prefix: str, doc: str, body: list, compute: list[str], defined: set[str],
                args: dict[str, str], scope: set[str], results: list[str], native, given=()) -> str | None:
    """A kernel whose rows of each value are cut at the call (``_c.cut``, ``_c.local``: the rank's or the chunk's
    position stays out of the compiled code) as a module-level function, Inductor's, or C where ``native(dims)``
    gives its kinds and source (see _native_chunk). ``args``: argument at the call -> parameter, for those the
    body names already; the cut rows, then ``given`` (names passed as they are), then the values it reads join
    it. The call, or None where the body needs ``_c`` itself."""
    p = e.p

    def param(match: re.Match) -> str:
        expr = match.group(0)
        if expr not in args:
            args[expr] = e.ident.fresh(f"{match.group(1)}_k", scope)
        return args[expr]

    body = [(_CUT.sub(param, x), m) for x, m in body]
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
    raw += [n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
            and n.id in ir and n.id not in defined | stored]
    for name in dict.fromkeys(raw):
        if name in used:
            args.setdefault(name, name)
    dims = [f"d_{x}" for x in p.dims if f"d_{x}" in used]
    if results:
        body.append((f"    return {_tuple_text(map(e.ident, results))}",
                     compute[-1]))
    fname = f"{prefix}{len([x for x in e.toplevel if x[0].startswith('def ')])}"
    params = dims + list(args.values())
    e.toplevel += [(f"def {fname}({', '.join(params)}):", g.members[0]), (f'    """{doc}."""', g.members[0])]
    e.toplevel += body + [("", None), ("", None)]
    built = native(dims)
    if built is None:
        e.toplevel += [(f"{fname} = _kernel({fname})", g.members[0]), ("", None)]
    else:
        kinds, source, sums = built
        e.toplevel += [(f"{fname} = _native(_kernel({fname}), {kinds!r}, r\"\"\"", g.members[0])]
        e.toplevel += [(x, g.members[0]) for x in source.rstrip("\n").split("\n")]
        e.toplevel += [(f'""", sums={sums})' if sums else '""")', g.members[0]), ("", None)]
    ints = {e.ident(a) for m in compute for a in p[m].args if p[a].op == "scalar" and p[a].type.dtype == "int64"}
    call_args = dims + [f"_int64({a})" if a in ints else a for a in args]
    call = f"{fname}({', '.join(call_args)})"
    if results:
        call = f"{_tuple_text(map(e.ident, results))} = {call}"
    return call


def _native_chunk(e: _Emitter, compute: list[str], inplace: dict[str, str], into, peers, buffers,
                  parts: Stmt | None, parts_names: tuple[str, ...], args: dict[str, str], dims: list[str],
                  results: list[str], pre: tuple[str, ...] = (), sources: tuple[str, ...] = (),
                  ranked=None, slots=None) -> tuple[str, str, int] | None:
    """The chunk kernel as C (coconet.kernels.native): its parameters' kinds, its source and how many partial
    sums it returns. Only where it stores a gathered state's rows into the peers' copies (shm), where its
    streamed stores save the read of every line an ordinary store makes first, or a gathered value into this
    rank's slot (``slots``). None where a statement has no
    translation or it returns anything but partial sums (Inductor's kernel serves alone)."""
    p = e.p
    slots = slots or {}
    if e.backend != "shm" or not (into or slots) or any(p[r].op != "partial_sum" for r in results):
        return None
    by_ident = {e.ident(s.name): s for s in p.stmts}
    slot_params = {args[rows]: o for o, rows in slots.items()}
    kinds: list[tuple[str, str]] = [(d, "dim") for d in dims]
    constants: list[tuple[str, float]] = []
    host: set[str] = set()
    peer_params = {args[peers[m]]: p[m].type.dtype for m in into}
    holders = {buf: p[o] for o, buf in (buffers or {}).items()}  # the buffer a sliced output is written into

    def of(dtype, kind: str) -> str:  # the kind of rows of a half-precision dtype (bf16 rows, f16 peers, …)
        return f"{HALF[dtype]} {kind}" if dtype in HALF else kind

    # the shape of what the chunk computes: an (m, 1) or (1, w) float32 operand of (m, w) statements is a
    # factor broadcast to its rows (Adafactor's r and c), read a row at a time
    shape = next((p[p[m].args[0]].type.shape for m in into), None) or next(
        (p[m].type.shape for m in compute if p[m].op != "partial_sum" and p[m].type is not None), None)

    def rows_or_factor(t) -> str:
        if shape is not None and len(shape) == 2 and t.shape != shape and (t.dtype or "float32") == "float32":
            if t.shape == (shape[0], Dim.const(1)):
                return "row factor"
            if t.shape == (Dim.const(1), shape[1]):
                return "column factor"
        return of(t.dtype, "rows")

    for expr, param in args.items():
        cut = _CUT.fullmatch(expr)
        if param in peer_params:
            kind = of(peer_params[param], "peers")
        elif param in parts_names:
            kind = of(p[sources[parts_names.index(param)]].type.dtype if pre else parts.type.dtype, "parts")
        elif param in (ranked or {}).values():
            kind = "rank numbers"
        elif param in slot_params:
            kind = of(p[slot_params[param]].type.dtype, "rows")
        elif cut:  # rows of a tensor, or of a holder (its dtype the output's)
            tensor = by_ident.get(cut.group(1)) or holders.get(cut.group(1))
            kind = rows_or_factor(tensor.type) if tensor is not None else "rows"
        elif expr in by_ident and by_ident[expr].type is not None and by_ident[expr].type.dtype != "int64":
            kind = "scalar" if by_ident[expr].type.shape == () else rows_or_factor(by_ident[expr].type)
            if kind == "scalar" and by_ident[expr].op == "const":
                constants.append((param, by_ident[expr].attr("value")))
            if kind == "scalar" and e.number(by_ident[expr].name):
                host.add(param)
        else:
            return None  # dropout's first row, an int scalar
        kinds.append((param, kind))

    def name_of(text: str) -> str | None:
        text = _CUT.sub(lambda m: args.get(m.group(0), "?"), text)
        return text if text.isidentifier() else None

    factors = {param for param, kind in kinds if kind in FACTORS}
    stmts, sums, pre_stmts = [], [], []
    if pre and any(p[x].type.dtype != "float32" and p[x].type.dtype not in HALF for x in sources):
        return None
    for m in (*pre, *compute):
        s = p[m]
        if s.op in ROWWISE_OPS:
            return None  # C computes a chunk of flat elements: a row's reduction is Inductor's
        dtype = ("bool" if s.op in COMPARE
                 else s.attr("dtype") if s.op == "cast" and s.attr("dtype") in HALF else "float32")
        # arithmetic kept in a half dtype is Inductor's: torch's kernels round every op to it, which C can do
        # but at a cost that outweighs what it saves (benchmarks/results/interleaved_adam_bf16_rounded_w*.json)
        if s.type is None or (s.type.dtype or "float32") != dtype or s.op == "dropout":
            return None
        operands = [name_of(e.operand(s, a)) for a in s.args]
        if factors and (s.type.shape if s.op != "partial_sum" else p[s.args[0]].type.shape) != shape:
            return None  # beside factors, every value of the chunk is one of its rows' (a sum of a factor is not)
        if None in operands or (s.op != "partial_sum" and any(
                p[a].type.shape not in ((), s.type.shape) and not (s.type.shape == shape and x in factors)
                for a, x in zip(s.args, operands))):
            return None  # C reads an operand row for row, a factor a row at a time: another broadcast is Inductor's
        if s.op == "partial_sum":
            if m in results:
                sums.append((e.ident(m), operands[0]))
            continue
        (pre_stmts if m in pre else stmts).append(
            (e.ident(m), s.op, tuple(operands), s.attr("dtype") if s.op == "cast" else s.attr("value")))
    writes = [(name_of(e.operand(p[o], t)), e.ident(o)) for o, t in inplace.items()]
    writes += [(name_of(e.operand(p[p[m].args[0]], t)), e.ident(p[m].args[0])) for m, t in into.items()]
    writes += [(name_of(_holder_rows(p, o, buf)), e.ident(o)) for o, buf in (buffers or {}).items()]
    writes += [(param, e.ident(o)) for param, o in slot_params.items()]
    streams = [(args[peers[m]], e.ident(p[m].args[0])) for m in into]
    if any(t is None for t, _ in writes):
        return None
    spec = ChunkKernel(
        params=tuple(kinds),
        parts=(e.ident(parts.name), parts_names[0], parts.attr("op")) if parts is not None else None,
        stmts=tuple(stmts), numbers=frozenset(e.ident(m) for m in compute if e.number(m)),
        writes=tuple(writes), streams=tuple(streams), sums=tuple(sums), constants=tuple(constants),
        host=frozenset(host),
        pre=tuple(pre_stmts), part=e.ident(sources[0]) if pre else None,
        also=tuple(zip(map(e.ident, sources[1:]), parts_names[1:])) if pre else (),
        ranked=tuple((e.ident(x), param) for x, param in (ranked or {}).items()))
    try:
        return spec.kinds, c_source(spec), len(sums)
    except Untranslatable:
        return None


def _lower_overlap(e: _Emitter, g: Group, chunks: int) -> list[str]:
    p = e.p
    mm, coll = p[g.members[0]], p[g.members[1]]
    if mm.op in CONVS:
        return _lower_conv_overlap(e, mm, coll, chunks)
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


def _lower_conv_overlap(e: _Emitter, conv: Stmt, coll: Stmt, chunks: int) -> list[str]:
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


def _lower_bucket(e: _Emitter, g: Group, cap: int) -> list[str]:
    """One launch per ``cap`` bytes for the bucket's collectives: NCCL groups them with no copy, gloo runs
    its coalesced form, which flattens them in C++."""
    p = e.p
    first = p[g.members[0]]
    names = ", ".join(e.ident(m) for m in g.members)
    srcs = "[" + ", ".join(e.operand(p[m], p[m].args[0]) for m in g.members) + "]"
    lines = [f"# bucket({', '.join(g.members)}): at most {cap} bytes per launch"]
    if first.op == "allreduce":
        keep = [needs_copy(p, m) for m in g.members]
        return lines + [f"[{names}] = _bucket_allreduce(_c, {srcs}, {first.attr('op')!r}, {cap}, {keep})"]
    if first.op == "reduce_scatter":
        dims = [p[m].type.layout.dim for m in g.members]
        ns = [dim_expr(p[m].type.shape[d]) for m, d in zip(g.members, dims)]
        return lines + [f"{names} = _bucket_reduce_scatter(_c, {srcs}, {dims}, [{', '.join(ns)}], "
                        f"{first.attr('op')!r}, {cap})"]
    dims = [p[p[m].args[0]].type.layout.dim for m in g.members]
    ns = [dim_expr(p[p[m].args[0]].type.shape[d]) for m, d in zip(g.members, dims)]
    return lines + [f"{names} = _bucket_all_gather(_c, {srcs}, {dims}, [{', '.join(ns)}], {cap})"]


SHM_DOC = "the shm backend (collectives in shared memory; a gloo group bootstraps it and carries send/recv)"


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
    gathers = max([sum(p[m].op == "all_gather" and m not in slotless for m in g.members) for g in p.groups
                   if g.kind == "fused_collective"], default=0)
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


def _module(schedule: Schedule, backend: str, e: _Emitter, body, updates: list[str]):
    p = e.p
    layout_doc = ", ".join(f"{s.name}: {s.type.layout}" for s in p.inputs)
    target = SHM_DOC if backend == "shm" else f"torch.distributed ({backend})"
    header = [
        '"""Generated by coconet ' + __version__ + " for " + target + ".",
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
        *(["The group's ranks must share this node's memory: its first step maps their segments",
           "of /dev/shm (the files are gone once mapped). Its large copies compile a few lines of C",
           "with the system's C compiler when there is one.",
           *(["So does a chunk kernel given in C (_native): without a compiler, Inductor's runs."]
             if any(x.startswith("_chunk") and "= _native(" in x for x, _ in e.toplevel) else [])]
          if backend == "shm" else []),
        *(["Dropout is torch's own (F.dropout): its masks are not coconet's counter-based ones."]
          if e.dropout == "torch" and any(s.op == "dropout" for s in p.stmts) else []),
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
    device = "torch.device('cuda', torch.cuda.current_device())" if backend == "nccl" else "torch.device('cpu')"
    lines: list[tuple[str, str | None]] = [(x, None) for x in [
        "",
        "def step(tensors, scalars, *, group=None, stage=0, stages=1, sizes=None, custom_ops=None):",
        f"    _c = _Ctx(group, {device})",
        "    _custom = custom_ops or {}",
        "    _outputs, _sent = {}, {}",
    ]]
    rest = [("    " + x, None) for x in _shm_segments(p, e.slotless, e.packed)] if backend == "shm" else []
    rest += [("    " + x, m) for k in e.kernels for x, m in [("", None)] + k + [("", None)]]
    rest += [("    " + x, m) for x, m in body]
    used = _names(textwrap.dedent("\n".join(x for x, _ in rest)).split("\n"))
    # a dim the step never reads needs no binding (kernels are nested: they read the dims too)
    lines += [("    " + x, None) for x in _dims_prologue(p) if x.split(" ")[0] in used]
    lines += rest
    lines += [("    " + x, t) for x, t in updates]
    lines.append(('    return {"outputs": _outputs, "sent": _sent}', None))
    lines = e.toplevel + lines
    code = "\n".join(x.rstrip() for x, _ in lines) + "\n"
    # the runtime's names the code calls, imported (coconet.kernels)
    at = header.index("RUNTIME")
    head = header[:at] + "\n".join(runtime.imports(code, backend)).split("\n") + header[at + 1:]
    line_map = {len(head) + i + 1: m for i, (_, m) in enumerate(lines) if m is not None}
    return "\n".join(head) + "\n" + code, line_map
