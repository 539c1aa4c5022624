"""The generated code and the cost model take the same decisions: both read one ``LoweringPlan``. For every
schedule of every example and benchmark program, on every backend, the module ``lower`` writes runs the plan's
units in the plan's order with the plan's kernels, collective calls and end-of-step writes, and the cost model
prices exactly those units."""

import ast
import re
from collections import Counter
from pathlib import Path

import pytest

from coconet.codegen.lower import Names, lower
from coconet.codegen.plan import KNOB_DEFAULTS, LoweringPlan
from coconet.errors import BackendError
from coconet.loader import load_file
from coconet.schedules.ir import Group
from coconet.schedules.schedule import Schedule
from coconet.schedules.space import generate
from coconet.schedules.transforms.fuse_collective import FuseCollective
from coconet.tuner import cost

ROOT = Path(__file__).parents[2]
PROGRAMS = sorted(
    str(p.relative_to(ROOT))
    for folder in ("examples", "examples/optim", "benchmarks/programs")
    for p in (ROOT / folder).glob("*.py")
)
BACKENDS = ("gloo", "nccl", "shm")
# what a statement run on its own calls: the runtime's collective, or nothing where it is a view, a binding or
# written at the step's end
CALL = re.compile(r"\b(_allreduced|_allreduce|_reduce_scatter|_all_gather|_gather_into|_broadcast)\(")


def _step(tree: ast.Module) -> ast.FunctionDef:
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "step")


def _defs(nodes) -> list[ast.FunctionDef]:
    return [n for n in nodes if isinstance(n, ast.FunctionDef)]


def _unit_of(plan: LoweringPlan, name: str):
    g = plan.program.group_of.get(name)
    return g if g is not None and g in plan.units else name


def _rendered_units(gen, plan: LoweringPlan) -> list:
    """The units the step's own lines implement, in the order they run (nested kernels and the end's writes
    aside)."""
    tree = ast.parse(gen.source)
    step = _step(tree)
    nested = {ln for f in _defs(step.body) for ln in range(f.lineno, f.end_lineno + 1)}
    ident = Names(plan.program)
    states = {ident(t) for t in plan.program.updates}
    ends = {
        ln
        for st in step.body
        if isinstance(st, ast.Expr) and ast.unparse(st).split(".copy_(")[0] in states
        for ln in range(st.lineno, st.end_lineno + 1)
    }
    out: list = []
    for line, name in sorted(gen.line_map.items()):
        if not step.lineno <= line <= step.end_lineno or line in nested:
            continue
        unit = _unit_of(plan, name)
        if line not in ends and unit in plan.units and (not out or out[-1] != unit):
            out.append(unit)
    return out


def _check_code(s: Schedule, backend: str, plan: LoweringPlan) -> None:
    gen = lower(s, backend)
    p = plan.program
    tree = ast.parse(gen.source)
    step = _step(tree)
    # the units run in the plan's order: each one that renders lines at all
    silent = {u for u in plan.units if not isinstance(u, Group) and (p[u].op == "update" or u in plan.fused_gathers)}
    expected = [u for u in plan.units if u not in silent]
    assert _rendered_units(gen, plan) == expected, s.text
    # one module-level function per fuse kernel, compiled where the plan compiles it
    top = {f.name for f in _defs(tree.body)}
    text = gen.source
    for g, k in plan.fuse_kernels.items():
        (name,) = [
            gen.source.split("\n")[ln - 1].split("(")[0][4:]
            for ln, m in gen.line_map.items()
            if m == g.members[0] and gen.source.split("\n")[ln - 1].startswith("def _fuse")
        ]
        assert (
            name in top
            and (f"{name} = _kernel({name})" in text or f"{name} = _native(_kernel({name})" in text) == k.compiled
        ), (s.text, g)
    # one nested function per fused collective; a chunk kernel exactly where the plan compiles the chunk
    nested = [f.name for f in _defs(step.body)]
    assert Counter(n.rstrip("0123456789") for n in nested) == Counter(
        {"_fused_collective": len(plan.fused_collectives)} if plan.fused_collectives else {}
    )
    chunk_of = {
        m: n
        for n in top
        if n.startswith("_chunk")
        for ln, m in gen.line_map.items()
        if gen.source.split("\n")[ln - 1].startswith(f"def {n}(")
    }
    for g, fc in plan.fused_collectives.items():
        assert (g.members[0] in chunk_of) == fc.compiles, (s.text, g)
    # the collectives the step calls itself: those of its statements run on their own and its overlaps'
    calls = Counter()
    for u in plan.units:
        if isinstance(u, Group) and u.kind == "overlap":  # the matmul's chunks, each one's collective in flight
            calls[f"_{p[u.members[1]].op}"] += 1
        if isinstance(u, Group) or u in silent:
            continue
        op = p[u].op
        if op == "allreduce":
            calls["_allreduced" if u in plan.copies else "_allreduce"] += 1
        elif op == "all_gather":
            calls["_gather_into" if u in plan.into_state else "_all_gather"] += 1
        elif op in ("reduce_scatter", "broadcast"):
            calls[f"_{op}"] += 1
    step_text = "\n".join(ast.unparse(st) for st in step.body if not isinstance(st, ast.FunctionDef))
    assert Counter(CALL.findall(step_text)) == calls, s.text
    # the end of the step: the plan's copies, then what is computed straight into its state
    tail = [ast.unparse(st) for st in step.body[-(len(plan.copied_at_end) + len(plan.at_end) + 1) : -1]]
    ident = Names(p)
    assert [x.split(".copy_(")[0] for x in tail[: len(plan.copied_at_end)]] == [
        ident(t) for t, _ in plan.copied_at_end
    ], s.text
    assert all(f"out={ident(t)})" in x for x, t in zip(tail[len(plan.copied_at_end) :], plan.at_end)), s.text


def _check_cost(s: Schedule, backend: str, plan: LoweringPlan) -> None:
    priced = cost.plan(s, backend)
    p = plan.program
    names = [u.what for u in priced.units if u.what != "updates"]
    # a unit of its own for every group and for every statement that moves bytes, in the plan's order
    assert names == [str(u) for u in plan.units if str(u) in names], s.text
    assert {str(g) for g in p.groups} <= set(names), s.text
    assert not set(names) & {m for ms in (*plan.absorbed.values(), *plan.pre.values()) for m in ms}
    assert not set(names) & set(plan.rows_only) - {str(u) for u in plan.units}
    ends = [k.what for u in priced.units if u.what == "updates" for k in u.kernels]
    assert [w for w in ends if w.startswith("clone ")] == [f"clone {v}" for v in plan.aliased], s.text
    assert sorted(w[: -len(".copy_")] for w in ends if w.endswith(".copy_")) == sorted(
        t for t, _ in plan.copied_at_end
    ), s.text
    assert sorted(w for w in ends if " into " in w) == sorted(f"{v} into {t}" for t, v in plan.at_end.items())
    # an allreduce clones its operand where the plan copies it; a gather into state writes its rows itself
    by_name = {u.what: u for u in priced.units}
    for u in plan.units:
        if isinstance(u, Group) or u not in by_name:
            continue
        kernels = [k.what for k in by_name[u].kernels]
        if p[u].op == "allreduce":
            assert (f"clone {p[u].args[0]}" in kernels) == (u in plan.copies), (s.text, u)
        if p[u].op == "all_gather":
            assert (f"{u} rows" in kernels) == (u in plan.into_state), (s.text, u)
    assert not plan.fused_gathers & set(names), s.text
    # a compiled chunk is one kernel per fused collective; else its statements, each its own
    for g, fc in plan.fused_collectives.items():
        (unit,) = [u for u in priced.units if u.what == str(g)]
        assert any(k.what == f"{g} kernel" for k in unit.kernels) == fc.compiles, (s.text, g)
        assert unit.chunks == (1 if backend == "shm" else plan.knobs["fc_chunks"])


@pytest.mark.parametrize("program", PROGRAMS)
def test_the_code_and_the_cost_model_take_the_plans_decisions(program):
    prog = load_file(ROOT / program)
    for s in generate(prog):
        for backend in BACKENDS:
            plan = LoweringPlan.of(s, backend)
            if backend != "nccl":  # whose code differs from gloo's in the device alone: no decision
                _check_code(s, backend, plan)
            _check_cost(s, backend, plan)


def test_a_plan_is_immutable_and_its_knobs_default_as_the_transform_declares():
    s = Schedule.parse("split(ar0); reorder(ag0); fuse_collective(rs0)", load_file(ROOT / "examples/adam.py"))
    plan = LoweringPlan.of(s, "shm")
    with pytest.raises(AttributeError):
        plan.units = ()  # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.rows_only["x"] = 0  # type: ignore[index]
    assert plan.knobs["fc_chunks"] == FuseCollective.knobs["fc_chunks"][0] == KNOB_DEFAULTS["fc_chunks"]
    assert LoweringPlan.of(s.with_knobs(fc_chunks=2), "shm").knobs["fc_chunks"] == 2
    with pytest.raises(BackendError, match="unknown backend 'mpi'"):
        LoweringPlan.of(s, "mpi")
