"""A fused kernel that writes a mask, and one that reads it, on CPU: Inductor's own bool tensors against
the generated code's kernels, which hand Inductor bools as bytes converted through floats.

    python benchmarks/cpu_masks.py [--log2n 24] [--threads 1] [--out benchmarks/results/cpu_masks.json]

The pair is the shape of a step whose comparison is made before a reduction and read after it (the mask of
an error-feedback compressor, `q = where(c >= 0, s, -s)` with `s` a mean of |c|): one kernel writes `c` and
`c >= 0`, the other reads the mask into a where. Each way in one run on the same tensors, against eager
torch; ranks run one thread each, the default here. The figure of merit is each kernel's median time.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import time
from pathlib import Path

import torch


def writes_mask(g, e, zero):
    c = g + e
    return c, c >= zero, torch.abs(c).sum()


def reads_mask(mask, c, s):
    return c - torch.where(mask, s, -s)


def timed(fn, repeats):
    fn()
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log2n", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_masks.json"))
    args = ap.parse_args()
    from coconet.kernels.compiled import kernel as _kernel

    # as the ranks do (coconet.tuner.rank): freed memory is kept, so no way pays page faults
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 30)
    libc.mallopt(-1, (1 << 31) - 1)
    torch.set_num_threads(args.threads)
    n = 2**args.log2n
    gen = torch.Generator().manual_seed(0)
    g, e = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    s = torch.tensor(0.5)
    ways = {
        "eager": (writes_mask, reads_mask),
        "inductor_bools": (torch.compile(writes_mask, dynamic=False), torch.compile(reads_mask, dynamic=False)),
        "coconet_kernel": (_kernel(writes_mask), _kernel(reads_mask)),
    }
    seconds, results = {}, {}
    for name, (write, read) in ways.items():
        c, mask, total = write(g, e, 0.0)
        results[name] = read(mask, c, s)
        seconds[name] = {
            "writes_mask": timed(lambda: write(g, e, 0.0), args.repeats),
            "reads_mask": timed(lambda: read(mask, c, s), args.repeats),
        }
    same = all(torch.equal(results["eager"], r) for r in results.values())
    out = {
        "n": n,
        "threads": args.threads,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "same_result": same,
        "seconds": seconds,
        "ratio_to_eager": {k: {op: t / seconds["eager"][op] for op, t in v.items()} for k, v in seconds.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
