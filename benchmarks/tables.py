"""The result tables of the docs, rendered from ``benchmarks/results/*.json``, never copied by hand.

    python benchmarks/tables.py            # rewrite every table block in docs/*.md from its JSON
    python benchmarks/tables.py --check    # exit 1 naming each block that no longer matches its JSON

A block in a page is the lines between ``<!-- table: KIND FILE ... -->`` and ``<!-- /table -->``; KIND says how
one result file becomes rows:

- ``bench``: ``coconet bench`` (``benchmarks/results/bench_*.json``): per size, the torch baseline, the fastest
  correct schedule and their ratio, and the best over the memory/compute floor; a range where the run had
  several rounds (each round's median).
- ``training``: ``benchmarks/training_loop.py``: the step of DDP + ``Adam(fused=True)`` against coconet's, per
  round, and how far the losses drifted apart.
- ``time``: where a ``coconet bench`` step's time goes: the program as written, the fastest schedule that uses
  each transformation, the fastest of all, and the floor the matmuls (or convolutions) alone need at the
  matmul rate measured in the same run, with its share of the fastest step; the rest of that step is
  communication, pointwise work and the framework's overheads.
- ``cost_model``: ``benchmarks/cost_model.py``: Kendall τ between predicted and measured times per program and
  backend, and between the rounds themselves (how much the measurement alone reorders).

tests/test_docs.py runs ``--check``, so a page and its results cannot disagree.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
BLOCK = re.compile(r"(<!-- table: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def _range(values: Iterable[float], fmt: Callable[[float], str], unit: str = "") -> str:
    vals = sorted(values)
    lo, hi = fmt(vals[0]), fmt(vals[-1])
    return (lo if lo == hi else f"{lo}–{hi}") + unit


def _ms(values: Iterable[float]) -> str:
    return _range((s * 1e3 for s in values), lambda x: f"{x:.3g}", " ms")


def _ratio(values: Iterable[float]) -> str:
    return _range(values, lambda x: f"{x:.2f}", "x")


def _sizes(sizes: dict[str, int]) -> str:
    def one(v: int) -> str:
        return f"2^{v.bit_length() - 1}" if v >= 1024 and v & (v - 1) == 0 else str(v)

    return ", ".join(f"{k}={one(v)}" for k, v in sizes.items())


def _medians(entry: dict[str, Any]) -> list[float]:
    return entry.get("round_medians_s") or [entry["median_s"]]


def _link(name: str, suffix: str) -> str:
    """A link from a page in docs/ to a result file, where it exists."""
    path = RESULTS / (Path(name).stem + suffix)
    return f"[{suffix.lstrip('.')}](../benchmarks/results/{path.name})" if path.exists() else ""


def bench_rows(name: str, data: dict[str, Any]) -> list[list[str]]:
    rows = []
    for p in data["points"]:
        best, torch = p.get("best"), p.get("torch")
        if not best or not torch or torch.get("status") != "ok":
            continue
        speedups = p.get("best_speedup_rounds") or [p["best_speedup"]]
        floor = p.get("best_over_floor_rounds") or ([p["best_over_floor"]] if p.get("best_over_floor") else [])
        where = " ".join(x for x in (_link(name, ".json"), _link(name, ".png")) if x)
        rows.append(
            [
                f"{data['workload']}, {_sizes(p['sizes'])} ({where})",
                str(data["world"]),
                ", ".join(data["backends"]),
                str(p.get("rounds_done", data.get("rounds", 1))),
                _ms(_medians(torch)),
                f"{_ms(_medians(best))}, `{best['schedule']}`",
                _ratio(speedups),
                _ratio(floor) if floor else "",
            ]
        )
    return rows


BENCH_HEAD = ["workload", "world", "backends", "rounds", "torch baseline", "best schedule", "speed-up", "best / floor"]


def training_rows(name: str, data: dict[str, Any]) -> list[list[str]]:
    rounds = data["rounds"]
    where = " ".join(x for x in (_link(name, ".json"), _link(name, ".png")) if x)
    return [
        [
            f"{data['parameters'] / 1e6:.0f}M parameters, batch {data['batch']} ({where})",
            str(data["world"]),
            str(len(rounds)),
            _ms(r["ddp_step_s"] for r in rounds),
            _ms(r["coconet_step_s"] for r in rounds),
            _ratio(r["speedup"] for r in rounds),
            f"{data['loss_rel_gap']['coconet']:.1e}",
        ]
    ]


TRAINING_HEAD = ["model", "world", "rounds", "DDP + Adam(fused)", "coconet", "speed-up", "loss gap"]


def cost_model_rows(name: str, data: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in data["results"]:
        between = r.get("kendall_tau_between_rounds") or []
        rows.append(
            [
                f"{r['program']} ({_sizes(r['sizes'])})",
                r["backend"],
                str(r["schedules"]),
                f"{r['kendall_tau']:.2f}",
                _range(between, lambda x: f"{x:.2f}") if between else "",
            ]
        )
    return rows


FAMILIES = (("fuse", "fuse("), ("overlap", "overlap("), ("fuse_collective", "fuse_collective("))


def time_rows(name: str, data: dict[str, Any]) -> list[list[str]]:
    rows = []
    for p in data["points"]:
        ok = [r for r in p["results"] if r["status"] == "ok" and r.get("median_s")]
        if not ok or not p.get("best"):
            continue

        def fastest(rs: list[dict[str, Any]]) -> str:
            return _ms([min(r["median_s"] for r in rs)]) if rs else "—"

        torch = p.get("torch") or {}
        families = [fastest([r for r in ok if mark in r["schedule"]]) for _, mark in FAMILIES]
        best = min(r["median_s"] for r in ok)
        compute = p.get("compute_floor_s") or 0.0
        rows.append(
            [
                f"{data['workload']}, {_sizes(p['sizes'])}",
                str(data["world"]),
                _ms([torch["median_s"]]) if torch.get("status") == "ok" else "—",
                fastest([r for r in ok if r["schedule"] == "baseline"]),
                *families,
                _ms([best]),
                _ms([compute]) if compute else "—",
                f"{100 * compute / best:.0f}%" if compute else "—",
            ]
        )
    return rows


TIME_HEAD = [
    "workload",
    "world",
    "torch",
    "as written",
    *(f for f, _ in FAMILIES),
    "best",
    "matmul/conv floor",
    "floor share",
]
COST_HEAD = ["program", "backend", "schedules", "τ predicted vs measured", "τ between rounds"]
KINDS: dict[str, tuple[list[str], Callable[[str, dict[str, Any]], list[list[str]]]]] = {
    "bench": (BENCH_HEAD, bench_rows),
    "training": (TRAINING_HEAD, training_rows),
    "time": (TIME_HEAD, time_rows),
    "cost_model": (COST_HEAD, cost_model_rows),
}


def render(spec: str) -> str:
    """The markdown table of a block's spec, ``KIND FILE ...``."""
    kind, *files = spec.split()
    if kind not in KINDS or not files:
        raise ValueError(f"table spec {spec!r}: want KIND FILE ... with KIND one of {', '.join(KINDS)}")
    head, rows_of = KINDS[kind]
    rows = [row for f in files for row in rows_of(f, json.loads((RESULTS / f).read_text()))]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def rewrite(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(m.group("spec")) + m.group(4), text)


def stale(pages: Sequence[Path]) -> list[str]:
    """The pages whose table blocks differ from what their JSON renders."""
    return [p.name for p in pages if rewrite(p.read_text()) != p.read_text()]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only say which pages are stale (exit 1 if any)")
    args = ap.parse_args(argv)
    pages = sorted(DOCS.glob("*.md"))
    if args.check:
        bad = stale(pages)
        for name in bad:
            print(
                f"docs/{name}: a result table differs from its JSON; run python benchmarks/tables.py", file=sys.stderr
            )
        return 1 if bad else 0
    for p in pages:
        text = p.read_text()
        new = rewrite(text)
        if new != text:
            p.write_text(new)
            print(f"docs/{p.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
