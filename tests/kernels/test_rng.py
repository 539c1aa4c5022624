import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coconet.kernels import rng as trng
from coconet.schedules import rng

torch = pytest.importorskip("torch")


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**64 - 1), st.lists(st.integers(0, 2**62), min_size=1, max_size=64))
def test_torch_matches_numpy(seed, index):
    index = np.array(index + [2**40 + 3, 2**32 - 1, 2**32], dtype=np.int64)
    got = trng.random_bits(seed, torch.from_numpy(index)).numpy()
    assert np.array_equal(got, rng.random_bits(seed, index).astype(np.int64))


@pytest.mark.parametrize(
    "shape,region",
    [((7, 5), (slice(2, 5), slice(0, 5))), ((1000,), None), ((3, 4, 5), (slice(0, 3), slice(1, 2), slice(0, 5)))],
)
def test_torch_mask_matches_numpy(shape, region):
    for seed in (0, 17, 2**63 + 5):
        assert np.array_equal(
            trng.dropout_mask(seed, 0.3, shape, region).numpy(), rng.dropout_mask(seed, 0.3, shape, region)
        )


def test_cuda_source_compiles():
    cuda = "/usr/local/cuda/bin/nvcc"
    nvcc = shutil.which("nvcc") or (cuda if shutil.os.path.exists(cuda) else None)
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "rng.cu"
        src.write_text(trng.CUDA_SOURCE)
        proc = subprocess.run(
            [nvcc, "-c", str(src), "-o", str(Path(d) / "rng.o")], capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr


@pytest.mark.gpu
def test_cuda_matches_numpy():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("cupy")
    index = np.concatenate([np.arange(10**6), np.arange(2**40, 2**40 + 1000), [2**32 - 1, 2**32, 2**62]]).astype(
        np.int64
    )
    for seed in (0, 1234, 2**64 - 1):
        want = rng.random_bits(seed, index)
        assert np.array_equal(trng.cuda_random_bits(seed, index), want)
        got = trng.random_bits(seed, torch.from_numpy(index).cuda()).cpu().numpy()
        assert np.array_equal(got, want.astype(np.int64))


def test_seed_as_twos_complement_int64_tensor():
    """Compiled kernels take the seed as a 0-d int64 tensor; seeds of 2^63 and up wrap to negative."""
    index = torch.arange(0, 4096, dtype=torch.int64)
    for seed in (0, 7, 2**32 + 3, 2**63 - 1, 2**63, 2**64 - 1):
        as_tensor = torch.tensor(seed - 2**64 if seed >= 2**63 else seed, dtype=torch.int64)
        assert torch.equal(trng.philox_words(as_tensor, index), trng.philox_words(seed, index))
        assert np.array_equal(trng.philox_words(seed, index).numpy(), rng.random_bits(seed, index.numpy()))
