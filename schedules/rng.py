"""The counter-based RNG of ``dropout``: the specification and its NumPy reference.

A dropout mask must depend only on (seed, global element index), so that the
unsliced program, any slice of it, a fused kernel and a chunked kernel draw
the same mask. The specification, implemented bit-identically here (NumPy),
in ``coconet.kernels.rng`` (torch, CPU or CUDA tensors) and in its CUDA C:

- Generator: Philox4x32-10 (Salmon et al., SC'11; Random123). Per round
  ``(hi0, lo0) = mulhilo32(0xD2511F53, c0)``, ``(hi1, lo1) = mulhilo32(0xCD9E8D57, c2)``,
  ``c = (hi1^c1^k0, lo1, hi0^c3^k1, lo0)``; the key is bumped by
  ``(0x9E3779B9, 0xBB67AE85)`` mod 2^32 between rounds; 10 rounds.
- Key: the seed, an integer in [0, 2^64): ``k0 = seed & 0xFFFFFFFF``, ``k1 = seed >> 32``.
- Element ``g`` (row-major flat index into the *global* tensor, 0 <= g < 2^63)
  takes word ``g % 4`` of the block with counter ``(b & 0xFFFFFFFF, b >> 32, 0, 0)``,
  ``b = g // 4`` — four elements share one Philox call.
- Keep iff ``(word >> 8) >= threshold(p)`` with ``threshold(p) = floor(p * 2^24 + 0.5)``:
  an integer comparison, so every implementation decides identically; the keep
  probability is ``1 - threshold(p) / 2^24``.
- Dropout value: ``x * keep / (1 - p)`` (inverted dropout, as torch does).
"""

from __future__ import annotations

import math

import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10
_MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(counter: np.ndarray, key: tuple[int, int]) -> np.ndarray:
    """Philox4x32-10 of ``counter`` (uint32, shape (..., 4)) under ``key`` (k0, k1)."""
    c = np.asarray(counter, dtype=np.uint32).astype(np.uint64)
    c0, c1, c2, c3 = c[..., 0], c[..., 1], c[..., 2], c[..., 3]
    k0, k1 = int(key[0]) & 0xFFFFFFFF, int(key[1]) & 0xFFFFFFFF
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + W0) & 0xFFFFFFFF, (k1 + W1) & 0xFFFFFFFF
        p0 = c0 * np.uint64(M0)  # < 2^64: exact in uint64
        p1 = c2 * np.uint64(M1)
        hi0, lo0 = p0 >> np.uint64(32), p0 & _MASK32
        hi1, lo1 = p1 >> np.uint64(32), p1 & _MASK32
        c0, c1, c2, c3 = hi1 ^ c1 ^ np.uint64(k0), lo1, hi0 ^ c3 ^ np.uint64(k1), lo0
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 2**64:
        raise ValueError(f"seed {seed!r} must be an integer in [0, 2^64)")
    return int(seed)


def threshold(p: float) -> int:
    if not (isinstance(p, (int, float, np.floating)) and 0.0 <= p < 1.0):
        raise ValueError(f"dropout probability {p!r} must be in [0, 1)")
    return math.floor(float(p) * 2**24 + 0.5)


def random_bits(seed: int, index: np.ndarray) -> np.ndarray:
    """The 32-bit word of each global flat index (any shape) under ``seed``."""
    seed = check_seed(seed)
    g = np.asarray(index, dtype=np.int64)
    if g.size and g.min() < 0:
        raise ValueError("element indices must be non-negative")
    flat = g.reshape(-1).astype(np.uint64)
    blocks, inverse = np.unique(flat >> np.uint64(2), return_inverse=True)
    counter = np.zeros(blocks.shape + (4,), dtype=np.uint32)
    counter[:, 0] = (blocks & _MASK32).astype(np.uint32)
    counter[:, 1] = (blocks >> np.uint64(32)).astype(np.uint32)
    words = philox4x32_10(counter, (seed & 0xFFFFFFFF, seed >> 32))
    out = words[inverse.reshape(-1), (flat & np.uint64(3)).astype(np.intp)]
    return out.reshape(g.shape)


def keep_mask(seed: int, p: float, index: np.ndarray) -> np.ndarray:
    t = threshold(p)
    if t == 0:
        return np.ones(np.shape(index), dtype=bool)
    return (random_bits(seed, index) >> np.uint32(8)) >= np.uint32(t)


def global_index(shape: tuple[int, ...], region: tuple[slice, ...] | None = None) -> np.ndarray:
    """Row-major global flat indices of the sub-box ``region`` of a tensor of ``shape``."""
    shape = tuple(int(n) for n in shape)
    if region is None:
        region = tuple(slice(0, n) for n in shape)
    if len(region) != len(shape):
        raise ValueError(f"region has {len(region)} dims, the tensor {len(shape)}")
    axes = []
    for sl, n in zip(region, shape):
        start, stop, step = sl.indices(n)
        if step != 1:
            raise ValueError("regions are boxes: slices with step 1")
        axes.append(np.arange(start, max(start, stop), dtype=np.int64))
    strides = [int(np.prod(shape[k + 1 :], dtype=np.int64)) for k in range(len(shape))]
    out = np.zeros(tuple(len(a) for a in axes), dtype=np.int64)
    for k, (a, s) in enumerate(zip(axes, strides)):
        out += (a * s).reshape((1,) * k + (-1,) + (1,) * (len(shape) - k - 1))
    return out


def dropout_mask(seed: int, p: float, shape: tuple[int, ...], region: tuple[slice, ...] | None = None) -> np.ndarray:
    """Keep mask of ``region`` (default: all) of a global tensor of ``shape``."""
    return keep_mask(seed, p, global_index(shape, region))
