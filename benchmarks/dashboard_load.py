"""Time to build a program's dashboard view (``GET /dashboard/api/programs/{hash}``) from a SQLite store of
``--rows`` measurements, read as digests (what the view does) against full measurement records (what it
did before: every row's samples, versions and schedule IR decoded), side by side in one run.

    python benchmarks/dashboard_load.py [--rows 10000 200000] [--repeats 3]

The store is the one ``benchmarks/api_latency.py`` fills (the examples' programs, 20 sizes, five worlds,
two backends). Writes benchmarks/results/dashboard_load.json: per size, the median of ``--repeats`` of
each way and their ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "dashboard_load.json"
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    from api_latency import populate

    from coconet.server import dashboard_data
    from coconet.server.store import Store

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[10_000, 200_000])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    class FullRecords:
        """The store, its digests served from full records: the view as it was built before."""

        def __init__(self, store: Store) -> None:
            self.store = store

        def measurement_digests(self, program_hash: str):
            return self.store.measurements(program_hash)

        def __getattr__(self, name: str):
            return getattr(self.store, name)

    points = []
    for rows in args.rows:
        with tempfile.TemporaryDirectory() as tmp:
            url = f"sqlite:///{tmp}/store.db"
            populate(url, rows)
            store = Store.open(url)
            program = max(dashboard_data.program_list(store), key=lambda p: p["results"])["hash"]
            measured = len(store.measurement_digests(program))
            times: dict[str, list[float]] = {"digests": [], "full_records": []}
            for _ in range(args.repeats):  # interleaved: load on the machine falls on both alike
                for way, source in (("digests", store), ("full_records", FullRecords(store))):
                    t0 = time.perf_counter()
                    view = dashboard_data.program_view(source, program)
                    times[way].append(time.perf_counter() - t0)
            assert view is not None
            median = {k: statistics.median(v) for k, v in times.items()}
            points.append({"rows": rows, "program_measurements": measured, "median_s": median, "samples_s": times,
                           "speedup": median["full_records"] / median["digests"]})
            print(f"{rows:>9,} rows ({measured:,} of the program): digests {median['digests']:.3f} s, "
                  f"full records {median['full_records']:.3f} s, {points[-1]['speedup']:.1f}x")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"store": "sqlite", "machine": platform.machine(), "python": platform.python_version(),
                               "points": points}, indent=2) + "\n")


if __name__ == "__main__":
    main()
