"""Helpers every generated module carries, so that it runs with torch alone.

The text of these helpers is pasted into each generated module (``coconet.codegen.runtime_text``); the
functions here are also importable, which is how the tests exercise them directly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from coconet.codegen.cache import _cache_dir
from coconet.kernels.rng import philox_blocks, philox_rounds, philox_words


class _Ctx:
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


_OPS = {"sum": "SUM", "prod": "PRODUCT", "max": "MAX", "min": "MIN", "avg": "SUM"}
# torch >= 2.12 names the flat collectives *_single; older releases *_tensor
_AG = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_RS = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _reduce_op(op):
    return getattr(dist.ReduceOp, _OPS[op])


def _allreduce(c, x, op, async_op=False):
    """In place on x. gloo has no AVG: sum, then divide."""
    work = dist.all_reduce(x, op=_reduce_op(op), group=c.group, async_op=async_op)
    if op == "avg":
        if work is not None:
            work.wait()
            work = None
        x.div_(c.world)
    return work


def _allreduced(c, x, op):
    """The reduction over ranks of x, in a buffer of its own: x is left as it is."""
    y = x.clone()
    _allreduce(c, y, op)
    return y


def _matmul(a, b):
    """a (..., K) @ b (K, M). float32 on CPU goes through oneDNN's linear, as Inductor's CPU lowering does:
    on the Megatron layer's shapes it ran 1.07-1.25x torch.matmul's MKL sgemm where first measured, two
    ranks at once included, and 0.85-0.99x on an Intel Xeon (benchmarks/cpu_matmul.py). A product with
    one row or one column (a matrix's row or column sums as a product with ones) is torch.matmul: MKL's
    gemv ran it 1.9-2.4x as fast as oneDNN there. Anything else, or a torch without oneDNN, too."""
    if (a.device.type == "cpu" and a.dtype == b.dtype == torch.float32 and a.dim() >= 2 and a.numel()
            and b.numel() and a.numel() > a.shape[-1] and b.shape[-1] > 1 and torch.backends.mkldnn.is_available()):
        if not (b.is_contiguous() or b.t().is_contiguous()):
            # a weight whose rows are strided (the overlap's column chunks of a weight): oneDNN's linear on
            # one took 15 s where the same chunk copied took 11 ms (2048 x 1024 x 256); the copy is 1/m of
            # the product's work
            b = b.contiguous()
        y = torch.ops.mkldnn._linear_pointwise(a.reshape(-1, a.shape[-1]), b.t(), None, "none", [], "")
        return y.reshape(a.shape[:-1] + b.shape[-1:])
    return torch.matmul(a, b)


def _broadcast(c, x, root):
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


def _reduce_scatter(c, x, dim, n, op="sum", async_op=False):
    """The rows this rank holds of the reduction over ranks of x (uneven slices allowed).
    With async_op, returns a function that waits and gives the rows (the collective is in flight)."""
    full, chunk = _padded(c, x, dim, n)
    out = full.new_empty((chunk,) + tuple(full.shape[1:]))
    work = _RS(out, full, op=_reduce_op(op), group=c.group, async_op=async_op)

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


def _all_gather(c, x, dim, n):
    """The whole value from every rank's rows along dim (uneven slices allowed)."""
    part = _part(c, x, dim, n)
    out = part.new_empty((part.shape[0] * c.world,) + tuple(part.shape[1:]))
    _AG(out, part, group=c.group)
    return out[:n].movedim(0, dim)


def _coalesced(c):
    """Collectives issued inside run as one launch when they leave: NCCL groups them (no copy), gloo runs
    its coalesced form (it flattens them in C++). A private torch API; without it they run one by one."""
    try:
        from torch.distributed.distributed_c10d import _coalescing_manager
    except ImportError:
        import contextlib

        return contextlib.nullcontext()
    return _coalescing_manager(c.group)


def _launches(xs, cap):
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


def _bucket_allreduce(c, xs, op, cap, keep=None):
    """One allreduce launch per cap bytes of the buffers xs, without a flattening copy here: the reduced
    buffers, in place but for those ``keep`` marks (those are left as they are, reduced into copies)."""
    xs = [x.clone() if k else x for x, k in zip(xs, keep or [False] * len(xs))]
    for launch in _launches(xs, cap):
        with _coalesced(c):
            for i in launch:
                dist.all_reduce(xs[i], op=_reduce_op(op), group=c.group)
    if op == "avg":
        for x in xs:
            x.div_(c.world)
    return xs


def _bucket_reduce_scatter(c, xs, dims, ns, op, cap):
    padded = [_padded(c, x, d, n)[0] for x, d, n in zip(xs, dims, ns)]
    outs = [f.new_empty((f.shape[0] // c.world,) + tuple(f.shape[1:])) for f in padded]
    for launch in _launches(padded, cap):
        with _coalesced(c):
            for i in launch:
                _RS(outs[i], padded[i], op=_reduce_op(op), group=c.group)
    return [_rows_of(c, o, d, n, op) for o, d, n in zip(outs, dims, ns)]


def _bucket_all_gather(c, xs, dims, ns, cap):
    parts = [_part(c, x, d, n) for x, d, n in zip(xs, dims, ns)]
    outs = [p.new_empty((p.shape[0] * c.world,) + tuple(p.shape[1:])) for p in parts]
    for launch in _launches(outs, cap):
        with _coalesced(c):
            for i in launch:
                _AG(outs[i], parts[i], group=c.group)
    return [o[:n].movedim(0, d) for o, d, n in zip(outs, dims, ns)]


class _Chunk:
    """Rows [a, b) of the rows this rank holds of a dim of extent n: what one step of a chunked fused
    collective computes on. Stands in for _Ctx in the statements of the chunk."""

    def __init__(self, c, n, a, b):
        self.group, self.rank, self.world, self.global_rank, self.device = c.group, c.rank, c.world, c.global_rank, c.device
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


def _reduce_scatter_chunks(c, x, dim, n, count, op):
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
        started.append((_Chunk(c, n, a, b), out, _RS(out, send, op=_reduce_op(op), group=c.group, async_op=True)))
    for k, out, work in started:
        work.wait()
        if op == "avg":
            out.div_(c.world)
        yield k, out[: k.b - k.a].movedim(0, dim)


class _Gather:
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


def _flat_index(shape, dim, first, count, device):
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


def _words(seed, shape, dim, first, count, device):
    """The Philox word of each element of rows [first, first + count) of ``dim`` of ``shape`` (all of it if
    dim < 0), in that piece's shape. On CPU the rounds bound the kernel: where every row is whole blocks of
    four, one call serves a block and the four words go through a buffer. On CUDA memory bounds it (an
    H100 ran the fused epilogue at 71% of copy bandwidth): every element runs its own call."""
    inner = 1
    for n in shape[dim + 1:] if dim >= 0 else shape:
        inner *= n
    if device.type != "cpu" or inner % 4:
        return philox_words(seed, _flat_index(shape, dim, first, count, device))
    rows = (tuple(shape[:dim]) + (count,)) if dim >= 0 else ()
    blocks = _flat_index(tuple(shape[:dim + 1]) + (inner // 4,), dim, first, count, device)
    return philox_blocks(seed, blocks).reshape(rows + tuple(shape[dim + 1:] if dim >= 0 else shape))


def _dropout(c, x, p, seed, shape, dim):
    """Inverted dropout with the counter-based mask of coconet.schedules.rng (Philox4x32-10)."""
    if p == 0:
        return x
    lo, hi = c.rows(shape[dim]) if dim >= 0 else (0, 0)
    return _dropped(x, p, _words(seed, shape, dim, lo, hi - lo, x.device))


def _dropout_rows(x, p, seed, shape, dim, first):
    """_dropout of the rows of ``dim`` from ``first`` (a tensor) on: a chunk of a fused collective."""
    if p == 0:
        return x
    return _dropped(x, p, _words(seed, shape, dim, first, x.shape[dim], x.device))


def _dropped(x, p, words):
    keep = (words >> 8) >= int(p * 16777216 + 0.5)
    return torch.where(keep, x / (1.0 - p), torch.zeros((), dtype=x.dtype, device=x.device))


def _int64(x):
    """An int as a 0-d int64 tensor (two's complement for seeds of 2^63 and up), on the host as the
    scalars are: kernels take it as an argument, and a new value does not compile again."""
    return torch.tensor(x - (1 << 64) if x >= 1 << 63 else x, dtype=torch.int64)


def _kernel(fn):
    """A fused pointwise kernel, compiled by Inductor on its first call with each new shape of its inputs
    (vectorised C++ on CPU, Triton on CUDA) and loaded from Inductor's on-disk cache by later processes.

    On CPU the kernel is Inductor's code for the traced graph alone (``standalone_compile``): no Dynamo frame
    or guards around each call, which cost more than a small kernel's work (benchmarks/kernel_call.py). It
    has no guards of its own, so it is kept per signature of its inputs (shapes, strides, dtypes, the values
    of what is not a tensor); inputs that share memory, inputs that need autograd, CUDA tensors, and graphs
    that will not trace go through ``torch.compile``, whose guards cover them. Neither is compiled through
    AOTAutograd's cache: given views of one buffer that the kernel writes (the rows of several gathers in
    one segment), it has handed later processes a kernel traced for other sizes, which failed or wrote
    wrong rows."""
    from torch._functorch import config

    dynamo = []  # torch.compile's wrapper of fn, made on the first call that needs it
    built = {}  # signature of the inputs -> Inductor's kernel for them (None: through torch.compile)

    def no_autograd_cache(call, *args):
        # set around every call, as any call may compile; the caller's setting comes back after.
        # (config.patch would do, at twice a small kernel's cost per call)
        was = config.enable_autograd_cache
        config.enable_autograd_cache = False
        try:
            return call(*args)
        finally:
            config.enable_autograd_cache = was

    def standalone(leaves, layout, tensors):
        from torch.fx.experimental.proxy_tensor import make_fx

        at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        returns = []  # what fn returns, seen as it is traced: None or a tensor (True), or a tuple of them
        # Inductor's C++ loads and stores a bool vector through masked byte loads and stores, which cost
        # 10-20x a float's on cores where those are slow (AMD's: 200 ms against 10 ms to write a 2^24 mask,
        # 99 ms against 15 ms to read one into a where, one thread; benchmarks/cpu_masks.py): the kernel
        # is handed bools as bytes and writes bytes, which it converts through floats. A bool tensor the
        # kernel writes (a chunk's rows of a sliced mask) stays one: the conversion is a copy, and the
        # writes would go into it
        bools_in = {j for j, x in enumerate(tensors) if x.dtype == torch.bool}
        bools_out: list[int] = []
        written: set[int] = set()  # bool inputs the traced kernel wrote

        def flat(*xs):
            full, derived = list(leaves), {}
            for j, (i, x) in enumerate(zip(at, xs)):
                full[i] = derived[j] = x.to(torch.float32) != 0 if j in bools_in else x
            args, k = [], 0
            for kind, n in layout:  # the arguments again: leaves, and lists or tuples of them
                args.append(full[k] if kind is None else kind(full[k:k + n]))
                k += 1 if kind is None else n
            out = fn(*args)
            written.update(j for j in bools_in if derived[j]._version)
            returns.append(out is None or isinstance(out, torch.Tensor))
            outs = () if out is None else (out,) if isinstance(out, torch.Tensor) else tuple(out)
            bools_out.extend(i for i, o in enumerate(outs) if o.dtype == torch.bool)
            return tuple(torch.where(o, 1.0, 0.0).to(torch.uint8) if i in bools_out else o
                         for i, o in enumerate(outs))

        def as_bytes(xs):
            return [x.view(torch.uint8) if j in bools_in else x for j, x in enumerate(xs)]

        try:
            graph = make_fx(flat, tracing_mode="fake")(*as_bytes(tensors))  # fake: tracing must not run the writes
            if written:  # traced again with those handed over as they are
                bools_in -= written
                bools_out.clear()
                graph = make_fx(flat, tracing_mode="fake")(*as_bytes(tensors))
            compiled = torch._inductor.standalone_compile(graph, as_bytes(tensors),
                                                          dynamic_shapes="from_example_inputs")
        except Exception:  # data-dependent Python that only Dynamo traces, or a torch without standalone_compile
            return None
        if bools_in or bools_out:
            run = compiled

            def compiled(*xs):
                outs = run(*as_bytes(xs))
                return [o.view(torch.bool) if i in bools_out else o for i, o in enumerate(outs)]

        if returns[0]:  # the graph's outputs are () or (the tensor,)
            return lambda *xs: next(iter(compiled(*xs) or ()), None)
        return lambda *xs: tuple(compiled(*xs))

    def through_dynamo(*args):
        if not dynamo:
            dynamo.append(torch.compile(fn, dynamic=False, fullgraph=True))
        return no_autograd_cache(dynamo[0], *args)

    def kernel(*args):
        for a in args:
            if isinstance(a, torch.Tensor):
                if not a.is_cpu:
                    # a device kernel: Dynamo's guards are its only key, and building the signature below
                    # cost an H200's host 23-33 us a call (benchmarks/kernel_wrapper.py)
                    return through_dynamo(*args)
                break
        # flattened by hand: torch's pytree takes longer than a small kernel's whole call
        leaves, layout = [], []
        for a in args:
            if isinstance(a, (list, tuple)):
                leaves.extend(a)
                layout.append((type(a), len(a)))
            else:
                leaves.append(a)
                layout.append((None, 1))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        grad = torch.is_grad_enabled()
        key = (tuple(layout), grad, tuple((x.shape, x.stride(), x.dtype, x.device, x.requires_grad)
                                          if isinstance(x, torch.Tensor) else _constant(x) for x in leaves))
        hit = built.get(key, False)
        separate = len({x.untyped_storage().data_ptr() for x in tensors}) == len(tensors)
        if hit is False:
            plain = (separate and all(x.device.type == "cpu" for x in tensors)
                     and not (grad and any(x.requires_grad for x in tensors)))
            hit = built[key] = no_autograd_cache(standalone, leaves, tuple(layout), tensors) if plain else None
        if hit is None or not separate:  # inputs that share memory: the kernel was traced for separate ones
            return through_dynamo(*args)
        return hit(*tensors)
    return kernel


def _constant(x):
    """What a compiled kernel bakes in of an argument that is not a tensor: its value, or for an object (a
    rank's _Ctx, made anew every step) its plain attributes' values and which objects the others are."""
    plain = (type(None), bool, int, float, str, torch.dtype, torch.device)
    if isinstance(x, plain):
        return type(x), x
    state = getattr(x, "__dict__", None)
    if state is None:
        return type(x), id(x)
    return type(x), tuple((k, v if isinstance(v, plain) else id(v)) for k, v in state.items())


def _size(sizes, name):
    if sizes is None or name not in sizes:
        raise ValueError(f"dim {name} cannot be read off the inputs: pass sizes={{'{name}': ...}} to step()")
    return int(sizes[name])


def _norm(x, block=4096):
    """The L2 norm of all of x. torch.linalg.vector_norm of a whole CPU float32 tensor sums it in one pass with
    float32 accumulators: off by 2e-4 at 2^24 elements, 2e-3 at 2^25 (against a float64 norm). The norms of
    blocks, then the norm of those, stay within 1e-7 there, as fast; half dtypes accumulate in float32."""
    flat = x.reshape(-1)
    whole = flat.numel() - flat.numel() % block
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else None
    total = torch.linalg.vector_norm(flat[:whole].view(-1, block), dim=1, dtype=acc).square().sum()
    if whole < flat.numel():
        total = total + torch.linalg.vector_norm(flat[whole:], dtype=acc).square()
    return total.sqrt().to(x.dtype)


HELPERS = (_Ctx, _reduce_op, _allreduce, _allreduced, _matmul, _broadcast, _padded, _rows_of, _reduce_scatter, _part, _all_gather, _coalesced, _launches,
           _bucket_allreduce, _bucket_reduce_scatter, _bucket_all_gather, _Chunk, _reduce_scatter_chunks, _Gather,
           _flat_index, _words, philox_rounds, philox_words, philox_blocks, _dropout, _dropout_rows, _dropped, _int64, _kernel, _constant, _cache_dir, _size, _norm)
