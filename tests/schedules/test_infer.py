"""The layout table of docs/dsl.md, "Layouts", checked exhaustively through the DSL."""

import itertools

import pytest

import coconet as cc
from coconet.errors import ProgramError
from coconet.schedules.types import Local, Replicated, Sliced, TensorType, promote

R, L = "Replicated", "Local"
S0, S1 = "Sliced(0)", "Sliced(1)"
ALL = [R, L, S0, S1]


def build(shape_a, la, shape_b=None, lb=None, dtype_a="float32", dtype_b="float32"):
    p = cc.Program("t", dims=("N", "M", "K"))
    a = p.tensor("a", shape_a, layout=la, dtype=dtype_a)
    b = p.tensor("b", shape_b, layout=lb, dtype=dtype_b) if shape_b is not None else None
    return p, a, b


POINTWISE = {
    (R, R): R,
    (R, L): L,
    (L, R): L,
    (L, L): L,
    (R, S0): S0,
    (S0, R): S0,
    (R, S1): S1,
    (S1, R): S1,
    (S0, S0): S0,
    (S1, S1): S1,
    (L, S0): None,
    (S0, L): None,
    (L, S1): None,
    (S1, L): None,
    (S0, S1): None,
    (S1, S0): None,
}


@pytest.mark.parametrize("la,lb", list(itertools.product(ALL, ALL)))
@pytest.mark.parametrize("op", ["add", "mul", "maximum", "gt"])
def test_pointwise_table(la, lb, op):
    want = POINTWISE[(la, lb)]
    p, a, b = build(("N", "M"), la, ("N", "M"), lb)
    fn = {"add": lambda: a + b, "mul": lambda: a * b, "maximum": lambda: cc.maximum(a, b), "gt": lambda: a > b}[op]
    if want is None:
        with pytest.raises(ProgramError) as info:
            fn()
        assert info.value.statement and info.value.rule and la in str(info.value) and lb in str(info.value)
    else:
        assert str(fn().layout) == want


@pytest.mark.parametrize("lx", [R, L, S0])
def test_scalar_operands_broadcast(lx):
    p, x, _ = build(("N",), lx)
    (s,) = p.scalars("s")
    y = s * x + 2.0
    assert str(y.layout) == lx and y.shape == x.shape


def test_local_scalar_with_sliced_tensor_is_an_error():
    p, x, g = build(("N",), S0, ("N",), L)
    with pytest.raises(ProgramError, match="Local and Sliced"):
        cc.sum(g) * x


def test_replicated_side_is_sliced_along_the_aligned_dim():
    p, x, bias = build(("N", "M"), S1, ("M",), R)
    assert str((x + bias).layout) == S1
    p, x, bias = build(("N", "M"), S0, ("M",), R)
    assert str((x + bias).layout) == S0  # bias has no dim 0: used whole


def test_sliced_dim_cannot_broadcast():
    p, x, y = build((1, "M"), S0, ("N", "M"), R)
    with pytest.raises(ProgramError, match="sliced dim"):
        x + y


def test_shapes_must_broadcast():
    p, a, b = build(("N",), R, ("M",), R)
    with pytest.raises(ProgramError, match=r"do not broadcast.*a: \(N,\).*b: \(M,\)"):
        a + b


def test_symbolic_dims_compare_in_normal_form():
    p, a, b = build(("2*N", "M"), R, ("N*2", "M"), R)
    assert (a + b).shape == a.shape


COLLECTIVES = {"allreduce": {L: R}, "reduce_scatter": {L: S0}, "all_gather": {S0: R, S1: R}, "broadcast": {L: R}}


@pytest.mark.parametrize("coll", sorted(COLLECTIVES))
@pytest.mark.parametrize("lx", ALL)
def test_collective_table(coll, lx):
    p, x, _ = build(("N", "M"), lx)
    fn = getattr(cc, coll)
    want = COLLECTIVES[coll].get(lx)
    if want is None:
        with pytest.raises(ProgramError) as info:
            fn(x)
        assert info.value.rule.startswith(coll)
    else:
        assert str(fn(x).layout) == want


def test_reduce_scatter_dim():
    p, x, _ = build(("N", "M"), L)
    assert str(cc.reduce_scatter(x, dim=1).layout) == S1
    assert str(cc.reduce_scatter(x, dim=-1).layout) == S1
    with pytest.raises(ProgramError, match="out of range"):
        cc.reduce_scatter(x, dim=2)


A3 = ["Replicated", "Local", "Sliced(0)", "Sliced(1)", "Sliced(2)"]
B2 = ["Replicated", "Local", "Sliced(0)", "Sliced(1)"]
MATMUL = {
    (R, R): R,
    (L, R): L,
    ("Sliced(0)", R): "Sliced(0)",
    ("Sliced(1)", R): "Sliced(1)",
    (R, "Sliced(1)"): "Sliced(2)",
    ("Sliced(2)", "Sliced(0)"): L,
    (R, "Sliced(0)"): R,
}


@pytest.mark.parametrize("la,lb", list(itertools.product(A3, B2)))
def test_matmul_table(la, lb):
    p, a, b = build(("N", "M", "K"), la, ("K", "N"), lb)
    want = MATMUL.get((la, lb))
    if want is None:
        with pytest.raises(ProgramError) as info:
            cc.matmul(a, b)
        assert info.value.rule == "matmul layouts" and la in str(info.value)
    else:
        y = cc.matmul(a, b)
        assert str(y.layout) == want
        assert [str(d) for d in y.shape] == ["N", "M", "N"]


def test_a_replicated_matrix_times_rows_is_partial_products_and_an_allreduce():
    p, a, b = build(("M", "K"), R, ("K", "N"), "Sliced(0)")
    p.output("y", cc.matmul(a, b))
    prog = p.ir
    ops = [(s.op, tuple(prog[x].op for x in s.args), str(s.type.layout)) for s in prog.stmts[2:5]]
    assert ops == [("slice", ("input",), "Sliced(1)"), ("matmul", ("slice", "input"), L), ("allreduce", ("matmul",), R)]


def test_matmul_shapes():
    p, a, b = build(("N", "K"), R, ("M", "N"), R)
    with pytest.raises(ProgramError, match="contracted dims differ"):
        cc.matmul(a, b)
    p, a, b = build(("N", "K"), R, ("K",), R)
    with pytest.raises(ProgramError, match=r"\(K, M\)"):
        cc.matmul(a, b)


@pytest.mark.parametrize("lx", ALL)
@pytest.mark.parametrize("fn", ["norm", "sum"])
def test_reductions(lx, fn):
    p, x, _ = build(("N", "M"), lx)
    y = getattr(cc, fn)(x)
    assert y.shape == ()
    assert str(y.layout) == {R: R, L: L, S0: R, S1: R}[lx]
    ops = [n.op for n in p._b.nodes]
    if lx.startswith("Sliced"):
        # the partial reduction and its allreduce are explicit statements
        assert "partial_sum" in ops and "allreduce" in ops


UPDATE = {(R, R), (L, L), (S0, S0), (S1, S1), (R, S0), (R, S1)}


@pytest.mark.parametrize("lt,le", list(itertools.product(ALL, ALL)))
def test_update_table(lt, le):
    p, t, e = build(("N", "M"), lt, ("N", "M"), le)
    if (lt, le) in UPDATE:
        p.update(t, e * 1.0)
        ops = [s.op for s in p.ir.stmts]
        assert ("all_gather" in ops) == (lt == R and le != R)
    else:
        with pytest.raises(ProgramError) as info:
            p.update(t, e * 1.0)
        assert info.value.rule.startswith("update(t, e)") and lt in str(info.value) and le in str(info.value)


def test_update_shape_and_dtype():
    p, t, e = build(("N",), R, ("M",), R)
    with pytest.raises(ProgramError, match="shape"):
        p.update(t, e)
    p, t, e = build(("N",), R, ("N",), R, dtype_b="float16")
    p.update(t, e * 1.0 + t)  # float16 + float32 tensor -> float32: fine
    p, t, e = build(("N",), R, ("N",), R, dtype_a="float16", dtype_b="float32")
    with pytest.raises(ProgramError, match=r"cast\("):
        p.update(t, e)


def test_update_twice_and_update_of_expression():
    p, t, e = build(("N",), R, ("N",), R)
    p.update(t, e)
    with pytest.raises(ProgramError, match="updated twice"):
        p.update(t, e)
    with pytest.raises(ProgramError, match="program state"):
        p.update(t + 1.0, e)


@pytest.mark.parametrize(
    "a,b,want",
    [
        ("float16", "float32", "float32"),
        ("bfloat16", "float16", "float32"),
        ("float64", "bfloat16", "float64"),
        ("float16", "float16", "float16"),
    ],
)
def test_tensor_dtype_promotion(a, b, want):
    p, x, y = build(("N",), R, ("N",), R, dtype_a=a, dtype_b=b)
    assert (x + y).dtype == want


def test_scalars_and_literals_do_not_widen_tensors():
    p, x, _ = build(("N",), R, dtype_a="float16")
    (lr,) = p.scalars("lr")
    assert (lr * x).dtype == "float16"
    assert (x * 0.5).dtype == "float16"
    assert (lr * 0.5).dtype == "float32"
    assert (cc.sqrt(x)).dtype == "float16"


def test_comparisons_are_bool_and_not_arithmetic():
    p, x, y = build(("N",), R, ("N",), R)
    c = x > y
    assert c.dtype == "bool"
    assert cc.where(c, x, y).dtype == "float32"
    with pytest.raises(ProgramError, match="comparison result"):
        c + x
    with pytest.raises(ProgramError, match="bool condition"):
        cc.where(x, x, y)
    with pytest.raises(ProgramError, match="truth value"):
        if x > y:
            pass


def test_promote_matches_torch():
    torch = pytest.importorskip("torch")
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
    for a, b in itertools.product(tdt, tdt):
        for shape_a, shape_b in [((), ()), ((3,), ()), ((), (3,)), ((3,), (3,))]:
            ta, tb = torch.ones(shape_a, dtype=tdt[a]), torch.ones(shape_b, dtype=tdt[b])
            want = str((ta + tb).dtype).replace("torch.", "")
            got = promote(
                [
                    (TensorType((None,) * len(shape_a), a, Replicated()), None),
                    (TensorType((None,) * len(shape_b), b, Replicated()), None),
                ]
            )
            assert got == want, (a, b, shape_a, shape_b)


def test_layout_values():
    assert str(Sliced()) == "Sliced(0)"
    assert Local() == Local() and Sliced(1) != Sliced(0)


def test_dividing_integers_is_true_division():
    """As torch's and NumPy's `/`: two int64 scalars divide into a float (the reference gave 0.5 for 1 / 2
    where the listing said int64)."""
    p = cc.Program("ratio", dims=())
    step, warm = p.scalar("step", dtype="int64"), p.scalar("warm", dtype="int64")
    p.output("r", step / warm)
    p.output("d", step - warm)
    types = {s.name: s.type.dtype for s in p.ir.stmts if s.type is not None}
    assert types["div0"] == "float32" and types["sub0"] == "int64"
