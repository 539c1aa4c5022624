"""Native code the shm backend runs, compiled once per machine with the system's C compiler into coconet's
cache and loaded with ctypes: the copy with non-temporal stores that large copies into shared segments use
(``stream_copier``), and a fused collective's chunk kernel given as C (``native``; its C is written by
``coconet.kernels.native``). Without a C compiler, torch's copy and Inductor's kernel serve instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile

import torch

from .cache import cache_dir

STREAM_C = r"""
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


def last_level_cache():
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


def stream_copier():
    """``STREAM_C`` compiled (once per machine and compiler) and loaded; None without a C compiler."""
    lib = native_library(STREAM_C, "stream_copy", ["-O2"], "its copy kernel")
    if lib is None:
        return None
    fn = lib.coconet_stream_copy
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t), None
    return fn


def native_library(source, name, flags, what):
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
    folder = os.path.join(cache_dir(), "kernels")
    path = os.path.join(folder, f"{name}_{digest}.so")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            with open(os.path.join(tmp, f"{name}.c"), "w") as f:
                f.write(source)
            built = subprocess.run(
                [cc, *flags, "-shared", "-fPIC", "-o", os.path.join(tmp, f"{name}.so"), os.path.join(tmp, f"{name}.c")],
                capture_output=True,
                text=True,
            )
            if built.returncode != 0:
                raise RuntimeError(f"shm backend: {cc} could not compile {what}:\n{built.stderr}")
            os.replace(os.path.join(tmp, f"{name}.so"), path)  # atomic: ranks compiling at once agree
    return ctypes.CDLL(path)


# IEEE operations as written: no fused multiply-adds, no reassociation (not -ffast-math)
CHUNK_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off")


def _chunk_function(source):
    """``source``'s coconet_chunk compiled (once per machine, compiler and CPU) and loaded with its C signature;
    None without a C compiler."""
    lib = native_library(source, "chunk", list(CHUNK_FLAGS), "a chunk kernel")
    if lib is None:
        return None
    fn = lib.coconet_chunk
    fn.argtypes = (ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
    fn.restype = None
    return fn


def _factor_width(kinds, args, rows, cols, n):
    """The width w of the rows (m, w) that a call's row factors (m the lengths in ``rows``) and column factors
    (w those in ``cols``) broadcast to, its tensors of ``n`` numbers each with w its last dim; None where they
    do not agree (or w would be 0)."""
    if len(rows) > 1 or len(cols) > 1 or n is None:
        return None
    m, width = next(iter(rows), None), next(iter(cols), None)
    if width is None:
        width = n // m if m else 0
    tensors = [t for kind, x in zip(kinds, args) if kind in "tuxlhpbky" for t in (x if kind in "lhpbky" else (x,))]
    if (
        not width
        or n % width
        or (m is not None and m * width != n)
        or any(t.dim() == 0 or t.shape[-1] != width for t in tensors)
    ):
        return None
    return width


def native(fn, kinds, source, sums=0):
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
    # each tensor's element type, by its kind
    dtypes = [torch.bfloat16 if kind in "hub" else torch.float16 if kind in "kxy" else torch.float32 for kind in kinds]

    def kernel(*args):
        if not lib:
            lib.append(_chunk_function(source))
        if lib[0] is None:
            return fn(*args)
        grad = torch.is_grad_enabled()
        ptrs, counts, scalars, n = [], [], [], None
        rows, cols = set(), set()  # the lengths of the row factors and of the column factors passed
        for kind, dtype, x in zip(kinds, dtypes, args):
            if kind == "d":
                continue
            if kind in "rc":
                if (
                    x.dtype != torch.float32
                    or x.device.type != "cpu"
                    or not x.is_contiguous()
                    or x.dim() != 2
                    or x.shape[1 if kind == "r" else 0] != 1
                    or (grad and x.requires_grad)
                ):
                    return fn(*args)
                (rows if kind == "r" else cols).add(x.numel())
                ptrs.append(x.data_ptr())
                continue
            if kind == "s":
                if isinstance(x, torch.Tensor) and (
                    x.numel() != 1
                    or x.dtype not in (torch.float32, torch.bool)
                    or x.device.type != "cpu"
                    or (grad and x.requires_grad)
                ):
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
            for t in xs:
                if (
                    t.dtype != dtype
                    or t.device.type != "cpu"
                    or not t.is_contiguous()
                    or (n is not None and t.numel() != n)
                    or (grad and t.requires_grad)
                ):
                    return fn(*args)
                n = t.numel()
                ptrs.append(t.data_ptr())
        if rows or cols:  # the rows (m, w) the factors broadcast to: C is told w
            width = _factor_width(kinds, args, rows, cols, n)
            if width is None:
                return fn(*args)
            counts.append(width)
        out = (ctypes.c_double * max(1, sums))()
        pointers, lengths = (ctypes.c_void_p * len(ptrs))(*ptrs), (ctypes.c_long * max(1, len(counts)))(*counts)
        lib[0](n, pointers, lengths, (ctypes.c_float * max(1, len(scalars)))(*scalars), out)
        return tuple(torch.tensor(x, dtype=torch.float32) for x in out[:sums]) if sums else None

    return kernel
