"""Which compiler should fuse pointwise kernels on CPU? An in-place Adam update, three ways.

    python benchmarks/cpu_kernels.py [--log2n 24] [--threads 2] [--out benchmarks/results/cpu_kernels.json]

Compared in one run on the same tensors: torch eager (separate kernels, as the
generated code runs without a compiler), torch.optim.Adam(fused=True) (the
baseline's kernel), torch.compile (Inductor) of the update written in place,
and a numba parallel loop. The figure of merit is the time of one update once
compiled, and the first-call compile time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path


def adam_eager(g, w, m, v, lr, b1, b2, eps, t):
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    mh = m / (1 - b1**t)
    vh = v / (1 - b2**t)
    w.sub_(lr * mh / (vh.sqrt() + eps))


def adam_inplace(g, w, m, v, lr, b1, b2, eps, t):
    m1 = b1 * m + (1 - b1) * g
    v1 = b2 * v + (1 - b2) * g * g
    w1 = w - lr * (m1 / (1 - b1**t)) / ((v1 / (1 - b2**t)).sqrt() + eps)
    m.copy_(m1)
    v.copy_(v1)
    w.copy_(w1)


def numba_kernel():
    import math

    import numba

    @numba.njit(parallel=True, fastmath=False, cache=False)
    def adam(g, w, m, v, lr, b1, b2, eps, c1, c2):
        for i in numba.prange(g.shape[0]):
            gi = g[i]
            mi = b1 * m[i] + (1 - b1) * gi
            vi = b2 * v[i] + (1 - b2) * gi * gi
            m[i] = mi
            v[i] = vi
            w[i] = w[i] - lr * (mi / c1) / (math.sqrt(vi / c2) + eps)

    return adam


def timed(fn, repeats):
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), samples


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log2n", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_kernels.json"))
    args = ap.parse_args()
    os.environ.setdefault("NUMBA_NUM_THREADS", str(args.threads))
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    n = 2**args.log2n
    gen = torch.Generator().manual_seed(0)
    g, w = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = torch.randn(n, generator=gen), torch.rand(n, generator=gen)
    hp = dict(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, t=3)
    results = {}

    results["torch_eager"] = timed(lambda: adam_eager(g, w, m, v, **hp), args.repeats)[0]

    wp = torch.nn.Parameter(w.clone())
    opt = torch.optim.Adam([wp], lr=hp["lr"], betas=(hp["b1"], hp["b2"]), eps=hp["eps"], fused=True)
    wp.grad = g.clone()
    opt.step()
    results["torch_adam_fused"] = timed(opt.step, args.repeats)[0]

    compiled = torch.compile(adam_inplace, dynamic=False)
    t0 = time.perf_counter()
    compiled(g, w, m, v, **hp)
    results["torch_compile_first_call_s"] = time.perf_counter() - t0
    results["torch_compile"] = timed(lambda: compiled(g, w, m, v, **hp), args.repeats)[0]

    try:
        kern = numba_kernel()
        gn, wn, mn, vn = (x.numpy() for x in (g, w, m, v))
        c1, c2 = np.float32(1 - hp["b1"] ** hp["t"]), np.float32(1 - hp["b2"] ** hp["t"])
        scal = [np.float32(hp[k]) for k in ("lr", "b1", "b2", "eps")]
        t0 = time.perf_counter()
        kern(gn, wn, mn, vn, *scal, c1, c2)
        results["numba_first_call_s"] = time.perf_counter() - t0
        results["numba"] = timed(lambda: kern(gn, wn, mn, vn, *scal, c1, c2), args.repeats)[0]
    except ImportError:
        results["numba"] = None

    # the floor: 7 float32 streams (read g, w, m, v; write w, m, v) at this machine's copy bandwidth
    a, b = torch.empty(n * 4), torch.empty(n * 4)
    copy_s = timed(lambda: b.copy_(a), args.repeats)[0]
    bandwidth = 2 * a.numel() * 4 / copy_s
    results["copy_bandwidth_GBps"] = bandwidth / 1e9
    results["limit"] = 7 * n * 4 / bandwidth
    out = {
        "n": n,
        "threads": args.threads,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "seconds": results,
        "ratio_to_limit": {
            k: results[k] / results["limit"]
            for k in ("torch_eager", "torch_adam_fused", "torch_compile", "numba")
            if results.get(k)
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
