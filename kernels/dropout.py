"""Dropout with the counter-based mask of ``coconet.schedules.rng`` (Philox4x32-10 keyed by the seed and each
element's global flat index), so that a sliced, fused or chunked step draws the mask of the whole program.
"""

from __future__ import annotations

import torch

from .philox import philox_blocks, philox_words


def flat_index(shape, dim, first, count, device):
    """Row-major flat indices into ``shape`` of rows [first, first + count) of ``dim`` (all of it if dim < 0).
    ``first`` may be a tensor: one compiled kernel then serves every chunk of a fused collective."""
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for k in range(len(shape) - 1, -1, -1):
        if k == dim:
            axis = (torch.arange(count, dtype=torch.int64, device=device) + first) * stride
        else:
            axis = torch.arange(shape[k], dtype=torch.int64, device=device) * stride
        index = index + axis.reshape((-1,) + (1,) * (len(shape) - 1 - k))
        stride *= shape[k]
    return index


def dropout_words(seed, shape, dim, first, count, device):
    """The Philox word of each element of rows [first, first + count) of ``dim`` of ``shape`` (all of it if
    dim < 0), in that piece's shape. On CPU the rounds bound the kernel: where every row is whole blocks of
    four, one call serves a block and the four words go through a buffer. On CUDA memory bounds it (an
    H100 ran the fused epilogue at 71% of copy bandwidth): every element runs its own call."""
    inner = 1
    for n in shape[dim + 1 :] if dim >= 0 else shape:
        inner *= n
    if device.type != "cpu" or inner % 4:
        return philox_words(seed, flat_index(shape, dim, first, count, device))
    rows = (tuple(shape[:dim]) + (count,)) if dim >= 0 else ()
    blocks = flat_index(tuple(shape[: dim + 1]) + (inner // 4,), dim, first, count, device)
    return philox_blocks(seed, blocks).reshape(rows + tuple(shape[dim + 1 :] if dim >= 0 else shape))


def dropout(c, x, p, seed, shape, dim):
    """Inverted dropout with the counter-based mask of coconet.schedules.rng (Philox4x32-10)."""
    if p == 0:
        return x
    lo, hi = c.rows(shape[dim]) if dim >= 0 else (0, 0)
    return dropped(x, p, dropout_words(seed, shape, dim, lo, hi - lo, x.device))


def dropout_rows(x, p, seed, shape, dim, first):
    """dropout of the rows of ``dim`` from ``first`` (a tensor) on: a chunk of a fused collective."""
    if p == 0:
        return x
    return dropped(x, p, dropout_words(seed, shape, dim, first, x.shape[dim], x.device))


def dropped(x, p, words):
    keep = (words >> 8) >= int(p * 16777216 + 0.5)
    return torch.where(keep, x / (1.0 - p), torch.zeros((), dtype=x.dtype, device=x.device))
