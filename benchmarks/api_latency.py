"""Latency of ``GET /api/v1/best`` under a fixed request rate, on SQLite and PostgreSQL, with stores of
about 1,000 and 1,000,000 measurement rows.

The server is ``coconet serve`` (uvicorn, one process, no tuning workers) in a subprocess on a free port;
the load is open-loop: request i is due at t0 + i/rate and its latency counts from then, so a server that
falls behind is charged for the queue it builds (no coordinated omission). 90% of the requests hit a tuned
key exactly, 10% ask for untuned sizes and get the nearest tuned ones. Before the load, 300 requests one at a
time give the server's own latency (serial_p50_ms, serial_p99_ms), apart from any queue.

    nice -n 19 python benchmarks/api_latency.py [--rate 300] [--seconds 10] [--rows 1000 1000000]

Writes benchmarks/results/api_latency.json. PostgreSQL runs from /usr/local/bin (initdb, pg_ctl; as the
postgres user when run as root), as the store's tests start it; without those binaries it is skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "api_latency.json"
PG_BIN = Path(os.environ.get("COCONET_PG_BIN", "/usr/local/bin"))
SIZES = [2**k for k in range(10, 30)]  # 20 tuned sizes per (program, topology, world, backend)
WORLDS = (2, 4, 8, 16, 32)
BACKENDS = ("gloo", "shm")
BATCH = 20_000


# -- stores


def populate(url: str, rows: int) -> list[tuple[str, str, int]]:
    """``rows`` measurements over the examples' programs, ``per_key`` per (program, sizes, topology, world,
    backend), the first of each key its winner; the (program, topology, world) triples tuned."""
    from coconet.loader import load_file
    from coconet.schedules.schedule import Schedule
    from coconet.server.records import NewMeasurement
    from coconet.server.store import Store

    programs = [load_file(p) for p in sorted((ROOT / "examples").glob("*.py"))]
    programs = [p for p in programs if list(p.dims) == ["N"]] or programs[:1]
    per_key = 10 if rows <= 10_000 else 100
    keys = max(1, rows // per_key)
    with Store.open(url) as store:
        base: dict[str, Any] = {}
        for p in programs:
            store.add_program(p)
            base[p.hash] = NewMeasurement.of(Schedule(p), sizes={"N": 1024}, topology="t0", world=2, backend="gloo",
                                             samples=[1e-3] * 5, n=5, median_s=1e-3, ci_lo_s=9e-4, ci_hi_s=1.1e-3)
        triples: set[tuple[str, str, int]] = set()

        def key(i: int) -> tuple[str, dict[str, int], str, int, str]:
            # key i -> program, sizes, topology, world, backend: sizes vary fastest, so every tuned triple has
            # a run of sizes to fall back on.
            size, rest = SIZES[i % len(SIZES)], i // len(SIZES)
            backend, rest = BACKENDS[rest % len(BACKENDS)], rest // len(BACKENDS)
            world, rest = WORLDS[rest % len(WORLDS)], rest // len(WORLDS)
            prog, rest = programs[rest % len(programs)].hash, rest // len(programs)
            return prog, {"N": size}, f"topo{rest}", world, backend

        pending: list[Any] = []
        done = 0
        t0 = time.perf_counter()

        def flush() -> None:
            nonlocal done
            ids = store.add_measurements(pending)
            store.add_winners([(ids[j], ids[j + 1], ids[j + 1]) for j in range(0, len(ids), per_key)])
            done += len(pending)
            pending.clear()
            print(f"  {done:>9,} rows  {time.perf_counter() - t0:6.1f} s", file=sys.stderr, end="\r")

        for i in range(keys):
            prog, sizes, topo, world, backend = key(i)
            triples.add((prog, topo, world))
            for j in range(per_key):
                median = 1e-3 * (1 + j / per_key) * sizes["N"] / 1024
                pending.append(replace(base[prog], sizes=sizes, topology=topo, world=world, backend=backend,
                                       median_s=median, ci_lo_s=median * 0.97, ci_hi_s=median * 1.03))
            if len(pending) >= BATCH:
                flush()
        if pending:
            flush()
        print(file=sys.stderr)
    return sorted(triples)


class Postgres:
    """A throwaway PostgreSQL server on a unix socket in a temp dir (as tests/server/conftest.py starts it)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="coconet-bench-pg-"))
        self.data, self.sock = self.root / "data", self.root / "sock"

    @staticmethod
    def available() -> bool:
        return (PG_BIN / "initdb").exists() and (PG_BIN / "pg_ctl").exists()

    def _run(self, *cmd: str) -> None:
        full = ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else list(cmd)
        subprocess.run(full, check=True, capture_output=True)

    def start(self) -> None:
        for p in (self.data, self.sock):
            p.mkdir()
        if os.geteuid() == 0:
            for p in (self.root, self.data, self.sock):
                shutil.chown(p, "postgres", "postgres")
        self._run(str(PG_BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres")
        opts = f"-k {self.sock} -p 5433 -c listen_addresses='' -c fsync=off -c synchronous_commit=off"
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-o", opts, "-l", str(self.root / "log"), "-w", "start")

    def new_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(host=str(self.sock), port=5433, user="postgres", dbname="postgres", autocommit=True) as c:
            c.execute(f"CREATE DATABASE {name}")
        return f"postgresql+psycopg://postgres@/{name}?host={self.sock}&port=5433"

    def stop(self) -> None:
        try:
            self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop")
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)


# -- server and load


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(url: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "COCONET_API_TOKEN": "bench"}
    # --json: no access log line per request (a log write per request is not what is measured here).
    proc = subprocess.Popen([sys.executable, "-m", "coconet", "serve", "--port", str(port), "--db", url,
                             "--workers", "0", "--json"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            if httpx.get(f"{base}/api/v1/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.terminate()
    raise RuntimeError("the server did not come up in 60 s")


def queries(triples: list[tuple[str, str, int]], seed: int = 0) -> Iterator[dict[str, Any]]:
    rng = random.Random(seed)
    while True:
        prog, topo, world = rng.choice(triples)
        if rng.random() < 0.9:
            n = rng.choice(SIZES)  # may be untuned on the smallest store: then it is a nearest lookup too
        else:
            n = 3 * rng.choice(SIZES)  # never tuned: the nearest tuned size answers
        yield {"program": prog, "sizes": f"N={n}", "topology": topo, "world": world}


async def load(base: str, triples: list, rate: float, seconds: float) -> dict[str, Any]:
    import httpx

    q = queries(triples)
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    errors = 0
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=10) as client:
        for _ in range(50):  # warm-up: connections, the server's caches
            await client.get("/api/v1/best", params=next(q))
        # One at a time first: the server's own cost, apart from any queue the load builds.
        serial = []
        for _ in range(300):
            t = time.perf_counter()
            await client.get("/api/v1/best", params=next(q))
            serial.append(time.perf_counter() - t)
        serial.sort()

        async def one(due: float, params: dict) -> None:
            nonlocal errors
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                r = await client.get("/api/v1/best", params=params)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            except httpx.HTTPError:
                errors += 1
                return
            latencies.append(time.perf_counter() - due)

        n = int(rate * seconds)
        t0 = time.perf_counter() + 0.1
        started = time.perf_counter()
        await asyncio.gather(*(one(t0 + i / rate, next(q)) for i in range(n)))
        elapsed = time.perf_counter() - started
    latencies.sort()

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1e3

    return {"requests": n, "ok": statuses.get(200, 0), "statuses": statuses, "errors": errors,
            "target_rate": rate, "achieved_rate": round(len(latencies) / elapsed, 1),
            "p50_ms": round(pct(0.50), 2), "p90_ms": round(pct(0.90), 2), "p99_ms": round(pct(0.99), 2),
            "max_ms": round(latencies[-1] * 1e3, 2),
            "serial_p50_ms": round(serial[150] * 1e3, 2), "serial_p99_ms": round(serial[296] * 1e3, 2)}


def run_one(backend: str, rows: int, url: str, rate: float, seconds: float) -> dict[str, Any]:
    t = time.perf_counter()
    triples = populate(url, rows)
    fill_s = time.perf_counter() - t
    proc, base = serve(url)
    try:
        result = asyncio.run(load(base, triples, rate, seconds))
    finally:
        proc.terminate()
        proc.wait(30)
    result.update(backend=backend, rows=rows, populate_s=round(fill_s, 1))
    print(json.dumps(result), file=sys.stderr)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=300.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rows", type=int, nargs="+", default=[1000, 1_000_000])
    ap.add_argument("--backends", nargs="+", default=["sqlite", "postgresql"])
    ap.add_argument("-o", "--out", type=Path, default=OUT)
    args = ap.parse_args()
    results = []
    tmp = Path(tempfile.mkdtemp(prefix="coconet-bench-api-"))
    pg = None
    try:
        for backend in args.backends:
            if backend == "postgresql":
                if not Postgres.available():
                    print(f"skipping PostgreSQL: no initdb/pg_ctl in {PG_BIN}", file=sys.stderr)
                    continue
                pg = Postgres()
                pg.start()
            for rows in args.rows:
                url = pg.new_database(f"b{rows}") if backend == "postgresql" and pg else \
                    f"sqlite:///{tmp / f'b{rows}.db'}"
                results.append(run_one(backend, rows, url, args.rate, args.seconds))
    finally:
        if pg is not None:
            pg.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    doc = {"benchmark": "GET /api/v1/best latency, open loop", "rate": args.rate, "seconds": args.seconds,
           "machine": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
           "note": "client and server share this machine's cores (and other benchmarks may run beside them)",
           "load_average_after": os.getloadavg(),
           "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
