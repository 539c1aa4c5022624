"""Collectives of the shm backend: the ranks of one node reducing in shared memory.

Like ``coconet.codegen.prelude``, the text of these helpers is pasted into the
generated modules that call them; for the shm backend they take the place of
the torch.distributed collectives of the same names, so the lowering is one.

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
(``_gather_into``): a barrier (no rank reads its copy any more), each rank's
rows into every copy, a barrier.

An input that a fused collective reduces and the step leaves as it is (a gradient) moves the same way into a
segment of its own on its first step, and its peers read their rows of it there: nothing is published. That
takes a barrier after the peers' last read and before the step returns, for the caller may write the next
gradient into the tensor then: the gathers that end the collective give one, and a collective that gathers
nothing (its state stays sliced) ends with one of its own (``_end_collective``). A caller who passes another
tensor (a view that cannot move, a second buffer while the first is alive, a new ``.grad`` every step) has it
published into the slot as before; a tensor that comes in place of a moved one gone after serving more than one
step takes its segment, and the segment of one that served a single step is let go (``_Shm.stage_input``). What
the step computes from each rank's gradient before reducing it (divided by a predivide factor, unscaled, cast to
float32) the compiled chunk kernel computes on each rank's rows as it sums them (``reduced_in_kernel`` in
``coconet.codegen.lower``): the gradient is read where it lies all the same, and that value is never written out.
A number each rank computes it with that is the rank's own (its token count, a clip factor from its gradient's
norm) rides in the rank's words of the barrier that begins the collective (``_Shm.post``), so that every rank
weighs each rank's rows by that rank's number.

A copy larger than this rank's share of the last-level cache (the cache over the
group's ranks) is made with non-temporal stores: its destination is not read
again before the copy has evicted it, and an ordinary store reads every line
before writing it. The copy is a few lines of C, compiled once per machine with
the system's C compiler into coconet's cache (torch's copy where there is none);
it fences its stores, so the flag that follows still orders them.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from coconet.codegen.cache import _cache_dir
from coconet.codegen.prelude import _Chunk, _launches  # shared with the torch backend

# process group -> its _Shm, made on the group's first step. Module state on purpose: step() is called
# with the group alone, every iteration, and the mapped segments (and state moved into them) must outlive
# it, as torch.distributed keeps its groups; a ProcessGroup takes no attributes to hang them on.
_GROUPS = {}

_STREAM_C = r"""
#include <emmintrin.h>
#include <stdint.h>
#include <string.h>

/* memcpy whose stores bypass the cache, a 64-byte line at a time; the fence makes them visible before
   any later store (the barrier's flag) */
void coconet_stream_copy(char *dst, const char *src, size_t n) {
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head; src += head; n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src), b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32)), d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, n);
    _mm_sfence();
}
"""


class _Shm:
    """The shared segments of one process group, per rank: a header (the barrier's flag, the words barriers
    carry), then ``slots`` slots of ``nbytes``; and the state segments of gathers into state."""

    HEADER = 4096  # the barrier's flag, on its own cache lines, then the words barriers carry (from WORDS)
    WORDS = 64
    STATES = (HEADER - WORDS) // 16  # states one barrier can carry news of: a word each, in two rows
    PATIENCE_S = 300.0

    def __init__(self, group, slots):
        if platform.machine().lower() not in ("x86_64", "amd64"):
            raise RuntimeError(f"the shm backend relies on x86-64 store ordering; this is {platform.machine()}")
        self.group, self.slots = group, slots
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        first = dist.get_process_group_ranks(group)[0] if group is not None else 0
        name = [f"/dev/shm/coconet-{os.getpid()}-{uuid.uuid4().hex[:12]}" if self.rank == 0 else None]
        dist.broadcast_object_list(name, src=first, group=group)
        self.prefix, self.generation = name[0], 0
        self.epoch, self.next, self.slot_bytes = 0, 0, 0
        self.segments, self.flags, self.words = [], [], []
        self.pool, self.last = None, None
        # shared state (see the module's doc): name -> (this rank's segment, whether it is the state itself),
        # name -> every rank's segment as mapped here; what the next barrier brings news of; files to unlink
        self.states, self.peer_states, self.staged, self.made, self.made_count = {}, {}, [], [], 0
        # inputs a fused collective reduces out of their own segments (stage_input): name -> [this rank's
        # segment, the caller's tensor on it (weak), the steps it has served]; name -> where each rank's rows
        # are this step (its segment, or None: its slot)
        self.inputs, self.sources = {}, {}
        self.kept = {}  # name -> the buffer a value the step computes for a fused collective goes into (held)
        limit = os.environ.get("COCONET_SHM_STREAM_BYTES", "")
        if limit and not limit.isdigit():
            raise ValueError(f"COCONET_SHM_STREAM_BYTES={limit!r}: not a number of bytes")
        self.stream_min = int(limit) if limit else _last_level_cache() // self.world
        self.stream = None

    @staticmethod
    def of(group, slots, nbytes):
        """The group's segments, grown to ``nbytes`` per slot (every rank asks for the same, at the same step)."""
        shm = _GROUPS.get(group)
        if shm is None:
            shm = _GROUPS[group] = _Shm(group, slots)
        if shm.slot_bytes < nbytes or shm.slots < slots:
            shm.slots = max(shm.slots, slots)
            shm._map(-(-nbytes // 64) * 64)
        return shm

    def _map(self, slot_bytes):
        self.generation += 1
        size = self.HEADER + self.slots * slot_bytes
        paths = [f"{self.prefix}-{self.generation}-{r}" for r in range(self.world)]
        mine = _segment(paths[self.rank], size, new=True, ranks=self.world)
        mine[:8].view(torch.int64).fill_(self.epoch)
        dist.barrier(group=self.group)  # every segment exists
        self.segments = [mine if r == self.rank else _segment(p, size)
                         for r, p in enumerate(paths)]
        dist.barrier(group=self.group)  # every rank has mapped them: the names can go
        os.unlink(paths[self.rank])
        self.flags = [s[:8].view(torch.int64) for s in self.segments]
        self.words = [s[self.WORDS:self.HEADER].view(torch.int64).view(2, -1) for s in self.segments]
        self.slot_bytes = slot_bytes

    def take(self):
        slot = self.next
        self.next = (self.next + 1) % self.slots
        return slot

    def at(self, rank, slot, offset, dtype, shape):
        """Rank ``rank``'s slot as a tensor of ``shape``, from byte ``offset`` of the slot."""
        start = self.HEADER + slot * self.slot_bytes + offset
        nbytes = math.prod(shape) * dtype.itemsize
        return self.segments[rank][start:start + nbytes].view(dtype).view(shape)

    def copy(self, dst, src, stream=None):
        """``dst.copy_(src)``, between tensors alike with non-temporal stores: from ``stream_min`` bytes, or
        as ``stream`` says (a copy that is one of many whose destinations all go unread after)."""
        n = dst.numel() * dst.element_size()
        if (not (n >= self.stream_min if stream is None else stream) or dst.dtype != src.dtype
                or dst.shape != src.shape or not dst.is_contiguous() or not src.is_contiguous()):
            return dst.copy_(src)
        if self.stream is None:
            self.stream = _stream_copier() or False
        if self.stream is False:  # no C compiler: torch's copy serves
            return dst.copy_(src)
        self.stream(dst.data_ptr(), src.data_ptr(), n)
        return dst

    def barrier(self):
        self.epoch += 1
        self.flags[self.rank].fill_(self.epoch)
        deadline, spins = None, 0
        for r, flag in enumerate(self.flags):
            while int(flag) < self.epoch:
                spins += 1
                if spins < 2000:
                    os.sched_yield()  # ranks may outnumber cores: let the late one run
                    continue
                time.sleep(5e-5)
                deadline = deadline or time.monotonic() + self.PATIENCE_S
                if time.monotonic() > deadline:
                    raise RuntimeError(f"shm barrier: rank {r} of the group did not arrive within {self.PATIENCE_S:.0f} s")
        if self.staged:
            self._map_states()

    def stage_state(self, name, word, t):
        """Before the barrier that begins a fused collective whose peers write their rows of state ``t`` into
        this rank's copy: a segment for them to write into, and word ``word`` of this rank's row for that
        barrier saying whether it is new (the number of its file) or the one they have mapped (0)."""
        if word >= self.STATES:
            raise RuntimeError(f"shm: a fused collective gathering into more than {self.STATES} states")
        held = self.states.get(name)
        if held is not None and held[0].shape == t.shape and held[0].dtype == t.dtype and (
                (t.is_contiguous() and t.data_ptr() == held[0].data_ptr()) if held[1] else not _movable(t)):
            news = 0
        else:
            home = self._own_segment(t)
            moved = home is not None
            news, seg = home if moved else self._new_segment(t)  # else a shadow, copied into t after the step
            self.states[name] = (seg, moved)
        self.words[self.rank][(self.epoch + 1) % 2, word] = news
        self.staged.append((name, word, t.shape, t.dtype))

    def stage_input(self, name, word, x):
        """Before the barrier that begins a fused collective reducing input ``x`` (which the step does not write,
        and whose collective ends with a barrier after the peers' last read of it): whether this rank must
        publish x into its slot (True), or its peers read it where it is, in a segment of its own that x moved
        into (``Tensor.set_``, as state does) on a step before, or moves into now. Word ``word`` of this rank's
        row tells the peers which: 0 the segment they have mapped, k>0 the new file k, -1 the slot, -2 the slot
        and the segment they have mapped is gone.

        The caller who writes each gradient into the same tensor (``.grad`` accumulated in place, DDP's
        gradient_as_bucket_view) then publishes nothing, and so does a step that computes x into the buffer
        ``held`` keeps for it. A tensor that comes in place of one that served more
        than the step it moved in, and is gone (inputs made anew for a new run of steps), takes that one's
        segment: one copy, and the steps after publish nothing. Where the one that moved in served one step
        only, the caller brings a new tensor every step (``zero_grad()`` sets ``.grad`` to None): each is
        published, which copies less than moving it would, and the segment is let go on every rank, its memory
        with it. A tensor that comes a second time after that moves into a segment of its own again. Where
        a tensor would move but other tensors view it (a flat buffer that the parameters' ``.grad`` views are
        written through), its memory is made shared where it is instead (``_share_in_place``), a file of its
        own, and read there the same way."""
        if word >= self.STATES:
            raise RuntimeError(f"shm: a fused collective gathering into {word} states and reducing an input")
        held = self.inputs.get(name)
        seg = held[0] if held is not None else None  # None while this rank publishes every step
        fits = seg is not None and seg.shape == x.shape and seg.dtype == x.dtype
        news = -1
        if fits and held[1]() is x and x.data_ptr() == seg.data_ptr():
            held[2] += 1
            news = 0
        elif fits and held[1]() is None and held[2] > 1 and _movable(x):
            _move_into(x, seg)  # every peer's reads of it ended at the barrier that ended the last step
            held[1:] = [weakref.ref(x), 1]
            news = 0
        elif fits and held[1]() is None and held[2] == 1:
            self.inputs[name] = [None, weakref.ref(x), 0]
            news = -2
        # (a movable x that fits a gone one's segment took it above: what comes here with it does not move)
        elif ((not fits or held[1]() is None) and (seg is not None or held is None or held[1]() is x)
              and (home := self._own_segment(x)) is not None):
            news, seg = home
            self.inputs[name] = [seg, weakref.ref(x), 1]
        elif seg is None and held is not None:
            held[1] = weakref.ref(x)
        self.words[self.rank][(self.epoch + 1) % 2, word] = news
        self.staged.append((name, word, x.shape, x.dtype))
        return news < 0

    def held(self, name, shape, dtype):
        """The buffer the step computes value ``name`` into for a fused collective to reduce: the same tensor
        every step (a new one when its shape or dtype changes), so that ``stage_input`` moves it into a
        segment once and the peers read it there from then on, where a new tensor each step is published."""
        t = self.kept.get(name)
        if t is None or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            t = self.kept[name] = torch.empty(shape, dtype=dtype)
        return t

    def post(self, word, numbers):
        """Before a barrier: this rank's ``numbers`` (0-d float32 tensors) in its words from ``word`` on, as
        float64 (which holds a float32 exactly), for the peers to read after it (``posted``)."""
        if word + len(numbers) > self.words[self.rank].shape[1]:
            raise RuntimeError(f"shm: {len(numbers)} numbers of every rank from word {word} on: "
                               f"a barrier carries {self.words[self.rank].shape[1]}")
        row = self.words[self.rank][(self.epoch + 1) % 2].view(torch.float64)
        for j, x in enumerate(numbers):
            row[word + j] = float(x)

    def posted(self, word, count):
        """After the barrier: per number posted from ``word`` on, every rank's as one float32 tensor, this
        rank's first and then the peers' in rank order (the order of the rows every rank's reductions sum)."""
        order = [self.rank] + [r for r in range(self.world) if r != self.rank]
        rows = torch.stack([self.words[r][self.epoch % 2, word:word + count].view(torch.float64) for r in order])
        return list(rows.t().to(torch.float32).contiguous())

    def _new_segment(self, t):
        """(its number, it): a new segment shaped like ``t`` that the peers map at the next barrier, its file
        unlinked once they have (``unlink_made``)."""
        self.made_count += 1
        path = f"{self.prefix}-state-{self.rank}-{self.made_count}"
        seg = _state_segment(path, t.shape, t.dtype, new=True)
        self.made.append(path)
        return self.made_count, seg

    def _own_segment(self, t):
        """(its number, the segment) that ``t`` lives in from now on: a new segment it moves into, or where other
        tensors view it, its own memory made shared (``_share_in_place``); None where it can be neither."""
        if _movable(t):
            news, seg = self._new_segment(t)
            _move_into(t, seg)
            return news, seg
        return self._share_in_place(t) if _whole(t) else None

    def _share_in_place(self, t):
        """(its number, a tensor on t's storage) for a tensor that cannot move because other tensors view its
        storage (``_movable``): the storage's memory made a file of /dev/shm where it is, so that every view
        follows, and the file linked under this group's name for the peers to map; None where torch cannot
        share it so (the tensor then stays in private memory, shadowed or published: correct, one copy more).
        The number carries the byte offset of t's data in that file above its 32 low bits."""
        path = f"{self.prefix}-state-{self.rank}-{self.made_count + 1}"
        offset = _share_storage(t, path)
        if offset is None:
            return None
        self.made_count += 1
        self.made.append(path)
        seg = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, t.shape, t.stride())
        return self.made_count | offset << 32, seg

    def _map_states(self):
        """At the barrier after stage_state or stage_input: the peers' new segments mapped, and where each rank's
        rows of a staged input are this step. A rank writes a barrier's words before it arrives, and the next
        words to the same row only after the barrier after, which no rank passes before this one has read
        them."""
        row = self.epoch % 2
        for name, word, shape, dtype in self.staged:
            peers = self.peer_states.setdefault(name, [None] * self.world)
            here = []
            for r in range(self.world):
                news = 0 if r == self.rank else int(self.words[r][row, word])
                if news == -2:  # rank r let its segment go: so does this rank's mapping of it
                    peers[r] = None
                if news > 0:  # a new file, its data from the offset in the high bits (``_share_in_place``)
                    peers[r] = _state_segment(f"{self.prefix}-state-{r}-{news & 0xFFFFFFFF}", shape, dtype,
                                              offset=news >> 32)
                elif r != self.rank and news == 0 and (peers[r] is None or peers[r].shape != shape
                                                       or peers[r].dtype != dtype):
                    raise RuntimeError(f"shm: rank {r} has no segment for {name!r} shaped {tuple(shape)}")
                here.append(peers[r] if news >= 0 else None)
            self.sources[name] = here
        self.staged = []

    def unlink_made(self):
        """The files of new state segments, once every peer has mapped them (at the barrier they were made
        for, which comes before the one that ends their collective)."""
        for path in self.made:
            os.unlink(path)
        self.made = []

    def call(self, fn, *args, async_op=False):
        """Runs a collective now, or on the group's one communication thread (async_op, or while earlier async
        ones are queued there: every rank must meet the collectives in the same order)."""
        if not async_op and (self.last is None or self.last.done()):
            return fn(*args)
        if self.pool is None:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="coconet-shm")
        self.last = self.pool.submit(_on_comm_thread, fn, *args)
        return self.last if async_op else self.last.result()

    def close(self):
        if self.pool is not None:
            self.pool.shutdown()
        for path in self.made:  # a step that failed between making a segment and its last barrier
            if os.path.exists(path):
                os.unlink(path)
        self.segments, self.flags, self.words, self.states, self.peer_states, self.made = [], [], [], {}, {}, []
        self.inputs, self.sources = {}, {}
        _GROUPS.pop(self.group, None)


def _whole(t):
    """Whether ``t`` is the whole, contiguous content of a CPU storage (not a view into a larger buffer)."""
    return (t.device.type == "cpu" and t.is_contiguous() and t._base is None and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def _movable(t):
    """Whether state ``t`` can move into a segment of its own: it is its storage's whole content and no other
    tensor holds that storage. A view into a larger buffer would lose its link to the buffer; a buffer that
    other tensors view (a flat buffer whose views are a model's parameters or their ``.grad``, as DDP's
    buckets and ZeRO's flat partitions are) would leave them on its old memory, and the parameters would
    silently stop seeing the step, the gradients written through them never be read: such a buffer is made
    shared memory where it is instead (``_Shm._share_in_place``)."""
    # the tensor's own reference and the storage object asked for here; torch without the count: never move
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return _whole(t) and use_count is not None and use_count(t.untyped_storage()._cdata) <= 2


def _share_storage(t, path):
    """Makes the memory of ``t``'s storage a file of /dev/shm in place and links it at ``path``; the byte offset
    of t's data in the file, or None where that cannot be done. torch's file-system sharing (what
    ``share_memory_`` does under that strategy) copies the storage into a new file and swaps the storage's
    memory for it, so that every tensor on the storage follows, which is what a buffer with views needs."""
    st = t.untyped_storage()
    nbytes, folder = st.nbytes(), os.path.dirname(path)
    # a buffer this small costs nothing to copy; one already shared (torch.multiprocessing, a mapped file) may
    # be another process's too, which a swap of its memory would cut off
    if nbytes < 64 or st.is_shared():
        return None
    room = os.statvfs(folder)
    if room.f_bavail * room.f_frsize < nbytes + 4096:  # the copy touches every page: SIGBUS past the room
        _no_room(folder, nbytes, "for a buffer that other tensors view")
    try:
        _, name, _ = st._share_filename_cpu_()
        os.link("/dev/shm" + name.decode(), path)
    except (RuntimeError, OSError, AttributeError):
        return None  # no torch_shm_manager, another file system: private memory serves, with its copies
    # where the data begins in the file: a mark written through the storage, found in the file
    data = torch.empty(0, dtype=torch.uint8).set_(st, 0, (nbytes,))
    kept, mark = data[:16].clone(), os.urandom(16)
    data[:16].copy_(torch.frombuffer(bytearray(mark), dtype=torch.uint8))
    try:
        with open(path, "rb") as f:
            offset = f.read(4096 + 16).find(mark)
    finally:
        data[:16].copy_(kept)
    if offset < 0 or offset % 64 or os.stat(path).st_size < offset + nbytes:
        os.unlink(path)
        return None
    return offset


def _move_into(t, seg):
    """Tensor ``t`` onto segment ``seg`` with its values (``Tensor.set_``): the caller's tensor keeps its identity."""
    seg.copy_(t)
    with torch.no_grad():
        t.set_(seg.untyped_storage(), 0, t.shape, t.stride())


def _state_segment(path, shape, dtype, new=False, offset=0):
    """The file ``path`` of /dev/shm (made if ``new``) mapped as a contiguous tensor of ``shape`` from byte
    ``offset``."""
    nbytes = math.prod(shape) * dtype.itemsize
    return _segment(path, max(offset + nbytes, 64), new)[offset:offset + nbytes].view(dtype).view(shape)


def _segment(path, nbytes, new=False, ranks=0):
    """The file ``path`` of /dev/shm mapped as ``nbytes`` bytes, made if ``new``. tmpfs hands a page out at its
    first touch, so a segment past what /dev/shm can hold (64 MiB in a docker container not given --shm-size)
    would kill its rank with SIGBUS at a later store. A state's segment, all of which is written at once, takes
    its pages when made; a group's slots, of which a rank writes only the rows its peers read, are checked
    against the room /dev/shm has for the ``ranks`` segments like it that the group's ranks make together."""
    if new:
        folder = os.path.dirname(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        why = None
        try:
            if ranks:
                room = os.statvfs(folder)
                if room.f_bavail * room.f_frsize < ranks * nbytes:
                    why = f"one for each of {ranks} ranks"
            else:
                os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            why = e.strerror
        finally:
            os.close(fd)
        if why is not None:
            os.unlink(path)
            _no_room(folder, nbytes, why)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def _no_room(folder, nbytes, why):
    room, mib = os.statvfs(folder), 2**20  # read now: what is free once a file made for it is gone
    raise RuntimeError(
        f"shm backend: {folder} cannot hold a segment of {nbytes / mib:.1f} MiB ({why}; "
        f"{room.f_bavail * room.f_frsize / mib:.1f} MiB free of {room.f_blocks * room.f_frsize / mib:.1f} "
        "MiB): give it more room (docker run --shm-size, a larger tmpfs) or run on gloo")


def _last_level_cache():
    """Bytes of this CPU's last-level cache (32 MiB where the system does not say)."""
    best = (0, 32 << 20)
    root = "/sys/devices/system/cpu/cpu0/cache"
    for index in os.listdir(root) if os.path.isdir(root) else []:
        try:
            with open(f"{root}/{index}/level") as f, open(f"{root}/{index}/size") as g:
                level, size = int(f.read()), g.read().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        best = max(best, (level, int(size.rstrip("KMG")) * scale))
    return best[1]


def _stream_copier():
    """``_STREAM_C`` compiled (once per machine and compiler) and loaded; None without a C compiler."""
    lib = _native_library(_STREAM_C, "stream_copy", ["-O2"], "its copy kernel")
    if lib is None:
        return None
    fn = lib.coconet_stream_copy
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t), None
    return fn


def _native_library(source, name, flags, what):
    """C ``source`` compiled with ``flags`` into coconet's cache (once per machine, compiler and CPU: flags may
    say -march=native) and loaded; None without a C compiler. ``what`` it is, for the compiler's error."""
    cc = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
    if cc is None:
        return None
    cpu = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line for line in f if line.startswith(("flags", "model name"))), "")
    digest = hashlib.sha256("\n".join([cc, *flags, cpu, source]).encode()).hexdigest()[:16]
    folder = os.path.join(_cache_dir(), "kernels")
    path = os.path.join(folder, f"{name}_{digest}.so")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            with open(os.path.join(tmp, f"{name}.c"), "w") as f:
                f.write(source)
            built = subprocess.run([cc, *flags, "-shared", "-fPIC", "-o", os.path.join(tmp, f"{name}.so"),
                                    os.path.join(tmp, f"{name}.c")], capture_output=True, text=True)
            if built.returncode != 0:
                raise RuntimeError(f"shm backend: {cc} could not compile {what}:\n{built.stderr}")
            os.replace(os.path.join(tmp, f"{name}.so"), path)  # atomic: ranks compiling at once agree
    return ctypes.CDLL(path)


def _native(fn, kinds, source, sums=0):
    """Kernel ``fn`` (a fused collective's chunk, or a fuse group's rows that it writes into the peers'
    copies) run by ``source``'s C function (coconet.kernels.native) where the call's tensors allow it: every
    tensor a contiguous float32 CPU tensor of one length (bfloat16 or float16 where its kind says so), every
    scalar one number, nothing that needs autograd; ``fn`` otherwise, and where there is no C compiler.
    ``kinds``: a letter per parameter of fn (d a dim, s a scalar, t a tensor, l a list of tensors summed, h the
    same of bfloat16 tensors, p a list of peers' rows, q a float32 tensor of every rank's number, one per tensor
    of the l or h; u and b a bfloat16 tensor and a list of peers' bfloat16 rows; k, x and y the float16 h, u
    and b; r and c a float32 (m, 1) row factor and (1, w) column factor broadcast to (m, w) rows, whose w
    follows the lists' counts).
    ``sums``: how many partial sums fn returns (as float32 scalars, in order); C returns them alike."""
    lib = []  # the C function, or None: fn serves every call

    def kernel(*args):
        if not lib:
            # IEEE operations as written: no fused multiply-adds, no reassociation (not -ffast-math)
            built = _native_library(source, "chunk", ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math",
                                                      "-ffp-contract=off"], "a chunk kernel")
            if built is not None:
                built = built.coconet_chunk
                built.argtypes = (ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
                built.restype = None
            lib.append(built)
        if lib[0] is None:
            return fn(*args)
        grad = torch.is_grad_enabled()
        ptrs, counts, scalars, n = [], [], [], None
        rows, cols = set(), set()  # the lengths of the row factors and of the column factors passed
        for kind, x in zip(kinds, args):
            if kind == "d":
                continue
            if kind in "rc":
                if (x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous() or x.dim() != 2
                        or x.shape[1 if kind == "r" else 0] != 1 or (grad and x.requires_grad)):
                    return fn(*args)
                (rows if kind == "r" else cols).add(x.numel())
                ptrs.append(x.data_ptr())
                continue
            if kind == "s":
                if isinstance(x, torch.Tensor) and (x.numel() != 1 or x.dtype not in (torch.float32, torch.bool)
                                                    or x.device.type != "cpu" or (grad and x.requires_grad)):
                    return fn(*args)
                scalars.append(float(x))
                continue
            if kind == "q":
                if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous() or x.dim() != 1:
                    return fn(*args)
                ptrs.append(x.data_ptr())
                continue
            xs = x if kind in "lhpbky" else (x,)
            if kind in "lhpbky":
                counts.append(len(xs))
            dtype = torch.bfloat16 if kind in "hub" else torch.float16 if kind in "kxy" else torch.float32
            for t in xs:
                if (t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous()
                        or (n is not None and t.numel() != n) or (grad and t.requires_grad)):
                    return fn(*args)
                n = t.numel()
                ptrs.append(t.data_ptr())
        if rows or cols:
            # the rows (m, w): m the row factor's length, w the column factor's, every tensor's last dim
            if len(rows) > 1 or len(cols) > 1 or n is None:
                return fn(*args)
            m, width = next(iter(rows), None), next(iter(cols), None)
            if width is None:
                width = n // m if m else 0
            tensors = [t for kind, x in zip(kinds, args) if kind in "tuxlhpbky"
                       for t in (x if kind in "lhpbky" else (x,))]
            if (not width or n % width or (m is not None and m * width != n)
                    or any(t.dim() == 0 or t.shape[-1] != width for t in tensors)):
                return fn(*args)
            counts.append(width)
        out = (ctypes.c_double * max(1, sums))()
        lib[0](n, (ctypes.c_void_p * len(ptrs))(*ptrs), (ctypes.c_long * max(1, len(counts)))(*counts),
               (ctypes.c_float * max(1, len(scalars)))(*scalars), out)
        return tuple(torch.tensor(x, dtype=torch.float32) for x in out[:sums]) if sums else None
    return kernel


def _on_comm_thread(fn, *args):
    """A collective on the communication thread, as one named span in a profiler trace."""
    with torch.profiler.record_function(f"shm {fn.__name__}"):
        return fn(*args)


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
        peers = [s.at(r, slot, offsets[k], x.dtype, tuple(x.shape))[lo[k]:hi[k]] for r in range(c.world) if r != c.rank]
        out = x.new_empty((hi[k] - lo[k],) + tuple(x.shape[1:]))
        outs.append(_shm_reduce(c, x[lo[k]:hi[k]], peers, op, out).movedim(0, dims[k]))
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


def _allreduce(c, x, op, async_op=False):
    """In place on x, reduced in shared memory."""
    done = c.shm.call(_shm_allreduce, c, [x], op, async_op=async_op)
    return _Done(done) if async_op else None


def _allreduced(c, x, op):
    """The reduction over ranks of x, in a buffer of its own: x is left as it is, and not copied first."""
    return c.shm.call(_shm_allreduce, c, [x], op, [torch.empty_like(x)])[0]


def _reduce_scatter(c, x, dim, n, op="sum", async_op=False):
    """The rows this rank holds of the reduction over ranks of x, read out of the peers' segments.
    With async_op, returns a function that waits and gives the rows."""
    done = c.shm.call(_shm_reduce_scatter, c, [x], [dim], [n], op, async_op=async_op)
    return (lambda: done.result()[0]) if async_op else done[0]


def _all_gather(c, x, dim, n):
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


def _broadcast(c, x, root):
    """In place on x: the value of group rank ``root``."""
    return c.shm.call(_shm_broadcast, c, x, root)


def _bucket_allreduce(c, xs, op, cap, keep=None):
    """One publish and two barriers per ``cap`` bytes of the buffers xs: the reduced buffers, in place but for
    those ``keep`` marks (those are left as they are, reduced into buffers of their own)."""
    outs = [torch.empty_like(x) if k else x for x, k in zip(xs, keep or [False] * len(xs))]
    for launch in _launches(xs, cap):
        c.shm.call(_shm_allreduce, c, [xs[i] for i in launch], op, [outs[i] for i in launch])
    return outs


def _bucket_reduce_scatter(c, xs, dims, ns, op, cap):
    outs = [None] * len(xs)
    for launch in _launches(xs, cap):
        got = c.shm.call(_shm_reduce_scatter, c, [xs[i] for i in launch], [dims[i] for i in launch],
                         [ns[i] for i in launch], op)
        for i, y in zip(launch, got):
            outs[i] = y
    return outs


def _bucket_all_gather(c, xs, dims, ns, cap):
    outs = [None] * len(xs)
    for launch in _launches(xs, cap):
        got = c.shm.call(_shm_all_gather, c, [xs[i] for i in launch], [dims[i] for i in launch], [ns[i] for i in launch])
        for i, y in zip(launch, got):
            outs[i] = y
    return outs


def _scatter_parts(c, x, dim, n, count, name=None, word=0, numbers=(), every=None):
    """Publishes x once, then yields, for ``count`` chunks of the rows this rank holds: the chunk, its rows
    on this rank (from x), on every peer (from their segments), and where this rank may write them.

    Given the input's ``name`` (and its ``word`` at the barrier), x is an input the step does not write and
    a barrier follows the last chunk: x may then live in a segment of its own, which the peers read instead
    of a copy of it in the slot (``_Shm.stage_input``). ``numbers``: 0-d values of this rank posted at the
    same barrier, every rank's appended to ``every`` (``_Shm.posted``). A tuple of inputs (and of names, with
    words from ``word`` on) yields per chunk those three for each in turn, packed one after the other in the
    slot where they are published: what a chunk kernel reads them from (``_reduce_scatter_parts``)."""
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
        k = _Chunk(c, n, a, a + size)
        span = slice(lo + k.a, lo + k.b)
        each = []
        for t, at, seg in zip(rows, offsets, where):
            shape = tuple(t.shape)
            peers = [(s.at(r, slot, at, t.dtype, shape) if seg[r] is None else seg[r].movedim(dim, 0))[span]
                     for r in range(c.world) if r != c.rank]
            # this rank's own rows of its slot: nobody reads them, and they stay mapped from step to step
            each += [t[span], peers, s.at(c.rank, slot, at, t.dtype, shape)[span]]
        yield (k, *each)


def _reduce_scatter_chunks(c, x, dim, n, count, op, name=None, word=0):
    """Yields (chunk, its reduced rows) for ``count`` chunks of the rows this rank holds, each reduced out
    of the peers' segments just before it is computed on, while it is still in cache."""
    for k, own, peers, out in _scatter_parts(c, x, dim, n, count, name, word):
        yield k, _shm_reduce(c, own, peers, op, out).movedim(0, dim)


def _reduce_scatter_parts(c, x, dim, n, count, name=None, word=0, numbers=()):
    """Yields (chunk, its rows on every rank, unreduced): the kernel computing on the chunk sums them as it
    reads them, so the reduced rows are never written out. With ``numbers`` (0-d values every rank computes
    its rows with before they are summed: a weight, a clip factor), then every rank's of each, in the rows'
    order. A tuple of inputs (``_scatter_parts``): the chunk's rows on every rank of each, in turn."""
    every = []
    for k, *each in _scatter_parts(c, x, dim, n, count, name, word, numbers, every):
        rows = [[p.movedim(0, dim) for p in [own] + peers] for own, peers in zip(each[::3], each[1::3])]
        yield (k, *rows, *every)


def _reduce_all(parts, op):
    """The reduction of every rank's rows, in the order ``_shm_reduce`` takes them (this rank's first)."""
    combine = _combine(op)
    total = parts[0]
    for p in parts[1:]:
        total = combine(total, p)
    return total


class _Gather:
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
        rest = tuple(shape[:self.dim]) + tuple(shape[self.dim + 1:])
        return self._slot_rows(k, dtype, rest).movedim(0, self.dim)

    def _slot_rows(self, k, dtype, rest):
        """Chunk k's rows of this rank's slot, the gathered dim first (``rest``: the other dims)."""
        if self.slot is None:
            self.slot = self.c.shm.call(self.c.shm.take)
        self.shape, self.dtype = (self.n,) + rest, dtype
        lo, _ = self.c.rows(self.n)
        return self.c.shm.at(self.c.rank, self.slot, 0, dtype, self.shape)[lo + k.a:lo + k.b]

    def result(self, end=True):
        """The gathered value, once every rank has written its rows: after the barrier that ends the collective,
        which this call makes unless an earlier gather's did (``end``)."""
        s = self.c.shm
        out = torch.empty(self.shape, dtype=self.dtype, device=self.c.device)
        if end:
            _end_collective(self.c)
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
            _end_collective(self.c)
        seg, moved = s.states[self.name]
        if not moved:
            for r in range(self.c.world):
                if r != self.c.rank:
                    lo, hi = self.c.rows(self.n, r)
                    s.copy(out.movedim(self.dim, 0)[lo:hi], seg.movedim(self.dim, 0)[lo:hi])


def _end_collective(c):
    """The barrier that ends a fused collective: no peer reads this rank's rows (in its slot, or of an input
    where it lies) after it, and the segments made at the barrier that began it are mapped by every peer,
    so their files go. Its gathers end with it; one that gathers nothing (its state stays sliced) ends with
    it alone where its peers read an input where it lies, which the caller may write once the step returns."""
    s = c.shm
    s.call(s.barrier)
    s.call(s.unlink_made)


def _gather_into(c, x, dim, n, state, name):
    """The all_gather of ``x`` (this rank's rows of dim ``dim``, of extent ``n``) as the new value of the
    Replicated ``state`` called ``name``, written straight into it: this rank's rows into its own copy and
    into every peer's (in shared memory, as a fused collective's gather into state does), with no gathered
    temporary, no slot and no copy into the state after. The first barrier: no rank reads its copy any
    more (the lowering takes this only where every other reader of the state comes before), and every
    copy is mapped; the second: every copy is whole."""
    (g,), (peers,) = _into_peers(c, (dim, n, state, name))
    c.shm.copy(g._rows(state, _Chunk(c, n, 0, n)), x)
    for peer in peers:
        c.shm.copy(peer, x, stream=g.stream)
    g.into(state)


def _into_peers(c, *states):
    """The start of all_gathers into Replicated states (see _gather_into), each given as (dim, n, the state,
    its name), at one barrier: their _Gathers, whose ``into`` ends them (the first one's at one barrier for
    all), and per state this rank's rows of every peer's copy, which a fused kernel writes as it computes
    them. After the barrier every copy is mapped and no rank reads another's rows of its copy any more."""
    gathers = [_Gather(c, dim, n, state, name, word) for word, (dim, n, state, name) in enumerate(states)]
    c.shm.call(c.shm.barrier)
    return gathers, [g.peer_rows(_Chunk(c, g.n, 0, g.n)) for g in gathers]


HELPERS = (_Shm, _whole, _movable, _share_storage, _no_room, _move_into, _state_segment, _segment, _last_level_cache, _stream_copier, _native_library, _native, _on_comm_thread, _Done, _offsets, _publish, _combine, _shm_reduce, _shm_reduce_scatter, _shm_all_gather,
           _shm_allreduce, _allreduce, _allreduced, _reduce_scatter, _all_gather, _shm_broadcast, _broadcast, _bucket_allreduce,
           _bucket_reduce_scatter, _bucket_all_gather, _scatter_parts, _reduce_scatter_chunks, _reduce_scatter_parts, _reduce_all,
           _Gather, _end_collective, _gather_into, _into_peers)
