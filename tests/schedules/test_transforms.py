"""Each transform's documented refusals, and the rewrites' exact effect."""

import runpy
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import coconet as cc
from coconet.errors import IllegalTransform, ScheduleError
from coconet.schedules import equivalence
from coconet.schedules.builder import Builder
from coconet.schedules.schedule import Schedule
from coconet.schedules.transforms import (
    TRANSFORMS,
    AsSlice,
    Bucket,
    Fuse,
    FuseCollective,
    Overlap,
    Reorder,
    SliceReduce,
    SliceSend,
    Split,
)
from coconet.schedules.transforms.base import convex, convex_with
from coconet.schedules.transforms.fuse import regions
from tests.strategies import adam_over, collective_programs

ROOT = Path(__file__).parents[2]


def example(name):
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"))["program"].ir


def sched(name, text):
    return Schedule.parse(text, example(name)).scheduled


def refuses(transform, program, fragment):
    with pytest.raises(IllegalTransform) as info:
        transform.apply(program)
    assert fragment in str(info.value), str(info.value)
    assert str(info.value).startswith(transform.text())


def test_split_rewrites_the_allreduce():
    p = sched("adam", "split(ar0)")
    ops = [s.op for s in p.stmts]
    assert "allreduce" not in ops and ops.count("reduce_scatter") == 1 and ops.count("all_gather") == 1
    assert str(p["rs0"].type.layout) == "Sliced(0)" and str(p["ag0"].type.layout) == "Replicated"


def test_split_refusals():
    adam = example("adam")
    refuses(Split("mul0"), adam, "mul0 is a mul, not an allreduce")
    refuses(Split("nothing"), adam, "no statement 'nothing'")
    refuses(Split("ar0", dim=1), adam, "out of range")
    p = cc.Program("s", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    p.output("n", cc.allreduce(cc.sum(g)))
    refuses(Split("ar0"), p.ir, "reduces a scalar")
    assert Split.instances(p.ir) == []


def test_reorder_moves_work_onto_slices():
    p = sched("adam", "split(ar0); reorder(ag0)")
    for name in ("add0", "add1", "sub4"):
        assert str(p[name].type.layout) == "Sliced(0)"
    # the Replicated state is read as slices, and the updates gather
    ups = p.updates
    assert all(p[v].op == "all_gather" for v in ups.values())


def test_reorder_refuses_local_inputs():
    p = cc.Program("r", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    h = p.tensor("h", ("N",), layout=cc.Local)
    w = p.tensor("w", ("N",), layout=cc.Replicated)
    a = cc.allreduce(g)
    p.output("y", a * w)
    p.output("z", a + h)  # a Local operand: the sum cannot run on slices
    prog = Schedule.parse("split(ar0)", p.ir).scheduled
    assert [m for m in Reorder.instances(prog)] == [Reorder("ag0")]
    add = next(s.name for s in prog.stmts if s.op == "add")
    refuses(Reorder("ag0", (add,)), prog, f"{add} reads Local h")
    refuses(Reorder("ag0", ("g",)), prog, "g is a input; only pointwise work")
    refuses(Reorder("ag1"), prog, "no statement 'ag1'")


def test_reorder_inserts_partial_norms_for_lamb():
    p = sched("lamb", "split(ar0); reorder(ag0)")
    ops = [s.op for s in p.stmts]
    assert ops.count("partial_sum") == 1  # norm(u) is over slices; norm(w) still over the whole w
    p = sched("lamb", "split(ar0); reorder(ag0); as_slice(w)")
    assert [s.op for s in p.stmts].count("partial_sum") == 2


def adafactor():
    return runpy.run_path(str(ROOT / "benchmarks" / "programs" / "adafactor.py"))["program"].ir


def test_reorder_takes_row_and_column_sums_onto_the_rows():
    # Adafactor: g^2's row sums are products of its rows, computed on this rank's; its column sums contract
    # the rows, so each rank multiplies its columns of the ones by its rows, and an allreduce adds them up
    p = Schedule.parse("split(ar0); reorder(ag0)", adafactor()).scheduled
    rows, cols = (s for s in p.stmts if s.op == "matmul")
    assert str(rows.type.layout) == "Sliced(0)" and rows.args[1] == "ones_k"
    assert p[cols.args[0]].op == "slice" and p[cols.args[0]].attr("dim") == -1 and p[cols.args[0]].args == ("ones_m",)
    assert str(cols.type.layout) == "Local" and [p[u].op for u in p.users[cols.name]] == ["allreduce"]
    # r's and w's new values are gathered, c's comes whole out of its allreduce, and g^2 is never gathered
    assert sorted(t for t, v in p.updates.items() if p[v].op == "all_gather") == ["r", "w"]
    assert [s.op for s in p.stmts].count("all_gather") == 2


def test_split_slices_a_dim_longer_than_one():
    # a (1, K) column sum: split along dim 0 would give every row to rank 0
    p = Schedule.parse("split(ar0); reorder(ag0)", adafactor()).scheduled
    ar = next(s.name for s in p.stmts if s.op == "allreduce" and s.type.ndim == 2)
    assert Split.instances(p) == [Split(ar, dim=1)]


def test_fuse_collective_leaves_out_work_sliced_along_rows_of_another_extent():
    # the (1, K) sums scattered along their one row: the (M, K) update sliced along its M rows is not the
    # chunk's rows, and stays out of the fused collective
    text = "split(ar0); reorder(ag0); split(ar0, dim=0); as_slice(w); reorder(ag0); fuse_collective(rs1)"
    p = Schedule.parse(text, adafactor()).scheduled
    (group,) = p.groups
    assert {p[m].type.shape[0].value for m in group.members if p[m].op not in ("all_gather",)} == {1}


def test_as_slice_shards_state():
    p = sched("adam", "split(ar0); reorder(ag0); as_slice(m); as_slice(v)")
    assert str(p["m"].type.layout) == "Sliced(0)" and str(p["v"].type.layout) == "Sliced(0)"
    assert str(p["w"].type.layout) == "Replicated"
    assert p[p.updates["m"]].op != "all_gather" and p[p.updates["w"]].op == "all_gather"


def test_as_slice_refusals():
    adam = example("adam")
    refuses(AsSlice("m"), adam, "reorder the update onto slices first")
    refuses(AsSlice("g"), adam, "is Local")
    refuses(AsSlice("lr"), adam, "lr is a scalar, not a tensor input")
    p = cc.Program("a", dims=("N",))
    x = p.tensor("x", ("N",), layout=cc.Replicated)
    p.output("y", x * 2.0)
    refuses(AsSlice("x"), p.ir, "not updated")


def test_as_slice_gathers_for_readers_that_need_the_whole_state():
    p = cc.Program("a", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    m = p.tensor("m", ("N",), layout=cc.Replicated)
    wt = p.tensor("wt", ("N", "N"), layout=cc.Replicated)
    p.update(m, m + cc.allreduce(g))
    p.output("y", cc.matmul(m, wt))
    prog = Schedule.parse("split(ar0); reorder(ag0); as_slice(m)", p.ir).scheduled
    mm = next(s for s in prog.stmts if s.op == "matmul")
    assert prog[mm.args[0]].op == "all_gather" and prog[prog[mm.args[0]].args[0]].name == "m"


def test_as_slice_gathers_for_a_reader_whose_slices_would_meet_others_along_another_dim():
    # cv (a column factor) kept sliced along its columns, s1 along its rows: s0 + cv could take cv's
    # slices, but its result meets s1's rows, so that reader gets cv whole
    p = cc.Program("a", dims=("N", "M"))
    g = p.tensor("g", ("N", "M"), layout=cc.Local)
    s0, s1 = (p.tensor(n, ("N", "M"), layout=cc.Replicated) for n in ("s0", "s1"))
    cv = p.tensor("cv", (1, "M"), layout=cc.Replicated)
    by_row = p.tensor("by_row", (1, "N"), layout=cc.Replicated)
    p.update(cv, by_row @ (s1 - (s0 + cv)))
    p.update(s1, cc.allreduce(g))
    text = "split(ar0); as_slice(s1); split(ar0, dim=1); as_slice(cv)"
    prog = Schedule.parse(text, p.ir).scheduled
    assert str(prog["cv"].type.layout) == "Sliced(1)" and str(prog["s1"].type.layout) == "Sliced(0)"
    add = next(s for s in prog.stmts if s.op == "add")
    assert prog[add.args[1]].op == "all_gather" and prog[add.args[1]].args == ("cv",)
    assert AsSlice("cv") in AsSlice.instances(Schedule.parse(text.rsplit(";", 1)[0], p.ir).scheduled)
    for world in (1, 2, 3):
        assert not equivalence.check(Schedule.parse(text, p.ir), world, {"N": 6, "M": 4})


def test_reorder_leaves_work_already_on_slices_as_its_readers_took_it():
    # after reorder(ag0), d = ag1 - rs0 is already on rows, and the product takes them as partial products;
    # moving d onto rs1's rows must not hand the product d whole (no matmul rule for its sliced ones row)
    p = cc.Program("r", dims=("N", "M"))
    g0, g1 = (p.tensor(n, ("N", "M"), layout=cc.Local) for n in ("g0", "g1"))
    by_row = p.tensor("by_row", (1, "N"), layout=cc.Replicated)
    p.output("o", by_row @ (cc.allreduce(g1) - cc.allreduce(g0)))
    text = "split(ar0); split(ar1); reorder(ag0); reorder(ag1)"
    prog = Schedule.parse(text, p.ir).scheduled
    assert "all_gather" not in [s.op for s in prog.stmts]
    mm = next(s for s in prog.stmts if s.op == "matmul")
    assert prog[mm.args[1]].op == "sub" and str(mm.type.layout) == "Local"
    for world in (1, 2, 3):
        assert not equivalence.check(Schedule.parse(text, p.ir), world, {"N": 6, "M": 4})


def test_fuse_refuses_a_cycle():
    p = cc.Program("f", dims=("N",))
    x = p.tensor("x", ("N",), layout=cc.Replicated)
    a = (x * 2.0).named("a")
    b = cc.norm(a)  # not pointwise: a -> norm -> c leaves and re-enters {a, c}
    c = (a * b).named("c")
    p.output("y", c)
    refuses(Fuse(("a", "c")), p.ir, "cycle")
    assert Fuse.instances(p.ir) == []


def test_fuse_refusals():
    adam = example("adam")
    refuses(Fuse(("mul0",)), adam, "at least two")
    refuses(Fuse(("ar0", "mul1")), adam, "ar0 is a allreduce")
    refuses(Fuse(("sub0", "mul1")), adam, "computes a scalar")
    meg = example("megatron_mlp")
    refuses(Fuse(("mm0", "add0")), meg, "mm0 is a matmul")
    fused = Fuse(("add0", "drop0", "add1")).apply(meg)
    refuses(Fuse(("add0", "drop0")), fused, "already runs in fuse")


def test_a_statement_named_twice_is_refused():
    # deduplicated silently, fuse(mul0, mul0) had passed as a one-member kernel
    adam = example("adam")
    mul = next(s.name for s in adam.stmts if s.op == "mul" and s.type.ndim > 0)
    refuses(Fuse((mul, mul)), adam, f"{mul} is named twice")
    refuses(Bucket(("ar0", "ar1", "ar0")), example("adam_multi"), "ar0 is named twice")
    split = sched("adam", "split(ar0)")
    refuses(Reorder("ag0", ("add0", "add0")), split, "add0 is named twice")
    with pytest.raises(ScheduleError, match="named twice"):
        Schedule.parse(f"fuse({mul}, {mul})", adam)


def test_fuse_collective():
    p = sched("adam", "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0)")
    (group,) = p.groups
    assert group.kind == "fused_collective" and group.members[0] == "rs0"
    assert [p[m].op for m in group.members].count("all_gather") == 1  # only w is gathered
    refuses(FuseCollective("rs0"), sched("adam", "split(ar0)"), "reorder first")
    refuses(FuseCollective("ar0"), example("adam"), "not a reduce_scatter")


def test_fuse_collective_takes_the_partial_sums_of_its_slices():
    # LAMB's norm(u) over the slices: u * u is summed inside, chunk by chunk; the allreduce of the partials,
    # and the trust ratio and update that wait for it, stay outside
    base = sched("lamb", "split(ar0); reorder(ag0)")
    p = sched("lamb", "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0)")
    (group,) = p.groups
    psum = next(m for m in group.members if p[m].op == "partial_sum")
    assert p[p[psum].args[0]].op == "mul" and p[p[psum].args[0]].args[0] == p[p[psum].args[0]].args[1]
    assert all(u not in group.members for u in p.users[psum]) and p[p.users[psum][0]].op == "allreduce"
    text = FuseCollective("rs0").describe(AsSlice("v").apply(AsSlice("m").apply(base)))
    assert text == "rs0 fused with 12 statements, 1 partial sum and 0 all_gathers"


def test_slice_reduce_takes_a_replicated_norm_from_the_ranks_slices():
    lamb = example("lamb")
    p = SliceReduce("norm0").apply(lamb)
    root = p["norm0"]  # the name stays on the value: what reads the norm reads it unchanged
    assert root.op == "sqrt" and p[root.args[0]].op == "allreduce"
    psum = p[p[root.args[0]].args[0]]
    square = p[psum.args[0]]
    view = p[square.args[0]]
    assert psum.op == "partial_sum" and square.op == "mul" and square.args == (view.name, view.name)
    assert view.op == "slice" and view.args == ("w",) and view.type.layout == cc.Sliced(0)
    assert [t.text() for t in SliceReduce.instances(lamb)] == ["slice_reduce(norm0)"]
    # norm(u) reads the allreduced gradient: split and reorder slice it, reducing only the rows they keep
    assert SliceReduce.instances(sched("lamb", "split(ar0)")) == [SliceReduce("norm0")]
    assert SliceReduce.instances(p) == []


def test_slice_reduce_refusals():
    lamb = example("lamb")
    refuses(SliceReduce("div3"), lamb, "not a norm or sum")
    refuses(SliceReduce("nope"), lamb, "no statement")
    refuses(SliceReduce("norm0", dim=1), lamb, "out of range")
    refuses(SliceReduce("norm1"), sched("lamb", "split(ar0); reorder(ag0)"), "a sqrt")  # its partials already
    refuses(SliceReduce("norm0"), sched("lamb", "fuse(mul7, sub4)"), "rewrites come before")
    p = cc.Program("local_norm", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    (a,) = p.scalars("a")
    p.output("n", cc.norm(g) + cc.sum(a))
    refuses(SliceReduce("norm0"), p.ir, "g is Local: only a value every rank holds whole")
    refuses(SliceReduce("sum0"), p.ir, "a is a scalar")


def test_a_slice_is_only_of_a_replicated_tensor():
    b = Builder("s", ("N",))
    g = b.add("input", (), {"shape": ("N",), "layout": "Local"}, name="g")
    x = b.add("const", (), {"value": 2})
    with pytest.raises(cc.ProgramError, match="only Replicated values"):
        b.add("slice", (g,))
    with pytest.raises(cc.ProgramError, match="scalar"):
        b.add("slice", (x,))
    rows = b.add("reduce_scatter", (g,), {"op": "sum", "dim": 0})
    assert b.add("slice", (rows,), {"dim": 0}) == rows  # what each rank holds already


def test_sharding_the_state_a_slice_reads_leaves_each_rank_its_rows_without_a_gather():
    # ZeRO-3's w: its norm from the rows each rank now holds, where a gather then a slice would move all of w
    p = sched("lamb", "split(ar0); reorder(ag0); slice_reduce(norm0); as_slice(w); as_slice(m); as_slice(v)")
    assert not [s for s in p.stmts if s.op in ("all_gather", "slice")]
    square = next(s for s in p.stmts if s.op == "mul" and s.args == ("w", "w"))
    assert [p[u].op for u in p.users[square.name]] == ["partial_sum"]


def test_fuse_collective_takes_the_work_on_a_slice_of_state_with_its_rows():
    # LAMB's norm(w) from slices: w's rows squared and summed in the chunk that reads them for the update
    p = sched("lamb", "split(ar0); reorder(ag0); as_slice(m); as_slice(v); slice_reduce(norm0); fuse_collective(rs0)")
    (group,) = p.groups
    assert [p[m].op for m in group.members].count("partial_sum") == 2
    view = next(m for m in group.members if p[m].op == "slice")
    assert p[view].args == ("w",)
    before = sched("lamb", "split(ar0); reorder(ag0); as_slice(m); as_slice(v); slice_reduce(norm0)")
    assert FuseCollective("rs0").describe(before) == "rs0 fused with 14 statements, 2 partial sums and 0 all_gathers"


def test_a_norm_written_before_the_allreduce_still_joins_the_fused_collective():
    # LARS as one might write it, the weights' norm first: sliced, it is computed where it is first read, after
    # the collective the fused one begins with
    p = cc.Program("lars", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    w, v = p.tensor("w", ("N",), layout=cc.Replicated), p.tensor("v", ("N",), layout=cc.Replicated)
    lr, eta = p.scalars("lr eta")
    w_norm = cc.norm(w)
    grad = cc.allreduce(g)
    v1 = v + lr * eta * w_norm / cc.norm(grad) * grad
    p.update(v, v1)
    p.update(w, w - v1)
    prog = p.ir
    assert prog.position["norm0"] < prog.position["ar0"]
    sched = Schedule.parse("split(ar0); reorder(ag0); as_slice(v); slice_reduce(norm0); fuse_collective(rs0)", prog)
    (group,) = sched.scheduled.groups
    assert [sched.scheduled[m].op for m in group.members].count("partial_sum") == 2 and "sl0" in group.members
    for world in (1, 2, 3):
        assert not equivalence.check(sched, world, {"N": 7})


def test_fuse_collective_leaves_out_a_slice_it_would_only_copy_out():
    b = Builder("idle", ("N",))
    g = b.add("input", (), {"shape": ("N",), "layout": "Local"}, name="g")
    w = b.add("input", (), {"shape": ("N",), "layout": "Replicated"}, name="w")
    rs = b.add("reduce_scatter", (g,), {"op": "sum", "dim": 0}, name="rs0")
    b.add("update", (w, b.add("mul", (rs, rs))))
    b.add("output", (b.add("slice", (w,), name="sl0"),), {"name": "rows"})
    p = b.finish()
    assert "sl0" not in FuseCollective("rs0").apply(p).groups[0].members
    b2 = Builder("used", ("N",))
    g = b2.add("input", (), {"shape": ("N",), "layout": "Local"}, name="g")
    w = b2.add("input", (), {"shape": ("N",), "layout": "Replicated"}, name="w")
    rs = b2.add("reduce_scatter", (g,), {"op": "sum", "dim": 0}, name="rs0")
    b2.add("update", (w, b2.add("mul", (rs, b2.add("slice", (w,), name="sl0")))))
    assert "sl0" in FuseCollective("rs0").apply(b2.finish()).groups[0].members


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(collective_programs(), st.sampled_from([1, 2, 3, 4]))
def test_slice_reduce_computes_what_the_program_computes(p, world):
    prog = p.ir
    splits = [s.name for s in prog.stmts if s.op == "allreduce" and s.type.ndim > 0]
    for t in SliceReduce.instances(prog):
        texts = [t.text()]
        for ar in splits:  # and a fused collective that may take the slice's work, where one applies
            split = Split(ar).apply(prog)
            rs = next(s.name for s in split.stmts if s.op == "reduce_scatter" and s.name not in prog)
            texts.append(f"split({ar}); {t.text()}; fuse_collective({rs})")
        for text in texts:
            try:
                s = Schedule.parse(text, prog)
                assert s.scheduled.groups or text == t.text()
            except (IllegalTransform, ScheduleError):
                assert text != t.text()
                continue
            assert not equivalence.check(s, world, {"N": 5, "M": 3}), text


def test_overlap_and_bucket():
    meg = example("megatron_mlp")
    p = Overlap("mm0", "ar0").apply(meg)
    assert p.groups[0].knobs == ("chunks",)
    refuses(Overlap("mm0", "add0"), meg, "not an allreduce or reduce_scatter")
    refuses(Overlap("mm0", "ar0"), p, "already runs in overlap")
    multi = example("adam_multi")
    assert Bucket.instances(multi) == [Bucket(("ar0", "ar1", "ar2", "ar3"))]
    refuses(Bucket(("ar0",)), multi, "at least two")
    dep = cc.Program("d", dims=("N",))
    g = dep.tensor("g", ("N",), layout=cc.Local)
    h = dep.tensor("h", ("N",), layout=cc.Local)
    a0 = cc.allreduce(g)
    dep.output("y", cc.allreduce(h * a0))
    refuses(Bucket(("ar0", "ar1")), dep.ir, "must be independent")


def test_slice_send_refusals():
    pipe = example("gpt_pipeline")
    refuses(SliceSend("send0"), pipe, "split and reorder")
    refuses(SliceSend("ar0"), pipe, "not a send")


def test_rewrites_come_before_groupings():
    fused = Fuse(("add0", "drop0", "add1")).apply(example("megatron_mlp"))
    refuses(Split("ar0"), fused, "rewrites come before")
    assert Split.instances(fused) == []


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("teleport(ar0)", "unknown transform 'teleport'"),
        ("split(ar0); chunks=4", "not a knob of this schedule"),
        ("overlap(mm0, ar0); chunks=0", "positive integer"),
        ("split(", "neither a transform"),
        ("chunks=4; overlap(mm0, ar0)", "knobs come after"),
        ("split(ar0, ar1)", "unexpected arguments"),
        ("split(ar0, dim=x)", "must be an integer"),
        ("split(add0)", "illegal schedule: split(add0): add0 is a add"),
        ("x" * (8192 + 256 * 40), "at most"),  # the megatron layer has fewer than 40 statements
    ],
)
def test_schedule_text_errors(text, fragment):
    with pytest.raises(ScheduleError) as info:
        Schedule.parse(text, example("megatron_mlp"))
    assert fragment in str(info.value)


def test_schedule_text_json_and_hash():
    prog = example("megatron_mlp")
    s = Schedule.parse("split(ar0);reorder(ag0) ;  overlap(mm0, rs0); chunks=8", prog)
    assert s.text == "split(ar0); reorder(ag0); overlap(mm0, rs0); chunks=8"
    assert s.knob_values == {"chunks": 8}
    assert s.hash != s.with_knobs(chunks=4).hash and s.structure == s.with_knobs(chunks=4).structure
    assert Schedule.from_json(s.to_json(), prog).text == s.text
    with pytest.raises(ScheduleError, match="for program"):
        Schedule.from_json({**s.to_json(), "program": "0" * 16}, prog)
    assert Schedule(prog).text == "baseline" and Schedule.parse("baseline", prog).hash == Schedule(prog).hash


def test_pretty_shows_layouts_and_units():
    text = Schedule.parse("split(ar0); reorder(ag0); fuse_collective(rs0)", example("megatron_mlp")).pretty()
    assert "Sliced(0)" in text and "[fused_collective rs0" in text
    assert text.splitlines()[0].startswith("# megatron_mlp  schedule: split(ar0)")


def test_every_transform_is_a_frozen_dataclass_with_a_unique_name():
    import dataclasses

    assert len({t.name for t in TRANSFORMS}) == len(TRANSFORMS)
    for t in TRANSFORMS:
        assert dataclasses.is_dataclass(t) and t.__dataclass_params__.frozen


def _spanned(backward):
    """Statements x and y with a fused group {a, b} whose members lie on both sides of them, the group
    joining two paths into a cycle through {x, y}: y -> u -> a and b -> x, or x -> u -> b and a -> y."""
    p = cc.Program("spans", dims=("N",))
    pin = p.tensor("pin", ("N",), layout=cc.Replicated)
    qin = p.tensor("qin", ("N",), layout=cc.Replicated)
    if backward:
        a = (pin * 2.0).named("a")
        x = (qin + 1.0).named("x")
        b = ((x * 3.0).named("u") * 2.0).named("b")
        p.output("b", b)
        p.output("y", (a + 1.0).named("y"))
    else:
        x = ((pin * 2.0).named("b") + 1.0).named("x")
        y = (qin * 3.0).named("y")
        p.output("x", x)
        p.output("a", ((y * 2.0).named("u") + 1.0).named("a"))
    return Fuse(("a", "b")).apply(p.ir)


@pytest.mark.parametrize("backward", [False, True])
def test_a_group_reaching_past_a_region_closes_a_cycle_through_it(backward):
    # the searches stop past the region's ends, except where a group reaches further: here the
    # only path back into {x, y} runs through the group's far member
    prog = _spanned(backward)
    assert convex(prog, {"x", "y"}) is not None
    assert convex_with(prog, {"x"}, "y") is not None
    assert convex_with(prog, {"y"}, "x") is not None
    refuses(Fuse(("x", "y")), prog, "cycle")


def test_a_rewrite_infers_each_literal_by_its_own_type():
    # a rewrite takes the types its source inferred; step * 2 and step * 2.0 share all but the literal's type
    p = cc.Program("lits", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    step = p.scalar("step", dtype="int64")
    p.output("sum", cc.allreduce(g))
    p.output("whole", (step * 2).named("twice"))
    p.output("real", (step * 2.0).named("twice_real"))
    before = p.ir
    after = Split("ar0").apply(before)
    assert before["twice"].type.dtype == "int64" and before["twice_real"].type.dtype == "float32"
    assert after["twice"].type.dtype == "int64" and after["twice_real"].type.dtype == "float32"


def test_regions_after_three_way_merges_keep_each_group():
    # two where()s each merge three groups; the group started next had been given x's number, so y
    # joined n1, which it does not read, and x was left out
    p = cc.Program("merges", dims=("N",))
    xs = [p.tensor(f"i{k}", ("N",), layout=cc.Replicated) for k in range(7)]
    a = (xs[0] > 0.0).named("a")
    b, c, d = [(xs[k] * 2.0).named(n) for k, n in ((1, "b"), (2, "c"), (3, "d"))]
    f = (xs[4] > 0.0).named("f")
    x = (xs[5] * 3.0).named("x")
    m1 = cc.where(a, b, c).named("m1")
    m2 = cc.where(f, m1, d).named("m2")
    n1 = (xs[6] * 5.0).named("n1")
    p.output("m2", m2)
    p.output("n1", n1)
    p.output("y", (x + 1.0).named("y"))
    assert regions(p.ir) == [("a", "b", "c", "d", "f", "m1", "m2"), ("x", "y")]


def _runs(prog, cls):
    """(program before, run) for every run of two or more ``cls`` in the schedules of ``prog``."""
    from coconet.schedules.space import generate

    for sched in generate(prog):
        before, i, ts = prog, 0, sched.transforms
        while i < len(ts):
            j = i
            while j < len(ts) and isinstance(ts[j], cls):
                j += 1
            if j - i >= 2:
                yield before, ts[i:j]
            for t in ts[i : max(j, i + 1)]:
                before = t.apply(before)
            i = max(j, i + 1)


def _one_by_one(prog, ts):
    for t in ts:
        prog = t.apply(prog)
    return prog


def _same(batch, one_by_one) -> bool:
    # names and order too (later transforms name statements), and where each statement was written
    return batch == one_by_one and batch.locations == one_by_one.locations


@pytest.mark.parametrize(
    "cls,name",
    [(AsSlice, "adam"), (AsSlice, "lamb"), (AsSlice, "adam_multi"), (Split, "adam_multi"), (Reorder, "adam_multi")],
)
def test_a_step_applied_together_is_the_step_applied_one_by_one(cls, name):
    together = 0
    for before, run in _runs(example(name), cls):
        batch = cls.apply_all(before, run)
        if batch is not None:
            together += 1
            assert _same(batch, _one_by_one(before, run))
    assert together > 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(collective_programs())
def test_random_steps_applied_together_are_the_steps_applied_one_by_one(p):
    for cls in (AsSlice, Split, Reorder):
        for before, run in _runs(p.ir, cls):
            batch = cls.apply_all(before, run)
            assert batch is None or _same(batch, _one_by_one(before, run))


def test_reorders_applied_together_name_what_they_make_with_the_names_the_ones_before_freed():
    """One by one, reorder(ag0) drops ag0 and the next reorder's first all_gather takes its name: the batch
    names what it makes as that sequence would."""
    before = Schedule.parse("; ".join(f"split(ar{i})" for i in range(4)), adam_over(4)).scheduled
    run = tuple(Reorder(f"ag{i}") for i in range(4))
    batch = Reorder.apply_all(before, run)
    assert batch is not None and _same(batch, _one_by_one(before, run))
    made = [s.name for s in batch.stmts if s.op == "all_gather"]
    assert "ag0" in made and made != sorted(made, key=lambda n: int(n[2:]))  # freed names reused, out of order


def test_reorders_whose_work_meets_are_left_one_by_one():
    # h reads the gathers of both allreduces: either reorder rewrites it, so they cannot be told apart
    p = cc.Program("meet", dims=("N",))
    g0, g1 = (p.tensor(f"g{i}", ("N",), layout=cc.Local) for i in range(2))
    w = p.tensor("w", ("N",), layout=cc.Replicated)
    p.update(w, w - (cc.allreduce(g0) * 0.5 + cc.allreduce(g1) * 0.25))
    before = Schedule.parse("split(ar0); split(ar1)", p.ir).scheduled
    run = (Reorder("ag0"), Reorder("ag1"))
    assert Reorder.apply_all(before, run) is None
    sched = Schedule.parse("split(ar0); split(ar1); reorder(ag0); reorder(ag1)", p.ir)
    assert _same(sched.scheduled, _one_by_one(before, run))


def test_splits_are_left_one_by_one_where_an_allreduce_bears_a_name_a_split_gives():
    # one by one, splitting the allreduce named rs0 frees that name for the next split's reduce_scatter
    p = cc.Program("names", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    h = p.tensor("h", ("N",), layout=cc.Local)
    p.output("a", cc.allreduce(g).named("rs0"))
    p.output("b", cc.allreduce(h))
    run = tuple(Split(s.name) for s in p.ir.stmts if s.op == "allreduce")
    assert Split.apply_all(p.ir, run) is None
    assert _one_by_one(p.ir, run)["rs0"].op == "reduce_scatter"
    assert Split.apply_all(p.ir, run[::-1]) is None  # not in program order


def test_slicing_state_a_reader_needs_whole_is_left_to_one_by_one():
    # the output reads m whole: one by one, m gets an all_gather of its own, named as it is made
    p = cc.Program("whole", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    m = p.tensor("m", ("N",), layout=cc.Replicated)
    v = p.tensor("v", ("N",), layout=cc.Replicated)
    avg = cc.allreduce(g)
    p.update(m, m * 0.9 + avg)
    p.update(v, v * 0.9 + avg * avg)
    p.output("m_before", m)
    before = Schedule.parse("split(ar0); reorder(ag0)", p.ir).scheduled
    run = (AsSlice("m"), AsSlice("v"))
    assert AsSlice.apply_all(before, run) is None
    after = _one_by_one(before, run)
    assert any(s.op == "all_gather" and s.args == ("m",) for s in after.stmts)


def test_group_reach_widens_through_chains_of_groups():
    import dataclasses

    from coconet.schedules.ir import Group

    p = cc.Program("reach", dims=("N",))
    x = p.tensor("x", ("N",), layout=cc.Replicated)
    for k in range(12):
        p.output(f"y{k}", (x * float(k + 2)).named(f"s{k}"))
    prog = p.ir
    at = {f"s{k}": prog.position[f"s{k}"] for k in range(12)}
    spans = dataclasses.replace(
        prog, groups=(Group("fuse", ("s1", "s4")), Group("fuse", ("s3", "s9")), Group("fuse", ("s10", "s11")))
    )
    # from s2: s1..s4 straddles it, then s3..s9 straddles s4; s10..s11 lies beyond, not reached
    assert spans.group_reach(at["s2"], at["s2"]) == (at["s1"], at["s9"])
    assert spans.group_reach(at["s6"], at["s6"]) == (at["s1"], at["s9"])
    assert spans.group_reach(at["s0"], at["s0"]) == (at["s0"], at["s0"])
    assert prog.group_reach(at["s2"], at["s5"]) == (at["s2"], at["s5"])
