"""What the dashboard's data costs the server for a program of ``--keys`` tuned keys in a SQLite store, against
reading every winner of the program (``Store.results``, what the page read and sent before it was paged and
filtered), in interleaved rounds.

    python benchmarks/dashboard_load.py [--keys 1000 10000] [--repeats 5]

Each key is adam's, with a baseline and a winner (SYNTHETIC timings: this measures reads, not schedules), over 4
topologies, 5 worlds, 2 backends and sizes N. Timed, each on its own: the first page of the winners table read
afresh (``winners_page`` over ``current_winners``), the next page (the cache's), the plots of every key and of one
topology, and ``Store.results``. Bytes: the first page's JSON against every winner's row as JSON. Writes
benchmarks/results/dashboard_load.json and, with coconet[bench] and a Chromium, dashboard_load.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from coconet.errors import CoconetError
from coconet.tuner.plots import COLOURS, can_write, figure, write_figure

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "dashboard_load.json"
TOPOLOGIES = {"local": "measured", "cluster": "measured", "dgx2": "model", "a100x8": "model"}
WORLDS, BACKENDS = (2, 4, 8, 16, 32), ("gloo", "nccl")


def populate(url: str, keys: int) -> str:
    """A store of ``keys`` keys of adam, each a baseline and a winner; the program's hash."""
    from coconet.loader import load_file
    from coconet.schedules.space import generate
    from coconet.server.records import NewMeasurement
    from coconet.server.store import Store

    program = load_file(ROOT / "examples" / "adam.py")
    schedules = [
        NewMeasurement.of(s, sizes={"N": 1}, topology="-", world=1, backend="gloo") for s in list(generate(program))[:3]
    ]
    sizes = max(1, keys // (len(TOPOLOGIES) * len(WORLDS) * len(BACKENDS)))
    rows = []
    for topology, source in TOPOLOGIES.items():
        for world in WORLDS:
            for backend in BACKENDS:
                for i in range(sizes):
                    n = 1024 * (i + 1)
                    base = 1e-5 * (i + 1) * (1 + world / 8)
                    for s, f in ((schedules[0], 1.0), (schedules[1 + i % 2], 0.6)):
                        rows.append(
                            dataclasses.replace(
                                s,
                                schedule_json=None,
                                sizes={"N": n},
                                topology=topology,
                                world=world,
                                backend=backend,
                                median_s=base * f,
                                n=5,
                                ci_lo_s=base * f * 0.97,
                                ci_hi_s=base * f * 1.03,
                                source=source,
                            )
                        )
    with Store.open(url) as store:
        h = store.add_program(program)
        ids = store.add_measurements(rows)
        store.add_winners([(ids[j + 1], None, ids[j]) for j in range(0, len(ids), 2)])
    return h


def main() -> None:
    from coconet.server import dashboard_data as data
    from coconet.server import dashboard_plots as plots
    from coconet.server.store import Store

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, nargs="+", default=[1000, 10_000])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    points = []
    for keys in args.keys:
        with tempfile.TemporaryDirectory() as tmp:
            url = f"sqlite:///{tmp}/store.db"
            h = populate(url, keys)
            store = Store.open(url)
            every, local = data.Filters(), data.Filters(topology="local")
            warm = data.WinnersCache()
            warm.get(store, h, every)
            ways: dict[str, Callable[[], Any]] = {
                "every_winner": lambda: store.results(h),
                "first_page": lambda: data.winners_page(data.WinnersCache().get(store, h, every), 25, 0),
                "next_page": lambda: data.winners_page(warm.get(store, h, every), 25, 25),
                "plots_all": lambda: plots.plots(
                    plots.timing_points(store, h, every), data.WinnersCache().get(store, h, every)
                ),
                "plots_one_topology": lambda: plots.plots(
                    plots.timing_points(store, h, local), data.WinnersCache().get(store, h, local)
                ),
            }
            times: dict[str, list[float]] = {k: [] for k in ways}
            for _ in range(args.repeats):  # interleaved: load on the machine falls on every way alike
                for way, read in ways.items():
                    t0 = time.perf_counter()
                    read()
                    times[way].append(time.perf_counter() - t0)
            page = json.dumps(ways["first_page"]())
            everything = json.dumps([data.winner_row(c) for c in data.current_winners(store, h, every)])
            store.close()
        median = {k: statistics.median(v) for k, v in times.items()}
        points.append(
            {
                "keys": keys,
                "median_s": median,
                "samples_s": times,
                "first_page_vs_every_winner": median["every_winner"] / median["first_page"],
                "bytes": {"first_page": len(page), "every_winner": len(everything)},
            }
        )
        print(
            f"{keys:>7,} keys: "
            + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in median.items())
            + f"; first page {len(page):,} B against {len(everything):,} B for every winner"
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps(
            {
                "store": "sqlite",
                "machine": platform.machine(),
                "python": platform.python_version(),
                "repeats": args.repeats,
                "points": points,
            },
            indent=2,
        )
        + "\n"
    )
    _plot(points)


def _plot(points: list[dict[str, Any]]) -> None:
    path = OUT.with_suffix(".png")
    try:
        can_write(path)
    except CoconetError as e:  # the figure is optional here: the JSON is the result
        print(f"no figure: {e}")
        return
    import plotly.graph_objects as go  # plotly: only when plotting

    fig = figure()
    for i, way in enumerate(points[0]["median_s"]):
        fig.add_trace(
            go.Scatter(
                x=[p["keys"] for p in points],
                y=[p["median_s"][way] * 1e3 for p in points],
                mode="lines+markers",
                name=way,
                line={"color": COLOURS[i % len(COLOURS)]},
            )
        )
    fig.update_layout(
        title="dashboard data: the server's time per request",
        xaxis={"type": "log", "title": "tuned keys of the program"},
        yaxis={"type": "log", "title": "median time (ms)"},
    )
    write_figure(fig, path, width=700, height=400)


if __name__ == "__main__":
    main()
