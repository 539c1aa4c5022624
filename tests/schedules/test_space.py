"""Every schedule the generator yields computes what its program computes."""

import os
import runpy
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coconet.codegen.analysis import step_units as units
from coconet.errors import ScheduleError
from coconet.schedules import equivalence
from coconet.schedules.schedule import Schedule, sharded_by
from coconet.schedules.space import generate
from coconet.schedules.transforms.base import convex, convex_with
from tests.strategies import adam_over, collective_programs, programs

ROOT = Path(__file__).parents[2]
GOLDEN = Path(__file__).parent / "golden"
SIZES = {
    "adam": {"N": 7},
    "sgd": {"N": 5},
    "lamb": {"N": 9},
    "adam_multi": {"H": 3},
    "megatron_mlp": {"B": 2, "S": 3, "H": 5},
    "gpt_pipeline": {"B": 2, "S": 1, "H": 3},
    "conv_block": {"B": 3, "C": 5, "H": 4, "W": 3},
    "gpt_layer_sp": {"S": 5, "B": 2, "H": 3},
    "attention_out": {"A": 5, "S": 3, "D": 2, "H": 4},
}


def example(name):
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"))["program"].ir


def assert_equivalent(base, sched, world, sizes, stages=1, seed=1):
    assert sched.program is base
    bad = equivalence.check(sched, world, sizes, stages=stages, seed=seed)
    assert not bad, f"{sched.text} at R={world}: {bad[0]}"


def test_the_check_finds_a_wrong_schedule():
    prog = example("adam")
    wrong = Schedule(prog)
    wrong.__dict__["scheduled"] = example("sgd")  # a "transform" that changed the meaning
    assert equivalence.check(wrong, 2, {"N": 5})
    assert not equivalence.check(Schedule.parse("split(ar0)", prog), 3, {"N": 5})
    assert equivalence.rel_err(np.array([1.0, 2.0]), np.array([1.0, 2.0 + 1e-6])) > equivalence.ORACLE_TOLERANCE
    assert equivalence.rel_err(np.array([np.nan, np.inf]), np.array([np.nan, np.inf])) == 0.0
    assert equivalence.rel_err(np.ones(2), np.ones(3)) == float("inf")


@pytest.mark.parametrize("name", sorted(SIZES))
def test_every_example_schedule_is_equivalent(name):
    prog = example(name)
    space = generate(prog)
    assert not space.refused and not space.truncated
    stages = 2 if prog.is_pipeline else 1
    for world in (1, 2, 3, 4):
        for sched in space:
            assert_equivalent(prog, sched, world, SIZES[name], stages)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(collective_programs())
def test_random_collective_programs(p):
    prog = p.ir
    space = generate(prog, depth=4)
    assert not space.refused
    assert len({s.structure for s in space}) == len(space)
    for world in (1, 2, 3, 4):
        for sched in space:
            assert_equivalent(prog, sched, world, {"N": 5, "M": 3})
    for sched in space:  # the interpreter ignores groups; a backend must find an order that runs each as a unit
        units(sched.scheduled)


@pytest.mark.parametrize("name", sorted(SIZES))
def test_what_a_schedule_hands_on_from_its_statements_is_what_they_give(name):
    """A group added to a program keeps the tables read off its statements (Program.with_groups): in every
    schedule they are what the scheduled program's statements give when computed anew."""
    import dataclasses

    from coconet.schedules.ir import _OF_STATEMENTS

    carried = 0
    for sched in generate(example(name)):
        prog = sched.scheduled
        fresh = dataclasses.replace(prog)
        for key in _OF_STATEMENTS:
            if key in prog.__dict__:
                carried += 1
                assert prog.__dict__[key] == getattr(fresh, key), (sched.text, key)
        assert prog.hash == fresh.hash and prog.group_of == fresh.group_of
    assert carried


def test_groups_that_would_need_each_other_first_are_never_offered():
    """Each group convex on its own, two groups can still need each other first: here a bucket of ag1 and
    ag3 where ag1 feeds the fused collective of rs0 and rs0 feeds ag3. No backend could run that schedule."""
    import coconet as cc

    p = cc.Program("cyc", dims=("N",))
    r1 = cc.allreduce(p.tensor("x", ("N",), layout=cc.Local))
    r2 = cc.allreduce(p.tensor("y", ("N",), layout=cc.Local))
    p.output("a", r1 - r2)
    p.output("b", cc.exp(r1) + 1.0)
    prog = p.ir
    space = generate(prog)
    assert not space.refused and len(space) > 20
    for sched in space:
        units(sched.scheduled)
    with pytest.raises(ScheduleError, match=r"bucket\(ag1, ag3\) as one unit would create a cycle"):
        Schedule.parse(
            "split(ar0); split(ar1); reorder(ag0); fuse(exp0, add0); fuse_collective(rs0); bucket(ag1, ag3)", prog
        )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(programs(max_ops=8))
def test_random_programs(p):
    prog = p.ir
    space = generate(prog, depth=3)
    assert not space.refused
    for world in (2, 3):
        for sched in space:
            assert_equivalent(prog, sched, world, {"N": 4, "M": 3})


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(collective_programs())
def test_text_round_trip_random(p):
    prog = p.ir
    for sched in generate(prog, depth=4):
        again = Schedule.parse(sched.text, prog)
        assert again.text == sched.text and again.structure == sched.structure and again.hash == sched.hash
        assert again.scheduled == sched.scheduled  # names too: later transforms name statements


@pytest.mark.parametrize("name", sorted(SIZES))
def test_text_and_json_round_trip(name):
    prog = example(name)
    for sched in generate(prog):
        again = Schedule.parse(sched.text, prog)
        assert again.text == sched.text and again.structure == sched.structure
        assert again.scheduled == sched.scheduled
        assert Schedule.from_json(sched.to_json(), prog).hash == sched.hash
        tuned = sched.with_knobs(**{k: dom[-1] for k, (_, dom) in sched.knob_domains.items()})
        if sched.knob_domains:
            assert tuned.hash != sched.hash and tuned.structure == sched.structure
            assert Schedule.parse(tuned.text, prog).knob_values == tuned.knob_values


def texts(name):
    """Schedule texts without their knob values."""
    return ["; ".join(x for x in s.text.split("; ") if "(" in x or "=" not in x) for s in generate(example(name))]


def test_the_space_contains_the_papers_schedules():
    adam = texts("adam")
    assert adam[0] == "baseline"
    assert "split(ar0); reorder(ag0)" in adam
    assert "split(ar0); reorder(ag0); as_slice(m); as_slice(v)" in adam
    assert "split(ar0); reorder(ag0); fuse_collective(rs0)" in adam
    assert "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0)" in adam
    assert any(t.startswith("fuse(") for t in adam)
    for opt in ("sgd", "lamb"):
        t = texts(opt)
        assert "split(ar0); reorder(ag0)" in t and "split(ar0); reorder(ag0); fuse_collective(rs0)" in t
        assert any("as_slice" in x for x in t) and any(x.startswith("fuse(") for x in t)
    multi = texts("adam_multi")
    assert "bucket(ar0, ar1, ar2, ar3)" in multi
    assert any("bucket(rs0, rs1, rs2, rs3)" in t for t in multi)
    mega = texts("megatron_mlp")
    assert {
        "overlap(mm0, ar0)",
        "split(ar0); reorder(ag0)",
        "fuse(add0, drop0, add1)",
        "split(ar0); reorder(ag0); fuse_collective(rs0)",
        "split(ar0); reorder(ag0); overlap(mm0, rs0)",
        "fuse(add0, drop0, add1); overlap(mm0, ar0)",
    } <= set(mega)
    pipe = texts("gpt_pipeline")
    assert {
        "split(ar0); reorder(ag0); slice_send(send0)",
        "split(ar0); reorder(ag0); slice_send(send0); overlap(mm0, rs0)",
    } <= set(pipe)


def test_lamb_on_slices_computes_partial_norms():
    prog = example("lamb")
    sched = Schedule.parse("split(ar0); reorder(ag0); as_slice(w); as_slice(m); as_slice(v)", prog)
    ops = [s.op for s in sched.scheduled.stmts]
    assert ops.count("partial_sum") == 2  # norm(w) and norm(u), both over slices now
    assert ops.count("allreduce") == 2
    for world in (2, 3, 4):
        assert_equivalent(prog, sched, world, {"N": 10})


def test_slice_send_gathers_only_where_needed():
    prog = example("gpt_pipeline")
    sched = Schedule.parse("split(ar0); reorder(ag0); slice_send(send0)", prog)
    s = sched.scheduled
    assert str(s["x"].type.layout) == "Sliced(0)"
    send = next(x for x in s.stmts if x.op == "send")
    assert str(s[send.args[0]].type.layout) == "Sliced(0)"
    assert not any(x.op == "all_gather" for x in s.stmts)  # the residual is only used on slices
    for world in (1, 3):
        assert_equivalent(prog, sched, world, {"B": 3, "S": 2, "H": 2}, stages=3)


def test_generation_is_deterministic_and_deduplicated():
    a, b = generate(example("adam")), generate(example("adam"))
    assert [s.text for s in a] == [s.text for s in b]
    assert len({s.structure for s in a}) == len(a)
    alone = generate(example("adam"), depth=0)
    assert alone.schedules[0].text == "baseline" and len(alone) == 1


@pytest.mark.parametrize("name", ["adam", "megatron_mlp"])
def test_golden_listing(name):
    listing = generate(example(name)).listing()
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("COCONET_UPDATE_GOLDEN"):
        path.write_text(listing)
    assert listing == path.read_text(), f"the {name} space changed; review and regenerate with COCONET_UPDATE_GOLDEN=1"


def test_sharded_names_the_state_a_schedule_leaves_sliced():
    prog = example("adam")
    zero1 = "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0)"
    assert Schedule(prog).sharded == ()
    assert Schedule.parse("split(ar0)", prog).sharded == ()
    assert Schedule.parse(zero1, prog).sharded == ("m", "v")
    assert set(Schedule.parse("split(ar0); reorder(ag0); as_slice(w); as_slice(m); as_slice(v)", prog).sharded) == {
        "w",
        "m",
        "v",
    }
    # a Sliced input the program declares so is not sharded by the schedule
    assert {s.sharded for s in generate(example("megatron_mlp"))} == {()}


@pytest.mark.parametrize("name", ["adam", "lamb", "adam_multi", "megatron_mlp"])
def test_sharded_read_off_the_text_alone_agrees_with_the_schedule(name):
    """The server names the state a stored winner shards from its text, without loading the program."""
    for s in generate(example(name)):
        assert sharded_by(s.text) == sorted(s.sharded), s.text
    assert sharded_by("baseline") == sharded_by("") == []
    with pytest.raises(ScheduleError, match="unknown transform 'shard'"):
        sharded_by("shard(w)")


def test_zero1_shards_the_moments_even_when_weight_decay_reads_the_weights_into_them():
    """RMSprop with coupled weight decay: the moments' new values read w, yet they are the state the step
    reads into w's update, and w's new value is read by nothing; ZeRO-1 shards sq and buf, not w."""
    from coconet import Local, Program, Replicated, allreduce, sqrt

    p = Program("rmsprop", dims=("N",))
    g = p.tensor("g", ("N",), layout=Local)
    w, sq, buf = (p.tensor(n, ("N",), layout=Replicated) for n in ("w", "sq", "buf"))
    lr, alpha, eps, mom, wd = p.scalars("lr alpha eps mom wd")
    d = allreduce(g, op="avg") + wd * w
    sq1 = alpha * sq + (1 - alpha) * d * d
    buf1 = mom * buf + d / (sqrt(sq1) + eps)
    p.update(sq, sq1)
    p.update(buf, buf1)
    p.update(w, w - lr * buf1)
    space = generate(p.ir)
    zero1 = [s for s in space if set(s.sharded) == {"sq", "buf"}]
    assert any("fuse_collective" in s.text for s in zero1)
    assert all(not equivalence.check(s, world, {"N": 7}) for s in zero1 for world in (2, 3))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(collective_programs(), st.data())
def test_growing_a_region_agrees_with_checking_it_whole(p, data):
    # regions grow through convex_with, which searches from the new statement alone
    for sched in generate(p.ir, depth=3):
        prog = sched.scheduled
        free = [s.name for s in prog.stmts if s.name not in prog.group_of]
        members: set[str] = set()
        for name in data.draw(st.lists(st.sampled_from(free), unique=True, max_size=8)) if free else []:
            whole = convex(prog, members | {name})
            if members:
                assert (convex_with(prog, members, name) is None) == (whole is None), (sched.text, members, name)
            if whole is None:
                members.add(name)


@pytest.mark.parametrize("name", ["adam", "adam_multi", "megatron_mlp", "lamb"])
def test_a_listing_words_each_schedule_as_it_would_alone(name, monkeypatch):
    space = generate(example(name))
    alone = [Schedule.parse(s.text, s.program).describe() for s in space]
    applied = []
    for cls in {type(t) for s in space for t in s.transforms}:
        monkeypatch.setattr(cls, "apply", _counting(cls.apply, applied))
    listed = [entry["description"] for entry in space.to_json()["schedules"]]
    assert listed == alone
    # prefixes are applied once for the whole listing, not once per schedule that starts with them
    assert len(applied) <= sum(len(s.transforms) for s in space) // 2


def _counting(apply, calls):
    def counted(self, program):
        calls.append(self)
        return apply(self, program)

    return counted


def test_the_longest_schedule_of_a_program_with_many_tensors_parses():
    # fifty tensors' ZeRO-1 schedule names each of them several times: 12 KB of text, which the fixed
    # 8 KB bound refused when a tune resumed it or the service showed its code
    prog = adam_over(50)
    longest = max(generate(prog), key=lambda s: len(s.text))
    assert len(longest.text) > 8192
    assert Schedule.parse(longest.text, prog).scheduled == longest.scheduled
    with pytest.raises(ScheduleError, match=r"at most \d+ characters for a program of \d+ statements"):
        Schedule.parse(longest.text + " " * (256 * len(prog) + 8192), prog)


def test_reading_a_schedule_rebuilds_its_program_once_per_run_of_a_batched_transform(monkeypatch):
    # twenty tensors' ZeRO-1 schedule: twenty splits, twenty reorders, as_slices of forty moments at least; one
    # rebuild per transform made reading it cost (tensors x statements) copies
    from coconet.schedules import rewrite

    prog = adam_over(20)
    zero1 = next(s for s in generate(prog) if s.sharded and "fuse" not in s.text)
    names = zero1.names
    assert names.count("split") == names.count("reorder") == 20 and names.count("as_slice") >= 40
    rebuilds = []
    finish = rewrite.Rewriter.finish
    monkeypatch.setattr(rewrite.Rewriter, "finish", lambda self, *a: rebuilds.append(self) or finish(self, *a))
    again = Schedule.parse(zero1.text, prog)
    assert again.scheduled == zero1.scheduled
    assert len(rebuilds) == len(names) - names.count("split") - names.count("reorder") - names.count("as_slice") + 3
