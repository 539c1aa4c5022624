"""Where one rank's time goes in the eager attention step of ``coconet bench attention_out``: each op of the
hand-written baseline (Megatron-LM's eager attention) on one rank's heads, one thread, beside the
``torch.tensordot`` the generated code calls for the projection.

    python benchmarks/attention_parts.py [--heads 8 4] [--out benchmarks/results/attention_parts.json]

Sizes are the bench's (S=512, D=64, H=1024; 16 heads, so 8 a rank at world 2 and 4 at world 4). Each figure
is the median of 9 timed calls after one untimed, in ms. The two forms of the projection are compared with
each other first.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path


def _ms(fn, calls: int = 9) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def parts(heads: int, s: int = 512, d: int = 64, h: int = 1024) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.randn(heads, s, d) for _ in range(3))
    w = torch.randn(heads, d, h)
    scores = torch.matmul(q, k.transpose(1, 2))
    probs = torch.softmax(scores, -1)
    ctx = torch.matmul(probs, v)
    y = torch.randn(s, h)

    def gemm():
        return torch.matmul(ctx.permute(1, 0, 2).reshape(s, heads * d), w.reshape(heads * d, h))

    def tensordot():
        return torch.tensordot(ctx, w, dims=([0, 2], [0, 1]))

    torch.testing.assert_close(gemm(), tensordot(), rtol=1e-4, atol=1e-3)
    return {
        "q @ k^T": _ms(lambda: torch.matmul(q, k.transpose(1, 2))),
        "* scale": _ms(lambda: scores * 0.125),
        "softmax": _ms(lambda: torch.softmax(scores, -1)),
        "F.dropout(probs)": _ms(lambda: F.dropout(probs, 0.1, True)),
        "probs @ v": _ms(lambda: torch.matmul(probs, v)),
        "projection: permute + matmul": _ms(gemm),
        "projection: tensordot": _ms(tensordot),
        "F.dropout(y + b)": _ms(lambda: F.dropout(y, 0.1, True)),
    }


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, nargs="+", default=[8, 4])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/attention_parts.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    report = {
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": 1,
        "sizes": {"S": 512, "D": 64, "H": 1024},
        "ms": {str(n): parts(n) for n in args.heads},
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for n, row in report["ms"].items():
        print(f"{n} heads: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))


if __name__ == "__main__":
    main()
