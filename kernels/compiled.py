"""The compiled-kernel wrapper: a generated step's fused pointwise functions compiled by Inductor
(``kernel``), and what a compiled kernel is keyed by besides its tensors (``constant``).
"""

from __future__ import annotations

import torch


def kernel(fn):
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
    # here, not at the module's import: an eager step imports this module too, and never needs it
    from torch._functorch import config

    dynamo = []  # torch.compile's wrapper of fn, made on the first call that needs it
    built = {}  # signature of the inputs -> Inductor's kernel for them (None: through torch.compile)

    def through_dynamo(*args):
        if not dynamo:
            dynamo.append(torch.compile(fn, dynamic=False, fullgraph=True))
        return _no_autograd_cache(config, dynamo[0], *args)

    def dispatch(*args):
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
        key = (
            tuple(layout),
            grad,
            tuple(
                (x.shape, x.stride(), x.dtype, x.device, x.requires_grad)
                if isinstance(x, torch.Tensor)
                else constant(x)
                for x in leaves
            ),
        )
        hit = built.get(key, False)
        separate = len({x.untyped_storage().data_ptr() for x in tensors}) == len(tensors)
        if hit is False:
            plain = (
                separate
                and all(x.device.type == "cpu" for x in tensors)
                and not (grad and any(x.requires_grad for x in tensors))
            )
            hit = built[key] = (
                _no_autograd_cache(config, _standalone, fn, leaves, tuple(layout), tensors) if plain else None
            )
        if hit is None or not separate:  # inputs that share memory: the kernel was traced for separate ones
            return through_dynamo(*args)
        return hit(*tensors)

    return dispatch


def _no_autograd_cache(config, call, *args):
    """``call(*args)`` with AOTAutograd's cache off (``config`` is torch._functorch's)."""
    # set around every call, as any call may compile; the caller's setting comes back after.
    # (config.patch would do, at twice a small kernel's cost per call)
    was = config.enable_autograd_cache
    config.enable_autograd_cache = False
    try:
        return call(*args)
    finally:
        config.enable_autograd_cache = was


def _standalone(fn, leaves, layout, tensors):
    """Inductor's kernel for ``fn`` traced on these inputs, or None where it will not trace (``kernel``)."""
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
            args.append(full[k] if kind is None else kind(full[k : k + n]))
            k += 1 if kind is None else n
        out = fn(*args)
        written.update(j for j in bools_in if derived[j]._version)
        returns.append(out is None or isinstance(out, torch.Tensor))
        outs = () if out is None else (out,) if isinstance(out, torch.Tensor) else tuple(out)
        bools_out.extend(i for i, o in enumerate(outs) if o.dtype == torch.bool)
        return tuple(torch.where(o, 1.0, 0.0).to(torch.uint8) if i in bools_out else o for i, o in enumerate(outs))

    def as_bytes(xs):
        return [x.view(torch.uint8) if j in bools_in else x for j, x in enumerate(xs)]

    try:
        graph = make_fx(flat, tracing_mode="fake")(*as_bytes(tensors))  # fake: tracing must not run the writes
        if written:  # traced again with those handed over as they are
            bools_in -= written
            bools_out.clear()
            graph = make_fx(flat, tracing_mode="fake")(*as_bytes(tensors))
        compiled = torch._inductor.standalone_compile(graph, as_bytes(tensors), dynamic_shapes="from_example_inputs")
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


def constant(x):
    """What a compiled kernel bakes in of an argument that is not a tensor: its value, or for an object (a
    rank's Ctx, made anew every step) its plain attributes' values and which objects the others are."""
    plain = (type(None), bool, int, float, str, torch.dtype, torch.device)
    if isinstance(x, plain):
        return type(x), x
    state = getattr(x, "__dict__", None)
    if state is None:
        return type(x), id(x)
    return type(x), tuple((k, v if isinstance(v, plain) else id(v)) for k, v in state.items())
