"""The reference interpreter against plain NumPy implementations of the paper's workloads."""

import runpy
from pathlib import Path

import numpy as np
import pytest

import coconet as cc
from coconet.errors import ProgramError, SizeError
from coconet.schedules import interp, rng

ROOT = Path(__file__).parents[2]
WORLDS = [1, 2, 3, 4]


def example(name):
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"))["program"].ir


def close(a, b):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("n", [1, 7, 13])
def test_sgd(world, n):
    prog = example("sgd")
    res = interp.run(prog, world, {"N": n}, seed=3)
    x = interp.make_inputs(prog, world, {"N": n}, seed=3)
    d = x["g"].sum(axis=0) + x["weight_decay"] * x["w"]
    buf = x["momentum"] * x["buf"] + d
    close(res.state("buf"), buf)
    close(res.state("w"), x["w"] - x["lr"] * buf)


def numpy_adam(x, g, w, m, v):
    b1, b2, t = x["beta1"], x["beta2"], x["t"]
    m1 = b1 * m + (1 - b1) * g
    v1 = b2 * v + (1 - b2) * g * g
    return w - x["lr"] * (m1 / (1 - b1**t)) / (np.sqrt(v1 / (1 - b2**t)) + x["eps"]), m1, v1


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("n", [5, 11])
def test_adam(world, n):
    prog = example("adam")
    res = interp.run(prog, world, {"N": n}, seed=1)
    x = interp.make_inputs(prog, world, {"N": n}, seed=1)
    w, m, v = numpy_adam(x, x["g"].sum(axis=0), x["w"], x["m"], x["v"])
    close(res.state("w"), w)
    close(res.state("m"), m)
    close(res.state("v"), v)
    assert res.state("g").shape == (world, n)  # Local state stays per rank


@pytest.mark.parametrize("world", WORLDS)
def test_adam_multi(world):
    prog = example("adam_multi")
    res = interp.run(prog, world, {"H": 3}, seed=2)
    x = interp.make_inputs(prog, world, {"H": 3}, seed=2)
    for name in ("w1", "b1", "w2", "b2"):
        w, m, v = numpy_adam(x, x[f"{name}_grad"].sum(axis=0), x[name], x[f"{name}_m"], x[f"{name}_v"])
        close(res.state(name), w)
        close(res.state(f"{name}_m"), m)
        close(res.state(f"{name}_v"), v)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("n", [6, 9])
def test_lamb(world, n):
    prog = example("lamb")
    res = interp.run(prog, world, {"N": n}, seed=4)
    x = interp.make_inputs(prog, world, {"N": n}, seed=4)
    g = x["g"].sum(axis=0)
    b1, b2, t = x["beta1"], x["beta2"], x["t"]
    m1 = b1 * x["m"] + (1 - b1) * g
    v1 = b2 * x["v"] + (1 - b2) * g * g
    u = (m1 / (1 - b1**t)) / (np.sqrt(v1 / (1 - b2**t)) + x["eps"]) + x["weight_decay"] * x["w"]
    trust = np.linalg.norm(x["w"]) / np.linalg.norm(u)
    close(res.state("w"), x["w"] - x["lr"] * trust * u)


def numpy_layer(x, h, seed):
    y = h @ x["w"] + x["b"]
    keep = rng.dropout_mask(int(seed), 0.1, y.shape)
    return np.where(keep, y / 0.9, 0.0)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("sizes", [{"B": 2, "S": 3, "H": 5}, {"B": 3, "S": 1, "H": 1}])
def test_megatron_mlp(world, sizes):
    prog = example("megatron_mlp")
    res = interp.run(prog, world, sizes, seed=5)
    x = interp.make_inputs(prog, world, sizes, seed=5)
    close(res.output("out"), numpy_layer(x, x["x"], x["seed"]) + x["r"])


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stages", [1, 3])
def test_gpt_pipeline(world, stages):
    prog = example("gpt_pipeline")
    sizes = {"B": 2, "S": 3, "H": 3}
    res = interp.run(prog, world, sizes, seed=6, stages=stages)
    act = None
    for k in range(stages):
        x = interp.make_inputs(prog, world, sizes, seed=6, stage=k)
        resid = x["x"] if k == 0 else act
        act = numpy_layer(x, x["h"], x["seed"]) + resid
        close(res.sent(stage=k), act)
    assert set(res.observable()) == {f"stage{k}.sent.activation" for k in range(stages)} | {
        f"stage{k}.state.{n}" for k in range(stages) for n in prog.updates
    }


def test_dropout_mask_matches_the_rng_whatever_the_layout():
    p = cc.Program("d", dims=("N", "M"))
    x = p.tensor("x", ("N", "M"), layout=cc.Sliced(1))
    p.output("y", cc.dropout(x, 0.5, 1234))
    shape = (5, 7)
    for world in WORLDS:
        res = interp.run(p, world, {"N": 5, "M": 7}, inputs={"x": np.ones(shape)})
        close(res.output("y"), np.where(rng.dropout_mask(1234, 0.5, shape), 2.0, 0.0))


def test_sliced_pieces_are_uneven_rows():
    p = cc.Program("s", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    rs = cc.reduce_scatter(g)
    p.output("rs", rs)
    p.output("ag", cc.all_gather(rs))
    res = interp.run(p, 4, {"N": 5}, inputs={"g": np.arange(20.0).reshape(4, 5)})
    pieces = res.stages[0].outputs["rs"]
    assert [len(q) for q in pieces] == [2, 2, 1, 0]
    total = np.arange(20.0).reshape(4, 5).sum(axis=0)
    close(res.output("rs"), total)
    close(res.output("ag"), total)
    assert [interp.slice_bounds(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]


def test_replicated_operand_is_sliced_for_a_sliced_result():
    p = cc.Program("s", dims=("N", "M"))
    x = p.tensor("x", ("N", "M"), layout=cc.Sliced(1))
    b = p.tensor("b", ("M",), layout=cc.Replicated)
    c = p.tensor("c", ("N", 1), layout=cc.Replicated)
    p.output("y", x * b + c)
    xs = {"x": np.arange(12.0).reshape(3, 4), "b": np.arange(4.0), "c": np.ones((3, 1))}
    for world in WORLDS:
        close(interp.run(p, world, {"N": 3, "M": 4}, inputs=xs).output("y"), xs["x"] * xs["b"] + xs["c"])


@pytest.mark.parametrize(
    "op,fn", [("sum", np.sum), ("max", np.max), ("min", np.min), ("prod", np.prod), ("avg", np.mean)]
)
def test_allreduce_ops(op, fn):
    p = cc.Program("a", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    p.output("y", cc.allreduce(g, op=op))
    res = interp.run(p, 3, {"N": 4}, seed=9)
    g = interp.make_inputs(p, 3, {"N": 4}, seed=9)["g"]
    close(res.output("y"), fn(g, axis=0))


def test_broadcast_and_its_root():
    p = cc.Program("b", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    p.output("y", cc.broadcast(g, root=2))
    x = interp.make_inputs(p, 3, {"N": 4})
    close(interp.run(p, 3, {"N": 4}).output("y"), x["g"][2])
    with pytest.raises(ProgramError, match="outside the world of 2 ranks") as info:
        interp.run(p, 2, {"N": 4})
    assert info.value.statement == "bc0"


def test_inputs_are_rounded_to_their_dtype():
    p = cc.Program("r", dims=("N",))
    x = p.tensor("x", ("N",), layout=cc.Replicated, dtype="float16")
    y = p.tensor("y", ("N",), layout=cc.Replicated, dtype="bfloat16")
    p.output("x", x * 1.0)
    p.output("y", y * 1.0)
    p.output("c", cc.cast(x, "bfloat16"))
    v = np.array([1.0 + 2**-12, 1.0 + 2**-9 + 2**-10, -3.14159])
    res = interp.run(p, 2, {"N": 3}, inputs={"x": v, "y": v})
    close(res.output("x"), v.astype(np.float16).astype(np.float64))
    torch = pytest.importorskip("torch")
    want = torch.tensor(v).to(torch.bfloat16).double().numpy()
    close(res.output("y"), want)
    close(res.output("c"), torch.tensor(v).half().to(torch.bfloat16).double().numpy())


def test_norm_of_sliced_is_global():
    p = cc.Program("n", dims=("N",))
    x = p.tensor("x", ("N",), layout=cc.Sliced(0))
    p.output("n", cc.norm(x))
    v = np.arange(7.0)
    for world in WORLDS:
        close(interp.run(p, world, {"N": 7}, inputs={"x": v}).output("n"), np.linalg.norm(v))


def test_custom_op_reference_runs_on_pieces():
    twice = cc.custom_op("twice", reference=lambda x: 2 * x)
    p = cc.Program("c", dims=("N",))
    x = p.tensor("x", ("N",), layout=cc.Sliced(0))
    p.output("y", twice(x))
    close(interp.run(p, 3, {"N": 5}, inputs={"x": np.arange(5.0)}).output("y"), 2 * np.arange(5.0))


def test_determinism_and_seed():
    prog = example("adam")
    a = interp.run(prog, 2, {"N": 8}, seed=1).observable()
    b = interp.run(prog, 2, {"N": 8}, seed=1).observable()
    c = interp.run(prog, 2, {"N": 8}, seed=2).observable()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["stage0.state.w"], c["stage0.state.w"])


def test_bad_runs():
    prog = example("adam")
    with pytest.raises(SizeError, match="no size given for N"):
        interp.run(prog, 2, {})
    with pytest.raises(SizeError, match="world"):
        interp.run(prog, 0, {"N": 4})
    with pytest.raises(SizeError, match="one value per rank"):
        interp.run(prog, 2, {"N": 4}, inputs={"g": np.ones(4)})


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_rank_draws_its_pieces_of_the_inputs_alone(world):
    p = cc.Program("layouts", dims=("N", "H"))
    g = p.tensor("g", ("N", "H"), layout=cc.Local)
    seed = p.scalar("seed", dtype="int64")
    x = p.tensor("x", ("N", "H"), layout=cc.Sliced(-1))
    w = p.tensor("w", ("N", "H"), layout=cc.Replicated)
    lr = p.scalar("lr")
    p.output("y", cc.allreduce(g * lr) + w)
    p.output("z", x * 2.0)
    p.output("d", cc.dropout(x, 0.5, seed))
    sizes = {"N": 5, "H": 7}
    every = interp.make_inputs(p, world, sizes, seed=9)
    for r in range(world):
        mine = interp.rank_inputs(p, world, sizes, r, seed=9)
        assert set(mine) == set(every)
        np.testing.assert_array_equal(mine["g"], every["g"][r])  # skipped to its row, not drawn whole
        assert mine["seed"] == every["seed"]
        np.testing.assert_array_equal(mine["x"], every["x"][:, slice(*interp.slice_bounds(7, world, r))])
        np.testing.assert_array_equal(mine["w"], every["w"])
        assert mine["lr"] == every["lr"]


def test_values_are_let_go_after_their_last_reader():
    prog = example("adam")
    lean = interp.run(prog, 3, {"N": 11}, seed=4)
    kept = interp.run(prog, 3, {"N": 11}, seed=4, keep_values=True)
    a, b = lean.observable(), kept.observable()
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    inner = next(s.name for s in prog.stmts if s.op == "mul")
    assert inner in kept.stages[0].values and inner not in lean.stages[0].values
    with pytest.raises(KeyError, match="keep_values=True"):
        lean.value(inner)
    close(kept.value(inner), kept.value(inner))
    # a Replicated value is one array on every rank, not R copies
    w = kept.stages[0].values[next(s.name for s in prog.stmts if s.op == "allreduce")]
    assert all(piece is w[0] for piece in w)


def test_declared_precision_rounds_every_value_to_its_dtype():
    """1 + 2^-30 is 1 in float32: a difference of two values that close comes out 0 when each is rounded as
    a float32 step holds it, and 2^-30 in float64; a float64 statement keeps its bits."""
    p = cc.Program("close", dims=("N",))
    x = p.tensor("x", ("N",), layout=cc.Replicated)
    p.output("d", (x + 2.0**-30) - x)
    p.output("d64", (cc.cast(x, "float64") + 2.0**-30) - cc.cast(x, "float64"))
    exact = interp.run(p.ir, 2, {"N": 5}).observable()
    declared = interp.run(p.ir, 2, {"N": 5}, precision="declared").observable()
    assert np.allclose(exact["stage0.output.d"], 2.0**-30, rtol=1e-6)
    assert np.all(declared["stage0.output.d"] == 0.0)
    assert np.array_equal(declared["stage0.output.d64"], exact["stage0.output.d64"])
    with pytest.raises(ValueError, match="precision"):
        interp.run(p.ir, 2, {"N": 5}, precision="float32")
