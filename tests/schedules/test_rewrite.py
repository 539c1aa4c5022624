"""The rewrite engine: a copy whose operands are as before is the statement as it was; any other is
verified and typed again."""

import pytest

from coconet import Local, Program, Replicated, allreduce
from coconet.schedules.rewrite import Rewriter


@pytest.mark.parametrize("literal, dtype", [(3, "int64"), (2.5, "float32"), (2.0, "float32")])
def test_a_copy_onto_another_literal_is_typed_by_that_literal(literal, dtype):
    # literals promote by their value's type: int64 step * 2 is int64, * 2.0 is not; types alike
    # (both weak, shape ()) must not pass for the operands being as before
    p = Program("literal", dims=("N",))
    step = p.scalar("step", "int64")
    p.output("twice", step * 2)
    ir = p.ir
    r = Rewriter(ir, "test")
    for s in ir.stmts:
        if s.op == "mul":
            other = r.add("const", [], {"value": literal})
            r.copy(s, args=[other if ir[a].op == "const" else r[a] for a in s.args])
        else:
            r.copy(s)
    out = r.finish()
    assert out["mul0"].type.dtype == dtype
    assert ir["mul0"].type.dtype == "int64"


def _sgd():
    p = Program("sgd", dims=("N",))
    g = p.tensor("g", ("N",), layout=Local)
    w = p.tensor("w", ("N",), layout=Replicated)
    p.update(w, w - 0.1 * allreduce(g) * 2)
    return p.ir


def test_a_copy_of_an_untouched_program_is_the_program():
    ir = _sgd()
    r = Rewriter(ir, "test")
    for s in ir.stmts:
        r.copy(s)
    assert r.finish().stmts == ir.stmts


def test_a_copy_past_the_size_bound_is_refused_naming_the_statement(monkeypatch):
    # the copy of a statement left alone skips the checks its program passed, not the program's size bound
    from coconet.errors import IllegalTransform
    from coconet.schedules import builder

    ir = _sgd()
    r = Rewriter(ir, "test")
    monkeypatch.setattr(builder, "MAX_STATEMENTS", 3)
    with pytest.raises(IllegalTransform) as err:
        for s in ir.stmts:
            r.copy(s)
    fourth = ir.stmts[3]
    assert f"statement {fourth.name} ({fourth.op}): program has more than 3 statements" in str(err.value)
    assert err.value.transform == "test"
