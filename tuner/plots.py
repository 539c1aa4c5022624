"""Figures of a benchmark report (``coconet bench``): PNG through matplotlib (the ``bench`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coconet.errors import NotAvailable


def bench_plot(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise NotAvailable("--plot needs matplotlib: pip install 'coconet[bench]'") from None
    points = report["points"]
    labels = [",".join(f"{k}={v}" for k, v in p["sizes"].items()) for p in points]
    x = range(len(points))
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(12, 4.5))
    series = {
        "torch baseline": [p["torch"]["median_s"] if p["torch"] else None for p in points],
        f"program as written ({report['backends'][0]})": [p["results"][0]["median_s"] for p in points],
        **{
            f"best schedule, {b}": [p[f"best_{b}"]["median_s"] if p.get(f"best_{b}") else None for p in points]
            for b in report["backends"]
        },
        ("floor (memory or matmul)" if any(p.get("compute_floor_s") for p in points) else "memory-bandwidth floor"): [
            p["floor_s"] for p in points
        ],
    }
    styles = ["o-", "s--"] + ["^-", "v-", "D-"][: len(report["backends"])] + ["kx:"]
    for (name, ys), style in zip(series.items(), styles):
        pts = [(i, y) for i, y in zip(x, ys) if y]
        if pts:
            ax_t.plot([i for i, _ in pts], [y for _, y in pts], style, label=name)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("step time (s), median")
    where = f" ({report['floor_device']})" if report.get("floor_device") else ""
    ax_t.set_title(
        f"{report['workload']}: world {report['world']}, {'+'.join(report['backends'])}, "
        f"{report['kernels']} kernels{where}",
        fontsize=10,
    )
    for name, key, style in (
        ("best / torch baseline (speed-up)", "best_speedup", "^-"),
        ("best / floor (distance)", "best_over_floor", "kx:"),
    ):
        pts = [(i, p[key]) for i, p in zip(x, points) if p[key]]
        if pts:
            ax_s.plot([i for i, _ in pts], [y for _, y in pts], style, label=name)
    ax_s.axhline(1.0, color="grey", linewidth=0.8)
    ax_s.set_yscale("log")
    ax_s.set_ylabel("ratio (log)")
    for ax in (ax_t, ax_s):
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=20, fontsize=8)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
