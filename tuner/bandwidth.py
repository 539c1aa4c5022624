"""The machine's memory bandwidth, as the floor takes it: the best rate of a few in-place streaming kernels.

One kernel does not show what the memory system can do. ``a += b`` (three streams, torch's kernel on all
threads) is the classic probe, but on a 2-core Xeon a kernel updating three states from one gradient in a
single pass (four reads, three writes, C) moved 1.2-1.4x its bytes a second, one process or several at
once, and so did the fused chunk kernels of the steps this floor stands under: against ``a += b`` alone,
a step could sit below its floor. So the probe runs both and takes the faster;
the C kernel where a C compiler exists (``a += b`` alone otherwise), and on CPU tensors only: on a GPU
``a += b`` reaches the device's bandwidth.
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple

from coconet.tuner.roofline import best_seconds

_STATES_C = """#include <string.h>
typedef float v8 __attribute__((vector_size(32)));
static inline v8 ld(const float *p) { v8 x; memcpy(&x, p, sizeof x); return x; }
static inline void st(float *p, v8 x) { memcpy(p, &x, sizeof x); }
/* x += g, y += g * g, z -= g over n floats (a multiple of 8), one pass: an optimizer step's access pattern */
void coconet_probe_states(float *x, float *y, float *z, const float *g, long n) {
    for (long i = 0; i < n; i += 8) {
        v8 gg = ld(g + i);
        st(x + i, ld(x + i) + gg);
        st(y + i, ld(y + i) + gg * gg);
        st(z + i, ld(z + i) - gg);
    }
}
"""


class Kernel(NamedTuple):
    name: str
    run: Callable[[], None]
    nbytes: int  # bytes one call moves: every stream read or written once
    buffers: tuple  # the tensors it reads and writes, in the order of its name
    pool: ThreadPoolExecutor | None = None  # the threads it runs on, which ``close`` ends


def kernels(nbytes: int, threads: int = 1, device: str = "cpu") -> list[Kernel]:
    """The probe's kernels, each over ``nbytes`` of buffers (a and b nbytes/2 each; x, y, z and g nbytes/4),
    their pages faulted in; the C kernel split over ``threads`` threads, whose pool ``close`` ends."""
    import torch

    a = torch.ones(max(1, nbytes // 8), dtype=torch.float32, device=device)
    b = torch.ones_like(a)
    out = [Kernel("a += b", lambda: a.add_(b), 3 * a.numel() * 4, (a, b))]
    if device != "cpu":
        return out
    fn = _states_kernel()
    if fn is None:
        return out
    n = max(8, nbytes // 16 // 8 * 8)
    x, y, z, g = (torch.zeros(n, dtype=torch.float32) for _ in range(4))
    threads = max(1, threads)
    cuts = [n * i // threads // 8 * 8 for i in range(threads)] + [n]
    parts = [
        (x.data_ptr() + 4 * lo, y.data_ptr() + 4 * lo, z.data_ptr() + 4 * lo, g.data_ptr() + 4 * lo, hi - lo)
        for lo, hi in zip(cuts, cuts[1:])
    ]
    # ctypes lets go of the GIL for the call: the threads run at once, each on its own rows
    pool = ThreadPoolExecutor(threads, thread_name_prefix="coconet-probe") if threads > 1 else None

    def states() -> None:
        if pool is None:
            fn(*parts[0])
            return
        for f in [pool.submit(fn, *p) for p in parts]:
            f.result()

    out.append(Kernel("x += g, y += g*g, z -= g", states, 7 * n * 4, (x, y, z, g), pool))
    for k in out:
        k.run()  # pages faulted in, code loaded
    return out


def _states_kernel():
    from coconet.kernels.copier import native_library

    lib = native_library(_STATES_C, "probe_states", ["-O3", "-march=native"], "the bandwidth probe's kernel")
    if lib is None:
        return None
    fn = lib.coconet_probe_states
    fn.argtypes, fn.restype = (ctypes.c_void_p,) * 4 + (ctypes.c_long,), None
    return fn


def memory_bandwidth(nbytes: int = 2**29, threads: int | None = None, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes per second through this machine's memory (all threads, or ``threads``) or the current CUDA
    device's: the best of ``repeats`` calls of each of the probe's kernels. The best, not the median: the
    floor must not sit above what the machine can do."""
    return max(memory_bandwidths(nbytes, threads, repeats, device).values())


def memory_bandwidths(
    nbytes: int = 2**29, threads: int | None = None, repeats: int = 5, device: str = "cpu"
) -> dict[str, float]:
    """``memory_bandwidth`` per kernel of the probe."""
    import torch

    old = torch.get_num_threads()
    if threads and device == "cpu":
        torch.set_num_threads(threads)
    try:
        probe = kernels(nbytes, torch.get_num_threads(), device)
        try:
            return {k.name: k.nbytes / best_seconds(k.run, repeats, device) for k in probe}
        finally:
            close(probe)
    finally:
        torch.set_num_threads(old)


def close(probe: list[Kernel]) -> None:
    for k in probe:
        if k.pool is not None:
            k.pool.shutdown()
