"""Requests per second of ``GET /api/v1/best`` answered by ``server.app.FastBest`` (the middleware that answers a
plain lookup on the event loop) against the same app without it (FastAPI's route: parameter validation,
dependencies, the hop to a worker thread, the response model), in interleaved rounds, in process.

    python benchmarks/best_fast_path.py [--rounds 5] [--requests 500]

The app is ``create_app`` on a SQLite store of 10,000 measurements of 1,000 tuned keys (``api_latency.populate``);
each request is an ASGI call made directly (no socket, no HTTP client), so what is timed is the server's own work
per request. 90% of the requests ask for a tuned key, 10% for untuned sizes (the nearest tuned ones answer).
Writes benchmarks/results/best_fast_path.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "best_fast_path.json"
sys.path.insert(0, str(ROOT / "benchmarks"))


async def _call(app: Any, query: bytes) -> int:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/api/v1/best",
        "raw_path": b"/api/v1/best",
        "root_path": "",
        "query_string": query,
        "headers": [(b"host", b"127.0.0.1")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    status = 0

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


async def _round(app: Any, queries: list[bytes]) -> float:
    t0 = time.perf_counter()
    for q in queries:
        status = await _call(app, q)
        if status != 200:
            raise SystemExit(f"GET /api/v1/best?{q.decode()} answered {status}")
    return len(queries) / (time.perf_counter() - t0)


def main() -> None:
    from api_latency import SIZES, populate

    from coconet.server.app import create_app
    from coconet.server.fastbest import FastBest

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=500)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/store.db"
        triples = populate(url, 10_000)  # 1,000 keys of 10 measurements
        rng = random.Random(0)
        queries = []
        for _ in range(args.requests):
            program, topology, world = rng.choice(triples)
            n = rng.choice(SIZES) if rng.random() < 0.9 else 3 * 2**20
            queries.append(
                urlencode({"program": program, "sizes": f"N={n}", "topology": topology, "world": world}).encode()
            )
        fast = create_app(url, token="t", workers=0, start_workers=False)
        plain = create_app(url, token="t", workers=0, start_workers=False)
        # the same app less the one middleware: every request goes to the route
        plain.user_middleware = [m for m in plain.user_middleware if m.cls is not FastBest]
        rates: dict[str, list[float]] = {"fast_path": [], "route": []}

        async def run() -> None:
            for app in (fast, plain):  # warm up: the middleware stack is built on the first call
                await _round(app, queries[:50])
            for _ in range(args.rounds):  # interleaved: load on the machine falls on both alike
                rates["fast_path"].append(await _round(fast, queries))
                rates["route"].append(await _round(plain, queries))

        asyncio.run(run())
        for app in (fast, plain):
            app.state.store.close()
    median = {k: statistics.median(v) for k, v in rates.items()}
    ratio = median["fast_path"] / median["route"]
    print(
        f"GET /api/v1/best: fast path {median['fast_path']:.0f} req/s, route {median['route']:.0f} req/s, "
        f"{ratio:.2f}x (median of {args.rounds} rounds of {args.requests})"
    )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps(
            {
                "store": "sqlite",
                "keys": 1000,
                "machine": platform.machine(),
                "python": platform.python_version(),
                "requests_per_round": args.requests,
                "req_per_s": rates,
                "median_req_per_s": median,
                "ratio": ratio,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
