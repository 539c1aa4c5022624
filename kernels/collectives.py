"""The collectives of a generated step over torch.distributed (gloo on CPU, NCCL on CUDA), and their chunked
and bucketed forms.

Every collective takes the rank's ``Ctx`` first and handles uneven slices (a dim of extent n split in
ceil(n / world) rows per rank, the last rank's fewer): its parts are padded to equal sizes for torch's
flat collectives. ``op`` is ``sum``, ``prod``, ``max``, ``min`` or ``avg`` (gloo has no AVG: a sum, then a
division). The shm backend's collectives (``coconet.kernels.shm``) have the same names and signatures.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .context import Chunk

OPS = {"sum": "SUM", "prod": "PRODUCT", "max": "MAX", "min": "MIN", "avg": "SUM"}
# torch >= 2.12 names the flat collectives *_single; older releases *_tensor
all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_op(op):
    return getattr(dist.ReduceOp, OPS[op])


def allreduce(c, x, op, async_op=False):
    """In place on x. gloo has no AVG: sum, then divide."""
    work = dist.all_reduce(x, op=reduce_op(op), group=c.group, async_op=async_op)
    if op == "avg":
        if work is not None:
            work.wait()
            work = None
        x.div_(c.world)
    return work


def allreduced(c, x, op):
    """The reduction over ranks of x, in a buffer of its own: x is left as it is."""
    y = x.clone()
    allreduce(c, y, op)
    return y


def broadcast(c, x, root):
    """In place on x: the value of group rank ``root``."""
    dist.broadcast(x, src=c.global_rank - c.rank + root, group=c.group)
    return x


def _padded(c, x, dim, n):
    """x moved so that ``dim`` leads, padded to world * ceil(n / world) rows: collectives want equal parts."""
    chunk = -(-n // c.world)
    x = x.movedim(dim, 0)
    if x.shape[0] == chunk * c.world:
        return x.contiguous(), chunk
    pad = x.new_zeros((chunk * c.world - x.shape[0],) + tuple(x.shape[1:]))
    return torch.cat([x, pad]), chunk


def _rows_of(c, out, dim, n, op):
    """This rank's rows from a reduce_scatter's padded output."""
    if op == "avg":
        out.div_(c.world)
    lo, hi = c.rows(n)
    return out[: hi - lo].movedim(0, dim)


def reduce_scatter(c, x, dim, n, op="sum", async_op=False):
    """The rows this rank holds of the reduction over ranks of x (uneven slices allowed).
    With async_op, returns a function that waits and gives the rows (the collective is in flight)."""
    full, chunk = _padded(c, x, dim, n)
    out = full.new_empty((chunk,) + tuple(full.shape[1:]))
    work = reduce_scatter_tensor(out, full, op=reduce_op(op), group=c.group, async_op=async_op)

    def finish():
        if work is not None:
            work.wait()
        return _rows_of(c, out, dim, n, op)

    return finish if async_op else finish()


def _part(c, x, dim, n):
    """This rank's rows of x with dim leading, padded to ceil(n / world): what an all_gather sends."""
    chunk = -(-n // c.world)
    part = x.movedim(dim, 0)
    if part.shape[0] != chunk:
        part = torch.cat([part, part.new_zeros((chunk - part.shape[0],) + tuple(part.shape[1:]))])
    return part.contiguous()


def all_gather(c, x, dim, n):
    """The whole value from every rank's rows along dim (uneven slices allowed)."""
    part = _part(c, x, dim, n)
    out = part.new_empty((part.shape[0] * c.world,) + tuple(part.shape[1:]))
    all_gather_into_tensor(out, part, group=c.group)
    return out[:n].movedim(0, dim)


def coalesced(c):
    """Collectives issued inside run as one launch when they leave: NCCL groups them (no copy), gloo runs
    its coalesced form (it flattens them in C++). A private torch API; without it they run one by one."""
    try:
        from torch.distributed.distributed_c10d import _coalescing_manager
    except ImportError:
        return contextlib.nullcontext()
    return _coalescing_manager(c.group)


def launches(xs, cap):
    """Consecutive groups of the buffers xs of at most cap bytes each (a larger buffer goes alone)."""
    groups, size = [[]], 0
    for i, x in enumerate(xs):
        nbytes = x.numel() * x.element_size()
        if groups[-1] and size + nbytes > cap:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    return groups


def bucket_allreduce(c, xs, op, cap, keep=None):
    """One allreduce launch per cap bytes of the buffers xs, without a flattening copy here: the reduced
    buffers, in place but for those ``keep`` marks (those are left as they are, reduced into copies)."""
    xs = [x.clone() if k else x for x, k in zip(xs, keep or [False] * len(xs))]
    for launch in launches(xs, cap):
        with coalesced(c):
            for i in launch:
                dist.all_reduce(xs[i], op=reduce_op(op), group=c.group)
    if op == "avg":
        for x in xs:
            x.div_(c.world)
    return xs


def bucket_reduce_scatter(c, xs, dims, ns, op, cap):
    padded = [_padded(c, x, d, n)[0] for x, d, n in zip(xs, dims, ns)]
    outs = [f.new_empty((f.shape[0] // c.world,) + tuple(f.shape[1:])) for f in padded]
    for launch in launches(padded, cap):
        with coalesced(c):
            for i in launch:
                reduce_scatter_tensor(outs[i], padded[i], op=reduce_op(op), group=c.group)
    return [_rows_of(c, o, d, n, op) for o, d, n in zip(outs, dims, ns)]


def bucket_all_gather(c, xs, dims, ns, cap):
    parts = [_part(c, x, d, n) for x, d, n in zip(xs, dims, ns)]
    outs = [p.new_empty((p.shape[0] * c.world,) + tuple(p.shape[1:])) for p in parts]
    for launch in launches(outs, cap):
        with coalesced(c):
            for i in launch:
                all_gather_into_tensor(outs[i], parts[i], group=c.group)
    return [o[:n].movedim(0, d) for o, d, n in zip(outs, dims, ns)]


def reduce_scatter_chunks(c, x, dim, n, count, op):
    """Yields (chunk, its reduced rows) for ``count`` chunks of the rows each rank holds. Every chunk's
    reduce_scatter is issued up front, so chunk k+1's is in flight while chunk k computes."""
    full, per = _padded(c, x, dim, n)
    blocks = full.view((c.world, per) + tuple(full.shape[1:]))
    size = max(1, -(-per // count))
    started = []
    for a in range(0, per, size):
        b = min(a + size, per)
        out = full.new_empty((b - a,) + tuple(full.shape[1:]))
        send = blocks[:, a:b].reshape(((b - a) * c.world,) + tuple(full.shape[1:]))
        started.append(
            (Chunk(c, n, a, b), out, reduce_scatter_tensor(out, send, op=reduce_op(op), group=c.group, async_op=True))
        )
    for k, out, work in started:
        work.wait()
        if op == "avg":
            out.div_(c.world)
        yield k, out[: k.b - k.a].movedim(0, dim)


class Gather:
    """The all_gather of one value, chunk by chunk as the chunks are computed, into one buffer."""

    def __init__(self, c, dim, n):
        self.c, self.dim, self.n = c, dim, n
        self.per = -(-n // c.world)
        self.out, self.works = None, []

    def add(self, k, x):
        a, b = k.span
        part = x.movedim(self.dim, 0)
        if part.shape[0] != b - a:
            part = torch.cat([part, part.new_zeros((b - a - part.shape[0],) + tuple(part.shape[1:]))])
        if self.out is None:
            self.out = part.new_empty((self.c.world, self.per) + tuple(part.shape[1:]))
        views = list(self.out[:, a:b].unbind(0))
        self.works.append(dist.all_gather(views, part.contiguous(), group=self.c.group, async_op=True))

    def result(self):
        for w in self.works:
            w.wait()
        flat = self.out.reshape((self.c.world * self.per,) + tuple(self.out.shape[2:]))
        return flat[: self.n].movedim(0, self.dim)
