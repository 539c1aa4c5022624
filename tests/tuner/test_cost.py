import dataclasses
import math
import runpy
from functools import lru_cache
from pathlib import Path

import pytest

from coconet.errors import CoconetError, IllegalTransform, TopologyError
from coconet.schedules.schedule import Schedule
from coconet.schedules.space import generate
from coconet.tuner import cost
from coconet.tuner.topology import list_topologies, load_topology

ROOT = Path(__file__).parents[2]
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))


@lru_cache(maxsize=None)
def space(name):
    return generate(runpy.run_path(str(ROOT / "examples" / f"{name}.py"))["program"])


def sizes_for(program, scale):
    if program.dims == ("B", "S", "H"):
        return {"B": 2**scale, "S": 256, "H": 256 * 2**scale}
    return {d: 2**14 * 64**scale for d in program.dims}


TOPOLOGIES = [load_topology(n) for n in list_topologies()]


def test_every_schedule_of_every_example_is_finite_and_positive_everywhere():
    for name in EXAMPLES:
        sp = space(name)
        for topo in TOPOLOGIES:
            for backend in topo.backends:
                for scale in (1, 2):
                    sizes = sizes_for(sp[0].program, scale)
                    for s in sp:
                        p = cost.predict(s, sizes, topo, backend)
                        parts = (p.compute_s, p.memory_s, p.communication_s, p.overhead_s, p.overlapped_s)
                        assert math.isfinite(p.seconds) and p.seconds > 0, (name, topo.name, backend, s.text)
                        assert all(math.isfinite(x) and x >= 0 for x in parts)
                        # overlap hides at most what the parts add up to: never a sum's worth more
                        assert p.overlapped_s <= p.compute_s + p.memory_s + p.communication_s + p.overhead_s
                        assert p.seconds == pytest.approx(sum(parts[:4]) - p.overlapped_s)
                        assert p.source == "model"


def _without_last_fuse(s):
    i = max((k for k, t in enumerate(s.transforms) if t.name == "fuse"), default=None)
    if i is None:
        return None
    try:
        other = Schedule(s.program, s.transforms[:i] + s.transforms[i + 1 :])
        _ = other.scheduled
    except IllegalTransform:
        return None
    return other


def test_fused_moves_no_more_memory_than_unfused():
    pairs = 0
    for name in EXAMPLES:
        sp = space(name)
        for s in sp:
            unfused = _without_last_fuse(s)
            if unfused is None:
                continue
            for topo in TOPOLOGIES:
                for backend in topo.backends:
                    for scale in (0, 1, 2):
                        sizes = sizes_for(s.program, scale)
                        a = cost.predict(s, sizes, topo, backend)
                        b = cost.predict(unfused, sizes, topo, backend)
                        assert a.memory_s <= b.memory_s * (1 + 1e-9), (name, s.text, topo.name, backend, sizes)
                        pairs += 1
    assert pairs > 100


@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter", "all_gather", "broadcast", "send"])
def test_collective_time_grows_with_size(op):
    for topo in TOPOLOGIES:
        for backend in topo.backends:
            if backend == "shm":
                moved = [cost.shm_collective(op, 2.0**k, topo.world)[0] for k in range(8, 34)]
                assert moved == sorted(moved)
                continue
            times = [cost.collective_time(op, 2.0**k, topo, backend, topo.world) for k in range(8, 34)]
            assert all(t > 0 for t in times) and times == sorted(times), (topo.name, backend, op)


def test_communication_of_a_schedule_grows_with_size():
    s = space("adam")[1]  # split(ar0)
    for topo in TOPOLOGIES:
        for backend in topo.backends:
            comm = [cost.predict(s, {"N": 2**k}, topo, backend).communication_s for k in range(12, 30, 2)]
            assert comm == sorted(comm), (topo.name, backend)


@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter", "all_gather", "broadcast"])
def test_multi_node_is_slower_than_one_node(op):
    multi = load_topology("h100-4node-ib")
    # the same ranks, the nodes joined as well as the GPUs inside one are
    joined = dataclasses.replace(multi, inter=multi.intra)
    # the same ranks in one (hypothetical) node: slower only once bandwidth rules (a 32-GPU chain's
    # latency exceeds a tree's across 4 nodes)
    one = dataclasses.replace(multi, nodes=1, ranks_per_node=multi.world, inter=None)
    for k in range(10, 32, 3):
        t = cost.collective_time(op, 2.0**k, multi, "nccl", multi.world)
        assert t > cost.collective_time(op, 2.0**k, joined, "nccl", joined.world)
        if k >= 22:
            assert t > cost.collective_time(op, 2.0**k, one, "nccl", one.world)
    # eight ranks fit one node of the cluster: as on a DGX H100
    dgx = load_topology("dgx-h100-8")
    assert cost.collective_time(op, 2.0**24, multi, "nccl", 8) == cost.collective_time(op, 2.0**24, dgx, "nccl", 8)
    s = space("adam")[0]
    assert (
        cost.predict(s, {"N": 2**26}, multi, "nccl").communication_s
        > cost.predict(s, {"N": 2**26}, joined, "nccl").communication_s
    )


def test_more_nodes_cost_more_at_large_sizes():
    s = space("adam")[0]
    small, big = load_topology("h100-4node-ib"), load_topology("h100-16node-ib")
    assert cost.predict(s, {"N": 2**28}, big, "nccl").seconds > cost.predict(s, {"N": 2**28}, small, "nccl").seconds


def test_bucket_pays_alpha_per_launch():
    sp = space("adam_multi")
    bucketed = next(s for s in sp if s.names == ["bucket"])
    topo = load_topology("cpu-25gbe")
    one_launch = cost.predict(bucketed.with_knobs(bucket_bytes=2**30), {"H": 64}, topo, "gloo")
    many = cost.predict(bucketed.with_knobs(bucket_bytes=1), {"H": 64}, topo, "gloo")
    assert many.communication_s > one_launch.communication_s


def test_chunks_pay_alpha_per_chunk():
    s = next(s for s in space("megatron_mlp") if s.names == ["overlap"])
    topo = load_topology("dgx-h100-8")
    tiny = {"B": 1, "S": 8, "H": 64}  # latency-bound: more chunks, more α
    assert (
        cost.predict(s.with_knobs(chunks=8), tiny, topo, "nccl").communication_s
        > cost.predict(s.with_knobs(chunks=2), tiny, topo, "nccl").communication_s
    )


def test_overlap_hides_time_on_gpus():
    sp = space("megatron_mlp")
    base = sp.find("split(ar0)")
    over = next(s for s in sp if s.text.startswith("split(ar0); overlap(mm0, rs0)"))
    topo = load_topology("dgx-h100-8")
    sizes = {"B": 8, "S": 1024, "H": 3072}
    p = cost.predict(over, sizes, topo, "nccl")
    assert p.overlapped_s > 0 and p.seconds < cost.predict(base, sizes, topo, "nccl").seconds


def test_ranking_is_deterministic():
    sp = list(space("adam"))
    topo = load_topology("dgx-a100-8")
    first = cost.rank(sp, {"N": 2**24}, topo, "nccl")
    cost._plan.cache_clear()
    assert [s.hash for s in cost.rank(sp, {"N": 2**24}, topo, "nccl")] == [s.hash for s in first]
    assert sorted(s.hash for s in first) == sorted(s.hash for s in sp)
    times = [cost.predict(s, {"N": 2**24}, topo, "nccl").seconds for s in first]
    assert times == sorted(times)
    # the paper's point: the fused, sliced schedules beat the program as written
    assert first[0].text != "baseline"


def test_pipeline_stages_and_world():
    sp = space("gpt_pipeline")
    topo = load_topology("h100-4node-ib")
    sizes = {"B": 2, "S": 2048, "H": 12288}
    a = cost.predict(sp[0], sizes, topo, "nccl")  # 32 ranks: two stages of 16
    b = cost.predict(sp[0], sizes, topo, "nccl", world=32, stages=4)  # four stages of 8, in one node each
    assert a.seconds > 0 and b.seconds > 0 and a.seconds != b.seconds
    assert a.seconds == cost.predict(sp[0], sizes, topo, "nccl", world=32, stages=2).seconds
    with pytest.raises(CoconetError, match="pipeline stages"):
        cost.predict(sp[0], sizes, topo, "nccl", stages=3)


def test_backend_must_be_the_topologys():
    with pytest.raises(TopologyError):
        cost.predict(space("adam")[0], {"N": 1024}, load_topology("dgx-h100-8"), "shm")
    with pytest.raises(CoconetError, match="unknown backend"):
        cost.plan(space("adam")[0], "mpi")


def test_explain_adds_up():
    s = space("adam")[8]
    topo = load_topology("local")
    units = cost.explain(s, {"N": 2**20}, topo, "gloo")
    assert sum(t for _, t, _ in units) == pytest.approx(cost.predict(s, {"N": 2**20}, topo, "gloo").seconds)
    assert any("fused_collective" in what for what, _, _ in units)


@pytest.mark.parametrize("chunks", [1, 4])
def test_zero1_fused_collective_on_shm_moves_the_floors_bytes(chunks):
    # the kernel reads every rank's gradient rows where they lie and writes w's new rows into every copy,
    # the state living in the segment its peers write into: what the roofline counts, and no more
    from coconet.tuner.roofline import bytes_moved_once

    prog = space("adam")[0].program
    s = Schedule.parse(
        f"split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0); fc_chunks={chunks}", prog
    )
    topo = dataclasses.replace(load_topology("local"), ranks_per_node=4)
    sizes = {"N": 2**24}
    for world in (2, 3, 4):
        moved = cost.predict(s, sizes, topo, "shm", world=world).memory_s / topo.memory_beta
        assert moved == pytest.approx(bytes_moved_once(prog, sizes, world, {"m", "v"}) / world, rel=1e-6)


@pytest.mark.parametrize("dtype, weighted", [("float32", False), ("bfloat16", False), ("float32", True)])
def test_a_gradient_computed_before_its_fused_collective_moves_no_bytes_of_its_own(dtype, weighted):
    # g cast and predivided (and weighted by a number of the rank's own) before its allreduce: the chunk
    # kernel computes each rank's rows of that from the rank's rows of g (codegen.fused.reduced_in_kernel), so
    # the step moves the floor's bytes, g read in its own dtype; no pass over the whole predivided value, no
    # publish of it
    import coconet as cc
    from coconet.tuner.roofline import bytes_moved_once

    p = cc.Program("adam_predivide", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local, dtype=dtype)
    w, m, v = (p.tensor(x, ("N",), layout=cc.Replicated) for x in "wmv")
    lr, pre = p.scalars("lr pre")
    x = cc.cast(g, "float32") / pre
    avg = cc.allreduce(x * p.tensor("n", (), layout=cc.Local) if weighted else x)
    p.update(m, 0.9 * m + 0.1 * avg)
    p.update(v, 0.999 * v + 0.001 * avg * avg)
    p.update(w, w - lr * (0.9 * m + 0.1 * avg) / (cc.sqrt(0.999 * v + 0.001 * avg * avg) + 1e-8))
    s = Schedule.parse("split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0); fc_chunks=4", p.ir)
    topo = dataclasses.replace(load_topology("local"), ranks_per_node=4)
    sizes = {"N": 2**24}
    for world in (2, 3, 4):
        moved = cost.predict(s, sizes, topo, "shm", world=world).memory_s / topo.memory_beta
        assert moved == pytest.approx(bytes_moved_once(p.ir, sizes, world, {"m", "v"}) / world, rel=1e-6)


def test_lamb_in_two_passes_on_shm_moves_what_its_kernels_touch():
    # the fused collective reads every rank's gradient rows and m, v, w's rows, writes m, v and u's rows, and
    # returns its share of sum(u * u); norm(w) reads all of w; the update's kernel reads u's and w's rows and
    # writes w's into every rank's copy: 3N + 8N/R floats per rank, no u * u, no gathered temporary
    prog = space("lamb")[0].program
    s = Schedule.parse(
        "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse(mul7, sub4); fuse_collective(rs0); fc_chunks=1", prog
    )
    topo = dataclasses.replace(load_topology("local"), ranks_per_node=4)
    n = 2**24
    for world in (2, 3, 4):
        moved = cost.predict(s, {"N": n}, topo, "shm", world=world).memory_s / topo.memory_beta
        assert moved == pytest.approx(4 * (3 * n + 8 * n / world), rel=1e-6)


def test_ranks_beyond_the_topologys_share_its_memory_and_cores():
    prog = space("adam")[0].program
    s = Schedule.parse("split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0)", prog)
    local = load_topology("local")
    roomy = dataclasses.replace(local, ranks_per_node=2 * local.ranks_per_node)
    sizes, world = {"N": 2**24}, 2 * local.world
    crowded = cost.predict(s, sizes, local, "shm", world=world)
    assert crowded.memory_s == pytest.approx(2 * cost.predict(s, sizes, roomy, "shm", world=world).memory_s)
    # on this machine twice the ranks split the step's bytes but share its bandwidth: the step takes longer
    assert crowded.seconds > cost.predict(s, sizes, local, "shm", world=local.world).seconds


def test_a_fuse_kernel_that_sums_a_member_writes_only_the_sum():
    # a loss scaler's overflow count: the kernel computing the mask sums it (codegen.analysis.fuse_reduced), so it
    # reads g and writes one number; the mask is not written out and read back by the sum
    import runpy
    from pathlib import Path

    prog = runpy.run_path(str(Path(__file__).parents[2] / "benchmarks/programs/adam_amp_skip.py"))["program"].ir
    s = Schedule.parse("fuse(abs0, gt0, where0)", prog)
    p = cost.plan(s, "gloo")
    assert not any(u.what == "sum0" for u in p.units)
    (k,) = next(u for u in p.units if u.what.startswith("fuse(")).kernels
    n, world = 2**20, 2
    elems = cost._elems(p, {"N": n}, world)
    assert cost._value(k.read, elems, world) == 4 * n
    assert cost._value(k.write, elems, world) == 0  # a number, which the model does not count


def test_sources_read_where_they_lie_are_not_published_and_an_update_in_place_is_not_copied():
    # gradient accumulation: the chunk kernel reads every rank's acc and g where they lie
    # (codegen.fused.reduced_in_kernel), a word more per element than Adam's kernel reading g alone, and acc + g
    # is computed nowhere else (gloo computes it whole); acc is cleared straight into itself
    # (codegen.analysis.updated_in_place): no publish, no copy
    text = "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0)"
    prog = runpy.run_path(str(Path(__file__).parents[2] / "benchmarks/programs/adam_accumulate.py"))["program"].ir
    s = Schedule.parse(text, prog)
    n, world = 2**20, 2

    def kernels(sched, backend):
        p = cost.plan(sched, backend)
        return cost._elems(p, {"N": n}, world), {k.what: k for u in p.units for k in u.kernels}

    elems, ks = kernels(s, "shm")
    assert "rs0 publish" not in ks and "acc.copy_" not in ks and "add0" not in ks
    assert cost._value(ks["mul5 into acc"].write, elems, world) == 4 * n
    assert cost._value(ks["mul5 into acc"].fresh, elems, world) == 0
    adam_prog = runpy.run_path(str(ROOT / "examples/adam.py"))["program"].ir
    adam_elems, adam = kernels(Schedule.parse(text, adam_prog), "shm")
    [fc] = [k for name, k in ks.items() if name.endswith(" kernel")]
    [adam_fc] = [k for name, k in adam.items() if name.endswith(" kernel")]
    assert cost._value(fc.read, elems, world) - cost._value(adam_fc.read, adam_elems, world) == 4 * n
    elems, ks = kernels(s, "gloo")
    assert cost._value(ks["add0"].fresh, elems, world) == 4 * n


def test_a_kernel_storing_into_state_and_into_a_held_buffer_makes_no_new_tensor():
    # error feedback: the second kernel writes the residual into e (e's other reader ran in the first kernel)
    # and the compressed gradient into the buffer the fused collective reads (codegen.analysis.in_place_outputs,
    # held_source): no fresh tensor, no copy into e, no publish; on gloo the compressed gradient is a new one
    prog = runpy.run_path(str(Path(__file__).parents[2] / "benchmarks/programs/ef_sign.py"))["program"].ir
    s = Schedule.parse(
        "split(ar0); reorder(ag0); fuse_collective(rs0); fuse(add0, abs0, ge0); fuse(where0, sub0)", prog
    )
    n, world = 2**20, 2
    for backend, fresh in (("shm", 0), ("gloo", 4 * n)):
        p = cost.plan(s, backend)
        ks = {k.what: k for u in p.units for k in u.kernels}
        elems = cost._elems(p, {"N": n}, world)
        kernel = ks["fuse(where0, sub0)"]
        assert "e.copy_" not in ks and "rs0 publish" not in ks
        assert cost._value(kernel.write, elems, world) == 8 * n
        assert cost._value(kernel.fresh, elems, world) == fresh
