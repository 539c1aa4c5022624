"""Where a rank stands when a generated step runs: its group, its rank and world in it, its device, and
which rows of a Sliced dim it holds (``Ctx``); a chunk of those rows, for the chunked forms of the
collectives (``Chunk``).
"""

from __future__ import annotations

import torch.distributed as dist


class Ctx:
    """Where this rank stands: its group, rank and world within it, device."""

    def __init__(self, group, device, shm=None):
        self.group, self.shm = group, shm
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.global_rank = dist.get_rank()
        self.device = device

    def rows(self, n, rank=None):
        """Rows [lo, hi) of a dim of extent n that this rank (or ``rank``) holds when Sliced."""
        chunk = -(-n // self.world)
        lo = min((self.rank if rank is None else rank) * chunk, n)
        return lo, min(lo + chunk, n)

    def cut(self, x, dim, n):
        lo, hi = self.rows(n)
        return x.narrow(dim, lo, hi - lo)


class Chunk:
    """Rows [a, b) of the rows this rank holds of a dim of extent n: what one step of a chunked fused
    collective computes on. Stands in for Ctx in the statements of the chunk."""

    def __init__(self, c, n, a, b):
        self.group, self.rank, self.world, self.global_rank, self.device = (
            c.group,
            c.rank,
            c.world,
            c.global_rank,
            c.device,
        )
        self.shm = c.shm
        self.n, self.span = n, (a, b)
        self.lo, hi = c.rows(n)
        self.a, self.b = min(a, hi - self.lo), min(b, hi - self.lo)

    def rows(self, n):
        if n != self.n:
            raise ValueError(f"a chunk of a dim of extent {self.n} cannot cut one of extent {n}")
        return self.lo + self.a, self.lo + self.b

    def cut(self, x, dim, n):
        lo, hi = self.rows(n)
        return x.narrow(dim, lo, hi - lo)

    def local(self, x, dim):
        """The chunk's rows of a value this rank holds as its slice."""
        return x.narrow(dim, self.a, self.b - self.a)
