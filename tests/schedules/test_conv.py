"""Convolutions: the layout table over every pair of layouts, shapes and their errors, the JSON IR, the
interpreter against torch on 1-4 ranks with uneven slices, and what the transforms make of them."""

import itertools
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import coconet as cc
from coconet.errors import IllegalTransform, ProgramError
from coconet.schedules import equivalence, interp
from coconet.schedules.schedule import Schedule
from coconet.schedules.serialize import export, load
from coconet.schedules.space import generate
from coconet.schedules.transforms.fuse import Fuse
from coconet.schedules.transforms.overlap import Overlap
from coconet.schedules.types import Local, Replicated, Sliced

pytestmark = pytest.mark.usefixtures("one_thread")  # torch's convolutions here: see the fixture

LAYOUTS = [Replicated(), Local(), Sliced(0), Sliced(1), Sliced(2), Sliced(3)]


def expected(lx, lw, groups):
    """The table, written out: the result's layout, or None where the pair is refused."""
    if lw == Replicated() and lx in (Replicated(), Local(), Sliced(0)):
        return lx
    if groups == 1 and (lx, lw) == (Replicated(), Sliced(0)):
        return Sliced(1)
    if groups == 1 and (lx, lw) == (Sliced(1), Sliced(1)):
        return Local()
    return None


@pytest.mark.parametrize("lx,lw,groups", list(itertools.product(LAYOUTS, LAYOUTS, [1, 2])))
def test_conv2d_table(lx, lw, groups):
    p = cc.Program("t", dims=("B", "C", "H", "W"))
    x = p.tensor("x", ("B", "2*C", "H", "W"), layout=lx)
    w = p.tensor("w", ("4*C", f"{2 // groups}*C", 3, 3), layout=lw)
    want = expected(lx, lw, groups)
    if want is None:
        with pytest.raises(ProgramError) as info:
            cc.conv2d(x, w, padding=1, groups=groups)
        assert info.value.rule == "conv2d layouts" and f"{lx} x {lw}" in str(info.value)
        if groups == 2 and expected(lx, lw, 1) is not None:
            assert "slicing channels needs groups=1" in str(info.value)
        return
    y = cc.conv2d(x, w, padding=1, groups=groups)
    assert y.layout == want and tuple(map(str, y.shape)) == ("B", "4*C", "H", "W")
    p.output("y", y)
    (conv,) = (s for s in p.ir.stmts if s.op == "conv2d")  # no statement of its own around it: the user's collective
    assert conv.type.layout == want and conv.attr("groups") == groups


@pytest.mark.parametrize("lx,lw", list(itertools.product(LAYOUTS[:5], LAYOUTS[:5])))
def test_conv1d_table(lx, lw):
    p = cc.Program("t", dims=("B", "C", "L"))
    x, w = p.tensor("x", ("B", "C", "L"), layout=lx), p.tensor("w", ("C", "C", 3), layout=lw)
    want = expected(lx, lw, 1)
    if want is None:
        with pytest.raises(ProgramError, match="no conv1d rule") as info:
            cc.conv1d(x, w)
        if lx == Sliced(2):
            assert "halo exchange" in str(info.value)
        return
    y = cc.conv1d(x, w)
    assert y.layout == want and tuple(map(str, y.shape)) == ("B", "C", "L - 2")


def test_partial_sums_need_their_collective():
    """The partial sums are Local: pointwise work on them stays per rank, and an allreduce completes them."""
    p = cc.Program("t", dims=("B", "C", "H"))
    x = p.tensor("x", ("B", "C", "H", "H"), layout=Sliced(1))
    w = p.tensor("w", ("C", "C", 1, 1), layout=Sliced(1))
    b = p.tensor("b", ("C", 1, 1), layout=Replicated)
    part = cc.conv2d(x, w)
    assert (part + b).layout == Local()
    assert cc.allreduce(part).layout == Replicated() and cc.reduce_scatter(part, dim=1).layout == Sliced(1)
    with pytest.raises(ProgramError, match="Local and Sliced"):
        part + x


@pytest.mark.parametrize(
    "shape,kernel,kw,want",
    [
        (("B", "C", "H", "W"), (3, 3), {}, ("H - 2", "W - 2")),
        (("B", "C", "H", "W"), (3, 3), {"padding": 1}, ("H", "W")),
        (("B", "C", "H", "W"), (3, 1), {"padding": (1, 0), "dilation": (2, 1)}, ("H - 2", "W")),
        (("B", "C", "2*H", "4*W"), (3, 3), {"stride": 2, "padding": 1}, ("H", "2*W")),
        (("B", "C", "2*H", "4*W + 1"), (1, 2), {"stride": (2, 4)}, ("H", "W")),
        (("B", "C", 9, 8), (3, 2), {"stride": (2, 3), "padding": (1, 2), "dilation": (2, 1)}, ("4", "4")),
    ],
)
def test_output_sizes_follow_torch_on_symbolic_dims(shape, kernel, kw, want):
    p = cc.Program("t", dims=("B", "C", "H", "W"))
    x = p.tensor("x", shape, layout=Replicated)
    w = p.tensor("w", ("C", "C") + kernel, layout=Replicated)
    y = cc.conv2d(x, w, **kw)
    assert tuple(map(str, y.shape[2:])) == want
    sizes = {"B": 2, "C": 3, "H": 5, "W": 3}
    got = interp.concrete_shape(y.type, sizes)
    xs = interp.concrete_shape(x.type, sizes)
    assert got == tuple(F.conv2d(torch.zeros(xs), torch.zeros((3, 3) + kernel), **kw).shape)


@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda x, w: cc.conv2d(x, w, stride=2),
            r"spatial dim 0 of x is H with kernel 3 and stride 2: the output size "
            r"\(H - 3\) // 2 \+ 1 is not a polynomial",
        ),
        (lambda x, w: cc.conv2d(x, w, padding="same"), r"padding 'same' is a string"),
        (lambda x, w: cc.conv2d(x, w, stride=(1, 1, 1)), r"stride \(1, 1, 1\) is not an int or 2 ints"),
        (lambda x, w: cc.conv2d(x, w, stride=0), r"stride 0 must be >= 1"),
        (lambda x, w: cc.conv2d(x, w, padding=-1), r"padding -1 must be >= 0"),
        (lambda x, w: cc.conv2d(x, w, padding=(1, 2**40)), r"padding \(1, 1099511627776\) is larger than 2\^20"),
        (lambda x, w: cc.conv2d(x, w, dilation=True), r"dilation True is not an int"),
        (lambda x, w: cc.conv2d(x, w, groups=0), r"groups 0 must be >= 1"),
        (lambda x, w: cc.conv2d(x, w, groups=3), r"x has C channels but w\(C, C, 3, 3\) with groups=3 takes 3 x C"),
        (
            lambda x, w: cc.conv1d(x, w),
            r"conv1d\(x: \(B, C, H, W\) Replicated, w: \(C, C, 3, 3\) Replicated\) takes "
            r"x \(B, C, L\) and w \(K, C/groups, k\)",
        ),
        (lambda x, w: cc.conv2d(x, cc.cast(w, "float16")), r"conv2d of x \(float32\) by cast0 \(float16\); cast one"),
        (lambda x, w: cc.conv2d(x > 0, w), r"conv2d operand gt0 is bool"),
        (lambda x, w: cc.conv2d(cc.sum(x, 0), w), r"takes x \(B, C, H, W\)"),
    ],
)
def test_errors_name_the_rule(call, match):
    p = cc.Program("t", dims=("B", "C", "H", "W"))
    x = p.tensor("x", ("B", "C", "H", "W"), layout=Replicated)
    w = p.tensor("w", ("C", "C", 3, 3), layout=Replicated)
    with pytest.raises(ProgramError, match=match) as info:
        call(x, w)
    assert info.value.rule and info.value.statement


def test_group_and_kernel_checks():
    p = cc.Program("t", dims=("B", "G", "H"))
    x = p.tensor("x", ("B", "2*G", 4, 4), layout=Replicated)
    with pytest.raises(ProgramError, match="3 output channels do not divide into groups=2"):
        cc.conv2d(x, p.tensor("w1", (3, "G", 1, 1), layout=Replicated), groups=2)
    with pytest.raises(
        ProgramError,
        match=r"G output channels are not a multiple of groups=2 for every size "
        r"\(write them as 2\*G\)",
    ):
        cc.conv2d(x, p.tensor("w2", ("G", "G", 1, 1), layout=Replicated), groups=2)
    grouped = cc.conv2d(x, p.tensor("w3", ("4*G", "G", 3, 3), layout=Replicated), padding=1, groups=2)
    assert tuple(map(str, grouped.shape)) == ("B", "4*G", "4", "4")
    depthwise = p.tensor("xd", ("B", 6, "H", "H"), layout=Sliced(0))
    out = cc.conv2d(depthwise, p.tensor("wd", (6, 1, 3, 3), layout=Replicated), groups=6)
    assert tuple(map(str, out.shape)) == ("B", "6", "H - 2", "H - 2") and out.layout == Sliced(0)
    with pytest.raises(ProgramError, match="smaller than the kernel's reach .* the output would be empty"):
        cc.conv2d(x, p.tensor("w4", ("G", "2*G", 3, 3), layout=Replicated), dilation=2)


def test_defaults_and_ints_are_one_statement():
    p = cc.Program("t", dims=("B", "C", "H"))
    x = p.tensor("x", ("B", "C", "H", "H"), layout=Replicated)
    w = p.tensor("w", ("C", "C", 3, 3), layout=Replicated)
    a = cc.conv2d(x, w, padding=1)
    assert cc.conv2d(x, w, stride=(1, 1), padding=[1, 1], dilation=1, groups=1).name == a.name == "conv0"
    p.output("y", a)
    assert p.ir[a.name].attrs == (("dilation", (1, 1)), ("groups", 1), ("padding", (1, 1)), ("stride", (1, 1)))


def test_json_round_trip_and_refusals():
    p = cc.Program("t", dims=("B", "C", "L"))
    x = p.tensor("x", ("B", "C", "2*L"), layout=Sliced(1))
    w = p.tensor("w", ("C", "C", 3), layout=Sliced(1))
    p.output("y", cc.allreduce(cc.conv1d(x, w, stride=2, padding=1)))
    text = export(p.ir)
    back = load(text)
    assert back.hash == p.ir.hash and export(back) == text
    data = json.loads(text)
    (conv,) = (e for e in data["statements"] if e["op"] == "conv1d")
    assert conv["attrs"] == {"stride": [2], "padding": [1], "dilation": [1], "groups": 1}
    conv["attrs"]["stride"] = [2, 2]
    with pytest.raises(ProgramError, match=r"attribute stride: stride \[2, 2\] is not an int or 1 ints"):
        load(json.dumps(data))
    conv["attrs"] = {"stride": 2, "bias": True}
    with pytest.raises(ProgramError, match=r"unknown attributes \['bias'\] for conv1d"):
        load(json.dumps(data))


# --- the interpreter against torch ---

RULES = {
    "RR": (Replicated(), Replicated()),
    "LR": (Local(), Replicated()),
    "S0R": (Sliced(0), Replicated()),
    "RS0": (Replicated(), Sliced(0)),
    "S1S1": (Sliced(1), Sliced(1)),
}


@st.composite
def convolutions(draw):
    nd = draw(st.sampled_from([1, 2]))
    rule = draw(st.sampled_from(sorted(RULES)))
    groups = draw(st.integers(1, 3)) if rule in ("RR", "LR", "S0R") else 1
    c, k = draw(st.integers(1, 4)) * groups, draw(st.integers(1, 3)) * groups
    taps = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    stride = tuple(draw(st.integers(1, 2)) for _ in range(nd))
    padding = tuple(draw(st.integers(0, 2)) for _ in range(nd))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(nd))
    spatial = tuple(
        max(1, d * (t - 1) + 1 - 2 * q) + draw(st.integers(0, 4)) for t, q, d in zip(taps, padding, dilation)
    )
    return dict(
        nd=nd,
        rule=rule,
        groups=groups,
        c=c,
        k=k,
        taps=taps,
        stride=stride,
        padding=padding,
        dilation=dilation,
        spatial=spatial,
    )


@settings(max_examples=80, deadline=None)
@given(case=convolutions(), world=st.integers(1, 4), batch=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_conv_matches_torch(case, world, batch, seed):
    lx, lw = RULES[case["rule"]]
    p = cc.Program("t", dims=("B",))
    x = p.tensor("x", ("B", case["c"]) + case["spatial"], layout=lx)
    w = p.tensor("w", (case["k"], case["c"] // case["groups"]) + case["taps"], layout=lw)
    conv = cc.conv1d if case["nd"] == 1 else cc.conv2d
    y = conv(x, w, stride=case["stride"], padding=case["padding"], dilation=case["dilation"], groups=case["groups"])
    p.output("y", y)
    res = interp.run(p, world, {"B": batch}, seed=seed)
    inputs = interp.make_inputs(p, world, {"B": batch}, seed=seed)
    fn = F.conv1d if case["nd"] == 1 else F.conv2d

    def ref(xv):
        return fn(
            torch.from_numpy(xv),
            torch.from_numpy(inputs["w"]),
            None,
            case["stride"],
            case["padding"],
            case["dilation"],
            case["groups"],
        ).numpy()

    got = res.output("y")
    if lx == Local():  # every rank's own x convolved
        want = np.stack([ref(inputs["x"][r]) for r in range(world)])
    elif lx == Sliced(1):  # every rank's partial sum over its channels: they add up to the convolution
        got = got.sum(axis=0)
        want = ref(inputs["x"])
    else:
        want = ref(inputs["x"])
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


def test_a_rank_without_channels_adds_nothing():
    """2 channels over 3 ranks: the last holds none of x's or w's input channels (a partial sum of zeros), nor
    of an output-channel slice of w (no channels of the result)."""
    p = cc.Program("t", dims=("B",))
    x = p.tensor("x", ("B", 2, 4, 4), layout=Sliced(1))
    w = p.tensor("w", (2, 2, 3, 3), layout=Sliced(1))
    xr = p.tensor("xr", ("B", 2, 4, 4), layout=Replicated)
    wk = p.tensor("wk", (2, 2, 3, 3), layout=Sliced(0))
    part = cc.conv2d(x, w, padding=1)
    p.output("y", cc.allreduce(part))
    p.output("z", cc.conv2d(xr, wk))
    res = interp.run(p, 3, {"B": 2}, keep_values=True)
    inputs = interp.make_inputs(p, 3, {"B": 2})
    assert np.all(res.stages[0].values[part.name][2] == 0) and res.stages[0].values[part.name][2].shape == (2, 2, 4, 4)
    torch_x = torch.from_numpy(inputs["x"])
    np.testing.assert_allclose(res.output("y"), F.conv2d(torch_x, torch.from_numpy(inputs["w"]), padding=1).numpy())
    assert [piece.shape[1] for piece in res.stages[0].outputs["z"]] == [1, 1, 0]
    np.testing.assert_allclose(
        res.output("z"), F.conv2d(torch.from_numpy(inputs["xr"]), torch.from_numpy(inputs["wk"])).numpy()
    )


# --- transforms ---


def channel_parallel(groups=1, local=False):
    p = cc.Program("cp", dims=("B", "C", "H"))
    if local:
        x = p.tensor("x", ("B", "2*C", "H", "H"), layout=Local)
        w = p.tensor("w", ("2*C", f"{2 // groups}*C", 3, 3), layout=Replicated)
    else:
        x = p.tensor("x", ("B", "2*C", "H", "H"), layout=Sliced(1))
        w = p.tensor("w", ("2*C", "2*C", 3, 3), layout=Sliced(1))
    b = p.tensor("b", ("2*C", 1, 1), layout=Replicated)
    y = cc.allreduce(cc.conv2d(x, w, padding=1, groups=groups))
    p.output("out", cc.maximum(y + b, 0.0))
    return p.ir


def test_fuse_leaves_a_convolution_out_naming_why():
    prog = channel_parallel()
    with pytest.raises(IllegalTransform, match="conv0 is a conv2d; only pointwise statements"):
        Fuse(("conv0", "add0")).apply(prog)
    assert all("conv0" not in t.members for t in Fuse.instances(prog))


def test_overlap_chunks_a_convolution_against_its_collective():
    prog = channel_parallel()
    assert Overlap.instances(prog) == [Overlap("conv0", "ar0")]
    split = Schedule.parse("split(ar0)", prog).scheduled
    assert Overlap.instances(split) == [Overlap("conv0", "rs0")]
    # grouped along the batch only where the output channels hold no groups to straddle
    grouped = Schedule.parse("split(ar0)", channel_parallel(groups=2, local=True)).scheduled
    assert Overlap.instances(grouped) == []
    with pytest.raises(IllegalTransform, match="chunked along its output channels, which would straddle its 2 groups"):
        Overlap("conv0", "rs0").apply(grouped)
    along_channels = Schedule.parse("split(ar0, dim=1)", channel_parallel(groups=2, local=True)).scheduled
    assert Overlap.instances(along_channels) == [Overlap("conv0", "rs0")]


def test_overlap_needs_the_batch_whole():
    p = cc.Program("bs", dims=("B", "C", "H"))
    x = p.tensor("x", ("B", "C", "H", "H"), layout=Sliced(0))
    w = p.tensor("w", ("C", "C", 1, 1), layout=Replicated)
    p.output("y", cc.all_gather(cc.conv2d(x, w)))
    assert Overlap.instances(p.ir) == []
    with pytest.raises(IllegalTransform, match="ag0 is a all_gather, not an allreduce or reduce_scatter"):
        Overlap("conv0", "ag0").apply(p.ir)


@pytest.mark.parametrize(
    "make", [channel_parallel, lambda: channel_parallel(groups=2, local=True)], ids=["channels", "local_groups"]
)
def test_every_schedule_is_equivalent(make):
    prog = make()
    space = generate(prog)
    assert not space.refused and any("overlap(conv0" in s.text for s in space)
    for world in (1, 2, 3, 4):
        for sched in space:
            bad = equivalence.check(sched, world, {"B": 3, "C": 2, "H": 3})
            assert not bad, f"{sched.text} at R={world}: {bad[0]}"
