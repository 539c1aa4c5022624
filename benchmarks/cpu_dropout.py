"""The Megatron epilogue (bias + dropout + residual) as one CPU kernel: what its RNG costs.

    python benchmarks/cpu_dropout.py [--log2n 20 22 24] [--threads 1] [--out benchmarks/results/cpu_dropout.json]

Compared in one run on the same tensors, each compiled by Inductor except the first:
- torch eager: ``F.dropout(x + b, p) + r`` (the baseline's epilogue; torch's own RNG, not ours);
- a Philox call per element: the mask of ``coconet.schedules.rng``, each element running
  Philox4x32-10 for its block of four and keeping its own word (as CUDA kernels do);
- a Philox call per block of four: the same mask, one call per four elements (as the generated CPU
  kernels do where a row is whole blocks of four);
- no RNG: ``(x + b) * 0.9 + r``, the same bytes without the rounds (the kernel's memory floor).
The allocator keeps freed memory, as in the ranks. The median of ``--repeats`` calls after two warm-up calls;
the two coconet kernels must draw the same mask, or the run stops.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from coconet.kernels.dropout import dropout_words as _words
from coconet.kernels.dropout import dropped as _dropped
from coconet.kernels.dropout import flat_index as _flat_index
from coconet.kernels.philox import philox_words
from coconet.tuner.rank import allocator_policy, keep_freed_memory

ROOT = Path(__file__).resolve().parents[1]
P = 0.1


def timed(fn, repeats):
    fn()
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log2n", type=int, nargs="+", default=[20, 22, 24])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/cpu_dropout.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as the ranks do: kernels' outputs and temporaries reuse pages, not fault them in
    seed = torch.tensor(1234, dtype=torch.int64)

    def per_element(x, b, r, seed):
        shape = tuple(x.shape)
        return _dropped(x + b, P, philox_words(seed, _flat_index(shape, 0, 0, shape[0], x.device))) + r

    def per_block(x, b, r, seed):
        shape = tuple(x.shape)
        return _dropped(x + b, P, _words(seed, shape, 0, 0, shape[0], x.device)) + r

    def no_rng(x, b, r):
        return (x + b) * (1 - P) + r

    kernels = {
        name: torch.compile(fn, dynamic=False, fullgraph=True)
        for name, fn in (("per_element", per_element), ("per_block", per_block), ("no_rng", no_rng))
    }
    report = {
        "threads": args.threads,
        "allocator": allocator_policy(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "p": P,
        "hidden": args.hidden,
        "points": [],
    }
    for log2n in args.log2n:
        n = 2**log2n
        x = torch.randn(n // args.hidden, args.hidden)
        b, r = torch.randn(args.hidden), torch.randn_like(x)
        if not torch.equal(kernels["per_element"](x, b, r, seed), kernels["per_block"](x, b, r, seed)):
            raise SystemExit("the two Philox kernels drew different masks")
        s = {
            "torch_eager": timed(lambda: torch.nn.functional.dropout(x + b, P) + r, args.repeats),
            "per_element": timed(lambda: kernels["per_element"](x, b, r, seed), args.repeats),
            "per_block": timed(lambda: kernels["per_block"](x, b, r, seed), args.repeats),
            "no_rng": timed(lambda: kernels["no_rng"](x, b, r), args.repeats),
        }
        point = {
            "n": n,
            "seconds": s,
            "ns_per_element": {k: v / n * 1e9 for k, v in s.items()},
            "per_element_over_per_block": s["per_element"] / s["per_block"],
            "torch_eager_over_per_block": s["torch_eager"] / s["per_block"],
            "per_block_over_no_rng": s["per_block"] / s["no_rng"],
        }
        report["points"].append(point)
        print(json.dumps(point))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
