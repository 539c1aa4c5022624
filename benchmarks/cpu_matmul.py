"""Which GEMM should the generated code call on CPU? torch.matmul (MKL's sgemm in the CPU wheels) against
oneDNN's linear (`_matmul` of the generated modules), on the Megatron layer's shapes and on products with
one row or one column (row and column sums as products with ones).

    python benchmarks/cpu_matmul.py [--procs 1 2] [--pairs 5] [--out benchmarks/results/cpu_matmul.json]

Each shape is one rank's row-parallel GEMM: (B*S, 4H/R) x (4H/R, H), whole and as the overlap
transform's chunks (rows in 4, or the weight's columns in 4: a view of the whole weight, as the
overlap passes it; `_matmul` copies it first, which the timing includes). With --procs 2 the same GEMMs run in two
processes at once, one thread each, as two ranks do on this machine: a library's rate alone is not its
rate beside a peer. The two libraries alternate within every pair of timings (which goes first
alternates too), and the figure is the median over pairs of each library's best of 3 calls, in GFLOP/s;
the ratio is oneDNN's rate over MKL's, per pair, then its median. Both results are compared with a
float64 product first.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import time
from pathlib import Path

SHAPES = [  # (name, rows, contraction, cols, columns of the weight the cols are cut from)
    # (B*S, 4H/R, H) for B=4, S=512 and B=8, S=512
    ("H=1024 R=2", 2048, 2048, 1024, 1024),
    ("H=1024 R=4", 2048, 1024, 1024, 1024),
    ("H=512 R=2", 4096, 1024, 512, 512),
    ("H=512 R=4", 4096, 512, 512, 512),
    ("H=1024 R=2, rows/4", 512, 2048, 1024, 1024),
    ("H=1024 R=2, cols/4", 2048, 2048, 256, 1024),
    # a matrix's row and column sums as products with ones (Adafactor's factored moments), one rank's rows
    ("row sums 2048x4096", 2048, 4096, 1, 1),
    ("column sums 2048x4096", 1, 2048, 4096, 4096),
]


def _onednn(a, b):
    """oneDNN's linear as `_matmul` calls it where it takes it (a strided weight copied first)."""
    import torch

    if not (b.is_contiguous() or b.t().is_contiguous()):
        b = b.contiguous()
    return torch.ops.mkldnn._linear_pointwise(a, b.t(), None, "none", [], "")


def _best(fn, a, b, calls=3):
    fn(a, b)
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(a, b)
        best = min(best, time.perf_counter() - t0)
    return best


def _pairs(shape, pairs, start=None):
    import torch

    torch.set_num_threads(1)
    _, m, k, n, width = shape
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=gen), torch.randn(k, width, generator=gen)[:, :n]
    ref = a.double() @ b.double()
    scale = ref.abs().max().item()
    errs = {
        name: ((fn(a, b).double() - ref).abs().max().item() / scale)
        for name, fn in (("mkl", torch.matmul), ("onednn", _onednn))
    }
    if start is not None:
        start.wait()
    out = {"mkl": [], "onednn": []}
    for i in range(pairs):
        order = (("mkl", torch.matmul), ("onednn", _onednn))[:: 1 if i % 2 == 0 else -1]
        for name, fn in order:
            out[name].append(_best(fn, a, b))
    return {"seconds": out, "max_rel_err": errs}


def _worker(shape, pairs, start, queue):
    queue.put(_pairs(shape, pairs, start))


def measure(shape, pairs, procs):
    if procs == 1:
        runs = [_pairs(shape, pairs)]
    else:
        ctx = mp.get_context("spawn")
        start, queue = ctx.Barrier(procs), ctx.Queue()
        ps = [ctx.Process(target=_worker, args=(shape, pairs, start, queue)) for _ in range(procs)]
        for p in ps:
            p.start()
        runs = [queue.get() for _ in ps]
        for p in ps:
            p.join()
    name, m, k, n, _ = shape
    flops = 2 * m * k * n
    ratios = [a / b for r in runs for a, b in zip(r["seconds"]["mkl"], r["seconds"]["onednn"])]
    return {
        "shape": name,
        "m": m,
        "k": k,
        "n": n,
        "procs": procs,
        "mkl_GFLOPs": statistics.median(flops / s / 1e9 for r in runs for s in r["seconds"]["mkl"]),
        "onednn_GFLOPs": statistics.median(flops / s / 1e9 for r in runs for s in r["seconds"]["onednn"]),
        "onednn_over_mkl": statistics.median(ratios),
        "ratios": ratios,
        "max_rel_err": {lib: max(r["max_rel_err"][lib] for r in runs) for lib in ("mkl", "onednn")},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_matmul.json"))
    args = ap.parse_args()
    import torch

    from coconet.tuner.fingerprint import cpu_model

    rows = []
    for procs in args.procs:
        for shape in SHAPES:
            r = measure(shape, args.pairs, procs)
            rows.append(r)
            print(
                f"{r['shape']:<22} procs={procs}  MKL {r['mkl_GFLOPs']:6.1f}  oneDNN {r['onednn_GFLOPs']:6.1f} "
                f"GFLOP/s  oneDNN/MKL {r['onednn_over_mkl']:.3f} "
                f"(pairs {min(r['ratios']):.2f}-{max(r['ratios']):.2f})",
                flush=True,
            )
    doc = {
        "torch": torch.__version__,
        "machine": platform.machine(),
        "processor": cpu_model(),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "pairs": args.pairs,
        "results": rows,
        "command": "python benchmarks/cpu_matmul.py "
        + " ".join(["--procs", *map(str, args.procs), "--pairs", str(args.pairs)]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
