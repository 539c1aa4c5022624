"""Convolutions on the backends: every layout rule and every schedule on gloo and shm (uneven channels, and a
rank with none), the code a convolution and its overlap lower to, the runtime's conv, the cost model's flops,
and the channel-parallel block's hand-written PyTorch baseline."""

import math
import runpy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import coconet as cc
from coconet import Local, Replicated, Sliced
from coconet.codegen.baselines import BASELINES, baseline_for
from coconet.codegen.lower import lower
from coconet.kernels.ops import conv, ieee_float32
from coconet.schedules.schedule import Schedule
from coconet.schedules.space import generate
from coconet.tuner import cost, roofline
from coconet.tuner.launch import Options, run_schedules
from coconet.tuner.topology import list_topologies, load_topology
from tests.tuner.test_launch import assert_all_ok, rank_processes

pytestmark = pytest.mark.usefixtures("temp_code_cache", "one_thread")
ROOT = Path(__file__).parents[2]


def example(name):
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"))["program"].ir


def every_rule():
    """Each layout rule once, with B, C and K of one extent, so that an operand cut to another's rows (as a
    pointwise operand of a Sliced result is) would still have a shape torch takes, and compute something else."""
    p = cc.Program("every_rule", dims=("N", "H"))
    xb = p.tensor("xb", ("N", "N", "H", "H"), layout=Sliced(0))
    xr = p.tensor("xr", ("N", "N", "H", "H"), layout=Replicated)
    xc = p.tensor("xc", ("N", "N", "H", "H"), layout=Sliced(1))
    xl = p.tensor("xl", ("N", "N", "2*H"), layout=Local)
    w = p.tensor("w", ("N", "N", 3, 3), layout=Replicated)
    wk = p.tensor("wk", ("N", "N", 3, 3), layout=Sliced(0))
    wc = p.tensor("wc", ("N", "N", 3, 3), layout=Sliced(1))
    wl = p.tensor("wl", ("N", "N", 2), layout=Replicated)
    p.output("batch", cc.conv2d(xb, w, padding=1))
    p.output("filters", cc.all_gather(cc.conv2d(xr, wk, padding=(1, 0))))
    p.output("channels", cc.allreduce(cc.conv2d(xc, wc, padding=1, dilation=(2, 1))))
    p.output("local", cc.allreduce(cc.conv1d(xl, wl, stride=2)))
    return p.ir


def test_each_rule_lowers_to_the_runtime_conv_on_whole_pieces():
    src = lower(Schedule(every_rule()), "gloo").source.split("def step")[1]
    assert "conv0 = _conv(xb, w, (1, 1), (1, 1), (1, 1), 1)" in src
    assert "conv1 = _conv(xr, wk, (1, 1), (1, 0), (1, 1), 1)" in src
    assert "conv2 = _conv(xc, wc, (1, 1), (1, 1), (2, 1), 1)" in src
    assert "conv3 = _conv(xl, wl, (2,), (0,), (1,), 1)" in src
    assert "_c.cut(" not in src


def opts(world, backend, sizes):
    return Options(world=world, sizes=sizes, backend=backend, kernels="eager", time=False, timeout_s=120)


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_the_schedules_of_every_rule(backend):
    """Two transforms deep (each split and overlap, and their pairs): at 3 ranks 5 channels are 2, 2 and 1."""
    prog = every_rule()
    assert_all_ok(run_schedules(list(generate(prog, depth=2)), opts(3, backend, {"N": 5, "H": 4})))
    assert not rank_processes()


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_a_rank_without_channels_and_chunks_without_rows(backend):
    """2 channels over 3 ranks (the last holds none of the input channels, nor of the filters), and overlaps in
    more chunks than batch rows or output channels."""
    prog = example("conv_block")
    picked = [s for s in generate(prog) if s.text == "baseline" or "overlap" in s.text]
    picked += [s.with_knobs(chunks=16) for s in picked if s.text != "baseline"]
    assert_all_ok(run_schedules(picked, opts(3, backend, {"B": 2, "C": 2, "H": 3, "W": 4})))
    rules = [s for s in generate(every_rule()) if s.text == "baseline"]
    assert_all_ok(run_schedules(rules, opts(3, backend, {"N": 2, "H": 3})))


def test_overlap_code_chunks_the_batch_or_the_filters():
    prog = example("conv_block")
    along_batch = lower(Schedule.parse("overlap(conv0, ar0)", prog)).source
    assert "for _ak in torch.tensor_split(x, 4, dim=0):" in along_batch
    assert "_yk = _conv(_ak, w, (1, 1), (1, 1), (1, 1), 1)" in along_batch
    # scattered along the batch: each chunk of output channels scattered along it, the rows joined by channel
    scattered = lower(Schedule.parse("split(ar0); overlap(conv0, rs0)", prog)).source
    assert "for _bk in torch.tensor_split(w, 4, dim=0):" in scattered
    assert "_reduce_scatter(_c, _conv(x, _bk, (1, 1), (1, 1), (1, 1), 1), 0, d_B, 'sum', async_op=True)" in scattered
    assert "rs0 = torch.cat([_finish() for _finish in _pending], dim=1)" in scattered
    by_channel = lower(Schedule.parse("split(ar0, dim=1); overlap(conv0, rs0)", prog)).source
    assert "for _ak in torch.tensor_split(x, 4, dim=0):" in by_channel
    assert "_reduce_scatter(_c, _conv(_ak, w, (1, 1), (1, 1), (1, 1), 1), 1, d_C, 'sum'" in by_channel
    assert "rs0 = torch.cat([_finish() for _finish in _pending], dim=0)" in by_channel


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_scatters_along_the_channels_overlapped(backend):
    prog = example("conv_block")
    picked = [
        Schedule.parse(t, prog)
        for t in ("split(ar0, dim=1); overlap(conv0, rs0)", "split(ar0, dim=2); reorder(ag0); overlap(conv0, rs0)")
    ]
    assert_all_ok(run_schedules(picked, opts(2, backend, {"B": 3, "C": 5, "H": 3, "W": 2})))


def test_runtime_conv_gives_zeros_for_a_slice_without_channels():
    x, w = torch.rand(2, 0, 5, 4), torch.rand(3, 0, 3, 3)
    y = conv(x, w, (1, 2), (1, 1), (1, 1), 1)
    assert y.shape == F.conv2d(torch.rand(2, 1, 5, 4), torch.rand(3, 1, 3, 3), None, (1, 2), 1).shape
    assert not y.any()
    assert conv(torch.rand(2, 4, 7), torch.rand(0, 4, 3), (2,), (0,), (1,), 1).shape == (2, 0, 3)
    a, b = torch.rand(2, 4, 6, 6), torch.rand(2, 2, 3, 3)
    assert torch.equal(conv(a, b, (1, 1), (0, 0), (1, 1), 2), F.conv2d(a, b, groups=2))
    before = torch.backends.cudnn.allow_tf32
    with ieee_float32(a):  # on the CPU nothing to change
        assert torch.backends.cudnn.allow_tf32 == before


def test_cost_model_prices_a_convolution_s_flops_as_a_matmul_s():
    prog = example("conv_block")
    topo = load_topology("cpu-25gbe")
    sizes = {"B": 8, "C": 256, "H": 16, "W": 16}  # compute-bound: many channels, a small image
    for world in (2, 4):
        (unit,) = [
            d for name, _, d in cost.explain(Schedule(prog), sizes, topo, "gloo", world=world) if name == "conv0"
        ]
        flops = 2 * 8 * 16 * 16 * 256 * math.ceil(256 / world) * 9  # each rank's input channels
        assert unit["compute"] == pytest.approx(flops / (topo.matmul_TFLOPS["float32"] * 1e12))
        assert roofline.matmul_flops_per_rank(prog, sizes, world) == flops
    for topo in (load_topology(n) for n in list_topologies()):
        for backend in topo.backends:
            for s in generate(prog):
                p = cost.predict(s, {"B": 8, "C": 64, "H": 56, "W": 56}, topo, backend, world=4)
                assert math.isfinite(p.seconds) and p.seconds > 0, (topo.name, backend, s.text)


@pytest.mark.parametrize("world", [2, 3])
def test_hand_written_baseline_computes_the_block(world):
    """F.conv2d of each rank's channels and dist.all_reduce, checked against the reference: at 3 ranks and 2
    channels the last rank holds none and adds zeros."""
    prog = example("conv_block")
    assert baseline_for(prog) is BASELINES["conv_block"]
    for sizes in ({"B": 2, "C": 5, "H": 4, "W": 3}, {"B": 1, "C": 2, "H": 3, "W": 3}):
        torch_row, ours = run_schedules(
            [Schedule(prog)],
            Options(world=world, sizes=sizes, kernels="eager", warmup=0, repeats=1),
            baselines=[BASELINES["conv_block"]],
        )
        assert torch_row.status == "ok" and torch_row.correct, torch_row.error
        assert ours.status == "ok" and ours.correct
