"""The names of generated code: whatever a program calls its tensors, scalars, statements and dims, each
program name is one Python identifier of its own in the module, apart from every name the lowering makes up
or the module reads (``torch``, ``_c``, ``d_N``, a chunk kernel's ``m_k``, ``int``, …)."""

import ast
import difflib
import re
import symtable

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from coconet import Local, Program, Replicated, Sliced, all_gather, allreduce, dropout, matmul, reduce_scatter, sqrt
from coconet.codegen import lower as lowering
from coconet.codegen.lower import KERNELS, RESERVED, lower
from coconet.codegen.names import module_names
from coconet.errors import BackendError
from coconet.schedules.schedule import Schedule
from coconet.schedules.space import generate
from coconet.tuner.launch import run_schedules
from tests.tuner.test_launch import EXAMPLES, assert_all_ok, check_only
from tests.tuner.test_launch import example as example_program

# names that are legal in a program and mean something in generated code, or look like what the lowering
# derives from a name (v_<reserved>, <name>_k, _<name>, <name>_parts, d_<dim>); and plain ones
POOL = [
    "torch",
    "v_torch",
    "v_torch_1",
    "class",
    "v_class",
    "lambda",
    "None",
    "m_k",
    "w_k",
    "x_k",
    "g_k",
    "row0_k",
    "d_N",
    "v_d_N",
    "N",
    "step",
    "tensors",
    "scalars",
    "sizes",
    "group",
    "stage",
    "stages",
    "custom_ops",
    "dist",
    "math",
    "os",
    "philox_words",
    "_x",
    "v__x",
    "_matmul",
    "v__matmul",
    "_dropout",
    "_Gather",
    "_c",
    "c",
    "_t",
    "t",
    "rank",
    "custom",
    "outputs",
    "Gather",
    "chunk0",
    "fuse0",
    "fused_collective0",
    "int",
    "float",
    "len",
    "max",
    "rank_parts",
    "parts",
    "k",
    "w",
    "m",
    "v",
    "g",
    "x",
]
DIM_POOL = ["N", "torch", "d_N", "_x", "step", "sizes", "x", "m_k", "w", "int", "H"]


def adamw(n, d):
    p = Program("adamw", dims=(d[0],))
    N = d[0]
    g = p.tensor(n[0], (N,), layout=Local)
    w, m, v = (p.tensor(n[i], (N,), layout=Replicated) for i in (1, 2, 3))
    lr, beta1, beta2, eps, wd, t = (p.scalar(n[i]) for i in range(4, 10))
    avg = allreduce(g).named(n[10])
    m1 = (beta1 * m + (1 - beta1) * avg).named(n[11])
    v1 = (beta2 * v + (1 - beta2) * avg * avg).named(n[12])
    u = (m1 / (1 - beta1**t) / (sqrt(v1 / (1 - beta2**t)) + eps)).named(n[13])
    p.update(m, m1)
    p.update(v, v1)
    p.update(w, (w - lr * (u + wd * w)).named(n[14]))
    return p.ir


def mlp(n, d):
    B, S, H = d[:3]
    p = Program("mlp", dims=(B, S, H))
    x = p.tensor(n[0], (B, S, f"4*{H}"), layout=Sliced(-1))
    w = p.tensor(n[1], (f"4*{H}", H), layout=Sliced(0))
    b = p.tensor(n[2], (H,), layout=Replicated)
    r = p.tensor(n[3], (B, S, H), layout=Replicated)
    seed = p.scalar(n[4], dtype="int64")
    y = allreduce(matmul(x, w).named(n[5])).named(n[6])
    out = (dropout((y + b).named(n[7]), 0.1, seed).named(n[8]) + r).named(n[9])
    p.output(n[10], out)
    return p.ir


def zero(n, d):
    """A sharded update written out: the reduce_scatter, the slice's update and the all_gather named."""
    N = d[0]
    p = Program("zero", dims=(N,))
    g = p.tensor(n[0], (N,), layout=Local)
    w = p.tensor(n[1], (N,), layout=Replicated)
    lr, mu = p.scalar(n[2]), p.scalar(n[3])
    rs = reduce_scatter(g).named(n[4])
    u = (lr * rs).named(n[5])
    v = (mu * u + rs).named(n[6])
    gathered = all_gather(v).named(n[7])
    p.update(w, (w - gathered).named(n[8]))
    p.output(n[9], u)  # a slice the step returns, as well as gathers
    return p.ir


TEMPLATES = {"adamw": (adamw, 15, 1), "mlp": (mlp, 11, 3), "zero": (zero, 10, 1)}


def canonical(template):
    """The template with plain names that mean nothing else anywhere."""
    _, stmts, dims = TEMPLATES[template]
    return [f"zq{i}" for i in range(stmts)], [f"ZD{i}" for i in range(dims)]


KERNEL_NAME = re.compile(r"_(fuse|chunk)\d+\Z")


def _ours(node) -> bool:
    """The step and its kernels: what the lowering writes, not what the module imports of the runtime."""
    if isinstance(node, ast.FunctionDef):
        return node.name == "step" or bool(KERNEL_NAME.match(node.name))
    return isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Name) and KERNEL_NAME.match(t.id) for t in node.targets
    )


def alpha(source: str) -> str:
    """The step and its kernels with every identifier numbered by where it first appears, and strings blanked
    (names of inputs, docstrings): two modules alike under this differ only in what they call things, one for
    one. A program name given to two things, or to something the module means otherwise (``torch``,
    ``int``), shows as one number where the other module has two."""
    body = [n for n in ast.parse(source).body if _ours(n)]
    order: dict[str, int] = {}

    def number(node):
        if isinstance(node, ast.Delete):
            return  # in the order of the names' spellings; everything deleted was bound first
        for name in (
            [node.id]
            if isinstance(node, ast.Name)
            else [node.arg]
            if isinstance(node, ast.arg)
            else [node.name]
            if isinstance(node, ast.FunctionDef)
            else []
        ):
            order.setdefault(name, len(order))
        for child in ast.iter_child_nodes(node):
            number(child)

    for node in body:
        number(node)

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node):
            return ast.copy_location(ast.Name(f"n{order[node.id]}", node.ctx), node)

        def visit_arg(self, node):
            node.arg = f"n{order[node.arg]}"
            return node

        def visit_FunctionDef(self, node):
            node.name = f"n{order[node.name]}"
            return self.generic_visit(node)

        def visit_Constant(self, node):
            return ast.Constant("") if isinstance(node.value, str) else node

        def visit_Delete(self, node):
            node = self.generic_visit(node)
            node.targets.sort(key=lambda t: int(t.id[1:]))
            return node

    return ast.unparse(Rename().visit(ast.Module(body=body, type_ignores=[])))


def translate(text: str, names: dict[str, str]) -> str:
    return re.sub(r"\b\w+\b", lambda m: names.get(m.group(0), m.group(0)), text)


def check_names(template, names, dims, pick):
    build, _, _ = TEMPLATES[template]
    prog = build(names, dims)
    plain_names, plain_dims = canonical(template)
    plain = build(plain_names, plain_dims)
    to_plain = dict(zip(names, plain_names))
    scheds = list(generate(prog))
    for sched in [scheds[k] for k in sorted({k % len(scheds) for k in pick} or {0})]:
        twin = Schedule.parse(translate(sched.text, to_plain), plain)
        for backend in ("gloo", "shm"):
            for kernels in KERNELS:
                gen = lower(sched, backend, kernels)
                compile(gen.source, "<test>", "exec")
                want, got = alpha(lower(twin, backend, kernels).source), alpha(gen.source)
                if got != want:
                    diff = "\n".join(list(difflib.unified_diff(want.split("\n"), got.split("\n"), lineterm=""))[:40])
                    pytest.fail(f"{sched.text} on {backend}, {kernels} kernels: names {names}, dims {dims}\n{diff}")


@st.composite
def named(draw):
    template = draw(st.sampled_from(sorted(TEMPLATES)))
    _, stmts, dims = TEMPLATES[template]
    names = draw(st.permutations(POOL))[:stmts]
    return template, names, draw(st.permutations(DIM_POOL))[:dims], draw(st.sets(st.integers(0, 15), max_size=3))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(named())
# a Local tensor torch beside a Replicated v_torch: both were v_torch (the eager baseline read the wrong one)
# (template, names of its statements, of its dims, which of its schedules: 0 the baseline, 11 its fused collective)
@example(("adamw", ["torch", "v_torch"] + [f"n{i}" for i in range(13)], ["N"], {0, 2, 11, 15}))
@example(
    (
        "adamw",
        ["g", "w", "w_k", "m_k", "lr", "int", "b2", "eps", "wd", "t", "avg", "m1", "v1", "u", "w1"],
        ["d_N"],
        {8, 11, 13},
    )
)
@example(("zero", ["c", "_t", "lr", "rank", "Gather", "t", "custom", "chunk0", "rank_parts", "o"], ["N"], {3, 6, 8}))
@example(
    (
        "mlp",
        ["class", "v_class", "_dropout", "float", "max", "x_k", "_matmul", "len", "None", "g_k", "o"],
        ["N", "d_N", "x_k"],
        {0, 3, 6, 9, 12},
    )
)
def test_any_names_lower_to_the_code_plain_names_do(case):
    """Every schedule on gloo and shm, compiled and eager kernels: the module compiles, and it is the module
    the same program with plain names lowers to, up to a one-to-one renaming."""
    template, names, dims, pick = case
    check_names(template, names, dims, pick)


def _scopes(table):
    yield table
    for child in table.get_children():
        yield from _scopes(child)


@pytest.mark.parametrize("name", EXAMPLES)
def test_what_generated_code_reads_from_the_module_or_builtins_no_program_name_can_be(name):
    """A program name is renamed when it is a module-level name of some generated module or in RESERVED: so
    every name that a step or kernel reads from outside it must be one of those, or start with ``_``."""
    prog = example_program(name)
    allowed = RESERVED | module_names()
    for sched in list(generate(prog))[::3]:
        for backend in ("gloo", "shm"):
            source = lower(sched, backend).source
            top = symtable.symtable(source, "<test>", "exec")
            ours = {n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and _ours(n)}
            for fn in top.get_children():
                if fn.get_name() not in ours:
                    continue
                for scope in _scopes(fn):
                    read = {s.get_name() for s in scope.get_symbols() if s.is_global() and s.is_referenced()}
                    stray = {x for x in read if not x.startswith("_") and x not in allowed}
                    assert not stray, (sched.text, backend, scope.get_name(), stray)


def test_a_module_that_does_not_compile_is_a_compile_error_naming_the_schedule(monkeypatch):
    sched = Schedule.parse("split(ar0)", example_program("adam"))
    monkeypatch.setattr(lowering, "_module", lambda *a, **k: ("def step(x, x):\n    pass\n", {}))
    with pytest.raises(BackendError, match=r"schedule 'split\(ar0\)' does not compile: duplicate argument") as e:
        lower(sched)
    assert e.value.kind == "compile_error"


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_torch_beside_v_torch_runs_correctly(backend):
    """Was: both v_torch in the module, the eager baseline's update read the gradient for the state."""
    prog = adamw(
        ["torch", "v_torch", "w_k", "m_k", "lr", "int", "b2", "eps", "wd", "t", "avg", "m1", "v1", "u", "w1"], ["d_N"]
    )
    scheds = [
        Schedule(prog),
        Schedule.parse(
            "split(avg); reorder(ag0); as_slice(v_torch); as_slice(w_k); as_slice(m_k); fuse_collective(rs0)", prog
        ),
    ]
    assert_all_ok(run_schedules(scheds, check_only(2, {"d_N": 7}, backend=backend)))
