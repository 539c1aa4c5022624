import dataclasses
import json
import runpy
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

import coconet as cc
from coconet.errors import ProgramError
from coconet.schedules.serialize import MAX_JSON_BYTES, export, load, to_dict
from tests.strategies import programs

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.py"))


def example(name):
    return runpy.run_path(str(Path(__file__).parents[2] / "examples" / f"{name}.py"))["program"].ir


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_round_trip(path):
    prog = runpy.run_path(str(path))["program"].ir
    again = load(export(prog))
    assert again.hash == prog.hash
    assert again.stmts == prog.stmts
    assert export(again) == export(prog)


def test_scheduled_programs_round_trip():
    """What the transforms make (partial sums, slices of replicated state) is a program like any other."""
    from coconet.schedules.space import generate

    ops = set()
    for s in generate(example("lamb")):
        prog = dataclasses.replace(s.scheduled, groups=())
        again = load(export(prog))
        assert again.hash == prog.hash and again.stmts == prog.stmts
        ops |= {x.op for x in prog.stmts}
    assert {"slice", "partial_sum", "reduce_scatter", "all_gather"} <= ops


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_random_programs_round_trip(p):
    prog = p.ir
    again = load(json.loads(export(prog)))
    assert again.hash == prog.hash
    assert again.stmts == prog.stmts


def test_hash_ignores_order_and_intermediate_names():
    prog = example("adam")
    d = to_dict(prog)
    renamed = {s["name"]: f"z_{s['name']}" for s in d["statements"] if s["op"] not in ("input", "scalar")}
    for s in d["statements"]:
        s["name"] = renamed.get(s["name"], s["name"])
        if "args" in s:
            s["args"] = [renamed.get(a, a) for a in s["args"]]
    d["statements"].reverse()
    assert load(d).hash == prog.hash


def test_hash_sees_a_changed_attribute():
    d = to_dict(example("megatron_mlp"))
    for s in d["statements"]:
        if s["op"] == "dropout":
            s["attrs"]["p"] = 0.2
    assert load(d).hash != example("megatron_mlp").hash


def _adam_dict():
    return to_dict(example("adam"))


def _expect(d, *fragments):
    with pytest.raises(ProgramError) as info:
        load(d if isinstance(d, (str, bytes)) else json.dumps(d))
    msg = str(info.value)
    for f in fragments:
        assert f in msg, msg
    assert "\n" not in msg
    return info.value


def test_unknown_op_names_the_statement():
    d = _adam_dict()
    d["statements"][9]["op"] = "frobnicate"
    err = _expect(d, "frobnicate", d["statements"][9]["name"])
    assert err.statement == d["statements"][9]["name"]


def test_dangling_reference():
    d = _adam_dict()
    d["statements"][9]["args"] = ["nowhere"]
    _expect(d, "nowhere", "no statement defines")


def test_cyclic_reference():
    d = {
        "version": 1,
        "name": "cyc",
        "dims": ["N"],
        "statements": [
            {"name": "x", "op": "input", "attrs": {"shape": ["N"], "layout": "Replicated"}},
            {"name": "a", "op": "add", "args": ["x", "b"]},
            {"name": "b", "op": "mul", "args": ["a", "x"]},
            {"name": "o", "op": "output", "args": ["b"], "attrs": {"name": "o"}},
        ],
    }
    _expect(d, "cyclic reference", "a -> b -> a")


def test_self_reference_is_a_cycle():
    d = {
        "version": 1,
        "name": "cyc",
        "dims": [],
        "statements": [
            {"name": "a", "op": "neg", "args": ["a"]},
            {"name": "o", "op": "output", "args": ["a"], "attrs": {"name": "o"}},
        ],
    }
    _expect(d, "cyclic reference")


def test_forward_references_are_sorted():
    d = _adam_dict()
    d["statements"].reverse()
    assert load(d).hash == example("adam").hash


@pytest.mark.parametrize(
    "dims,shape,fragment",
    [
        (["N"], ["K"], "not among the program's dims"),
        (["N"], [0], "must be positive"),
        (["N"], ["N/2"], "only names, integers"),
        (["N", "N"], ["N"], "repeat a name"),
        (["1N"], ["N"], "must be an identifier"),
        (["N"], ["N"] * 9, "at most 8"),
        (["N"], "N", "must be a list"),
    ],
)
def test_bad_dims(dims, shape, fragment):
    d = {
        "version": 1,
        "name": "p",
        "dims": dims,
        "statements": [
            {"name": "x", "op": "input", "attrs": {"shape": shape, "layout": "Replicated"}},
            {"name": "o", "op": "output", "args": ["x"], "attrs": {"name": "o"}},
        ],
    }
    _expect(d, fragment)


@pytest.mark.parametrize(
    "mutate,fragment",
    [
        (lambda d: d.update(extra=1), "unknown keys ['extra']"),
        (lambda d: d.pop("dims"), "lacks ['dims']"),
        (lambda d: d.update(version=99), "schema version 99"),
        (lambda d: d["statements"][0].update(type="x"), "unknown keys ['type']"),
        (lambda d: d["statements"][0]["attrs"].update(colour="red"), "unknown attributes ['colour']"),
        (lambda d: d["statements"][0]["attrs"].update(layout="Diagonal"), "not a layout"),
        (lambda d: d["statements"][0]["attrs"].update(dtype="int8"), "tensor dtype 'int8'"),
        (lambda d: d["statements"][9].update(args="g"), "'args' must be a list"),
        (lambda d: d["statements"].append(dict(d["statements"][0])), "defined twice"),
        (lambda d: d["statements"][9].update(args=["g", "w"]), "allreduce takes 1 operands"),
        (lambda d: d.update(statements={}), "statements must be a list"),
    ],
)
def test_malformed(mutate, fragment):
    d = _adam_dict()
    mutate(d)
    _expect(d, fragment)


def test_not_json_and_not_an_object():
    _expect("{not json", "not valid JSON")
    _expect("[1, 2]", "is an object")


def test_deep_nesting_is_refused_cleanly():
    _expect("[" * 100_000 + "]" * 100_000, "nested too deeply")


def test_oversized_programs():
    _expect(b" " * (MAX_JSON_BYTES + 1), "at most")
    d = {
        "version": 1,
        "name": "big",
        "dims": [],
        "statements": [{"name": f"s{i}", "op": "scalar"} for i in range(10_001)],
    }
    _expect(d, "10001 statements")


def test_load_needs_custom_ops_it_uses():
    import numpy as np

    twice = cc.custom_op("twice", reference=lambda x: 2 * x)
    p = cc.Program("c", dims=("N",))
    x = p.tensor("x", ("N",), layout=cc.Replicated)
    p.output("y", twice(x))
    text = export(p.ir)
    _expect(text, "unknown op 'twice'")
    again = load(text, ops=[twice])
    assert again.hash == p.ir.hash
    assert again.custom_ops["twice"] is twice
    assert np.isfinite(0)
