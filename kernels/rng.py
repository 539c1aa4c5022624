"""Dropout's counter-based RNG in torch and CUDA C, bit-identical to ``coconet.schedules.rng``.

torch lacks unsigned 32/64-bit arithmetic on most ops, so Philox runs in
int64: a 32x32-bit product may exceed 2^63 and wrap, but two's complement
keeps its low 64 bits exact, so ``(prod >> 32) & 0xFFFFFFFF`` is the true high
word even after the arithmetic shift.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from coconet.schedules.rng import check_seed, global_index, threshold


def philox_rounds(seed: int, block):
    """The four Philox4x32-10 words (int64 tensors in [0, 2^32)) of each block counter (an int64 tensor)
    under a 64-bit ``seed``. Self-contained (torch only) so generated code can carry a copy of it."""
    import torch

    mask = 0xFFFFFFFF
    c0, c1 = block & mask, (block >> 32) & mask
    c2 = torch.zeros_like(block)
    c3 = torch.zeros_like(block)
    k0, k1 = seed & mask, (seed >> 32) & mask  # seed: an int, or an int64 tensor (two's complement)
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
        p0, p1 = c0 * 0xD2511F53, c2 * 0xCD9E8D57
        hi0, lo0 = (p0 >> 32) & mask, p0 & mask
        hi1, lo1 = (p1 >> 32) & mask, p1 & mask
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def philox_words(seed: int, index):
    """The Philox word (int64 in [0, 2^32)) of each global flat index (int64 tensor): a call per element."""
    import torch

    c0, c1, c2, c3 = philox_rounds(seed, index >> 2)
    lane = index & 3
    # a select, not a stack + gather: a compiler fuses it into the one loop
    return torch.where(lane < 2, torch.where(lane == 0, c0, c1), torch.where(lane == 2, c2, c3))


def philox_blocks(seed: int, block):
    """The words of elements 4b … 4b+3 of each block b (int64 tensor), along a new last dim: one
    Philox call per four elements."""
    import torch

    return torch.stack(philox_rounds(seed, block), -1)


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


def dropout_mask(seed: int, p: float, shape: tuple[int, ...], region: tuple[slice, ...] | None = None,
                 device: Any = None):
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
        raise RuntimeError("cuda_random_bits needs CuPy (pip install cupy-cuda12x, or the CuPy of your CUDA) "
                           "and a CUDA device") from None
    seed = check_seed(seed)
    idx = cupy.asarray(np.ascontiguousarray(index, dtype=np.int64).reshape(-1))
    out = cupy.empty(idx.shape, dtype=cupy.uint32)
    kernel = cupy.RawModule(code=CUDA_SOURCE).get_function("coconet_random_bits")
    n = idx.size
    threads = 256
    if n:
        kernel(((n + threads - 1) // threads,), (threads,), (cupy.uint64(seed), idx, out, cupy.int64(n)))
    return cupy.asnumpy(out).reshape(np.shape(index))
