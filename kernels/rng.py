"""Dropout's counter-based RNG in torch and CUDA C, bit-identical to ``coconet.schedules.rng``: random bits,
keep masks and dropout masks of any region, for checks and for code outside a generated step. The Philox
rounds themselves are ``coconet.kernels.philox``, which generated steps call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from coconet.kernels.philox import philox_blocks, philox_rounds, philox_words  # noqa: F401 -- this module's API too
from coconet.schedules.rng import check_seed, global_index, threshold


def random_bits(seed: int, index: Any):
    """The 32-bit word (as int64 in [0, 2^32)) of each global flat index; works on any device."""
    import torch

    return philox_words(check_seed(seed), torch.as_tensor(index, dtype=torch.int64))


def keep_mask(seed: int, p: float, index: Any):
    import torch

    t = threshold(p)
    g = torch.as_tensor(index, dtype=torch.int64)
    if t == 0:
        return torch.ones_like(g, dtype=torch.bool)
    return (random_bits(seed, g) >> 8) >= t


def dropout_mask(
    seed: int, p: float, shape: tuple[int, ...], region: tuple[slice, ...] | None = None, device: Any = None
):
    import torch

    return keep_mask(seed, p, torch.as_tensor(global_index(shape, region), device=device))


CUDA_SOURCE = r"""
// Philox4x32-10 dropout RNG; see coconet.schedules.rng for the specification.
__device__ __forceinline__ unsigned int coconet_philox_word(unsigned long long seed, unsigned long long g) {
    unsigned long long b = g >> 2;
    unsigned int c0 = (unsigned int)b, c1 = (unsigned int)(b >> 32), c2 = 0u, c3 = 0u;
    unsigned int k0 = (unsigned int)seed, k1 = (unsigned int)(seed >> 32);
    #pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
        unsigned int hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        unsigned int hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        unsigned int n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    }
    unsigned int lane = (unsigned int)(g & 3ull);
    return lane == 0 ? c0 : lane == 1 ? c1 : lane == 2 ? c2 : c3;
}

__device__ __forceinline__ bool coconet_keep(unsigned long long seed, unsigned int threshold, unsigned long long g) {
    return (coconet_philox_word(seed, g) >> 8) >= threshold;
}

extern "C" __global__ void coconet_random_bits(unsigned long long seed, const long long* index,
                                               unsigned int* out, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = coconet_philox_word(seed, (unsigned long long)index[i]);
}
"""


def cuda_random_bits(seed: int, index: Any) -> np.ndarray:
    """Run ``CUDA_SOURCE`` through CuPy on the current GPU; returns NumPy uint32."""
    try:
        import cupy
    except ImportError:
        raise RuntimeError(
            "cuda_random_bits needs CuPy (pip install cupy-cuda12x, or the CuPy of your CUDA) and a CUDA device"
        ) from None
    seed = check_seed(seed)
    idx = cupy.asarray(np.ascontiguousarray(index, dtype=np.int64).reshape(-1))
    out = cupy.empty(idx.shape, dtype=cupy.uint32)
    kernel = cupy.RawModule(code=CUDA_SOURCE).get_function("coconet_random_bits")
    n = idx.size
    threads = 256
    if n:
        kernel(((n + threads - 1) // threads,), (threads,), (cupy.uint64(seed), idx, out, cupy.int64(n)))
    return cupy.asnumpy(out).reshape(np.shape(index))
