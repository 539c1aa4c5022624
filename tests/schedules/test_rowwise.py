"""Reductions along a dim, softmax and the norms built on them: the layout table over every layout, dim and
keepdim, the errors, the JSON IR, the interpreter against torch on 1-4 ranks with uneven slices, and what fuse
and fuse_collective take of them."""

import itertools
import runpy
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import coconet as cc
from coconet.errors import IllegalTransform, ProgramError
from coconet.schedules import interp
from coconet.schedules.serialize import export, load
from coconet.schedules.transforms.fuse import Fuse, fusable
from coconet.schedules.transforms.fuse_collective import FuseCollective, left_out
from coconet.schedules.types import Local, Replicated, Sliced

LAYOUTS = [Replicated(), Local(), Sliced(0), Sliced(1), Sliced(2)]
KINDS = ["sum", "mean", "max", "min"]
COLLECTIVE = {"sum": "sum", "mean": "sum", "max": "max", "min": "min"}
FN = {"sum": cc.sum, "mean": cc.mean, "max": cc.max, "min": cc.min}


def program(layout, shape=("A", "B", "C")):
    p = cc.Program("t", dims=("A", "B", "C"))
    return p, p.tensor("x", shape, layout=layout)


def expected_layout(layout, dims, keepdim):
    """The table, written out: R→R, L→L, S(k) over other dims → S(k shifted), S(k) over k → R via a collective."""
    if not isinstance(layout, Sliced):
        return layout, False
    if layout.dim in dims:
        return Replicated(), True
    return Sliced(layout.dim - (0 if keepdim else sum(d < layout.dim for d in dims))), False


@pytest.mark.parametrize(
    "layout,kind,dim,keepdim", list(itertools.product(LAYOUTS, KINDS, [None, 0, 1, 2, -1, -3], [False, True]))
)
def test_reduction_table(layout, kind, dim, keepdim):
    p, x = program(layout)
    y = FN[kind](x, dim=dim, keepdim=keepdim)
    dims = (0, 1, 2) if dim is None else (dim % 3,)
    names = ("A", "B", "C")
    want_shape = tuple("1" if k in dims else n for k, n in enumerate(names) if keepdim or k not in dims)
    assert tuple(str(d) for d in y.shape) == want_shape
    want, completed = expected_layout(layout, dims, keepdim)
    assert y.layout == want
    p.output("y", y)
    stmt = p.ir[y.name]
    if completed:  # each rank's share, then the collective of the kind
        assert stmt.op == "allreduce" and stmt.attr("op") == COLLECTIVE[kind]
        part = p.ir[stmt.args[0]]
        assert part.type.layout == Local()
        if kind == "sum" and dim is None and not keepdim:
            assert part.op == "partial_sum"  # sum(x) of a Sliced x, as it always was
        else:
            assert part.op == "partial_reduce" and part.attr("op") == kind
            assert part.attr("dim") == (None if dim is None else dim % 3)
    elif kind == "sum" and dim is None and not keepdim:
        assert stmt.op == "sum"  # the all-elements form is the one it always was
    else:
        assert stmt.op == "reduce" and stmt.attr("op") == kind and stmt.attr("keepdim") is keepdim
        assert stmt.attr("dim") == (None if dim is None else dim % 3)  # counted from the front


@pytest.mark.parametrize("layout,dim,op", list(itertools.product(LAYOUTS, [0, 1, 2, -1], ["softmax", "log_softmax"])))
def test_softmax_table(layout, dim, op):
    p, x = program(layout)
    y = getattr(cc, op)(x, dim)
    assert y.layout == layout and y.shape == x.shape
    p.output("y", y)
    ops = [s.op for s in p.ir.stmts]
    if isinstance(layout, Sliced) and layout.dim == dim % 3:
        # along the sliced dim: the dim's max and sum of exponentials as partials + allreduces, the rest pointwise
        assert op not in ops
        assert [(s.attr("op"), p.ir[s.args[0]].op) for s in p.ir.stmts if s.op == "allreduce"] == [
            ("max", "partial_reduce"),
            ("sum", "partial_reduce"),
        ]
    else:
        assert ops.count(op) == 1 and "allreduce" not in ops


def test_hash_consing_sees_negative_and_positive_dims_as_one():
    p, x = program(Replicated())
    assert cc.mean(x, -1).name == cc.mean(x, 2).name
    assert cc.softmax(x, -2).name == cc.softmax(x, 1).name


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda x: cc.sum(x, 3), r"sum over dim 3 of x with shape \(A, B, C\): dims are in \[-3, 2\]"),
        (lambda x: cc.max(x, -4), r"max over dim -4 of x with shape \(A, B, C\)"),
        (lambda x: cc.softmax(x, 5), r"softmax over dim 5 of x with shape \(A, B, C\)"),
        (lambda x: cc.mean(x, 1.0), r"mean: dim must be an int or None, got 1.0"),
        (lambda x: cc.min(x, 0, keepdim=1), r"min: keepdim must be True or False"),
        (lambda x: cc.log_softmax(x, None), r"log_softmax: dim must be an int, got None"),
        (lambda x: cc.sum(x > 0, 0), r"sum of a comparison result"),
    ],
)
def test_errors_name_the_op_the_dim_and_the_shape(call, match):
    _, x = program(Replicated())
    with pytest.raises(ProgramError, match=match) as info:
        call(x)
    if "over dim" in match:  # the builder's check: the statement is labelled by its kind
        assert info.value.statement == match.split()[0] + "0"


def test_a_scalar_has_no_dim_to_reduce():
    p = cc.Program("t")
    s = p.scalar("s")
    with pytest.raises(ProgramError, match="dims are none: it is a scalar"):
        cc.softmax(s, 0)
    assert cc.max(s).shape == ()


def test_json_round_trip_and_refusals():
    p, x = program(Sliced(0))
    w = p.tensor("w", ("C",), layout=Replicated)
    p.output("ln", cc.layer_norm(x, w, w))
    p.output("sm", cc.softmax(x, 0))
    p.output("mx", cc.max(x, 1, keepdim=True))
    text = export(p.ir)
    back = load(text)
    assert back.hash == p.ir.hash and export(back) == text
    bad = text.replace('"op": "max"', '"op": "median"', 1)
    with pytest.raises(ProgramError, match="'median' is not one of sum, mean, max, min"):
        load(bad)


# --- the interpreter against torch ---


def torch_of(kind, t, dim, keepdim):
    if dim is None and not keepdim:
        return {"sum": t.sum, "mean": t.mean, "max": t.amax, "min": t.amin}[kind]()
    dims = tuple(range(t.ndim)) if dim is None else dim
    return {"sum": torch.sum, "mean": torch.mean, "max": torch.amax, "min": torch.amin}[kind](t, dims, keepdim)


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(1, 4),
    sizes=st.tuples(st.integers(1, 7), st.integers(1, 5), st.integers(1, 4)),
    layout=st.sampled_from(LAYOUTS),
    kind=st.sampled_from(KINDS),
    dim=st.sampled_from([None, 0, 1, 2, -1]),
    keepdim=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_reductions_match_torch(world, sizes, layout, kind, dim, keepdim, seed):
    p, x = program(layout)
    p.output("y", FN[kind](x, dim=dim, keepdim=keepdim))
    dims = dict(zip("ABC", sizes))
    res = interp.run(p, world, dims, seed=seed)
    xs = torch.tensor(res.state("x"))
    if isinstance(layout, Local):  # each rank reduces its own value
        want = np.stack([torch_of(kind, xs[r], dim, keepdim).numpy() for r in range(world)])
    else:
        want = torch_of(kind, xs, dim, keepdim).numpy()
    np.testing.assert_allclose(res.output("y"), want, rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    world=st.integers(1, 4),
    sizes=st.tuples(st.integers(1, 7), st.integers(1, 5), st.integers(1, 4)),
    layout=st.sampled_from([Replicated(), Sliced(0), Sliced(1), Sliced(2)]),
    dim=st.sampled_from([0, 1, 2, -1]),
    log=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_softmax_matches_torch(world, sizes, layout, dim, log, seed):
    p, x = program(layout)
    p.output("y", (cc.log_softmax if log else cc.softmax)(x * 4.0, dim))
    res = interp.run(p, world, dict(zip("ABC", sizes)), seed=seed)
    xs = torch.tensor(res.state("x")) * 4.0
    want = (torch.log_softmax if log else torch.softmax)(xs, dim).numpy()
    np.testing.assert_allclose(res.output("y"), want, rtol=1e-12, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(
    world=st.integers(1, 4),
    rows=st.integers(1, 9),
    h=st.integers(1, 6),
    layout=st.sampled_from([Replicated(), Sliced(0)]),
    affine=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_layer_norm_and_rms_norm_match_torch(world, rows, h, layout, affine, seed):
    p = cc.Program("t", dims=("S", "H"))
    x = p.tensor("x", ("S", "H"), layout=layout)
    w = p.tensor("w", ("H",), layout=Replicated)
    b = p.tensor("b", ("H",), layout=Replicated)
    p.output("ln", cc.layer_norm(x, w if affine else None, b if affine else None, eps=1e-5))
    p.output("rms", cc.rms_norm(x, w if affine else None, eps=1e-6))
    res = interp.run(p, world, {"S": rows, "H": h}, seed=seed)
    xs, ws, bs = (torch.tensor(res.state(n)) for n in "xwb")
    ln = torch.nn.functional.layer_norm(xs, (h,), ws if affine else None, bs if affine else None, eps=1e-5)
    rms = torch.nn.functional.rms_norm(xs, (h,), ws if affine else None, eps=1e-6)
    np.testing.assert_allclose(res.output("ln"), ln.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(res.output("rms"), rms.numpy(), rtol=1e-10, atol=1e-10)
    assert isinstance(p.ir[p.ir.outputs["ln"]].type.layout, type(layout))  # rows stay where they lie


def test_an_empty_slice_reduces_to_the_identity_its_collective_ignores():
    """5 rows on 4 ranks are 2, 2, 1 and 0 rows: the last rank's share of a max is -inf, of a sum 0."""
    p, x = program(Sliced(0))
    p.output("mx", cc.max(x, 0))
    p.output("mn", cc.min(x, 0))
    p.output("mean", cc.mean(x, 0))
    res = interp.run(p, 4, {"A": 5, "B": 2, "C": 3}, keep_values=True)
    parts = {s.attr("op"): s.name for s in res.program.stmts if s.op == "partial_reduce"}
    assert np.all(res.stages[0].values[parts["max"]][3] == -np.inf)
    assert np.all(res.stages[0].values[parts["min"]][3] == np.inf)
    assert np.all(res.stages[0].values[parts["mean"]][3] == 0)
    xs = res.state("x")
    np.testing.assert_allclose(res.output("mean"), xs.mean(0), rtol=1e-12)


# --- fuse ---


def layer_norm_program():
    p = cc.Program("t", dims=("S", "H"))
    x = p.tensor("x", ("S", "H"), layout=Sliced(0))
    r = p.tensor("r", ("S", "H"), layout=Sliced(0))
    w = p.tensor("w", ("H",), layout=Replicated)
    p.output("y", cc.layer_norm(x + r, w, w))
    p.output("rows", cc.sum(x, 1))  # keepdim=False: (S,), another rank than the rows'
    return p.ir


def test_a_layer_norm_is_one_fuse_region():
    prog = layer_norm_program()
    regions = [t.members for t in Fuse.instances(prog)]
    assert regions == [("add0", "mean0", "sub0", "mul0", "mean1", "add1", "rsqrt0", "mul1", "mul2", "add2")]
    fused = Fuse(regions[0]).apply(prog)
    assert [g.kind for g in fused.groups] == ["fuse"]
    assert Fuse(regions[0]).describe(prog) == "10 statements fused into one kernel"


def test_fuse_refuses_what_one_iteration_space_cannot_hold():
    prog = layer_norm_program()
    with pytest.raises(IllegalTransform, match="share one layout and rank"):
        Fuse(("sum0", "add0")).apply(prog)  # (S,) beside (S, H)
    with pytest.raises(IllegalTransform, match="only pointwise statements and reductions or softmaxes along one dim"):
        Fuse(("add0", "y")).apply(prog)
    # without a statement along a dim, different shapes stay apart as they always did
    with pytest.raises(IllegalTransform, match="different shapes or layouts"):
        Fuse(("add1", "sub0")).apply(prog)
    p = cc.Program("t", dims=("S", "H"))
    x = p.tensor("x", ("S", "H"), layout=Sliced(0))
    p.output("m", cc.max(x) * x)  # a max over every element is a partial and an allreduce: no kernel's
    assert not any(fusable(p.ir, s.name) for s in p.ir.stmts if s.op in ("partial_reduce", "allreduce"))


# --- fuse_collective ---


def example_program(name):
    return runpy.run_path(str(Path(__file__).parents[2] / "examples" / f"{name}.py"))["program"].ir


def test_fuse_collective_takes_the_layer_norm_after_a_reduce_scatter_along_rows():
    """Megatron's sequence-parallel epilogue: the LayerNorm over H of rows scattered along S is whole in every
    chunk of the rows, so its means join the fused collective with the pointwise work and the all_gather."""
    prog = example_program("gpt_layer_sp")
    fc = FuseCollective("rs0")
    ln = ["mean0", "sub0", "mul0", "mean1", "add2", "rsqrt0", "mul1", "mul2", "add3"]
    assert fc.members(prog) == ("rs0", "add0", "drop0", "add1", *ln, "ag0")
    assert [g.kind for g in fc.apply(prog).groups] == ["fused_collective"]
    assert fc.describe(prog) == "rs0 fused with 12 statements and 1 all_gather"
    assert not left_out(prog, "rs0")
    # a LayerNorm fused first stays its own kernel: the collective takes the pointwise work before it
    fused = Fuse(tuple(ln)).apply(prog)
    assert fc.members(fused) == ("rs0", "add0", "drop0", "add1")


def test_fuse_collective_leaves_reductions_along_the_scattered_dim_and_says_why():
    p = cc.Program("t", dims=("S", "H"))
    x = p.tensor("x", ("S", "H"), layout=Local)
    h = cc.reduce_scatter(x)
    p.output("m", cc.mean(h, 0))  # over the scattered S: each rank's share, completed by an allreduce
    prog = p.ir
    with pytest.raises(IllegalTransform, match="pmean0 reduces along dim 0, the one rs0 scatters"):
        FuseCollective("rs0").apply(prog)
    p = cc.Program("t", dims=("S", "H"))
    x = p.tensor("x", ("S", "H"), layout=Local)
    h = cc.reduce_scatter(x) * 2.0
    p.output("m", cc.mean(h, 0))
    p.output("n", cc.all_gather(cc.softmax(h, 1)))  # along H: whole in every chunk of S
    prog = p.ir
    assert FuseCollective("rs0").members(prog) == ("rs0", "mul0", "softmax0", "ag0")
    assert set(left_out(prog, "rs0")) == {"pmean0"}
    assert FuseCollective("rs0").describe(prog).endswith("; pmean0 outside it")
    # scattered along the columns, a sum over the rows is sliced along dim 0 of its own: not the chunks' rows
    p = cc.Program("t", dims=("S", "H"))
    x = p.tensor("x", ("H", "S"), layout=Local)
    h = cc.reduce_scatter(x, dim=1) * 2.0
    p.output("m", cc.all_gather(cc.sum(h, 0)))
    prog = p.ir
    assert FuseCollective("rs0").members(prog) == ("rs0", "mul0")
    assert "sum0's result is not sliced along dim 1" in left_out(prog, "rs0")["sum0"]
