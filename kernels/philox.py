"""Philox4x32-10 in torch, bit-identical to ``coconet.schedules.rng``: the words dropout's masks are drawn
from.

torch lacks unsigned 32/64-bit arithmetic on most ops, so Philox runs in int64: a 32x32-bit product may
exceed 2^63 and wrap, but two's complement keeps its low 64 bits exact, so ``(prod >> 32) & 0xFFFFFFFF``
is the true high word even after the arithmetic shift.
"""

from __future__ import annotations

import torch


def philox_rounds(seed: int, block):
    """The four Philox4x32-10 words (int64 tensors in [0, 2^32)) of each block counter (an int64 tensor)
    under a 64-bit ``seed``."""
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
    c0, c1, c2, c3 = philox_rounds(seed, index >> 2)
    lane = index & 3
    # a select, not a stack + gather: a compiler fuses it into the one loop
    return torch.where(lane < 2, torch.where(lane == 0, c0, c1), torch.where(lane == 2, c2, c3))


def philox_blocks(seed: int, block):
    """The words of elements 4b … 4b+3 of each block b (int64 tensor), along a new last dim: one
    Philox call per four elements."""
    return torch.stack(philox_rounds(seed, block), -1)
