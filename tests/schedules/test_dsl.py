import pickle

import numpy as np
import pytest

import coconet as cc
from coconet.errors import ProgramError


def adam():
    p = cc.Program("adam", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    w = p.tensor("w", ("N",), layout=cc.Replicated)
    m = p.tensor("m", ("N",), layout=cc.Replicated)
    v = p.tensor("v", ("N",), layout=cc.Replicated)
    lr, beta1, beta2, eps, t = p.scalars("lr beta1 beta2 eps t")
    avg = cc.allreduce(g)
    m1 = beta1 * m + (1 - beta1) * avg
    v1 = beta2 * v + (1 - beta2) * avg * avg
    p.update(m, m1)
    p.update(v, v1)
    p.update(w, w - lr * (m1 / (1 - beta1**t)) / (cc.sqrt(v1 / (1 - beta2**t)) + eps))
    return p


def test_adam_statements():
    ir = adam().ir
    ops = [s.op for s in ir.stmts]
    assert ops.count("allreduce") == 1 and ops.count("update") == 3
    assert ir.updates == {"m": "add0", "v": "add1", "w": ir.updates["w"]}
    assert ir["ar0"].type.layout == cc.Replicated()
    # the literal 1 is one statement however often it is written
    assert ops.count("const") == 1


def test_hash_consing_shares_identical_expressions():
    p = cc.Program("h", dims=("N",))
    x = p.tensor("x", ("N",), layout=cc.Replicated)
    a, b = x * 2.0, x * 2.0
    assert a.idx == b.idx
    assert (x * 2).idx != a.idx  # int and float literals are different constants


def test_same_program_twice_same_hash_and_different_program_different_hash():
    assert adam().ir.hash == adam().ir.hash
    p = adam()
    p.output("extra", p["w"] * 2.0)
    assert p.ir.hash != adam().ir.hash


def test_ir_is_immutable():
    ir = adam().ir
    with pytest.raises(AttributeError):  # a frozen dataclass's FrozenInstanceError
        ir.name = "other"
    with pytest.raises(AttributeError):
        ir.stmts[0].op = "neg"
    assert isinstance(ir.stmts, tuple)


def test_named_statements_and_auto_names():
    p = cc.Program("n", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    s = cc.allreduce(g).named("avg")
    y = (s * 2.0).named("twice")
    p.output("y", y)
    names = [st.name for st in p.ir.stmts]
    assert "avg" in names and "twice" in names and "ar0" not in names
    with pytest.raises(ProgramError, match="already used"):
        (s + 1.0).named("twice")
    with pytest.raises(ProgramError, match="identifier"):
        (s + 1.0).named("not a name")
    with pytest.raises(ProgramError, match="defined twice"):
        p.tensor("g", ("N",), layout=cc.Local)


def test_error_points_at_the_users_line():
    p = cc.Program("e", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    x = p.tensor("x", ("N",), layout=cc.Sliced(0))
    with pytest.raises(ProgramError) as info:
        g + x  # this line
    err = info.value
    assert err.location.endswith(f"test_dsl.py:{err.location.rsplit(':', 1)[1]}")
    assert err.statement == "add0" and err.op == "add"
    text = str(err)
    assert "g: (N,) Local" in text and "x: (N,) Sliced(0)" in text and "[rule: pointwise L⊕S is an error]" in text


def test_errors_pickle_with_their_fields():
    p = cc.Program("e", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    with pytest.raises(ProgramError) as info:
        cc.all_gather(g)
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is ProgramError
    assert (again.statement, again.op, again.rule, str(again)) == (
        info.value.statement,
        "all_gather",
        "all_gather: S→R",
        str(info.value),
    )


@pytest.mark.parametrize(
    "build,fragment",
    [
        (lambda p: p.tensor("x", ("N",)), "needs a layout"),
        (lambda p: p.tensor("x", ("N",), layout="Diagonal"), "not a layout"),
        (lambda p: p.tensor("x", ("N",), layout=cc.Replicated, dtype="int8"), "int8"),
        (lambda p: p.tensor("x", ("N",), layout=cc.Sliced(1)), "out of range"),
        (lambda p: p.tensor("x", (), layout=cc.Sliced(0)), "scalar cannot be Sliced"),
        (lambda p: p.tensor("x", ("Q",), layout=cc.Local), "not among the program's dims"),
        (lambda p: p.tensor("1x", ("N",), layout=cc.Local), "identifier"),
        (lambda p: p.scalar("s", dtype="bool"), "scalar dtype"),
        (lambda p: cc.dropout(p.tensor("x", ("N",), layout=cc.Local), 1.0, 0), r"\[0, 1\)"),
        (lambda p: cc.dropout(p.tensor("x", ("N",), layout=cc.Local), 0.1, p.scalar("s")), "int64 Replicated scalar"),
        (lambda p: cc.dropout(p.tensor("x", ("N",), layout=cc.Local), 0.1, -1), "seed"),
        (lambda p: cc.allreduce(p.tensor("x", ("N",), layout=cc.Local), op="median"), "median"),
        (lambda p: cc.send(p.scalar("s")), "scalar"),
        (lambda p: cc.send(p.tensor("x", ("N",), layout=cc.Local), to=cc.PREV_STAGE), "NEXT_STAGE"),
        (lambda p: p.output("o", "text"), "neither an expression nor a number"),
    ],
)
def test_bad_statements(build, fragment):
    p = cc.Program("b", dims=("N",))
    with pytest.raises(ProgramError, match=fragment):
        build(p)


def test_bad_programs():
    with pytest.raises(ProgramError, match="identifier"):
        cc.Program("no spaces")
    with pytest.raises(ProgramError, match="repeat"):
        cc.Program("p", dims=("N", "N"))
    p = cc.Program("p", dims=("N",))
    p.tensor("x", ("N",), layout=cc.Local)
    with pytest.raises(ProgramError, match="no effect"):
        _ = p.ir


def test_operands_of_two_programs():
    p, q = cc.Program("p", dims=("N",)), cc.Program("q", dims=("N",))
    x = p.tensor("x", ("N",), layout=cc.Replicated)
    y = q.tensor("y", ("N",), layout=cc.Replicated)
    with pytest.raises(ProgramError, match="two programs"):
        x + y
    with pytest.raises(ProgramError, match="belongs to program p"):
        q.update(x, y)


def test_number_arguments_fold():
    assert cc.sqrt(4.0) == 2.0
    assert cc.exp(0) == 1.0


def test_dead_code_is_dropped_but_inputs_stay():
    p = cc.Program("d", dims=("N",))
    x = p.tensor("x", ("N",), layout=cc.Replicated)
    p.tensor("u", ("N",), layout=cc.Replicated)  # an input nothing reads
    _ = cc.exp(x)
    p.output("y", x * 2.0)
    names = [s.name for s in p.ir.stmts]
    assert "exp0" not in names and "u" in names


def test_norm_of_sliced_is_explicit():
    p = cc.Program("n", dims=("N",))
    x = p.tensor("x", ("N",), layout=cc.Sliced(0))
    nrm = cc.norm(x)
    p.output("n", nrm)
    ops = [s.op for s in p.ir.stmts]
    assert ops == ["input", "mul", "partial_sum", "allreduce", "sqrt", "output"]
    assert nrm.layout == cc.Replicated() and nrm.shape == ()


def test_pipeline_channels_must_agree():
    p = cc.Program("pp", dims=("N",))
    x = cc.recv(p, "x", ("N",), layout=cc.Replicated)
    cc.send(x * 2.0)
    assert p.ir.is_pipeline
    q = cc.Program("pp", dims=("N",))
    x = cc.recv(q, "x", ("N",), layout=cc.Replicated)
    cc.send(cc.cast(x, "float16"))
    with pytest.raises(ProgramError, match="receives .* but the stage sends"):
        _ = q.ir


def test_custom_pointwise_op():
    gelu = cc.custom_op("gelu", reference=lambda x: 0.5 * x * (1 + np.tanh(0.7978845608 * (x + 0.044715 * x**3))))
    p = cc.Program("c", dims=("N",))
    x = p.tensor("x", ("N",), layout=cc.Sliced(0))
    b = p.tensor("b", ("N",), layout=cc.Replicated)
    y = gelu(x + b)
    assert y.layout == cc.Sliced(0)
    p.output("y", y)
    assert p.ir.custom_ops == {"gelu": gelu}
    g = p.tensor("g", ("N",), layout=cc.Local)
    with pytest.raises(ProgramError, match="Local and Sliced"):
        gelu(g + 0.0) + x


def test_custom_local_op():
    def infer(types, attrs):
        (t,) = types
        return t.shape[:-1] + (attrs["k"],), t.dtype

    topk = cc.custom_op(
        "topk_values", reference=lambda x, k: np.sort(x, axis=-1)[..., -k:], kind="local", attrs=("k",), infer=infer
    )
    p = cc.Program("c", dims=("N", "M"))
    x = p.tensor("x", ("N", "M"), layout=cc.Replicated)
    y = topk(x, k=2)
    assert [str(d) for d in y.shape] == ["N", "2"]
    with pytest.raises(ProgramError, match="cannot take Sliced"):
        topk(p.tensor("s", ("N", "M"), layout=cc.Sliced(0)), k=2)
    with pytest.raises(ProgramError, match="unknown attributes"):
        topk(x, j=2)


def test_custom_op_declarations():
    with pytest.raises(ProgramError, match="shadow"):
        cc.custom_op("sqrt", reference=np.sqrt)
    with pytest.raises(ProgramError, match="kind"):
        cc.custom_op("f", reference=np.sqrt, kind="global")
    with pytest.raises(ProgramError, match="infer rule"):
        cc.custom_op("f", reference=np.sqrt, kind="local")
    reg = cc.OpRegistry()
    f = reg.register(cc.custom_op("f", reference=np.sqrt))
    assert reg.get("f") is f
    with pytest.raises(ProgramError, match="already registered"):
        reg.register(cc.custom_op("f", reference=np.sqrt))
