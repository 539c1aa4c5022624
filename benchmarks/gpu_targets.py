"""The issue's GPU targets judged from what benchmarks/gpu_checks.sh wrote: one line each, met / not met /
no figure, and OUTDIR/targets.json. Run last by gpu_checks.sh.

    python benchmarks/gpu_targets.py OUTDIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# (name, file, how to read the figure from it, the least that meets the target)
SPEEDUP = "whole step, best schedule over all_reduce + Adam(fused=True), world 1"


def _load(outdir: Path, name: str):
    try:
        return json.loads((outdir / name).read_text())
    except (OSError, ValueError):
        return None


def _bench_speedup(d, key: str, value: int):
    for p in (d or {}).get("points", []):
        if p.get("sizes", {}).get(key) == value:
            return p.get("best_speedup")
    return None


def _kernel_fraction(d, n: int):
    for r in (d or {}).get("adam", []):
        if r.get("n") == n:
            return r["coconet"].get("kernels_fraction_of_peak")
    return None


def judge(outdir: Path) -> list[dict]:
    adam, meg, kern = (
        _load(outdir, n) for n in ("bench_adam_nccl_w1.json", "bench_megatron_nccl_w1.json", "gpu_kernels.json")
    )
    rows = [
        {"target": f"Adam N=2^24: {SPEEDUP}", "want": 1.5, "got": _bench_speedup(adam, "N", 2**24)},
        {"target": f"Adam N=2^20: {SPEEDUP}", "want": 1.0, "got": _bench_speedup(adam, "N", 2**20)},
        {
            "target": "Megatron B=8,S=1024,H=3072: "
            + SPEEDUP.replace("all_reduce + Adam(fused=True)", "eager PyTorch"),
            "want": 1.0,
            "got": _bench_speedup(meg, "H", 3072),
        },
        {
            "target": "Megatron fused epilogue (bias+dropout+residual): fraction of HBM peak, kernel alone",
            "want": 0.8,
            "got": ((kern or {}).get("epilogue") or {}).get("coconet_compiled", {}).get("kernels_fraction_of_peak"),
        },
    ]
    for k in range(22, 27):
        rows.append(
            {
                "target": f"fused Adam kernel N=2^{k}: fraction of HBM peak, kernel alone",
                "want": 0.8,
                "got": _kernel_fraction(kern, 2**k),
            }
        )
    for r in rows:
        r["met"] = None if r["got"] is None else bool(r["got"] >= r["want"])
    return rows


def main(outdir: Path) -> list[dict]:
    rows = judge(outdir)
    (outdir / "targets.json").write_text(json.dumps({"source": "measured", "targets": rows}, indent=1) + "\n")
    print("--- targets")
    for r in rows:
        verdict = {None: "NO FIGURE", True: "met", False: "NOT MET"}[r["met"]]
        got = "-" if r["got"] is None else f"{r['got']:.2f}"
        print(f"{verdict:9} {got:>6} (want >= {r['want']}) {r['target']}")
    return rows


if __name__ == "__main__":
    main(Path(sys.argv[1]))
