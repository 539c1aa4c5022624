"""The C chunk kernels (coconet.kernels.native) against float32 IEEE arithmetic in torch: the same bits at
every alignment and length, streamed or not; and the generated module's wrapper handing what C cannot take
to the kernel it stands in for."""

import dataclasses
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coconet.kernels import copier
from coconet.kernels.chunk import COMPARE, DTYPE, HALF, OPS, POWERS, ChunkKernel, Untranslatable, half
from coconet.kernels.native import c_source

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")

# sqrt correctly rounded, as IEEE has it and C computes it: from float64, which rounds to the same float32.
# (torch's own CPU sqrt can be an ulp off: sqrt(1.1523602f) is 1.0734805f there.)
UNARY = {
    "neg": lambda a: -a,
    "sqrt": lambda a: torch.sqrt(a.double()).float(),
    "rsqrt": lambda a: 1 / torch.sqrt(a.double()).float(),
    "abs": torch.abs,
    "slice": lambda a: a,
}  # a chunk's rows of a replicated value, as they are


def maximum(a, b):
    """torch.maximum as Inductor's kernel and torch's vectorised loop compute it: NaN from either, b of +0 and
    -0 (torch's scalar loop, below 8 elements, takes a), which a division after shows as the sign of an inf."""
    return torch.where((a > b) | a.isnan(), a, b)


def minimum(a, b):
    return torch.where((a < b) | a.isnan(), a, b)


BINARY = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "maximum": maximum,
    "minimum": minimum,
}
assert set(UNARY) | set(BINARY) == set(OPS)
# x ** c for the constants C translates, as torch computes them (0.5: the correctly rounded square root, see sqrt)
POWER = {
    0.0: lambda a: torch.ones_like(a),
    1.0: lambda a: a,
    2.0: lambda a: a * a,
    3.0: lambda a: a * a * a,
    -1.0: lambda a: 1 / a,
    -2.0: lambda a: 1 / (a * a),
    0.5: UNARY["sqrt"],
    -0.5: UNARY["rsqrt"],
}
assert set(POWER) == set(POWERS)
# every rank's rows combined in order, as codegen.shm.reduce_all does
REDUCTIONS = {"sum": torch.add, "avg": torch.add, "prod": torch.mul, "max": maximum, "min": minimum}
COMPARISONS = {"lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne}
assert set(COMPARISONS) == set(COMPARE)
# host-number arithmetic, as Python does it (division left out: Python raises where C gives inf)
NUMBER = {"add": lambda p, q: p + q, "sub": lambda p, q: p - q, "mul": lambda p, q: p * q, "neg": lambda p: -p}

# what the Python kernel of a chunk takes, in its order: peers, two tensors it reads and writes, the parts it
# sums, a scalar
PARAMS = (("x_peers", "peers"), ("a", "rows"), ("b", "rows"), ("g_parts", "parts"), ("s", "scalar"))


@st.composite
def chunk_kernels(draw):
    """A random chunk: statements over the reduced parts, two tensors, a scalar and host numbers, comparisons
    and the where and cast that read them; one value written into each tensor, one streamed into the peers,
    none to two summed."""
    names, numbers, masks, stmts = ["g", "a", "b", "s"], [], [], []
    for k in range(draw(st.integers(1, 8))):
        name = f"t{k}"
        choice = draw(
            st.sampled_from(["unary", "binary", "binary", "const", "number", "compare", "where", "cast", "power"])
        )
        if choice == "power":  # the exponent a constant of the chunk
            stmts.append((f"{name}_c", "const", (), draw(st.sampled_from(sorted(POWERS)))))
            numbers.append(f"{name}_c")
            stmts.append((name, "pow", (draw(st.sampled_from(names)), f"{name}_c"), None))
            names.append(name)
        elif choice == "compare":
            x, y = draw(st.sampled_from(names)), draw(st.sampled_from(names + numbers))
            stmts.append((name, draw(st.sampled_from(sorted(COMPARE))), draw(st.permutations([x, y])), None))
            masks.append(name)
        elif choice in ("where", "cast") and masks:
            cond = draw(st.sampled_from(masks))
            if choice == "cast":
                stmts.append((name, "cast", (cond,), "float32"))
            else:
                pool = names + numbers
                stmts.append((name, "where", (cond, draw(st.sampled_from(pool)), draw(st.sampled_from(pool))), None))
            names.append(name)
        elif choice == "const":
            stmts.append((name, "const", (), draw(st.sampled_from([0.0, -0.0, 1.5, -2.0, 1e-8, 3, float("inf")]))))
            numbers.append(name)
        elif choice == "number" and numbers:
            op = draw(st.sampled_from(sorted(NUMBER)))
            args = tuple(draw(st.sampled_from(numbers)) for _ in range(1 if op == "neg" else 2))
            stmts.append((name, op, args, None))
            numbers.append(name)
        elif choice in ("unary", "where", "cast"):
            stmts.append((name, draw(st.sampled_from(sorted(UNARY))), (draw(st.sampled_from(names)),), None))
            names.append(name)
        else:
            pool = names + numbers
            x, y = draw(st.sampled_from(names)), draw(st.sampled_from(pool))
            stmts.append((name, draw(st.sampled_from(sorted(BINARY))), draw(st.permutations([x, y])), None))
            names.append(name)
    values = [n for n in names if n not in ("a", "b", "s")] or ["g"]
    writes = (("a", draw(st.sampled_from(values))), ("b", draw(st.sampled_from(values))))
    sums = tuple((f"psum{j}", draw(st.sampled_from(values))) for j in range(draw(st.integers(0, 2))))
    # what each rank's rows go through before they are summed (the gradient predivided, unscaled, weighted
    # by the rank's own number): a chain from the rows, each statement reading the one before and maybe the
    # scalar or the rank's number
    pre, last = [], "q"
    ranked = draw(st.booleans())
    # the rows bfloat16 or float16, which a cast to float32 reads first (a mixed-precision gradient)
    half = draw(st.sampled_from([None, "bfloat16", "float16"]))
    if half:
        pre.append(("uc", "cast", ("q",), "float32"))
        last = "uc"
    for j in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):
            pre.append((f"u{j}", draw(st.sampled_from(sorted(UNARY))), (last,), None))
        else:
            other = draw(st.sampled_from(["s", "kr"] if ranked else ["s"]))
            pre.append((f"u{j}", draw(st.sampled_from(sorted(BINARY))), draw(st.permutations([last, other])), None))
        last = f"u{j}"
    # rows of a second input read alongside, rank by rank (the sum of earlier micro-batches' gradients)
    two = bool(pre) and draw(st.booleans())
    half_two = draw(st.sampled_from([None, "bfloat16", "float16"])) if two else None
    if two:
        other = "q2"
        if half_two:
            pre.append(("uc2", "cast", ("q2",), "float32"))
            other = "uc2"
        pre.append(("uz", draw(st.sampled_from(sorted(BINARY))), draw(st.permutations([last, other])), None))
    params = tuple((n, f"{HALF[half]} parts" if half and n == "g_parts" else k) for n, k in PARAMS)
    if two:
        params = params[:4] + (("g2_parts", f"{HALF[half_two]} parts" if half_two else "parts"),) + params[4:]
    if ranked:  # every rank's number comes after the parts
        params = params[: 4 + two] + (("k_ranks", "rank numbers"),) + params[4 + two :]
    return ChunkKernel(
        params=params,
        parts=("g", "g_parts", draw(st.sampled_from(sorted(REDUCTIONS)))),
        stmts=tuple(stmts),
        numbers=frozenset(numbers),
        writes=writes,
        streams=(("x_peers", draw(st.sampled_from(values))),),
        sums=sums,
        pre=tuple(pre),
        part="q" if pre else None,
        ranked=(("kr", "k_ranks"),) if ranked and pre else (),
        also=(("q2", "g2_parts"),) if two else (),
    )


def evaluate(k: ChunkKernel, stmts, env):
    """``stmts`` run eagerly on ``env``: numbers in double, tensors in float32."""
    for name, op, args, value in stmts:
        xs = [env[x] for x in args]
        if op == "const":
            env[name] = value
        elif name in k.numbers:
            env[name] = NUMBER[op](*xs)
        elif op in COMPARISONS:
            x, y = (torch.as_tensor(v, dtype=torch.float32) for v in xs)
            env[name] = COMPARISONS[op](x, y)
        elif op == "where":
            env[name] = torch.where(xs[0], *(torch.as_tensor(v, dtype=torch.float32) for v in xs[1:]))
        elif op == "cast":
            env[name] = xs[0].float()
        elif op == "pow":
            env[name] = POWER[float(xs[1])](torch.as_tensor(xs[0], dtype=torch.float32))
        elif op in UNARY:
            x = xs[0] if isinstance(xs[0], torch.Tensor) else torch.as_tensor(xs[0], dtype=torch.float32)
            env[name] = UNARY[op](x)
        else:
            x, y = xs
            if op in ("maximum", "minimum"):
                x, y = (torch.as_tensor(v, dtype=torch.float32) for v in (x, y))
            env[name] = BINARY[op](x, y)
    return env


def reference(k: ChunkKernel, peers, a, b, parts, s, ranks=None, parts2=None):
    """The chunk as the Python kernel computes it, eagerly: numbers in double, tensors in float32; ``ranks``
    every rank's number, in the order of the parts; ``parts2`` every rank's rows of the second input."""
    env = {"a": a.clone(), "b": b.clone(), "s": s}
    if k.pre:  # each rank's rows through the pre statements (with the rank's number), then summed in rank order
        parts = [
            evaluate(
                k,
                k.pre,
                {
                    k.part: p,
                    "q2": None if parts2 is None else parts2[r],
                    "s": s,
                    "kr": None if ranks is None else ranks[r],
                },
            )[k.pre[-1][0]]
            for r, p in enumerate(parts)
        ]
    total = parts[0]
    for p in parts[1:]:
        total = REDUCTIONS[k.parts[2]](total, p)
    env["g"] = total / len(parts) if k.parts[2] == "avg" else total
    env = evaluate(k, k.stmts, env)
    out = {t: torch.broadcast_to(torch.as_tensor(env[v], dtype=torch.float32), a.shape) for t, v in k.writes}
    streamed = torch.broadcast_to(torch.as_tensor(env[k.streams[0][1]], dtype=torch.float32), a.shape)
    sums = tuple(torch.broadcast_to(torch.as_tensor(env[v], dtype=torch.float32), a.shape).double() for _, v in k.sums)
    return out["a"], out["b"], [streamed.clone() for _ in peers], sums


def cut(base, offset, n):
    return base[offset : offset + n]


def operands(n, offsets, peers=3, parts=3, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def noisy(offset):
        x = torch.randn(n + 64, generator=gen)
        x[::7] = 0.0
        x[3::11] = float("nan")
        x[5::13] = -x[5::13].abs()
        return cut(x, offset, n)

    return (
        [cut(torch.zeros(n + 64), offsets[2 + i % 2], n) for i in range(peers)],
        noisy(offsets[0]),
        noisy(offsets[1]),
        [noisy(offsets[i % 2]) for i in range(parts)],
        torch.tensor(0.75),
    )


def chunk_inputs(k, n, offsets):
    """What the Python kernel of a chunk_kernels() kernel takes: the peers, a and b, every rank's parts
    (bfloat16 or float16 where the kernel says so), a second input's parts and every rank's number where the
    kernel reads them (else None), s."""
    peers, a, b, parts, s = operands(n, offsets)
    kind = dict(k.params)
    parts = [p.to(dtype_of(kind["g_parts"])) for p in parts]
    parts2 = None
    if k.also:
        parts2 = [p.neg().mul(0.5).to(dtype_of(kind["g2_parts"])) for p in operands(n, offsets[::-1], seed=1)[3]]
    ranks = torch.tensor([0.5, -1.25, 3.0])[: len(parts)] if "q" in k.kinds else None
    return peers, a, b, parts, parts2, ranks, s


def dtype_of(kind: str) -> torch.dtype:
    return getattr(torch, DTYPE.get(half(kind), "float32"))


def without_f16c(monkeypatch):
    """The C kernels compiled as for a machine without F16C (float16 converted by hand)."""
    build = copier.native_library

    def without(source, name, flags, what):
        return build(source, name, [*flags, "-mno-f16c"], what)

    monkeypatch.setattr(copier, "native_library", without)


def given_after_parts(parts2, ranks):
    return (*([parts2] if parts2 is not None else []), *([ranks] if ranks is not None else []))


def run_native(k, args, monkeypatch, tmp_path):
    monkeypatch.setenv("COCONET_CACHE_DIR", str(tmp_path))

    def fallback(*_):
        raise AssertionError("the C kernel handed a call it can take to the Python kernel")

    return copier.native(fallback, k.kinds, c_source(k), sums=len(k.sums))(*args)


@settings(max_examples=20, deadline=None)
@given(
    k=chunk_kernels(),
    n=st.sampled_from([0, 1, 5, 16, 17, 40, 1000]),
    offsets=st.tuples(
        st.sampled_from([0, 1, 3]), st.sampled_from([0, 2]), st.sampled_from([0, 5]), st.sampled_from([0, 5, 6])
    ),
)
def test_the_c_kernel_computes_the_bits_torch_does(tmp_path_factory, k, n, offsets):
    """Streamed when the peers' rows start at one offset in their lines (offsets[2] == offsets[3]), stored
    plainly otherwise; heads and tails of every length around the 16-float lines. Sums in double, in another
    order than the reference's: the same float32 but for its last bit."""
    peers, a, b, parts, parts2, ranks, s = chunk_inputs(k, n, offsets)
    want_a, want_b, want_peers, want_sums = reference(k, peers, a, b, parts, s, ranks, parts2)
    args = (peers, a, b, parts, *given_after_parts(parts2, ranks), s)
    with pytest.MonkeyPatch.context() as m:
        sums = run_native(k, args, m, tmp_path_factory.mktemp("cache"))
    assert (sums is None) == (not k.sums)
    for got, values in zip(sums or (), want_sums, strict=True):
        assert got.dtype == torch.float32 and got.shape == ()
        # the rounding of a double sum, in either order, weighs on what cancels by the size of what was summed
        want = values.sum()
        slack = 1e-12 * float(values.abs().nansum()) if torch.isfinite(want) else 0.0
        torch.testing.assert_close(got.double(), want.float().double(), rtol=2**-23, atol=slack, equal_nan=True)
    torch.testing.assert_close(a, want_a, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(b, want_b, rtol=0, atol=0, equal_nan=True)
    for got, want in zip(peers, want_peers):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def assert_same_half(got, want, msg=""):
    """The same bits, but for a NaN's (torch's own kernels round a NaN to bfloat16 0xffff vectorised and to
    0x7fc0 one at a time; to float16, F16C keeps some of a NaN's payload where torch's scalar cast does not)."""
    assert got.dtype == want.dtype and want.dtype in (torch.bfloat16, torch.float16), msg
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), msg
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan]), msg


@settings(max_examples=12, deadline=None)
@given(
    k=chunk_kernels(),
    n=st.sampled_from([0, 1, 5, 16, 17, 33, 40, 1000]),
    offsets=st.tuples(
        st.sampled_from([0, 1, 3]), st.sampled_from([0, 2]), st.sampled_from([0, 5]), st.sampled_from([0, 5, 6])
    ),
    halves=st.tuples(st.sampled_from([0, 1, 8, 16]), st.sampled_from([0, 3, 8, 16, 24]), st.sampled_from([0, 3, 24])),
    dtype=st.sampled_from(sorted(HALF)),
    data=st.data(),
)
def test_a_value_cast_to_half_precision_is_stored_as_torch_rounds_it(
    tmp_path_factory, k, n, offsets, halves, dtype, data
):
    """A bfloat16 or float16 state beside the float32 ones (the copy of the weights mixed-precision training
    keeps): a value of the chunk cast to it, stored into this rank's rows and the peers' copies at every offset
    of those in their lines (32 rows a line, streamed where every copy starts at one offset in its line,
    stored plainly otherwise), beside the float32 peers (streamed or not), with the bits torch's cast gives."""
    # the value also streamed into the float32 peers: the bfloat16 must be torch's cast of what C computed
    # (a sign of zero from maximum or minimum may differ from the reference's, as torch's own kernels differ)
    tensors = [x for x, op, *_ in k.stmts if x not in k.numbers and op not in COMPARE] + ["g"]
    value = data.draw(st.sampled_from(tensors))
    tag = HALF[dtype]
    params = k.params[:1] + ((("y_peers", f"{tag} peers"),) + k.params[1:3] + (("c", f"{tag} rows"),) + k.params[3:])
    k = dataclasses.replace(
        k,
        params=params,
        stmts=k.stmts + (("h", "cast", (value,), dtype),),
        writes=k.writes + (("c", "h"),),
        streams=(("x_peers", value), ("y_peers", "h")),
    )
    peers, a, b, parts, parts2, ranks, s = chunk_inputs(k, n, offsets)
    halves_peers = [cut(torch.zeros(n + 64, dtype=getattr(torch, dtype)), halves[1 + i % 2], n) for i in range(3)]
    c = cut(torch.zeros(n + 64, dtype=getattr(torch, dtype)), halves[0], n)
    args = (peers, halves_peers, a, b, c, parts, *given_after_parts(parts2, ranks), s)
    with pytest.MonkeyPatch.context() as m:
        run_native(k, args, m, tmp_path_factory.mktemp("cache"))
    want = peers[0].to(getattr(torch, dtype))
    assert_same_half(c, want, "this rank's rows")
    for got in halves_peers:
        assert_same_half(got, want, "a peer's copy")


@pytest.mark.parametrize(
    "dtype,by_hand",
    [("bfloat16", False), ("float16", False), ("float16", True)],
    ids=["bfloat16", "float16", "float16-by-hand"],
)
def test_the_rounding_to_half_precision_is_torchs_at_its_edges(monkeypatch, tmp_path, dtype, by_hand):
    """Ties to even either way, a carry into the exponent, the largest values rounding to infinity, subnormals
    of either dtype, signed zeros and NaNs of either sign: as torch's cast gives them, in the vector loop and
    one by one; float16 through F16C and, on a machine without it, by hand."""
    if by_hand:
        without_f16c(monkeypatch)
    edges = [
        1.0 + 2.0**-8,
        1.0 + 3 * 2.0**-8,
        1.0 + 2.0**-8 + 2.0**-20,
        2.0 - 2.0**-9,
        3.4028235e38,
        3.3961776e38,
        1e-40,
        -1e-45,
        0.0,
        -0.0,
        float("inf"),
        -float("inf"),
        float("nan"),
        -float("nan"),
        -1.00390625,
        65504.0,
        1.1754944e-38,
        # float16's: ties at 1 and 2048, the largest finite and the first value that rounds past it,
        # subnormals and the ties between them, the smallest normal, below half the smallest subnormal
        1.0 + 2.0**-11,
        1.0 + 3 * 2.0**-11,
        2049.0,
        2051.0,
        65519.99,
        65520.0,
        -65536.0,
        2.0**-24,
        2.0**-25,
        3 * 2.0**-25,
        -5 * 2.0**-25,
        2.0**-14 - 2.0**-25,
        2.0**-26,
        1e-3,
        0.1,
    ]
    x = torch.tensor(edges * 6 + edges[:5])  # vectors of 8 and a tail
    tag = HALF[dtype]
    k = ChunkKernel(
        params=(("y_peers", f"{tag} peers"), ("a", "rows"), ("c", f"{tag} rows"), ("g_parts", "parts")),
        parts=("g", "g_parts", "sum"),
        stmts=(("h", "cast", ("a",), dtype),),
        numbers=frozenset(),
        writes=(("c", "h"),),
        streams=(("y_peers", "h"),),
    )
    peers, c = [torch.zeros(len(x), dtype=getattr(torch, dtype))], torch.zeros(len(x), dtype=getattr(torch, dtype))
    run_native(k, (peers, x, c, [torch.zeros(len(x))]), monkeypatch, tmp_path)
    want = x.to(getattr(torch, dtype))
    assert_same_half(c, want)
    assert_same_half(peers[0], want)
    if dtype == "bfloat16":
        assert torch.equal(c.view(torch.int16)[x.isnan()], torch.full((int(x.isnan().sum()),), -1, dtype=torch.int16))


def test_float16_rows_are_widened_as_torch_casts_them(monkeypatch, tmp_path):
    """Every float16 bit pattern, read by a cast to float32 before the ranks' rows are summed (the gradient of
    mixed-precision training), F16C and by hand: the float32 torch's cast gives, NaNs NaN."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    rows = bits.view(torch.float16)
    k = ChunkKernel(
        params=(("a", "rows"), ("g_parts", "f16 parts")),
        parts=("g", "g_parts", "sum"),
        stmts=(),
        numbers=frozenset(),
        writes=(("a", "g"),),
        streams=(),
        pre=(("uc", "cast", ("q",), "float32"),),
        part="q",
    )
    want = rows.float()
    for by_hand in (False, True):
        with pytest.MonkeyPatch.context() as m:
            if by_hand:
                without_f16c(m)
            a = torch.zeros(len(rows))
            run_native(k, (a, [rows]), m, tmp_path / ("by-hand" if by_hand else "f16c"))
        nan = want.isnan()
        assert torch.equal(a.isnan(), nan), by_hand
        assert torch.equal(a.view(torch.int32)[~nan], want.view(torch.int32)[~nan]), by_hand


@settings(max_examples=16, deadline=None)
@given(
    dtype=st.sampled_from(sorted(HALF)),
    op=st.sampled_from(sorted(REDUCTIONS)),
    ranks=st.integers(1, 4),
    n=st.sampled_from([1, 7, 8, 33, 1000]),
    offset=st.sampled_from([0, 1, 5]),
    scale=st.sampled_from([1.0, 3e2, 2e4]),
)
def test_half_precision_rows_summed_as_they_are_round_every_partial_total(
    tmp_path_factory, dtype, op, ranks, n, offset, scale
):
    """A float16 or bfloat16 gradient reduced in its own dtype (``cast(allreduce(g), float32)``, as DDP reduces
    a half gradient): every rank's rows widened, combined in rank order, each partial total rounded to the dtype
    as torch's half add rounds it (and an average's division after): the bits of the Python chunk's
    ``_reduce_all``, overflow to infinity and NaNs included."""
    tag, half_dtype = HALF[dtype], getattr(torch, dtype)
    gen = torch.Generator().manual_seed(ranks * 1000 + n)
    rows = []
    for r in range(ranks):
        x = torch.randn(n + 8, generator=gen) * scale
        x[r::17] = float("nan")
        x[(r + 5) :: 23] = float("inf") * (-1) ** r
        rows.append(cut(x.to(half_dtype), offset, n))
    k = ChunkKernel(
        params=(("a", "rows"), ("g_parts", f"{tag} parts")),
        parts=("g", "g_parts", op),
        stmts=(("f", "cast", ("g",), "float32"),),
        numbers=frozenset(),
        writes=(("a", "f"),),
        streams=(),
    )
    assert f"p_g = vround_{tag}((p_g + ld_{tag}(" in c_source(dataclasses.replace(k, parts=("g", "g_parts", "sum")))
    want = rows[0]
    for x in rows[1:]:
        want = REDUCTIONS[op](want, x)
    if op == "avg":
        want = want / ranks
    a = torch.zeros(n)
    with pytest.MonkeyPatch.context() as m:
        run_native(k, (a, rows), m, tmp_path_factory.mktemp("cache"))
    assert_same_half(a.to(half_dtype), want)
    assert torch.equal(a.isnan(), want.isnan()) and torch.equal(a[~a.isnan()], want.float()[~a.isnan()])
    with pytest.raises(Untranslatable):  # the half total is no float32 value to store as it is
        c_source(dataclasses.replace(k, stmts=(), writes=(("a", "g"),)))


@pytest.mark.parametrize("dtype", sorted(HALF))
@pytest.mark.parametrize("n,offset,peer_offset", [(1000, 0, 0), (1000, 3, 3), (77, 5, 8), (5, 1, 1)])
def test_a_half_precision_state_is_read_through_its_cast_and_written_back(
    monkeypatch, tmp_path, dtype, n, offset, peer_offset
):
    """Moments kept in bfloat16 or float16 (a low-precision optimizer state): the chunk reads the state's rows
    through a cast to float32, widened as they are loaded, and writes the new value, cast back, into the same rows
    and every peer's copy. The bits are torch's: the state's cast, float32 arithmetic, the cast back."""
    tag, half_dtype = HALF[dtype], getattr(torch, dtype)
    k = ChunkKernel(
        params=(
            ("y_peers", f"{tag} peers"),
            ("x_peers", "peers"),
            ("c", f"{tag} rows"),
            ("g_parts", "parts"),
            ("s", "scalar"),
        ),
        parts=("g", "g_parts", "sum"),
        stmts=(
            ("f", "cast", ("c",), "float32"),
            ("y0", "mul", ("s", "f"), None),
            ("y", "add", ("y0", "g"), None),
            ("h", "cast", ("y",), dtype),
        ),
        numbers=frozenset(),
        writes=(("c", "h"),),
        streams=(("x_peers", "y"), ("y_peers", "h")),
    )
    source = c_source(k)
    assert f"ld_{tag}(p_c + i)" in source and f"{tag}(p_c[i])" in source
    peers, _, _, parts, s = operands(n, (offset, 0, peer_offset, peer_offset))
    c = cut(torch.randn(n + 64, generator=torch.Generator().manual_seed(2)).to(half_dtype), offset, n)
    c[::9] = float("inf")
    before = c.clone()
    want = s * c.float() + (parts[0] + parts[1] + parts[2])
    half_peers = [cut(torch.zeros(n + 64, dtype=half_dtype), peer_offset, n) for _ in range(2)]
    run_native(k, (half_peers, peers, c, parts, s), monkeypatch, tmp_path)
    torch.testing.assert_close(peers[0], want, rtol=0, atol=0, equal_nan=True)
    assert_same_half(c, want.to(half_dtype))
    for got in half_peers:
        assert_same_half(got, want.to(half_dtype))
    # read by arithmetic whose result torch promotes to float32 (a product with the float32 g), the rows widen
    # all the same
    g = parts[0] + parts[1] + parts[2]
    direct = dataclasses.replace(k, stmts=(("y0", "mul", ("g", "c"), None),) + k.stmts[2:])
    assert (g * before).dtype == torch.float32
    want = g * before + g
    c, half_peers = before.clone(), [torch.zeros(n, dtype=half_dtype) for _ in range(2)]
    run_native(direct, (half_peers, peers, c, parts, s), monkeypatch, tmp_path)
    torch.testing.assert_close(peers[0], want, rtol=0, atol=0, equal_nan=True)
    assert_same_half(c, want.to(half_dtype))


@pytest.mark.parametrize("dtype", sorted(HALF))
def test_a_half_precision_value_is_stored_only_into_its_dtype(dtype):
    """A value cast to bfloat16 or float16 is held as the float32 it widens to: arithmetic reads it so (a product
    with a float32 tensor is float32 in torch too), and a cast back to float32 is that value. Stored into a
    float32 tensor or one of the other half dtype, summed over the rows, or a float32 value stored into a half
    tensor, it keeps Inductor's kernel."""
    tag, other = HALF[dtype], next(t for d, t in HALF.items() if d != dtype)
    params = (
        ("x_peers", "peers"),
        ("y_peers", f"{tag} peers"),
        ("a", "rows"),
        ("c", f"{tag} rows"),
        ("e", f"{other} rows"),
        ("g_parts", "parts"),
    )
    h = (("y0", "mul", ("a", "g"), None), ("h", "cast", ("a",), dtype))

    def kernel(stmts=h, writes=(("c", "h"),), streams=(("x_peers", "y0"), ("y_peers", "h")), sums=()):
        return ChunkKernel(params, ("g", "g_parts", "sum"), stmts, frozenset(), writes, streams, sums)

    assert f"vround_{tag}(ld(p_a + i))" in c_source(kernel())
    widened = c_source(
        kernel(
            h + (("f", "cast", ("h",), "float32"), ("y", "mul", ("f", "g"), None)),
            streams=(("x_peers", "y"), ("y_peers", "h")),
        )
    )
    assert "const v8 p_f = p_h;" in widened
    assert "const v8 p_y = (p_h * p_g);" in c_source(
        kernel(h + (("y", "mul", ("h", "g"), None),), streams=(("x_peers", "y"), ("y_peers", "h")))
    )
    for bad in (
        kernel(writes=(("c", "h"), ("a", "h"))),
        kernel(writes=(("c", "y0"),)),
        kernel(streams=(("x_peers", "h"), ("y_peers", "h"))),
        kernel(streams=(("x_peers", "y0"), ("y_peers", "y0"))),
        kernel(sums=(("psum", "h"),)),
        kernel(writes=(("c", "h"), ("e", "h"))),
    ):
        with pytest.raises(Untranslatable):
            c_source(bad)


def adam_kernel():
    stmts = (
        ("mul0", "mul", ("beta1", "m"), None),
        ("mul1", "mul", ("sub0", "g"), None),
        ("add0", "add", ("mul0", "mul1"), None),
        ("mul2", "mul", ("beta1", "v"), None),
        ("mul3", "mul", ("g", "g"), None),
        ("add1", "add", ("mul2", "mul3"), None),
        ("sqrt0", "sqrt", ("add1",), None),
        ("add2", "add", ("sqrt0", "eps"), None),
        ("div0", "div", ("add0", "add2"), None),
        ("sub4", "sub", ("w", "div0"), None),
    )
    params = (
        ("w_peers", "peers"),
        ("m", "rows"),
        ("v", "rows"),
        ("w", "rows"),
        ("g_parts", "parts"),
        ("beta1", "scalar"),
        ("sub0", "scalar"),
        ("eps", "scalar"),
    )
    return ChunkKernel(
        params=params,
        parts=("g", "g_parts", "sum"),
        stmts=stmts,
        numbers=frozenset(),
        writes=(("m", "add0"), ("v", "add1"), ("w", "sub4")),
        streams=(("w_peers", "sub4"),),
    )


def adam_args(n, peers=2):
    return [
        [torch.zeros(n) for _ in range(peers)],
        torch.randn(n),
        torch.rand(n),
        torch.randn(n),
        [torch.randn(n) for _ in range(3)],
        torch.tensor(0.9),
        torch.tensor(0.1),
        torch.tensor(1e-8),
    ]


def test_what_c_cannot_take_goes_to_the_python_kernel(monkeypatch, tmp_path):
    """A broadcast operand, a tensor of another dtype, one that needs autograd, a non-contiguous one: the
    Python kernel runs them; a well-formed call runs in C."""
    monkeypatch.setenv("COCONET_CACHE_DIR", str(tmp_path))
    k = adam_kernel()
    calls = []
    kernel = copier.native(lambda *args: calls.append(args), k.kinds, c_source(k))
    kernel(*adam_args(100))
    assert calls == [] and len(list((tmp_path / "kernels").glob("chunk_*.so"))) == 1
    bad = [adam_args(100) for _ in range(5)]
    bad[0][1] = torch.randn(1)  # m broadcast
    bad[1][2] = torch.rand(100, dtype=torch.float64)
    bad[2][3] = torch.randn(100, requires_grad=True)
    bad[3][4][1] = torch.randn(200)[::2]
    bad[4][5] = torch.tensor([0.9, 0.8])  # a scalar of two values
    for args in bad:
        kernel(*args)
    assert len(calls) == 5


def test_without_a_c_compiler_the_python_kernel_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("COCONET_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))
    k = adam_kernel()
    calls = []
    copier.native(lambda *args: calls.append(1), k.kinds, c_source(k))(*adam_args(10))
    assert calls == [1]


def test_a_statement_c_has_no_translation_for_is_refused():
    k = adam_kernel()
    for op in ("exp", "log", "where", "cast", "dropout"):
        stmts = k.stmts + (("odd", op, ("m",), None),)
        with pytest.raises(Untranslatable, match=op):
            c_source(ChunkKernel(k.params, k.parts, stmts, k.numbers, k.writes, k.streams))
    # a power: only of a tensor, by a constant C has a translation for (compiled in)
    for exponent, constants in (("v", ()), ("beta1", ()), ("beta1", (("beta1", 0.7),)), ("c", ())):
        stmts = k.stmts + (("c", "const", (), 1.5), ("odd", "pow", ("m", exponent), None))
        with pytest.raises(Untranslatable, match="pow"):
            c_source(ChunkKernel(k.params, k.parts, stmts, k.numbers | {"c"}, k.writes, k.streams, constants=constants))
    stmts = k.stmts + (("c", "const", (), 2), ("odd", "pow", ("c", "c"), None))
    with pytest.raises(Untranslatable, match="pow"):
        c_source(ChunkKernel(k.params, k.parts, stmts, k.numbers | {"c", "odd"}, k.writes, k.streams))
    stmts = k.stmts + (("odd", "pow", ("m", "beta1"), None),)
    src = c_source(ChunkKernel(k.params, k.parts, stmts, k.numbers, k.writes, k.streams, constants=(("beta1", 2.0),)))
    assert "p_odd = (p_m[i] * p_m[i]);" in src and "p_odd = (ld(p_m + i) * ld(p_m + i));" in src
    # a comparison is a mask: read only by where and a cast to float32, never as a number or summed
    mask = k.stmts + (("big", "gt", ("m", "v"), None),)
    for stmts, sums in (
        (mask + (("odd", "add", ("big", "m"), None),), ()),
        (mask + (("odd", "cast", ("big",), "float16"),), ()),
        (mask, (("psum", "big"),)),
    ):
        with pytest.raises(Untranslatable, match="big|cast"):
            c_source(ChunkKernel(k.params, k.parts, stmts, k.numbers, k.writes, k.streams, sums))


def test_powers_by_a_constant_are_what_torch_computes(monkeypatch, tmp_path):
    """``x ** c`` in C against torch's own ``x ** c`` (0.5 and -0.5 against the correctly rounded root, which
    C's is and torch's may miss by an ulp)."""
    monkeypatch.setenv("COCONET_CACHE_DIR", str(tmp_path))
    _, a, _, parts, _ = operands(1000, (0, 0, 0, 0), parts=1)
    a[::5] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-30, -3e38, 1e-45, 7.0])[: len(a[::5])].repeat(25)
    for c in sorted(POWERS):
        k = ChunkKernel(
            params=PARAMS,
            parts=("g", "g_parts", "sum"),
            stmts=(("y", "pow", ("a", "s"), None),),
            numbers=frozenset(),
            writes=(("b", "y"),),
            streams=(("x_peers", "y"),),
            constants=(("s", c),),
        )
        peers, b = [torch.zeros(1000)], torch.zeros(1000)
        run_native(k, (peers, a, b, parts, torch.tensor(c)), monkeypatch, tmp_path)
        want = POWER[c](a) if abs(c) == 0.5 else a**c
        torch.testing.assert_close(b, want, rtol=0, atol=0, equal_nan=True, msg=f"x ** {c}")
        torch.testing.assert_close(peers[0], want, rtol=0, atol=0, equal_nan=True, msg=f"x ** {c}")


def test_a_negative_zero_reaches_every_lane(monkeypatch, tmp_path):
    """-0.0 as a constant of the chunk, a number computed from constants, a scalar passed in or a rank's
    number, each the divisor of the rows: the vector loop's lanes get -0.0, not the +0.0 that adding it to a
    zero vector makes (the sign of the inf shows which); rows one by one and 8 and 16 at a time."""
    monkeypatch.setenv("COCONET_CACHE_DIR", str(tmp_path))
    numbers = (("z", "const", (), -0.0), ("one", "const", (), 1.0), ("nz", "mul", ("z", "one"), None))
    for divisor in ("z", "nz", "s", "kr"):
        if divisor == "kr":  # each rank's rows divided by its own number before they are summed
            k = ChunkKernel(
                params=(("x_peers", "peers"), ("a", "rows"), ("g_parts", "parts"), ("k_ranks", "rank numbers")),
                parts=("g", "g_parts", "sum"),
                stmts=(("d", "neg", ("g",), None),),
                numbers=frozenset(),
                writes=(("a", "d"),),
                streams=(("x_peers", "d"),),
                pre=(("u", "div", ("q", "kr"), None),),
                part="q",
                ranked=(("kr", "k_ranks"),),
            )
        else:
            k = ChunkKernel(
                params=(("x_peers", "peers"), ("a", "rows"), ("g_parts", "parts"), ("s", "scalar")),
                parts=("g", "g_parts", "sum"),
                stmts=numbers + (("d", "div", ("g", divisor), None),),
                numbers=frozenset({"z", "one", "nz"}),
                writes=(("a", "d"),),
                streams=(("x_peers", "d"),),
            )
        for n in (5, 16, 40):
            parts = [torch.linspace(-2, 3, n), torch.linspace(-4, 6, n)]
            peers, a = [torch.zeros(n)], torch.zeros(n)
            last = torch.tensor([-0.0, -0.0]) if divisor == "kr" else torch.tensor(-0.0)
            run_native(k, (peers, a, parts, last), monkeypatch, tmp_path)
            want = -(parts[0] / -0.0 + parts[1] / -0.0) if divisor == "kr" else (parts[0] + parts[1]) / -0.0
            for got in (a, peers[0]):
                torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=f"{divisor}, {n} rows")


def test_program_names_cannot_clash_with_the_kernels_own(monkeypatch, tmp_path):
    """A program may call its values n, i, a, out or float: they become p_<name>."""
    params = (("n_peers", "peers"), ("i", "rows"), ("float", "rows"), ("out_parts", "parts"), ("a", "scalar"))
    stmts = (("n", "mul", ("out", "a"), None), ("j", "add", ("n", "i"), None))
    k = ChunkKernel(params, ("out", "out_parts", "sum"), stmts, frozenset(), (("float", "j"),), (("n_peers", "n"),))
    src = c_source(k)
    assert "const float p_n = (p_out * p_a);" in src and "const v8 p_j = (p_n + ld(p_i + i));" in src
    peers, i, out = [torch.zeros(37)], torch.randn(37), torch.zeros(37)
    parts = [torch.randn(37), torch.randn(37)]
    run_native(k, (peers, i, out, parts, torch.tensor(3.0)), monkeypatch, tmp_path)
    assert torch.equal(peers[0], (parts[0] + parts[1]) * 3.0) and torch.equal(out, peers[0] + i)


def test_a_bool_scalar_passed_in_chooses_for_every_row(monkeypatch, tmp_path):
    """``where(ok, new, old)`` with ``ok`` a number the step computed before (a loss scaler's: no rank
    overflowed): the C kernel takes the bool as 1 or 0 and chooses alike for every row, streamed or not."""
    stmts = (("c", "const", (), 2.0), ("dbl", "mul", ("m", "c"), None), ("new", "where", ("ok", "dbl", "m"), None))
    k = ChunkKernel(
        params=(("m_peers", "peers"), ("m", "rows"), ("ok", "scalar")),
        parts=None,
        stmts=stmts,
        numbers=frozenset({"c"}),
        writes=(("m", "new"),),
        streams=(("m_peers", "new"),),
    )
    assert "(a->p_ok != 0.0f) ? " in c_source(k)
    for ok in (True, False):
        m = torch.randn(37)
        want = torch.where(torch.tensor(ok), m * 2.0, m)
        peers = [torch.zeros(37), torch.zeros(37)]
        run_native(k, (peers, m, torch.tensor(ok)), monkeypatch, tmp_path)
        for got in (m, *peers):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_rows_passed_in_are_stored_as_they_are(monkeypatch, tmp_path):
    """Adan keeps the reduced gradient it was given as next step's previous gradient (``p.update(gp, grad)``), read
    by the chunk as well: where the reduction ran before the kernel, the chunk stores its rows of ``grad`` into
    ``gp`` after reading ``gp``'s old rows, and streams a value computed from both into the peers."""
    stmts = (("diff", "sub", ("g", "gp"), None),)
    k = ChunkKernel(
        params=(("d_peers", "peers"), ("gp", "rows"), ("g", "rows")),
        parts=None,
        stmts=stmts,
        numbers=frozenset(),
        writes=(("gp", "g"),),
        streams=(("d_peers", "diff"),),
    )
    assert "st(p_gp + i, ld(p_g + i));" in c_source(k)
    g, gp = torch.randn(1001), torch.randn(1001)
    want_diff, peers = g - gp, [torch.zeros(1001), torch.zeros(1001)]
    run_native(k, (peers, gp, g), monkeypatch, tmp_path)
    torch.testing.assert_close(gp, g, rtol=0, atol=0)
    for got in peers:
        torch.testing.assert_close(got, want_diff, rtol=0, atol=0)
    with pytest.raises(Untranslatable):  # a scalar is no rows to store
        c_source(dataclasses.replace(k, params=k.params + (("s", "scalar"),), writes=(("gp", "s"),)))


# Adafactor's update on this rank's rows: w - (lr * g) * rsqrt(r * c / mean), r one value a row, c one a column
FACTORED = ChunkKernel(
    params=(
        ("w_peers", "peers"),
        ("w", "rows"),
        ("r", "row factor"),
        ("c", "column factor"),
        ("mean", "scalar"),
        ("lg", "rows"),
    ),
    parts=None,
    stmts=(
        ("rc", "mul", ("r", "c"), None),
        ("v", "div", ("rc", "mean"), None),
        ("inv", "rsqrt", ("v",), None),
        ("u", "mul", ("lg", "inv"), None),
        ("new", "sub", ("w", "u"), None),
    ),
    numbers=frozenset(),
    writes=(("w", "new"),),
    streams=(("w_peers", "new"),),
)


@pytest.mark.parametrize(
    "m,width,offsets",
    [(7, 16, (0, 0)), (5, 37, (0, 0)), (9, 100, (3, 3)), (3, 5, (1, 2)), (1, 1000, (0, 7)), (0, 16, (0, 0))],
)
def test_row_and_column_factors_are_broadcast_to_the_rows(monkeypatch, tmp_path, m, width, offsets):
    """An (m, 1) and a (1, w) factor read beside (m, w) rows, a row at a time: the bits torch's broadcast gives,
    whatever w is against the 16-float lines (each row's head its own), the peers streamed (offsets alike) or not."""

    def rows(seed, offset=0):
        x = torch.randn(m * width + offset, generator=torch.Generator().manual_seed(seed))
        return x[offset:].view(m, width)

    w, lg = rows(1), rows(2) * 1e-3
    r, c = rows(3)[:, :1].abs().contiguous() + 0.5, torch.rand(1, width) + 0.5
    mean = torch.tensor(0.75)
    peers = [torch.zeros(m * width + off)[off:].view(m, width) for off in offsets]
    want = w - lg * (1 / torch.sqrt(((r * c) / mean).double()).float())
    run_native(FACTORED, (peers, w, r, c, mean, lg), monkeypatch, tmp_path)
    for got in (w, *peers):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_factors_that_do_not_fit_the_rows_go_to_the_python_kernel(monkeypatch, tmp_path):
    monkeypatch.setenv("COCONET_CACHE_DIR", str(tmp_path))
    calls = []
    kernel = copier.native(lambda *args: calls.append(1), FACTORED.kinds, c_source(FACTORED))

    def args(r_shape=(4, 1), c_shape=(1, 8)):
        return (
            [torch.zeros(4, 8)],
            torch.zeros(4, 8),
            torch.ones(r_shape),
            torch.ones(c_shape),
            torch.tensor(1.0),
            torch.zeros(4, 8),
        )

    kernel(*args())
    assert calls == []
    for bad in (
        args(r_shape=(8, 1)),
        args(c_shape=(1, 4)),
        args(r_shape=(1, 4)),
        args(c_shape=(8, 1)),
        args(c_shape=(2, 8)),
    ):
        kernel(*bad)
    assert len(calls) == 5
    half_peers = dataclasses.replace(FACTORED, params=(("w_peers", "bf16 peers"),) + FACTORED.params[1:])
    with pytest.raises(Untranslatable, match="factor"):
        c_source(half_peers)
