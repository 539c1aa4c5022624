"""The code of one statement: its value as a torch expression on this rank's piece (or a chunk's rows) of its
operands, by op (``Emitter.stmt``; the collectives in ``Emitter.collective``). The units' renderers
(``render_fuse``, ``render_collective``, ``render_units``) call it for their members.
"""

from __future__ import annotations

from coconet.codegen.analysis import OUT, row_dim
from coconet.codegen.names import BINARY, TORCH_DTYPE, UNARY, Names, dim_expr, paren
from coconet.codegen.plan import LoweringPlan
from coconet.codegen.rowwise import normalize_text, reduce_text
from coconet.errors import BackendError
from coconet.schedules.ir import CONVS, VIEWS, Program, Stmt
from coconet.schedules.types import Replicated, Sliced

# what ``Emitter.collective`` renders: the runtime's collectives and the pipeline's transfers
COLLECTIVES = frozenset({"allreduce", "reduce_scatter", "all_gather", "broadcast", "send", "recv"})


class Emitter:
    """Renders a lowering plan: the code of its statements and units. The plan decides; the emitter keeps only
    what rendering produces (the kernels' text, the names it makes up)."""

    def __init__(self, plan: LoweringPlan, dropout: str = "counter"):
        self.plan = plan
        self.s = plan.schedule
        self.dropout = dropout
        self.p: Program = plan.program
        self.backend = plan.backend
        self.compile = plan.compiled
        self.ident = Names(self.p)
        # coconet's GEMM with its compiled kernels; the eager form (the eager baseline too) is plain torch
        self.matmul = "_matmul" if self.compile else "torch.matmul"
        self.kernels: list[list[tuple[str, str]]] = []  # nested in step: they read its dims
        self.toplevel: list[tuple[str, str | None]] = []  # fused pointwise kernels, at module level
        self.chunked: set[str] | None = None  # members of the chunked unit being emitted
        self.packed: list[tuple[str, ...]] = []  # inputs a chunk kernel sums from one slot (_shm_segments)
        self.rows_only = plan.rows_only
        self.rowwise = plan.chunk_rows
        # state another is updated to (a swap, a moment kept from the step before) is copied as the step begins,
        # before a kernel may write it, into a name of its own: the state's name stays the caller's tensor
        self.aliased = {v: self.ident.fresh(f"_{self.ident(v)}_before", set()) for v in plan.aliased}

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
        while s.op in VIEWS:
            s = self.p[s.args[0]]
        return f"{text}.clone()" if s.op == "input" and s.name in self.p.updates else text

    def into(self, s: Stmt, out: str) -> str:
        """Pointwise statement ``s`` computed into the tensor ``out`` (an op of ``OUT``). A number stays one where
        torch takes it (as the operator the statement is written with otherwise passes it)."""
        if s.op == "div" and self.number(s.args[0]):
            # ``c / x`` is x's reciprocal times c in torch (Tensor.__rtruediv__), at times an ulp from the quotient
            # that ``torch.div(c, x)`` gives: the bits of the same statement computed into a new tensor
            return (
                f"torch.mul(torch.reciprocal({self.operand(s, s.args[1])}, out={out}), "
                f"{self.operand(s, s.args[0])}, out={out})"
            )
        wrap = s.op in ("maximum", "minimum", "where")  # tensors only
        args = [
            self.tensor(a, self.operand(s, a)) if k == 0 or wrap else self.operand(s, a) for k, a in enumerate(s.args)
        ]
        return f"{OUT[s.op]}({', '.join(args)}, out={out})"

    def stmt(self, s: Stmt) -> list[str]:
        n, op = self.ident(s.name), s.op
        args = [self.operand(s, a) for a in s.args]
        names = [self.ident(a) for a in s.args]  # the operands as they lie
        if s.name in self.plan.held and s.name not in self.p.group_of:
            dtype = TORCH_DTYPE[s.type.dtype or "float32"]
            return [f"{n} = {self.into(s, f'_c.shm.held({s.name!r}, {self.local_shape_expr(s.type)}, {dtype})')}"]
        if op in COLLECTIVES:
            return self.collective(s, n, args)
        if op == "input":
            return [f"{n} = tensors[{s.name!r}]"] + (
                [f"{self.aliased[s.name]} = {n}.clone()"] if s.name in self.aliased else []
            )
        if op == "scalar":
            if s.type.dtype == "int64":
                return [f"{n} = int(scalars[{s.name!r}])"]
            # on the host whatever the backend: CUDA ops and compiled kernels take a 0-d CPU tensor as a plain
            # argument, where a 0-d CUDA tensor costs a host-to-device copy per step and every statement of
            # scalars alone a kernel launch (an H100's Adam step at N=2^24 spent 230 us of 840 on both)
            return [f"{n} = torch.tensor(float(scalars[{s.name!r}]), dtype={TORCH_DTYPE[s.type.dtype]})"]
        if op == "const":
            return [f"{n} = {s.attr('value')!r}"]
        if op in BINARY:
            return [f"{n} = {BINARY[op].format(*args)}"]
        if op in UNARY:
            return [f"{n} = {UNARY[op].format(self.tensor(s.args[0], args[0]) if op != 'neg' else paren(args[0]))}"]
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
            # a Replicated operand as it lies: no layout rule multiplies a cut of one (S(M)×R reads b whole,
            # R×S(N) a whole), where a pointwise operand's cut would take b's rows when K is M's extent
            mm = [x if isinstance(self.p[a].type.layout, Replicated) else y for a, x, y in zip(s.args, names, args)]
            return [f"{n} = {self.matmul}({mm[0]}, {mm[1]})"]
        if op == "tensordot":
            dims = tuple(list(d) for d in s.attr("dims"))
            return [f"{n} = torch.tensordot({names[0]}, {names[1]}, dims={dims})"]
        if op == "transpose":
            return [f"{n} = {names[0]}.transpose({s.attr('dim0')}, {s.attr('dim1')})"]
        if op in CONVS:
            # the operands as they lie: a batch, channel or whole piece is what the layout rule convolves (a
            # Replicated weight is never cut to a Sliced result's rows, as a pointwise operand is)
            return [f"{n} = {conv_call(s, *map(self.ident, s.args))}"]
        if op == "slice":
            return [f"{n} = {args[0]}"]  # the operand, cut to this rank's rows (or the chunk's)
        if op == "output":
            return [f"_outputs[{s.attr('name')!r}] = {self.kept(s.args[0], self.tensor(s.args[0], args[0]))}"]
        if op == "update":
            return []  # written at the end: every statement reads the state from before the step
        custom = self.p.custom_ops.get(op)
        if custom is not None:
            if custom.torch is None:
                raise BackendError(
                    f"custom op {op} has no torch implementation (custom_op(..., torch=fn))", kind="compile_error"
                )
            attrs = "".join(f", {k}={v!r}" for k, v in s.attrs)
            return [f"{n} = _custom[{op!r}]({', '.join(args)}{attrs})"]
        raise BackendError(f"the torch backend cannot lower {op} ({s.name})", kind="compile_error")

    def collective(self, s: Stmt, n: str, args: list[str]) -> list[str]:
        """A collective or a point-to-point transfer of ``s``, bound to ``n``, its operands ``args``."""
        op = s.op
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
        if op == "allreduce":
            if s.name in self.plan.copies:
                return [f"{n} = _allreduced(_c, {args[0]}, {s.attr('op')!r})"]
            return [f"{n} = {args[0]}", f"_allreduce(_c, {n}, {s.attr('op')!r})"]
        if op == "reduce_scatter":
            d = s.type.layout.dim
            return [f"{n} = _reduce_scatter(_c, {args[0]}, {d}, {dim_expr(s.type.shape[d])}, {s.attr('op')!r})"]
        if op == "all_gather":
            t = self.p[s.args[0]].type
            d = t.layout.dim
            state = self.plan.into_state.get(s.name)
            if s.name in self.plan.fused_gathers:
                return []  # the kernel that computes its rows writes them into every copy of the state
            if state is not None:
                return [f"_gather_into(_c, {args[0]}, {d}, {dim_expr(t.shape[d])}, {self.ident(state)}, {state!r})"]
            return [f"{n} = _all_gather(_c, {args[0]}, {d}, {dim_expr(t.shape[d])})"]
        if op == "broadcast":
            return [f"{n} = _broadcast(_c, {args[0]}.clone(), {s.attr('root')})"]
        if op == "send":
            return [
                f"_sent[{s.attr('tag')!r}] = {self.kept(s.args[0], args[0])}",
                "if stage + 1 < stages:",
                f"    dist.send({args[0]}.contiguous(), dst=_c.global_rank + _c.world)",
            ]
        raise BackendError(f"the torch backend cannot lower {op} ({s.name})", kind="compile_error")


def conv_call(s: Stmt, x: str, w: str) -> str:
    """The runtime's convolution of ``x`` by ``w`` with the statement's stride, padding, dilation and groups."""
    return f"_conv({x}, {w}, {s.attr('stride')}, {s.attr('padding')}, {s.attr('dilation')}, {s.attr('groups')})"
