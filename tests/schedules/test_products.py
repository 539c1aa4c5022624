"""Batched matmul, tensordot and transpose: the layout table over every pair of layouts, shapes and their
errors, the JSON IR, the interpreter against torch on 1-4 ranks with uneven slices, and what the transforms
make of them."""

import itertools
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import coconet as cc
from coconet.errors import IllegalTransform, ProgramError
from coconet.schedules import equivalence, interp
from coconet.schedules.schedule import Schedule
from coconet.schedules.serialize import export, load
from coconet.schedules.space import generate
from coconet.schedules.transforms.fuse import Fuse
from coconet.schedules.transforms.overlap import Overlap
from coconet.schedules.transforms.reorder import Reorder
from coconet.schedules.types import Local, Replicated, Sliced

pytestmark = pytest.mark.usefixtures("one_thread")

R, L, S0, S1, S2 = Replicated(), Local(), Sliced(0), Sliced(1), Sliced(2)
LAYOUTS = [R, L, S0, S1, S2]

# a (A, M, K) by b (A, K, N): the result's layout as the user sees it (the builder's slices and allreduces
# included), with the ops the builder writes; absent pairs are refused
BATCHED = {
    (R, R): (R, ()),
    (L, R): (L, ()),
    (S0, S0): (S0, ()),
    (S0, R): (S0, ("slice",)),  # b's rows of this rank's batch
    (R, S0): (S0, ("slice",)),
    (S1, R): (S1, ()),
    (R, S2): (S2, ()),
    (S2, S1): (L, ()),
    (R, S1): (R, ("slice", "allreduce")),  # a's columns by b's rows: partial products
}

# a (A, S, D) by b (A, D, H) over ([0, 2], [0, 1]) into (S, H)
TENSORDOT = {
    (R, R): (R, ()),
    (L, R): (L, ()),
    (R, L): (L, ()),
    (S1, R): (S0, ()),
    (R, S2): (S1, ()),
    (S0, S0): (L, ()),
    (S2, S1): (L, ()),
    (S0, R): (R, ("slice", "allreduce")),
    (R, S0): (R, ("slice", "allreduce")),
    (S2, R): (R, ("slice", "allreduce")),
    (R, S1): (R, ("slice", "allreduce")),
}


def made(p, op):
    """The ops the builder wrote around the user's product, in order."""
    return tuple(s.op for s in p.ir.stmts if s.op not in ("input", op, "output"))


@pytest.mark.parametrize("la,lb", list(itertools.product(LAYOUTS, LAYOUTS)))
def test_batched_matmul_table(la, lb):
    p = cc.Program("t", dims=("A", "M", "K", "N"))
    a, b = p.tensor("a", ("A", "M", "K"), layout=la), p.tensor("b", ("A", "K", "N"), layout=lb)
    if (la, lb) not in BATCHED:
        with pytest.raises(ProgramError) as info:
            cc.matmul(a, b)
        assert info.value.rule == "matmul layouts (batched)" and f"{la} x {lb}" in str(info.value)
        return
    want, ops = BATCHED[la, lb]
    y = a @ b
    assert y.layout == want and tuple(map(str, y.shape)) == ("A", "M", "N")
    p.output("y", y)
    assert made(p, "matmul") == ops


@pytest.mark.parametrize("la,lb", list(itertools.product(LAYOUTS, LAYOUTS)))
def test_tensordot_table(la, lb):
    p = cc.Program("t", dims=("A", "S", "D", "H"))
    a, b = p.tensor("a", ("A", "S", "D"), layout=la), p.tensor("b", ("A", "D", "H"), layout=lb)
    if (la, lb) not in TENSORDOT:
        with pytest.raises(ProgramError) as info:
            cc.tensordot(a, b, ([0, 2], [0, 1]))
        assert info.value.rule == "tensordot layouts" and f"{la} x {lb}" in str(info.value)
        if la in (S0, S2) and lb in (S0, S1):
            assert "same contracted pair" in str(info.value)
        return
    want, ops = TENSORDOT[la, lb]
    y = cc.tensordot(a, b, ([0, 2], [0, 1]))
    assert y.layout == want and tuple(map(str, y.shape)) == ("S", "H")
    p.output("y", y)
    assert made(p, "tensordot") == ops


@pytest.mark.parametrize("layout", LAYOUTS)
def test_transpose_moves_the_sliced_dim(layout):
    p = cc.Program("t", dims=("A", "S", "D"))
    x = p.tensor("x", ("A", "S", "D"), layout=layout)
    y = cc.transpose(x, 0, 2)
    assert tuple(map(str, y.shape)) == ("D", "S", "A")
    assert y.layout == {S0: S2, S2: S0}.get(layout, layout)
    # one statement however the swap is written
    assert cc.transpose(x, -1, 0).name == y.name == cc.transpose(x, 2, -3).name
    with pytest.raises(ProgramError, match=r"transpose over dim 3 of x with shape \(A, S, D\)"):
        cc.transpose(x, 0, 3)


def test_matrix_rules_keep_their_messages():
    p = cc.Program("t", dims=("M", "K", "N"))
    a = p.tensor("a", ("M", "K"), layout=Sliced(1))
    b = p.tensor("b", ("K", "N"), layout=Sliced(1))
    with pytest.raises(ProgramError, match=r"no matmul rule for Sliced\(1\) x Sliced\(1\)") as info:
        cc.matmul(a, b)
    assert info.value.rule == "matmul layouts"


@pytest.mark.parametrize(
    "shapes,call,match",
    [
        ((("A", "M", "K"), ("K",)), "mm", r"b \(K, M\)"),
        ((("A", "M", "K"), ("B", "K", "N")), "mm", r"batch dims differ: a\(A, M, K\) and b\(B, K, N\)"),
        ((("M", "K"), ("A", "K", "N")), "mm", "a batch of products needs a and b with the same dims"),
        ((("A", "M", "K"), ("A", "M", "N")), "mm", "contracted dims differ"),
        ((("A", "S", "D"), ("A", "D", "H")), ([0, 1], [0, 1]), r"pairs dim 1 of a\(A, S, D\) \(S\) with dim 1"),
        ((("A", "S", "D"), ("A", "D", "H")), ([0, 0], [0, 1]), "contracts a dim of a twice"),
        ((("A", "S", "D"), ("A", "D", "H")), ([0, 3], [0, 1]), "tensordot over dim 3 of a"),
        ((("A", "S"), ("A", "D", "H")), 3, "contracts 3 dims but a has 2 and b 3"),
        ((("A", "S"), ("A", "D", "H")), ([0], [0, 1]), r"pairs 1 of a's dims with 2 of b's"),
        ((("A", "S"), ("A", "D", "H")), "0", "not an int nor a pair of lists"),
    ],
)
def test_shape_errors_name_the_cause(shapes, call, match):
    p = cc.Program("t", dims=("A", "B", "M", "K", "N", "S", "D", "H"))
    a, b = (p.tensor(n, s, layout=Replicated) for n, s in zip("ab", shapes))
    with pytest.raises(ProgramError, match=match):
        cc.matmul(a, b) if call == "mm" else cc.tensordot(a, b, call)


def test_symbolic_extents_pair_up():
    p = cc.Program("t", dims=("A", "S", "D"))
    a = p.tensor("a", ("2*A", "S", "D + 1"), layout=Replicated)
    b = p.tensor("b", ("2*A", "D + 1", "S"), layout=Replicated)
    y = cc.tensordot(a, b, ([0, 2], [0, 1]))
    assert tuple(map(str, y.shape)) == ("S", "S") and cc.tensordot(a, b, ([2, 0], [1, 0])).name != y.name
    assert tuple(map(str, (a @ b).shape)) == ("2*A", "S", "S")
    with pytest.raises(ProgramError, match=r"pairs dim 1 of a\(2\*A, S, D \+ 1\) \(S\) with dim 0"):
        cc.tensordot(a, b, 2)  # a's (S, D + 1) with b's (2*A, D + 1)
    c = p.tensor("c", ("2*A", "D", "S"), layout=Replicated)
    with pytest.raises(ProgramError, match="contracted dims differ"):
        cc.matmul(a, c)


def test_int_dims_are_the_pairs_they_stand_for():
    p = cc.Program("t", dims=("A", "S", "D", "H"))
    a = p.tensor("a", ("S", "A", "D"), layout=Replicated)
    b = p.tensor("b", ("A", "D", "H"), layout=Replicated)
    y = cc.tensordot(a, b, 2)
    assert y.name == cc.tensordot(a, b, ([1, -1], [0, 1])).name
    p.output("y", y)
    (td,) = (s for s in p.ir.stmts if s.op == "tensordot")
    assert td.attr("dims") == ((1, 2), (0, 1))


def test_json_round_trip_and_refusals():
    p = cc.Program("t", dims=("A", "S", "D", "H"))
    k = p.tensor("k", ("A", "S", "D"), layout=Sliced(0))
    w = p.tensor("w", ("A", "D", "H"), layout=Sliced(0))
    p.output("y", cc.allreduce(cc.tensordot(cc.transpose(k, 1, 2), w, ([0, 1], [0, 1]))))
    text = export(p.ir)
    back = load(text)
    assert back.hash == p.ir.hash and export(back) == text
    data = json.loads(text)
    (td,) = (e for e in data["statements"] if e["op"] == "tensordot")
    assert td["attrs"] == {"dims": [[0, 1], [0, 1]]}
    td["attrs"]["dims"] = [[0, 1], [0]]
    with pytest.raises(ProgramError, match=r"attribute dims: dims \[\[0, 1\], \[0\]\] pairs 2 of a's dims with 1"):
        load(json.dumps(data))
    (tr,) = (e for e in data["statements"] if e["op"] == "transpose")
    tr["attrs"] = {"dim0": 1}
    with pytest.raises(ProgramError, match="dim1"):
        load(json.dumps(data))


# --- the interpreter against torch ---


@settings(max_examples=60, deadline=None)
@given(
    rule=st.sampled_from(sorted(BATCHED, key=str)),
    world=st.integers(1, 4),
    sizes=st.tuples(*(st.integers(1, 5) for _ in range(4))),
    seed=st.integers(0, 2**16),
)
def test_batched_matmul_matches_torch(rule, world, sizes, seed):
    la, lb = rule
    dims = dict(zip("AMKN", sizes))
    p = cc.Program("t", dims=tuple(dims))
    a, b = p.tensor("a", ("A", "M", "K"), layout=la), p.tensor("b", ("A", "K", "N"), layout=lb)
    p.output("y", a @ b)
    res = interp.run(p, world, dims, seed=seed)
    x = interp.make_inputs(p, world, dims, seed=seed)
    got = res.output("y")
    if la == L:  # every rank's own a by b
        want = np.stack(
            [torch.matmul(torch.from_numpy(x["a"][r]), torch.from_numpy(x["b"])).numpy() for r in range(world)]
        )
    else:
        want = torch.matmul(torch.from_numpy(x["a"]), torch.from_numpy(x["b"])).numpy()
    if BATCHED[rule][0] == L and la != L:  # every rank's partial products: they add up to the product
        got = got.sum(axis=0)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


@settings(max_examples=60, deadline=None)
@given(
    rule=st.sampled_from(sorted(TENSORDOT, key=str)),
    world=st.integers(1, 4),
    sizes=st.tuples(*(st.integers(1, 5) for _ in range(4))),
    seed=st.integers(0, 2**16),
)
def test_tensordot_matches_torch(rule, world, sizes, seed):
    la, lb = rule
    dims = dict(zip("ASDH", sizes))
    p = cc.Program("t", dims=tuple(dims))
    a, b = p.tensor("a", ("A", "S", "D"), layout=la), p.tensor("b", ("A", "D", "H"), layout=lb)
    p.output("y", cc.tensordot(a, b, ([0, 2], [0, 1])))
    res = interp.run(p, world, dims, seed=seed)
    x = interp.make_inputs(p, world, dims, seed=seed)
    got = res.output("y")

    def ref(av, bv):
        return torch.tensordot(torch.from_numpy(av), torch.from_numpy(bv), dims=([0, 2], [0, 1])).numpy()

    if la == L:
        want = np.stack([ref(x["a"][r], x["b"]) for r in range(world)])
    elif lb == L:
        want = np.stack([ref(x["a"], x["b"][r]) for r in range(world)])
    else:
        want = ref(x["a"], x["b"])
    if TENSORDOT[rule][0] == L and L not in rule:
        got = got.sum(axis=0)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", [R, L, S0, S1, S2])
def test_transpose_matches_torch(layout, world):
    dims = {"A": 3, "S": 5, "D": 2}
    p = cc.Program("t", dims=tuple(dims))
    x = p.tensor("x", ("A", "S", "D"), layout=layout)
    p.output("y", cc.transpose(x, 2, 0))
    res = interp.run(p, world, dims)
    xs = interp.make_inputs(p, world, dims)["x"]
    got = res.output("y")
    if layout == L:
        want = np.stack([torch.from_numpy(xs[r]).transpose(0, 2).numpy() for r in range(world)])
    else:
        want = torch.from_numpy(xs).transpose(0, 2).numpy()
    np.testing.assert_array_equal(got, want)


def test_a_rank_without_heads_adds_nothing():
    """2 heads over 3 ranks: the last holds none, and its share of the contraction is zeros."""
    p = cc.Program("t", dims=("S", "D", "H"))
    a = p.tensor("a", (2, "S", "D"), layout=S0)
    b = p.tensor("b", (2, "D", "H"), layout=S0)
    part = cc.tensordot(a, b, ([0, 2], [0, 1]))
    p.output("y", cc.allreduce(part))
    p.output("z", a @ cc.transpose(a, 1, 2))
    dims = {"S": 3, "D": 2, "H": 4}
    res = interp.run(p, 3, dims, keep_values=True)
    x = interp.make_inputs(p, 3, dims)
    assert not res.stages[0].values[part.name][2].any() and res.stages[0].values[part.name][2].shape == (3, 4)
    ta, tb = torch.from_numpy(x["a"]), torch.from_numpy(x["b"])
    np.testing.assert_allclose(res.output("y"), torch.tensordot(ta, tb, dims=([0, 2], [0, 1])).numpy())
    assert [piece.shape[0] for piece in res.stages[0].outputs["z"]] == [1, 1, 0]
    np.testing.assert_allclose(res.output("z"), (ta @ ta.transpose(1, 2)).numpy())


# --- transforms ---


def heads():
    """Attention's core on each rank's heads, then the row-parallel projection and a bias."""
    p = cc.Program("heads", dims=("A", "S", "D", "H"))
    q = p.tensor("q", ("A", "S", "D"), layout=S0)
    k = p.tensor("k", ("A", "S", "D"), layout=S0)
    w = p.tensor("w", ("A", "D", "H"), layout=S0)
    b = p.tensor("b", ("H",), layout=R)
    probs = cc.softmax(q @ cc.transpose(k, 1, 2) * 0.5, -1)
    y = cc.allreduce(cc.tensordot(probs @ k, w, ([0, 2], [0, 1])))
    p.output("out", y + b)
    return p.ir


def gathered_heads():
    """Batches of products after all_gathers, of the batch and of the rows: reorder runs them on the slices."""
    p = cc.Program("gathered", dims=("A", "S", "D"))
    x = p.tensor("x", ("A", "S", "D"), layout=S0)
    xs = p.tensor("xs", ("A", "S", "D"), layout=S1)
    v = p.tensor("v", ("A", "D", "S"), layout=R)
    u = p.tensor("u", ("A", "S", "S"), layout=R)
    g, gs = cc.all_gather(x * 2.0), cc.all_gather(xs * 3.0)
    p.output("y", (g @ v) + 1.0)  # this rank's batch by its batch of v (a slice)
    p.output("z", u @ gs)  # gs's rows are the contracted dim: u's columns by them, partial products
    p.output("t", gs @ v)  # gs's rows are the result's
    return p.ir


def test_fuse_leaves_products_and_transposes_out_naming_why():
    prog = heads()
    with pytest.raises(IllegalTransform, match="td0 is a tensordot; only pointwise statements"):
        Fuse(("td0", "add0")).apply(prog)
    with pytest.raises(IllegalTransform, match="tr0 is a transpose; only pointwise statements"):
        Fuse(("tr0", "mm0")).apply(prog)
    assert all(not {"td0", "tr0", "mm0", "mm1"} & set(t.members) for t in Fuse.instances(prog))


def test_overlap_refuses_a_batch_of_products():
    p = cc.Program("t", dims=("A", "M", "K", "N"))
    a = p.tensor("a", ("A", "M", "K"), layout=S2)
    b = p.tensor("b", ("A", "K", "N"), layout=S1)
    p.output("y", cc.allreduce(a @ b))
    assert Overlap.instances(p.ir) == []
    with pytest.raises(IllegalTransform, match="mm0 is a batch of products"):
        Overlap("mm0", "ar0").apply(p.ir)


def test_overlap_chunks_a_tensordot_against_its_allreduce_only():
    prog = heads()
    assert Overlap.instances(prog) == [Overlap("td0", "ar0")]
    split = Schedule.parse("split(ar0)", prog).scheduled
    assert Overlap.instances(split) == []
    with pytest.raises(IllegalTransform, match="td0 is a tensordot: its chunks are rows of the result, overlapped"):
        Overlap("td0", "rs0").apply(split)
    with pytest.raises(IllegalTransform, match="tr0 is a transpose, not a matmul, a tensordot or a convolution"):
        Overlap("tr0", "ar0").apply(prog)


def test_reorder_runs_a_batch_of_products_on_the_slices():
    prog = gathered_heads()
    batch, rows = (r.apply(prog) for r in Reorder.instances(prog))
    ops = {s.name: (s.op, s.args, s.type.layout if s.type else None) for s in batch.stmts}
    assert ops["mm0"] == ("matmul", ("mul0", "sl0"), S0) and ops["sl0"] == ("slice", ("v",), S0)
    ops = {s.name: (s.op, s.args, s.type.layout if s.type else None) for s in rows.stmts}
    (z,) = (s for s in rows.stmts if s.op == "output" and s.attr("name") == "z")
    ar = rows[z.args[0]]
    assert ar.op == "allreduce" and ops[ar.args[0]][0] == "matmul" and ops[ar.args[0]][2] == L
    (t,) = (s for s in rows.stmts if s.op == "output" and s.attr("name") == "t")
    assert rows[t.args[0]].op == "all_gather" and rows[rows[t.args[0]].args[0]].type.layout == S1
    for text in ("reorder(ag0)", "reorder(ag1)"):
        for world in (1, 2, 3):
            assert not equivalence.check(Schedule.parse(text, prog), world, {"A": 5, "S": 3, "D": 2}), text


@pytest.mark.parametrize("make", [heads, gathered_heads])
def test_every_schedule_is_equivalent(make):
    prog = make()
    space = generate(prog)
    assert not space.refused and len(space) > 1
    for s in space:
        for world in (2, 3):
            assert not equivalence.check(s, world, {"A": 5, "S": 3, "D": 2, "H": 4}), s.text
