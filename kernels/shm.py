"""Collectives of the shm backend: the ranks of one node reducing in shared memory.

For the shm backend these take the place of the torch.distributed collectives of
the same names and signatures (``coconet.kernels.collectives``), so that one
lowering serves both. The segments and their barrier are ``coconet.kernels.segments``;
the copies past the cache and the C chunk kernels, ``coconet.kernels.copier``.

Each rank of a process group owns a segment of ``/dev/shm`` that every rank of
the group maps (``torch.from_file(shared=True)``); the file is unlinked as soon
as all have mapped it, so nothing outlives the processes. A collective copies
each rank's buffer into its segment — the rows its peers need, not its own —
then meets the others at a barrier of per-rank flags in the segments; each rank
then reduces the rows it owns straight out of its peers' segments (its own
rows from its private buffer), and a gather copies every rank's rows out of
theirs. A fused collective computes on each chunk of reduced rows as it comes.
gloo only bootstraps the group (segment names) and carries pipeline send/recv.

A collective writes into the next of ``slots`` rotating slots of its segment.
A slot is reused ``slots`` collectives later, and must by then have been read
by every rank: a rank's reads of a collective end before it enters the next
one's barrier, and it writes a collective after passing the barrier of the one
before, so two slots suffice for collectives that run one after the other. A
chunked fused collective takes its reduce_scatter's slot, then one per gather
at its first chunk (but gathers into state, below), and writes the gathers
before their barriers: G gathers need G + 2 slots. Slots are taken in program order on every rank (async
collectives take theirs on the communication thread, in the order queued).
Peers see a rank's data once they see its flag because x86-64 keeps stores in
order; elsewhere the backend refuses to start.

The all_gather that ends a fused collective updating replicated state (ZeRO-1
Adam's ``w``) does not go through a slot: each rank's copy of the state lives in
a segment of its own, which its peers map, and each rank writes the rows it
computes straight into every peer's copy: a compiled chunk kernel stores each
new row into this rank's copy and the peers' as it computes it (in C where its
statements translate, ``coconet.kernels.native``: the peers' lines streamed past
the cache, not read first as an ordinary store reads them); eager kernels
copy each chunk's rows after it (a second pass that reads them back, from
memory once a chunk outgrows the cache). One barrier, and every copy is whole.
The state is moved into its segment on its first step (``Tensor.set_``: the
caller's tensor keeps its identity and values), so later steps find it there.
A state that other tensors view (a flat buffer under a model's parameters)
would leave them on its old memory: its storage's memory is made a file of
/dev/shm where it is instead (``_share_storage``), every view following. A
state that cannot move (a view into a larger buffer, not contiguous) gets a
shadow segment, copied into it after the barrier. The barrier that begins the
collective carries, per state, whether a rank made a new segment for it. An
all_gather outside a fused collective that gives a replicated state its new
value, where nothing reads the state after it, writes the same way
(``gather_into``): a barrier (no rank reads its copy any more), each rank's
rows into every copy, a barrier.

An input that a fused collective reduces and the step leaves as it is (a gradient) moves the same way into a
segment of its own on its first step, and its peers read their rows of it there: nothing is published. That
takes a barrier after the peers' last read and before the step returns, for the caller may write the next
gradient into the tensor then: the gathers that end the collective give one, and a collective that gathers
nothing (its state stays sliced) ends with one of its own (``end_collective``). A caller who passes another
tensor (a view that cannot move, a second buffer while the first is alive, a new ``.grad`` every step) has it
published into the slot as before; a tensor that comes in place of a moved one gone after serving more than one
step takes its segment, and the segment of one that served a single step is let go (``Shm.stage_input``). What
the step computes from each rank's gradient before reducing it (divided by a predivide factor, unscaled, cast to
float32) the compiled chunk kernel computes on each rank's rows as it sums them (the lowering's
``reduced_in_kernel``): the gradient is read where it lies all the same, and that value is never written out.
A number each rank computes it with that is the rank's own (its token count, a clip factor from its gradient's
norm) rides in the rank's words of the barrier that begins the collective (``Shm.post``), so that every rank
weighs each rank's rows by that rank's number.

A copy larger than this rank's share of the last-level cache (the cache over the
group's ranks) is made with non-temporal stores: its destination is not read
again before the copy has evicted it, and an ordinary store reads every line
before writing it. The copy is a few lines of C, compiled once per machine with
the system's C compiler into coconet's cache (torch's copy where there is none);
it fences its stores, so the flag that follows still orders them.
"""

from __future__ import annotations

import math

import torch

from .collectives import launches
from .context import Chunk


class _Done:
    """What an async shm collective returns: ``wait()`` like a torch.distributed work handle."""

    def __init__(self, future):
        self.future = future

    def wait(self):
        self.future.result()


def _offsets(nbytes):
    """Byte offsets of buffers of ``nbytes`` packed in one slot, each on its own cache line."""
    offsets, at = [], 0
    for n in nbytes:
        offsets.append(at)
        at += -(-n // 64) * 64
    return offsets


def _publish(c, slot, offset, rows, lo, hi):
    """Copies ``rows`` (dim 0 leading) into this rank's slot, all but rows [lo, hi): no peer reads those."""
    mine = c.shm.at(c.rank, slot, offset, rows.dtype, tuple(rows.shape))
    c.shm.copy(mine[:lo], rows[:lo])
    c.shm.copy(mine[hi:], rows[hi:])
    return mine


def _combine(op):
    """The torch op that takes one more rank's rows into a reduction over ranks (avg sums, then divides)."""
    return {"sum": torch.add, "avg": torch.add, "prod": torch.mul, "max": torch.maximum, "min": torch.minimum}[op]


def _shm_reduce(c, own, peers, op, out):
    """out = the reduction over ranks of rows whose copy on this rank is ``own`` and on the others ``peers``."""
    combine = _combine(op)
    if not peers:
        out.copy_(own)
    else:
        combine(own, peers[0], out=out)
    for p in peers[1:]:
        combine(out, p, out=out)
    if op == "avg":
        out.div_(c.world)
    return out


def _shm_reduce_scatter(c, xs, dims, ns, op):
    s = c.shm
    slot = s.take()
    rows = [x.movedim(d, 0) for x, d in zip(xs, dims)]
    offsets = _offsets([x.numel() * x.element_size() for x in xs])
    lo, hi = zip(*[c.rows(n) for n in ns])
    for k in range(len(xs)):
        _publish(c, slot, offsets[k], rows[k], lo[k], hi[k])
    s.barrier()
    outs = []
    for k, x in enumerate(rows):
        peers = [
            s.at(r, slot, offsets[k], x.dtype, tuple(x.shape))[lo[k] : hi[k]] for r in range(c.world) if r != c.rank
        ]
        out = x.new_empty((hi[k] - lo[k],) + tuple(x.shape[1:]))
        outs.append(_shm_reduce(c, x[lo[k] : hi[k]], peers, op, out).movedim(0, dims[k]))
    return outs


def _shm_all_gather(c, xs, dims, ns):
    s = c.shm
    slot = s.take()
    parts = [x.movedim(d, 0) for x, d in zip(xs, dims)]
    full = [(n,) + tuple(p.shape[1:]) for p, n in zip(parts, ns)]
    offsets = _offsets([math.prod(f) * p.element_size() for p, f in zip(parts, full)])
    for p, f, o, n in zip(parts, full, offsets, ns):
        lo, hi = c.rows(n)
        s.copy(s.at(c.rank, slot, o, p.dtype, f)[lo:hi], p)
    s.barrier()
    outs = []
    for p, f, o, n, d in zip(parts, full, offsets, ns, dims):
        out = p.new_empty(f)
        for r in range(c.world):
            lo, hi = c.rows(n, r)
            s.copy(out[lo:hi], p if r == c.rank else s.at(r, slot, o, p.dtype, f)[lo:hi])
        outs.append(out.movedim(0, d))
    return outs


def _shm_allreduce(c, xs, op, outs=None):
    """Reduces xs in place, or into ``outs`` (xs then are only read): every rank's reduced rows come out of
    the slots, this rank's too, so the result never needs a copy of its input."""
    s = c.shm
    slot = s.take()
    src = [x.reshape(-1) for x in xs]  # a copy if x is not contiguous: (in place) written back at the end
    xs = xs if outs is None else outs
    flat = src if outs is None else [x.reshape(-1) for x in xs]
    offsets = _offsets([x.numel() * x.element_size() for x in xs])
    mine = []
    for f, o in zip(src, offsets):
        lo, hi = c.rows(f.numel())
        mine.append(_publish(c, slot, o, f, lo, hi))
    s.barrier()
    for f, o, m in zip(src, offsets, mine):
        lo, hi = c.rows(f.numel())
        peers = [s.at(r, slot, o, f.dtype, (f.numel(),))[lo:hi] for r in range(c.world) if r != c.rank]
        _shm_reduce(c, f[lo:hi], peers, op, m[lo:hi])
    s.barrier()
    for x, f, o in zip(xs, flat, offsets):
        for r in range(c.world):
            lo, hi = c.rows(f.numel(), r)
            s.copy(f[lo:hi], s.at(r, slot, o, f.dtype, (f.numel(),))[lo:hi])
        if f.data_ptr() != x.data_ptr():
            x.copy_(f.view(x.shape))
    return xs


def allreduce(c, x, op, async_op=False):
    """In place on x, reduced in shared memory."""
    done = c.shm.call(_shm_allreduce, c, [x], op, async_op=async_op)
    return _Done(done) if async_op else None


def allreduced(c, x, op):
    """The reduction over ranks of x, in a buffer of its own: x is left as it is, and not copied first."""
    return c.shm.call(_shm_allreduce, c, [x], op, [torch.empty_like(x)])[0]


def reduce_scatter(c, x, dim, n, op="sum", async_op=False):
    """The rows this rank holds of the reduction over ranks of x, read out of the peers' segments.
    With async_op, returns a function that waits and gives the rows."""
    done = c.shm.call(_shm_reduce_scatter, c, [x], [dim], [n], op, async_op=async_op)
    return (lambda: done.result()[0]) if async_op else done[0]


def all_gather(c, x, dim, n):
    return c.shm.call(_shm_all_gather, c, [x], [dim], [n])[0]


def _shm_broadcast(c, x, root):
    s = c.shm
    slot = s.take()
    if c.rank == root:
        s.copy(s.at(c.rank, slot, 0, x.dtype, tuple(x.shape)), x)
    s.barrier()
    if c.rank != root:
        s.copy(x, s.at(root, slot, 0, x.dtype, tuple(x.shape)))
    return x


def broadcast(c, x, root):
    """In place on x: the value of group rank ``root``."""
    return c.shm.call(_shm_broadcast, c, x, root)


def bucket_allreduce(c, xs, op, cap, keep=None):
    """One publish and two barriers per ``cap`` bytes of the buffers xs: the reduced buffers, in place but for
    those ``keep`` marks (those are left as they are, reduced into buffers of their own)."""
    outs = [torch.empty_like(x) if k else x for x, k in zip(xs, keep or [False] * len(xs))]
    for launch in launches(xs, cap):
        c.shm.call(_shm_allreduce, c, [xs[i] for i in launch], op, [outs[i] for i in launch])
    return outs


def bucket_reduce_scatter(c, xs, dims, ns, op, cap):
    outs = [None] * len(xs)
    for launch in launches(xs, cap):
        got = c.shm.call(
            _shm_reduce_scatter, c, [xs[i] for i in launch], [dims[i] for i in launch], [ns[i] for i in launch], op
        )
        for i, y in zip(launch, got):
            outs[i] = y
    return outs


def bucket_all_gather(c, xs, dims, ns, cap):
    outs = [None] * len(xs)
    for launch in launches(xs, cap):
        got = c.shm.call(
            _shm_all_gather, c, [xs[i] for i in launch], [dims[i] for i in launch], [ns[i] for i in launch]
        )
        for i, y in zip(launch, got):
            outs[i] = y
    return outs


def scatter_parts(c, x, dim, n, count, name=None, word=0, numbers=(), every=None):
    """Publishes x once, then yields, for ``count`` chunks of the rows this rank holds: the chunk, its rows
    on this rank (from x), on every peer (from their segments), and where this rank may write them.

    Given the input's ``name`` (and its ``word`` at the barrier), x is an input the step does not write and
    a barrier follows the last chunk: x may then live in a segment of its own, which the peers read instead
    of a copy of it in the slot (``Shm.stage_input``). ``numbers``: 0-d values of this rank posted at the
    same barrier, every rank's appended to ``every`` (``Shm.posted``). A tuple of inputs (and of names, with
    words from ``word`` on) yields per chunk those three for each in turn, packed one after the other in the
    slot where they are published: what a chunk kernel reads them from (``reduce_scatter_parts``)."""
    s = c.shm
    slot = s.call(s.take)  # after the async collectives still queued: every rank takes slots in one order
    lo, hi = c.rows(n)
    xs, names = (x, name or (None,) * len(x)) if isinstance(x, tuple) else ((x,), (name,))
    # before the rows are taken: an input may move
    publish = [nm is None or s.call(s.stage_input, nm, word + j, t) for j, (t, nm) in enumerate(zip(xs, names))]
    rows = [t.movedim(dim, 0) for t in xs]
    offsets = _offsets([t.numel() * t.element_size() for t in rows])
    for r, at, pub in zip(rows, offsets, publish):
        if pub:
            s.call(_publish, c, slot, at, r, lo, hi)
    if numbers:
        s.call(s.post, word + len(xs), numbers)
    s.call(s.barrier)
    if numbers:
        every.extend(s.call(s.posted, word + len(xs), len(numbers)))
    where = [[None] * c.world if nm is None else s.sources[nm] for nm in names]
    per = -(-n // c.world)
    size = max(1, -(-per // count))
    for a in range(0, per, size):
        k = Chunk(c, n, a, a + size)
        span = slice(lo + k.a, lo + k.b)
        each = []
        for t, at, seg in zip(rows, offsets, where):
            shape = tuple(t.shape)
            peers = [
                (s.at(r, slot, at, t.dtype, shape) if seg[r] is None else seg[r].movedim(dim, 0))[span]
                for r in range(c.world)
                if r != c.rank
            ]
            # this rank's own rows of its slot: nobody reads them, and they stay mapped from step to step
            each += [t[span], peers, s.at(c.rank, slot, at, t.dtype, shape)[span]]
        yield (k, *each)


def reduce_scatter_chunks(c, x, dim, n, count, op, name=None, word=0):
    """Yields (chunk, its reduced rows) for ``count`` chunks of the rows this rank holds, each reduced out
    of the peers' segments just before it is computed on, while it is still in cache."""
    for k, own, peers, out in scatter_parts(c, x, dim, n, count, name, word):
        yield k, _shm_reduce(c, own, peers, op, out).movedim(0, dim)


def reduce_scatter_parts(c, x, dim, n, count, name=None, word=0, numbers=()):
    """Yields (chunk, its rows on every rank, unreduced): the kernel computing on the chunk sums them as it
    reads them, so the reduced rows are never written out. With ``numbers`` (0-d values every rank computes
    its rows with before they are summed: a weight, a clip factor), then every rank's of each, in the rows'
    order. A tuple of inputs (``scatter_parts``): the chunk's rows on every rank of each, in turn."""
    every = []
    for k, *each in scatter_parts(c, x, dim, n, count, name, word, numbers, every):
        rows = [[p.movedim(0, dim) for p in [own] + peers] for own, peers in zip(each[::3], each[1::3])]
        yield (k, *rows, *every)


def reduce_all(parts, op):
    """The reduction of every rank's rows, in the order ``_shm_reduce`` takes them (this rank's first)."""
    combine = _combine(op)
    total = parts[0]
    for p in parts[1:]:
        total = combine(total, p)
    return total


class Gather:
    """The all_gather of one value, chunk by chunk as the chunks are computed: each chunk goes into this
    rank's slot as it comes; one barrier, then every rank's rows are copied out. Its slot is taken at the
    first chunk, after the reduce_scatter's: slots are then reused in the order their reads end.

    Given the replicated ``state`` the value updates (``name``: which, ``word``: its word at the barrier), the
    kernel writes this rank's rows into the state and ``push`` writes them into every peer's copy instead."""

    def __init__(self, c, dim, n, state=None, name=None, word=0):
        self.c, self.dim, self.n = c, dim, n
        self.slot = None
        self.state, self.name = state, name
        if state is not None:
            c.shm.call(c.shm.stage_state, name, word, state)
            # all this rank pushes in the step outgrows its share of the cache: stream every chunk, however small
            lo, hi = c.rows(n)
            pushed = (c.world - 1) * (hi - lo) * (state.numel() // max(1, state.shape[dim])) * state.element_size()
            self.stream = pushed >= c.shm.stream_min

    def add(self, k, x):
        part = x.movedim(self.dim, 0)
        self.c.shm.copy(self._slot_rows(k, part.dtype, tuple(part.shape[1:])), part)

    def own(self, k, dtype, shape):
        """Chunk k's rows of this rank's slot, for the gathered value of ``shape`` and ``dtype``: a compiled
        chunk kernel writes them there as it computes them, where a returned chunk would be copied in by add."""
        rest = tuple(shape[: self.dim]) + tuple(shape[self.dim + 1 :])
        return self._slot_rows(k, dtype, rest).movedim(0, self.dim)

    def _slot_rows(self, k, dtype, rest):
        """Chunk k's rows of this rank's slot, the gathered dim first (``rest``: the other dims)."""
        if self.slot is None:
            self.slot = self.c.shm.call(self.c.shm.take)
        self.shape, self.dtype = (self.n,) + rest, dtype
        lo, _ = self.c.rows(self.n)
        return self.c.shm.at(self.c.rank, self.slot, 0, dtype, self.shape)[lo + k.a : lo + k.b]

    def result(self, end=True):
        """The gathered value, once every rank has written its rows: after the barrier that ends the collective,
        which this call makes unless an earlier gather's did (``end``)."""
        s = self.c.shm
        out = torch.empty(self.shape, dtype=self.dtype, device=self.c.device)
        if end:
            end_collective(self.c)
        for r in range(self.c.world):
            lo, hi = self.c.rows(self.n, r)
            s.copy(out[lo:hi], s.at(r, self.slot, 0, self.dtype, self.shape)[lo:hi])
        return out.movedim(0, self.dim)

    def push(self, k):
        """Chunk k's rows of the state, which the kernel has just written on this rank, into every peer's copy,
        where the kernel did not write them itself (eager kernels)."""
        rows = self._rows(self.state, k)
        for peer in self.peer_rows(k):
            self.c.shm.copy(peer, rows, stream=self.stream)

    def peer_rows(self, k):
        """Chunk k's rows of every peer's copy of the state: a compiled kernel writes this rank's rows there as it
        computes them (no peer reads them before the step ends)."""
        return [self._rows(peer, k) for r, peer in enumerate(self.c.shm.peer_states[self.name]) if r != self.c.rank]

    def _rows(self, t, k):
        lo, _ = self.c.rows(self.n)
        return t.narrow(self.dim, lo + k.a, k.b - k.a)

    def into(self, out, end=True):
        """Once every peer has written its rows, the state ``out`` is whole (copied out of its shadow where it
        could not move into shared memory): after the barrier that ends the collective, which this call makes
        unless an earlier gather's did (``end``)."""
        s = self.c.shm
        if end:
            end_collective(self.c)
        seg, moved = s.states[self.name]
        if not moved:
            for r in range(self.c.world):
                if r != self.c.rank:
                    lo, hi = self.c.rows(self.n, r)
                    s.copy(out.movedim(self.dim, 0)[lo:hi], seg.movedim(self.dim, 0)[lo:hi])


def end_collective(c):
    """The barrier that ends a fused collective: no peer reads this rank's rows (in its slot, or of an input
    where it lies) after it, and the segments made at the barrier that began it are mapped by every peer,
    so their files go. Its gathers end with it; one that gathers nothing (its state stays sliced) ends with
    it alone where its peers read an input where it lies, which the caller may write once the step returns."""
    s = c.shm
    s.call(s.barrier)
    s.call(s.unlink_made)


def gather_into(c, x, dim, n, state, name):
    """The all_gather of ``x`` (this rank's rows of dim ``dim``, of extent ``n``) as the new value of the
    Replicated ``state`` called ``name``, written straight into it: this rank's rows into its own copy and
    into every peer's (in shared memory, as a fused collective's gather into state does), with no gathered
    temporary, no slot and no copy into the state after. The first barrier: no rank reads its copy any
    more (the lowering takes this only where every other reader of the state comes before), and every
    copy is mapped; the second: every copy is whole."""
    (g,), (peers,) = into_peers(c, (dim, n, state, name))
    c.shm.copy(g._rows(state, Chunk(c, n, 0, n)), x)
    for peer in peers:
        c.shm.copy(peer, x, stream=g.stream)
    g.into(state)


def into_peers(c, *states):
    """The start of all_gathers into Replicated states (see gather_into), each given as (dim, n, the state,
    its name), at one barrier: their _Gathers, whose ``into`` ends them (the first one's at one barrier for
    all), and per state this rank's rows of every peer's copy, which a fused kernel writes as it computes
    them. After the barrier every copy is mapped and no rank reads another's rows of its copy any more."""
    gathers = [Gather(c, dim, n, state, name, word) for word, (dim, n, state, name) in enumerate(states)]
    c.shm.call(c.shm.barrier)
    return gathers, [g.peer_rows(Chunk(c, g.n, 0, g.n)) for g in gathers]
