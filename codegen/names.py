"""The names generated code uses: a program's statements as Python identifiers, the torch spellings of dtypes
and pointwise ops, a symbolic size as an expression, and the names a piece of generated code reads or binds.
"""

from __future__ import annotations

import ast
import functools
import keyword
import re
import textwrap

from coconet.codegen import runtime
from coconet.schedules.dims import Dim
from coconet.schedules.ir import Program

TORCH_DTYPE = {
    "float16": "torch.float16",
    "bfloat16": "torch.bfloat16",
    "float32": "torch.float32",
    "float64": "torch.float64",
    "int64": "torch.int64",
    "bool": "torch.bool",
}


BINARY = {
    "add": "{} + {}",
    "sub": "{} - {}",
    "mul": "{} * {}",
    "div": "{} / {}",
    "pow": "{} ** {}",
    "lt": "{} < {}",
    "le": "{} <= {}",
    "gt": "{} > {}",
    "ge": "{} >= {}",
    "eq": "{} == {}",
    "ne": "{} != {}",
    "maximum": "torch.maximum(_t({}), _t({}))",
    "minimum": "torch.minimum(_t({}), _t({}))",
}


UNARY = {
    "neg": "-{}",
    "sqrt": "torch.sqrt({})",
    "rsqrt": "torch.rsqrt({})",
    "exp": "torch.exp({})",
    "log": "torch.log({})",
    "abs": "torch.abs({})",
}


# what the step and its kernels read besides the program's values and coconet's own ``_`` names: the
# module's imports and step, step's parameters, the builtins the lowering calls
RESERVED = frozenset(
    {
        "torch",
        "dist",
        "math",
        "step",
        "tensors",
        "scalars",
        "group",
        "stage",
        "stages",
        "sizes",
        "custom_ops",
        "int",
        "float",
        "len",
        "max",
    }
)


# the names generated code binds in step and its kernels besides those of the program (the module's
# functions come from module_names): a derived name that the lowering makes up (``_<name>``) avoids them
LOCALS = frozenset(
    {
        "_c",
        "_custom",
        "_outputs",
        "_sent",
        "_rank",
        "_a",
        "_ak",
        "_yk",
        "_parts",
        "_works",
        "_w",
        "_pending",
        "_bk",
        "_finish",
        "_t",
    }
)


@functools.cache
def module_names() -> frozenset[str]:
    """The names a generated module binds at its top level, whatever its backend and program: torch, dist,
    ``_t``, ``step`` and what it may import of the runtime (``coconet.codegen.runtime``)."""
    return frozenset({"torch", "dist", "_t", "step"}) | runtime.names()


class Names:
    """The Python identifiers of a program's statements, one to one: a statement's own name where it can
    mean nothing else in the module, else ``v_<name>`` (``v_<name>_1``, … where the program has that name
    too). A dim is ``d_<dim>``, which no statement's identifier starts with, nor anything coconet names."""

    def __init__(self, p: Program):
        names = [s.name for s in p.stmts]
        kernels = {f"_{kind}{i}" for kind in ("fuse", "chunk", "fused_collective") for i in range(len(p.groups) + 1)}
        # a statement keeps its name unless it could be (or be mistaken for) a name the lowering makes up:
        # those all start with _ or d_, or are reserved
        plain = [
            n
            for n in names
            if not (keyword.iskeyword(n) or n in RESERVED or n in module_names() or n.startswith(("_", "d_")))
        ]
        self.taken = set(plain) | RESERVED | module_names() | LOCALS | kernels | {f"d_{d}" for d in p.dims}
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


def tuple_text(names) -> str:
    """Names as the targets or value of a tuple in Python text: ``a, b``, and ``a,`` for one."""
    names = list(names)
    return ", ".join(names) + ("," if len(names) == 1 else "")


def paren(x: str) -> str:
    return x if x.isidentifier() else f"({x})"


def names_in(lines) -> set[str]:
    """The names a piece of generated code mentions (not attributes, strings or comments)."""
    return {n.id for n in ast.walk(ast.parse("\n".join(lines))) if isinstance(n, ast.Name)}


def free_names(lines) -> set[str]:
    """The names a function nested in ``step`` reads from it: what it loads and neither takes nor binds."""
    fn = ast.parse(textwrap.dedent("\n".join(lines))).body[0]
    assert isinstance(fn, ast.FunctionDef)
    params = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
    names = [n for n in ast.walk(fn) if isinstance(n, ast.Name)]
    bound = {n.id for n in names if not isinstance(n.ctx, ast.Load)}
    return {n.id for n in names if isinstance(n.ctx, ast.Load)} - params - bound


CUT = re.compile(r"_c\.(?:local|cut)\((\w+), [^()]*\)")


def holder_rows(p: Program, o: str, holder: str) -> str:
    """The chunk's rows of ``holder``, the tensor of this rank's rows a compiled chunk kernel writes the sliced
    output ``o`` into: where the kernel writes them, and what a gather of ``o`` sends."""
    return f"_c.local({holder}, {p[o].type.layout.dim})"
