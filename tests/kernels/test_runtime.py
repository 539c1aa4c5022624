import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coconet.kernels import compiled, dropout, ops
from coconet.kernels import rng as trng
from coconet.schedules import rng


def _piece(shape, dim, first, count):
    return tuple(slice(first, first + count) if k == dim else slice(0, n) for k, n in enumerate(shape))


@st.composite
def pieces(draw):
    shape = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 4, 5, 8, 12]), min_size=1, max_size=4)))
    dim = draw(st.integers(-1, len(shape) - 1))
    if dim < 0:
        return shape, dim, 0, 0
    first = draw(st.integers(0, shape[dim]))
    return shape, dim, first, draw(st.integers(0, shape[dim] - first))


@settings(max_examples=150, deadline=None)
@given(pieces(), st.integers(0, 2**64 - 1))
def test_words_of_a_piece_are_the_specified_ones(piece, seed):
    """Whether a row is whole blocks of four (one Philox call per block) or not (one per element), every
    element gets the word of its global index."""
    shape, dim, first, count = piece
    got = dropout.dropout_words(seed, shape, dim, first, count, torch.device("cpu"))
    want = rng.random_bits(seed, rng.global_index(shape, _piece(shape, dim, first, count) if dim >= 0 else None))
    assert got.shape == want.shape and np.array_equal(got.numpy(), want.astype(np.int64))


def test_blocks_hold_the_four_words_of_their_elements():
    block = torch.tensor([0, 1, 7, 2**30, 2**40 + 5], dtype=torch.int64)
    for seed in (0, 99, 2**64 - 1):
        got = trng.philox_blocks(seed, block)
        assert got.shape == (5, 4)
        want = rng.random_bits(seed, (4 * block[:, None] + torch.arange(4)).numpy())
        assert np.array_equal(got.reshape(-1).numpy(), want.reshape(-1))


def test_chunk_rows_from_a_tensor_compiled():
    """A fused collective's chunk kernel: the first row arrives as a 0-d tensor, the shape as ints, and the
    compiled kernel (one call per block here: the last dim is 12) draws the specified mask."""
    shape, dim, p, seed = (6, 3, 12), 0, 0.25, 2**63 + 11
    fn = torch.compile(
        lambda x, s, first: dropout.dropout_rows(x, p, s, shape, dim, first), dynamic=False, fullgraph=True
    )
    x = torch.ones(2, 3, 12)
    for first in (0, 2, 4):
        got = fn(x, torch.tensor(seed - 2**64, dtype=torch.int64), torch.tensor(first, dtype=torch.int64))
        keep = rng.dropout_mask(seed, p, shape, _piece(shape, dim, first, 2))
        assert np.array_equal(got.numpy(), np.where(keep, 1 / (1 - p), 0.0).astype(np.float32))


@pytest.mark.parametrize("shape,dim", [((4, 6), 0), ((4, 6), 1), ((5, 8), -1)])
def test_dropout_of_a_ranks_piece(shape, dim):
    class Rank:
        world, rank = 2, 1

        def rows(self, n):
            chunk = -(-n // self.world)
            return min(self.rank * chunk, n), min(self.rank * chunk + chunk, n)

    lo, hi = Rank().rows(shape[dim]) if dim >= 0 else (0, 0)
    local = tuple(hi - lo if k == dim else n for k, n in enumerate(shape))
    got = dropout.dropout(Rank(), torch.ones(local), 0.5, 5, shape, dim)
    keep = rng.dropout_mask(5, 0.5, shape, _piece(shape, dim, lo, hi - lo) if dim >= 0 else None)
    assert np.array_equal(got.numpy(), np.where(keep, 2.0, 0.0).astype(np.float32))


def test_kernels_are_kept_out_of_aotautograds_cache(tmp_path):
    """A compiled kernel goes to Inductor's cache, never to AOTAutograd's: keyed on which inputs share a
    buffer but not on how (pytorch/pytorch#184694), that cache handed a later process a kernel traced for
    other views of its segment, which failed ('expected size 1008==1001') or wrote wrong rows."""
    script = (
        "import torch\n"
        "from coconet.kernels.compiled import kernel as _kernel\n"
        "def f(a, b, x):\n"
        "    a.copy_(x * 2)\n"
        "    b.copy_(x + 1)\n"
        "seg, x = torch.zeros(64), torch.arange(8.0)\n"
        "_kernel(f)(seg[0:8], seg[16:24], x)\n"
        "assert torch.equal(seg[0:8], x * 2) and torch.equal(seg[16:24], x + 1)\n"
        "assert torch._functorch.config.enable_autograd_cache  # only the kernel's compile is without it\n"
    )
    # (TORCHINDUCTOR_AUTOGRAD_CACHE, where set, overrides any setting made in code: left out)
    env = {
        **{k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_AUTOGRAD_CACHE"},
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path),
    }
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert any((tmp_path / "fxgraph").rglob("*")), "the kernel was not stored in Inductor's cache"
    assert not any((tmp_path / "aotautograd").rglob("*"))


def _no_dynamo(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.compile was called")

    monkeypatch.setattr(torch, "compile", refuse)


def test_a_cpu_kernel_runs_inductors_code_without_dynamo(monkeypatch):
    """On CPU a kernel is Inductor's code for its traced graph, kept per shape and stride of its inputs: each
    call writes its state once, lists of tensors and returned tuples come through, and a second shape (or
    the columns of a matrix, not contiguous) gets a kernel of its own."""
    _no_dynamo(monkeypatch)

    def step(peers, m, parts, beta):
        g = parts[0] + parts[1]
        m1 = beta * m + g
        m.copy_(m1)
        for p in peers:
            p.copy_(m1 * 2)
        return m1 + 1, g

    kernel = compiled.kernel(step)
    for shape, cut in (((6,), lambda t: t), ((9,), lambda t: t), ((5, 4), lambda t: t[:, 1:3])):
        m, peer, g0, g1 = (cut(torch.rand(shape)) for _ in range(4))
        want_m = 0.5 * m + g0 + g1
        for _ in range(2):  # the first call compiles, the second finds it
            before = m.clone()
            out, g = kernel([peer], m, [g0, g1], torch.tensor(0.5))
            want = 0.5 * before + g0 + g1
            assert torch.allclose(m, want) and torch.allclose(peer, want * 2)
            assert torch.allclose(out, want + 1) and torch.allclose(g, g0 + g1)
        assert not torch.allclose(want_m, m)  # the second call ran on the first's result: once per call


def test_dropout_in_a_kernel_traces_without_dynamo(monkeypatch):
    _no_dynamo(monkeypatch)
    x = torch.rand(3, 16)
    got = compiled.kernel(lambda x, seed, first: dropout.dropout_rows(x * 1.0, 0.5, seed, (8, 16), 0, first))(
        x, ops.int64(5), ops.int64(2)
    )
    assert torch.equal(got, dropout.dropout_rows(x, 0.5, ops.int64(5), (8, 16), 0, ops.int64(2)))


def test_a_kernel_compiles_once_for_a_context_made_anew_every_step(monkeypatch):
    """A fused kernel takes the rank's _Ctx, a new object every step: it is keyed by what its attributes hold
    (compiling on every step took 150 ms a step), and a context that differs in them compiles again."""
    real, compiles = torch._inductor.standalone_compile, []

    def counting(*args, **kwargs):
        compiles.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch._inductor, "standalone_compile", counting)

    class Ctx:
        def __init__(self, rank):
            self.rank, self.world, self.device = rank, 2, torch.device("cpu")

    kernel = compiled.kernel(lambda c, x: x * (c.rank + 1))
    x = torch.arange(4.0)
    for _ in range(3):
        assert torch.equal(kernel(Ctx(0), x), x)
    assert len(compiles) == 1
    assert torch.equal(kernel(Ctx(1), x), x * 2) and len(compiles) == 2


def test_a_kernel_is_handed_bools_as_bytes_and_returns_bools(monkeypatch):
    """Inductor's CPU code moves bool vectors through masked byte loads and stores (10-20x a float's on
    AMD cores, benchmarks/cpu_masks.py): the graph it compiles takes and returns no bool tensor, and the
    caller still gets bools, the mask of every element (a 0-d one too) as eager torch computes it. A bool
    tensor the kernel writes is handed over as it is: a converted copy would take the writes."""
    _no_dynamo(monkeypatch)
    real, graphs = torch._inductor.standalone_compile, []

    def spy(graph, inputs, **kwargs):
        graphs.append((graph, [x.dtype for x in inputs]))
        return real(graph, inputs, **kwargs)

    monkeypatch.setattr(torch._inductor, "standalone_compile", spy)

    def f(mask, x, flags):
        c = x * 2.0
        return torch.where(mask & flags[0], c, -c), c >= 1.0, x.sum() > 0, flags[1]

    kernel = compiled.kernel(f)
    x = torch.linspace(-2, 2, 37)
    mask, flags = x > -0.5, [x < 1.5, torch.arange(37) % 3 == 0]
    for _ in range(2):
        got, want = kernel(mask, x, flags), f(mask, x, flags)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g, w)
    assert len(graphs) == 1
    graph, dtypes = graphs[0]
    outputs = [n for n in graph.graph.nodes if n.op == "output"][0].args[0]
    assert torch.bool not in dtypes and dtypes.count(torch.uint8) == 3
    assert all(o.meta["val"].dtype != torch.bool for o in outputs)

    def rows_of_a_mask(out, x, flags):  # a chunk kernel writing its rows of a sliced mask
        out[2:5].copy_(x[2:5] > 0.0)
        return x * flags.to(torch.float32)

    kernel = compiled.kernel(rows_of_a_mask)
    out = torch.zeros(37, dtype=torch.bool)
    kernel(out, x, mask)
    assert torch.equal(out, torch.arange(37).ge(2) & torch.arange(37).lt(5) & (x > 0))
    assert graphs[-1][1] == [torch.bool, torch.float32, torch.uint8]  # the mask it writes is handed as it is


def test_inputs_that_share_memory_go_through_torch_compile(monkeypatch):
    """A kernel traced for separate inputs would write views of one buffer as if apart: those calls take
    torch.compile's path, whose guards see the aliasing, even where the same shapes ran standalone before."""
    dynamo = []
    real = torch.compile

    def spy(fn, **kwargs):
        dynamo.append(fn)
        return real(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)

    def f(a, b, x):
        a.copy_(x * 2)
        b.copy_(x + 1)

    kernel = compiled.kernel(f)
    x = torch.arange(8.0)
    a, b = torch.zeros(8), torch.zeros(8)
    kernel(a, b, x)
    assert not dynamo and torch.equal(a, x * 2) and torch.equal(b, x + 1)
    seg = torch.zeros(24)
    kernel(seg[0:8], seg[16:24], x)
    assert dynamo and torch.equal(seg[0:8], x * 2) and torch.equal(seg[16:24], x + 1)


@pytest.mark.gpu
def test_a_cuda_kernel_goes_through_torch_compile_with_host_scalars(monkeypatch):
    """A device kernel is torch.compile's, never traced standalone (its signature is not even built), and
    the generated step's 0-d scalars on the host come along into it."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")

    def refuse(*args, **kwargs):
        raise AssertionError("standalone_compile was called")

    monkeypatch.setattr(torch._inductor, "standalone_compile", refuse)

    def f(m, g, beta):
        m.copy_(beta * m + g)

    kernel = compiled.kernel(f)
    m, g = torch.rand(1000, device="cuda"), torch.rand(1000, device="cuda")
    for _ in range(2):
        want = 0.5 * m + g
        kernel(m, g, torch.tensor(0.5))
        assert torch.allclose(m, want)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 6), min_size=0, max_size=3),
    st.integers(0, 7),
    st.integers(0, 5),
    st.sampled_from(["float32", "float64", "bfloat16"]),
    st.booleans(),
    st.sampled_from(["", "t", "cols"]),
)
def test_the_generated_gemm_is_a_matmul(lead, k, m, dtype, strided_a, b_view):
    """`_matmul` (oneDNN's linear for float32 on CPU, torch.matmul otherwise) equals a float64 product on
    any (..., K) x (K, M): empty dims (a rank holding none of the contraction dim), a strided a, a b that
    is a transposed view or some columns of a wider weight (the overlap's chunks)."""
    gen = torch.Generator().manual_seed(len(lead) * 100 + k * 10 + m)
    a = torch.randn(*lead, 2 * k if strided_a else k, generator=gen).to(getattr(torch, dtype))
    a = a[..., ::2] if strided_a else a
    if b_view == "t":
        b = torch.randn(m, k, generator=gen).to(a.dtype).t()
    else:
        b = torch.randn(k, 3 * m + 1 if b_view == "cols" else m, generator=gen).to(a.dtype)[:, m : 2 * m]
    got = ops.matmul(a, b)
    want = torch.matmul(a.double(), b.double())
    assert got.dtype == a.dtype and got.shape == want.shape
    tol = {"float32": 1e-5, "float64": 1e-12, "bfloat16": 2e-2}[dtype] * max(1, k)
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol)


def test_the_generated_gemm_is_onednn_on_cpu_in_float32():
    """The path the benchmark measured is the one taken: float32 on CPU does not fall back to torch.matmul."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with torch.profiler.profile() as prof:
        ops.matmul(a, b)
    names = {e.name for e in prof.events()}
    assert "mkldnn::_linear_pointwise" in names and "aten::mm" not in names


def test_onednn_is_handed_dense_weights_only():
    """oneDNN's linear on a weight with strided rows (columns of a wider one, as the overlap transform
    chunks a weight) ran 1000x slower than on a copy of it: `_matmul` hands it the copy."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    from torch.utils._python_dispatch import TorchDispatchMode

    weights = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name == "mkldnn::_linear_pointwise":
                weights.append(args[1])
            return func(*args, **(kwargs or {}))

    a, w = torch.randn(6, 16), torch.randn(16, 12)
    with Record():
        got = [ops.matmul(a, chunk) for chunk in torch.tensor_split(w, 4, dim=1)]
        ops.matmul(a, w)
        ops.matmul(a, w.t().contiguous().t())
    assert len(weights) == 6
    assert all(x.is_contiguous() or x.t().is_contiguous() for x in weights)
    assert torch.allclose(torch.cat(got, dim=1), a @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 4095, 4096, 4097, 2**24 + 7])
def test_norm_holds_float32_to_its_rounding_at_any_size(n):
    """A float32 norm within 1e-6 of float64's, where torch.linalg.vector_norm of the whole tensor drifts by
    1.8e-4 at 2^24 elements (enough to fail every schedule of a LAMB step against the reference)."""
    x = torch.empty(n).uniform_(0.25, 1.0, generator=torch.Generator().manual_seed(n))
    want = x.double().norm().item()
    got = ops.norm(x)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert abs(got.item() - want) / want < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norm_of_a_half_tensor_accumulates_in_float32(dtype):
    x = torch.full((3, 10_000), 0.5, dtype=dtype)  # a sum of 30000 quarters: 7500, past what half holds exactly
    got = ops.norm(x)
    assert got.dtype == dtype and got.item() == pytest.approx(7500**0.5, rel=4e-3)
