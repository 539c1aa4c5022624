import runpy
from pathlib import Path

import pytest

from coconet import Local, Program, Replicated, Sliced, allreduce, dropout, matmul
from coconet.codegen.baselines import BASELINES, baseline_for
from coconet.errors import CoconetError
from coconet.schedules.schedule import Schedule
from coconet.tuner.launch import Options, run_schedules

ROOT = Path(__file__).parents[2]


def example(name):
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"))["program"].ir


def test_torch_adam_baseline_computes_the_program():
    """torch.optim.Adam(fused=True) after a summing all_reduce updates w, m, v as the program says."""
    prog = example("adam")
    for world in (2, 3):
        torch_row, ours = run_schedules(
            [Schedule(prog)],
            Options(world=world, sizes={"N": 7}, kernels="eager", warmup=1, repeats=2),
            baselines=[BASELINES["adam"]],
        )
        assert torch_row.schedule.startswith("torch: ") and torch_row.status == "ok" and torch_row.correct
        assert ours.status == "ok" and ours.correct and len(torch_row.samples) == 2


def test_eager_megatron_baseline_runs_unchecked():
    prog = example("megatron_mlp")
    torch_row, _ = run_schedules(
        [Schedule(prog)],
        Options(world=2, sizes={"B": 2, "S": 3, "H": 5}, kernels="eager", warmup=0, repeats=2),
        baselines=[BASELINES["megatron_mlp"]],
    )
    assert torch_row.status == "ok" and torch_row.correct is None  # torch's dropout mask is its own
    assert torch_row.median_s > 0


def test_a_baseline_of_another_program_is_refused():
    with pytest.raises(CoconetError, match="computes adam, not sgd"):
        run_schedules([Schedule(example("sgd"))], Options(world=2, sizes={"N": 4}), baselines=[BASELINES["adam"]])
    with pytest.raises(CoconetError, match="computes adam, not this program of that name"):
        run_schedules([Schedule(not_adam())], Options(world=2, sizes={"N": 4}), baselines=[BASELINES["adam"]])


def not_adam():
    """Named adam, but with no bias correction: torch.optim.Adam does not compute it."""
    p = Program("adam", dims=("N",))
    g = p.tensor("g", ("N",), layout=Local)
    w, m, v = (p.tensor(n, ("N",), layout=Replicated) for n in "wmv")
    lr, beta1, beta2, eps, t = p.scalars("lr beta1 beta2 eps t")
    avg = allreduce(g)
    m1 = beta1 * m + (1 - beta1) * avg
    v1 = beta2 * v + (1 - beta2) * avg * avg
    p.update(m, m1)
    p.update(v, v1)
    p.update(w, w - lr * m1 / (v1 + eps))
    return p.ir


def test_hand_written_baselines_stand_for_their_example_programs_only():
    assert baseline_for(example("adam")) is BASELINES["adam"]
    assert baseline_for(example("megatron_mlp")) is BASELINES["megatron_mlp"]
    other = baseline_for(not_adam())
    assert other.name == "eager" and other.make is None and other.checked


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_eager_baseline_of_any_program_computes_it(backend):
    """A program without a hand-written step gets its statements as eager PyTorch, checked like a schedule."""
    for name, sizes in (("sgd", {"N": 7}), ("lamb", {"N": 10})):
        prog = example(name)
        base = baseline_for(prog)
        assert base.name == "eager" and base.checked and "torch.distributed" in base.doc
        for world in (2, 3):
            torch_row, ours = run_schedules(
                [Schedule(prog)],
                Options(world=world, sizes=sizes, backend=backend, warmup=1, repeats=2),
                baselines=[base],
            )
            assert torch_row.schedule == f"torch: {base.doc}"
            assert torch_row.status == "ok" and torch_row.correct, torch_row.error
            assert ours.status == "ok" and ours.correct


def test_eager_baseline_with_dropout_calls_torchs_and_runs_unchecked():
    p = Program("proj", dims=("T", "H"))
    x = p.tensor("x", ("T", "H"), layout=Sliced(-1))
    w = p.tensor("w", ("H", "H"), layout=Sliced(0))
    r = p.tensor("r", ("T", "H"), layout=Replicated)
    seed = p.scalar("seed", dtype="int64")
    p.output("out", dropout(allreduce(matmul(x, w)), 0.5, seed) + r)
    base = baseline_for(p.ir)
    assert base.name == "eager" and not base.checked and base.doc.endswith("F.dropout")
    torch_row, ours = run_schedules(
        [Schedule(p.ir)], Options(world=2, sizes={"T": 4, "H": 6}, warmup=0, repeats=2), baselines=[base]
    )
    assert torch_row.status == "ok" and torch_row.correct is None and torch_row.median_s > 0
    assert ours.status == "ok" and ours.correct


def test_a_tuning_question_defaults_to_what_the_baseline_s_caller_never_reads():
    from coconet.codegen.baselines import shardable_text

    adam, sgd = example("adam"), example("sgd")
    assert shardable_text(adam) == "m,v"  # torch.optim keeps the moments; the model reads w whole
    assert shardable_text(sgd) == ""  # no hand-written baseline: everything stays whole
    assert shardable_text(example("megatron_mlp")) == "*"  # nothing it could shard
    assert shardable_text(adam, ["all"]) == "*" and shardable_text(adam, ["w"]) == "w"
    assert shardable_text(adam, []) == ""  # names given, none of them: not the default
    with pytest.raises(CoconetError, match="shardable g: not replicated state adam updates"):
        shardable_text(adam, ["g"])


def gpt_layer_sp(p_drop):
    """examples/gpt_layer_sp.py with another dropout probability (0: no mask, so torch's step can be checked)."""
    from coconet import all_gather, layer_norm, reduce_scatter

    p = Program("gpt_layer_sp", dims=("S", "B", "H"))
    x = p.tensor("x", ("S", "B", "4*H"), layout=Sliced(-1))
    w = p.tensor("w", ("4*H", "H"), layout=Sliced(0))
    b = p.tensor("b", ("H",), layout=Replicated)
    r = p.tensor("r", ("S", "B", "H"), layout=Sliced(0))
    gamma = p.tensor("gamma", ("H",), layout=Replicated)
    beta = p.tensor("beta", ("H",), layout=Replicated)
    seed = p.scalar("seed", dtype="int64")
    h = dropout(reduce_scatter(matmul(x, w), dim=0) + b, p_drop, seed) + r
    p.output("residual", h)
    p.output("out", all_gather(layer_norm(h, gamma, beta, eps=1e-5)))
    return p.ir


def _sp_rank(rank, world, store, sizes):
    import numpy as np
    import torch
    import torch.distributed as dist

    from coconet.codegen.baselines import GptLayerSPStep
    from coconet.schedules import interp

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        prog = gpt_layer_sp(0.0)
        given = interp.rank_inputs(prog, world, sizes, rank)
        tensors = {k: torch.tensor(v, dtype=torch.float32) for k, v in given.items() if k != "seed"}
        out = GptLayerSPStep(0.0)(tensors, {"seed": int(given["seed"])})["outputs"]
        ref = interp.run(prog, world, sizes)
        for name in ("residual", "out"):
            want = ref.stages[-1].outputs[name][rank]
            np.testing.assert_allclose(out[name].numpy(), want, rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()


def test_sequence_parallel_baseline_computes_the_program_on_uneven_slices(tmp_path):
    """Megatron-LM's sequence-parallel epilogue by hand, against the interpreter where dropout keeps every
    element: 5 sequence rows over 2 and 3 ranks (padded for the collectives, the last rank's slice short)."""
    import torch.multiprocessing as mp  # forkserver: ranks forked from a fresh process, never from this one, whose
    # OpenMP workers (left by any earlier test's parallel region) a forked child would wait on for ever

    assert gpt_layer_sp(0.1).hash == example("gpt_layer_sp").hash  # the example, as the test writes it
    assert baseline_for(example("gpt_layer_sp")) is BASELINES["gpt_layer_sp"]
    for world in (2, 3):
        store = tmp_path / f"store{world}"
        mp.start_processes(
            _sp_rank, args=(world, store, {"S": 5, "B": 2, "H": 3}), nprocs=world, start_method="forkserver"
        )


def test_sequence_parallel_baseline_runs_unchecked_in_a_launch():
    torch_row, ours = run_schedules(
        [Schedule(example("gpt_layer_sp"))],
        Options(world=3, sizes={"S": 5, "B": 2, "H": 3}, kernels="eager", warmup=0, repeats=2),
        baselines=[BASELINES["gpt_layer_sp"]],
    )
    assert torch_row.status == "ok" and torch_row.correct is None and torch_row.median_s > 0
    assert ours.status == "ok" and ours.correct
