"""The shm backend's shared memory: each group's segments of ``/dev/shm``, their rotating slots and the
barrier of per-rank flags in them (``Shm``, one per process group, made on the group's first step), and the
segments that state and inputs move into so that peers read and write them where they lie. Every module
stepping on a group uses its one ``Shm``; modules that alternate on one group are correct, but each moves its
state back into a segment every step, which a group of its own spares it. ``close_groups`` lets them all go.

How the collectives use them is ``coconet.kernels.shm``'s module doc.
"""

from __future__ import annotations

import math
import os
import platform
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from .copier import last_level_cache, stream_copier

# process group -> its Shm, made on the group's first step. Module state on purpose: step() is called
# with the group alone, every iteration, and the mapped segments (and state moved into them) must outlive
# it, as torch.distributed keeps its groups; a ProcessGroup takes no attributes to hang them on.
_GROUPS: dict[Any, Shm] = {}  # keyed by a ProcessGroup, or None: the default group


class Shm:
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
        self.stream_min = int(limit) if limit else last_level_cache() // self.world
        self.stream = None

    @staticmethod
    def of(group, slots, nbytes):
        """The group's segments, grown to ``nbytes`` per slot (every rank asks for the same, at the same step)."""
        shm = _GROUPS.get(group)
        if shm is None:
            shm = _GROUPS[group] = Shm(group, slots)
        if shm.slot_bytes < nbytes or shm.slots < slots:
            shm.slots = max(shm.slots, slots)
            shm._map(-(-nbytes // 64) * 64)
        return shm

    def _map(self, slot_bytes):
        self.generation += 1
        size = self.HEADER + self.slots * slot_bytes
        paths = [f"{self.prefix}-{self.generation}-{r}" for r in range(self.world)]
        mine = segment(paths[self.rank], size, new=True, ranks=self.world)
        mine[:8].view(torch.int64).fill_(self.epoch)
        dist.barrier(group=self.group)  # every segment exists
        self.segments = [mine if r == self.rank else segment(p, size) for r, p in enumerate(paths)]
        dist.barrier(group=self.group)  # every rank has mapped them: the names can go
        os.unlink(paths[self.rank])
        self.flags = [s[:8].view(torch.int64) for s in self.segments]
        self.words = [s[self.WORDS : self.HEADER].view(torch.int64).view(2, -1) for s in self.segments]
        self.slot_bytes = slot_bytes

    def take(self):
        slot = self.next
        self.next = (self.next + 1) % self.slots
        return slot

    def at(self, rank, slot, offset, dtype, shape):
        """Rank ``rank``'s slot as a tensor of ``shape``, from byte ``offset`` of the slot."""
        start = self.HEADER + slot * self.slot_bytes + offset
        nbytes = math.prod(shape) * dtype.itemsize
        return self.segments[rank][start : start + nbytes].view(dtype).view(shape)

    def copy(self, dst, src, stream=None):
        """``dst.copy_(src)``, between tensors alike with non-temporal stores: from ``stream_min`` bytes, or
        as ``stream`` says (a copy that is one of many whose destinations all go unread after)."""
        n = dst.numel() * dst.element_size()
        if (
            not (n >= self.stream_min if stream is None else stream)
            or dst.dtype != src.dtype
            or dst.shape != src.shape
            or not dst.is_contiguous()
            or not src.is_contiguous()
        ):
            return dst.copy_(src)
        if self.stream is None:
            self.stream = stream_copier() or False
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
                    raise RuntimeError(
                        f"shm barrier: rank {r} of the group did not arrive within {self.PATIENCE_S:.0f} s"
                    )
        if self.staged:
            self._map_states()

    def stage_state(self, name, word, t):
        """Before the barrier that begins a fused collective whose peers write their rows of state ``t`` into
        this rank's copy: a segment for them to write into, and word ``word`` of this rank's row for that
        barrier saying whether it is new (the number of its file) or the one they have mapped (0)."""
        if word >= self.STATES:
            raise RuntimeError(f"shm: a fused collective gathering into more than {self.STATES} states")
        held = self.states.get(name)
        if (
            held is not None
            and held[0].shape == t.shape
            and held[0].dtype == t.dtype
            and ((t.is_contiguous() and t.data_ptr() == held[0].data_ptr()) if held[1] else not _movable(t))
        ):
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
        elif (
            (not fits or held[1]() is None)
            and (seg is not None or held is None or held[1]() is x)
            and (home := self._own_segment(x)) is not None
        ):
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
            raise RuntimeError(
                f"shm: {len(numbers)} numbers of every rank from word {word} on: "
                f"a barrier carries {self.words[self.rank].shape[1]}"
            )
        row = self.words[self.rank][(self.epoch + 1) % 2].view(torch.float64)
        for j, x in enumerate(numbers):
            row[word + j] = float(x)

    def posted(self, word, count):
        """After the barrier: per number posted from ``word`` on, every rank's as one float32 tensor, this
        rank's first and then the peers' in rank order (the order of the rows every rank's reductions sum)."""
        order = [self.rank] + [r for r in range(self.world) if r != self.rank]
        rows = torch.stack([self.words[r][self.epoch % 2, word : word + count].view(torch.float64) for r in order])
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
                    peers[r] = _state_segment(
                        f"{self.prefix}-state-{r}-{news & 0xFFFFFFFF}", shape, dtype, offset=news >> 32
                    )
                elif (
                    r != self.rank
                    and news == 0
                    and (peers[r] is None or peers[r].shape != shape or peers[r].dtype != dtype)
                ):
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


def close_groups():
    """Lets go of every group's segments (and the state moved into them stays where it is, mapped until its
    tensors go): what runs next on those groups maps segments of its own."""
    for shm in list(_GROUPS.values()):
        shm.close()


def _on_comm_thread(fn, *args):
    """A collective on the communication thread, as one named span in a profiler trace."""
    with torch.profiler.record_function(f"shm {fn.__name__}"):
        return fn(*args)


def _whole(t):
    """Whether ``t`` is the whole, contiguous content of a CPU storage (not a view into a larger buffer)."""
    return (
        t.device.type == "cpu"
        and t.is_contiguous()
        and t._base is None
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def _movable(t):
    """Whether state ``t`` can move into a segment of its own: it is its storage's whole content and no other
    tensor holds that storage. A view into a larger buffer would lose its link to the buffer; a buffer that
    other tensors view (a flat buffer whose views are a model's parameters or their ``.grad``, as DDP's
    buckets and ZeRO's flat partitions are) would leave them on its old memory, and the parameters would
    silently stop seeing the step, the gradients written through them never be read: such a buffer is made
    shared memory where it is instead (``Shm._share_in_place``)."""
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
    return segment(path, max(offset + nbytes, 64), new)[offset : offset + nbytes].view(dtype).view(shape)


def segment(path, nbytes, new=False, ranks=0):
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
        "MiB): give it more room (docker run --shm-size, a larger tmpfs) or run on gloo"
    )
