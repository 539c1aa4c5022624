"""Latency of ``GET /api/v1/best`` under a fixed request rate, on SQLite and PostgreSQL, with stores of
about 1,000 and 1,000,000 measurement rows.

The server is ``coconet serve`` (uvicorn, one process, no tuning workers) in a subprocess on a free port;
the load is open-loop: request i is due at t0 + i/rate and its latency counts from then, so a server that
falls behind is charged for the queue it builds (no coordinated omission), and so is a request that waits
for one of the ``--connections`` keep-alive connections. 90% of the requests hit a tuned key exactly, 10% ask
for untuned sizes and get the nearest tuned ones. Before the load, 300 requests one at a time give the
server's own latency (serial_p50_ms, serial_p99_ms), apart from any queue.

The client speaks HTTP/1.1 over asyncio streams (on uvloop when installed): it runs on the same cores as
the server, and a client library such as httpx spends more CPU per request than the server does. Each
result says where the CPU went during the run (server, PostgreSQL's backends, this client, per request),
how busy the whole machine was and how much of that was other people's work, and how late the client
itself sent requests (client_send_lag_p99_ms: a starved client, not a slow server). The load average at
the start and the end goes with them.

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
from typing import Any, Callable, Iterator
from urllib.parse import urlencode

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
            base[p.hash] = NewMeasurement.of(
                Schedule(p),
                sizes={"N": 1024},
                topology="t0",
                world=2,
                backend="gloo",
                samples=[1e-3] * 5,
                n=5,
                median_s=1e-3,
                ci_lo_s=9e-4,
                ci_hi_s=1.1e-3,
            )
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
                pending.append(
                    replace(
                        base[prog],
                        sizes=sizes,
                        topology=topo,
                        world=world,
                        backend=backend,
                        median_s=median,
                        ci_lo_s=median * 0.97,
                        ci_hi_s=median * 1.03,
                    )
                )
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

    def backends(self) -> list[int]:
        """The server's processes: the postmaster and its children (a backend per connection)."""
        try:
            postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return []
        children = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == postmaster:
                    children.append(int(stat.parent.name))
            except (OSError, ValueError, IndexError):
                continue
        return [postmaster, *children]

    def stop(self) -> None:
        try:
            self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop")
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)


# -- server and load


class Http:
    """One keep-alive HTTP/1.1 connection over asyncio streams. httpx spends more CPU per request than the
    server does; on a machine whose cores the client shares with the server, that would be measured too."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port

    async def open(self) -> Http:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def get(self, target: str) -> tuple[int, bytes]:
        self.writer.write(f"GET {target} HTTP/1.1\r\nHost: {self.host}\r\n\r\n".encode())
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = None
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length is None:
            raise RuntimeError(f"no Content-Length in {head!r}")
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(url: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = {**os.environ, "COCONET_API_TOKEN": "bench"}
    # --json: no access log line per request (a log write per request is not what is measured here).
    proc = subprocess.Popen(
        [sys.executable, "-m", "coconet", "serve", "--port", str(port), "--db", url, "--workers", "0", "--json"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    async def health() -> int:
        conn = await Http("127.0.0.1", port).open()
        try:
            return (await conn.get("/api/v1/health"))[0]
        finally:
            conn.close()

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            if run(health()) == 200:
                return proc, port
        except OSError:
            time.sleep(0.2)
    proc.terminate()
    raise RuntimeError("the server did not come up in 60 s")


def queries(triples: list[tuple[str, str, int]], seed: int = 0) -> Iterator[str]:
    rng = random.Random(seed)
    while True:
        prog, topo, world = rng.choice(triples)
        if rng.random() < 0.9:
            n = rng.choice(SIZES)  # may be untuned on the smallest store: then it is a nearest lookup too
        else:
            n = 3 * rng.choice(SIZES)  # never tuned: the nearest tuned size answers
        yield "/api/v1/best?" + urlencode({"program": prog, "sizes": f"N={n}", "topology": topo, "world": world})


def cpu_s(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds of each of these processes so far (those gone are left out)."""
    out = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def machine_busy_s() -> float:
    """CPU seconds all cores of the machine spent busy so far (/proc/stat: user, nice, system, irq, softirq)."""
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in Path("/proc/stat").read_text().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], p: float) -> float:
    return round(xs[min(len(xs) - 1, int(p * len(xs)))] * 1e3, 2)


async def load(
    port: int,
    triples: list,
    rate: float,
    seconds: float,
    connections: int,
    server: int,
    database: Callable[[], list[int]],
) -> dict[str, Any]:
    """Serial latency, then the open-loop run; ``server`` is the server's pid, ``database()`` the database's
    processes (PostgreSQL's backends; none for SQLite, which runs inside the server)."""
    q = queries(triples)
    pool = [await Http("127.0.0.1", port).open() for _ in range(connections)]
    try:
        for _ in range(50):  # warm-up: connections, the server's caches
            await pool[0].get(next(q))
        # One at a time first: the server's own cost, apart from any queue the load builds.
        serial = []
        serial_statuses: dict[int, int] = {}
        for _ in range(300):
            t = time.perf_counter()
            status, _ = await pool[0].get(next(q))
            serial.append(time.perf_counter() - t)
            serial_statuses[status] = serial_statuses.get(status, 0) + 1
        serial.sort()

        free: asyncio.Queue[Http] = asyncio.Queue()
        for conn in pool:
            free.put_nowait(conn)
        latencies: list[float] = []
        statuses: dict[int, int] = {}
        errors = 0

        async def one(due: float, target: str) -> None:
            nonlocal errors
            # Waiting for a free connection counts: latency runs from the due time, whatever held it up.
            conn = await free.get()
            try:
                status, _ = await conn.get(target)
            except (OSError, asyncio.IncompleteReadError, RuntimeError):
                errors += 1
                conn.close()
                free.put_nowait(await Http("127.0.0.1", port).open())
                return
            free.put_nowait(conn)
            statuses[status] = statuses.get(status, 0) + 1
            latencies.append(time.perf_counter() - due)

        n = int(rate * seconds)
        targets = [next(q) for _ in range(n)]
        lags = []  # how late this generator itself sent each request (a starved client shows up here)
        db0, server0 = cpu_s(database()), cpu_s([server])
        client0, busy0 = time.process_time(), machine_busy_s()
        t0 = time.perf_counter() + 0.05
        tasks = []
        for i, target in enumerate(targets):
            # Open loop: request i is due at t0 + i/rate, whether or not earlier ones have been answered.
            due = t0 + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            lags.append(time.perf_counter() - due)
            tasks.append(asyncio.create_task(one(due, target)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
        client_cpu, busy = time.process_time() - client0, machine_busy_s() - busy0
        server_cpu = sum(cpu_s([server]).values()) - sum(server0.values())
        # A PostgreSQL backend started during the run (the server's pool grew) counts from zero.
        db_cpu = sum(t - db0.get(pid, 0.0) for pid, t in cpu_s(database()).items())
    finally:
        for conn in pool:
            conn.close()
    latencies.sort()
    lags.sort()
    return {
        "requests": n,
        "ok": statuses.get(200, 0),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "errors": errors,
        "target_rate": rate,
        "achieved_rate": round(len(latencies) / elapsed, 1),
        "p50_ms": pct(latencies, 0.50),
        "p90_ms": pct(latencies, 0.90),
        "p99_ms": pct(latencies, 0.99),
        "max_ms": round(latencies[-1] * 1e3, 2),
        "serial_p50_ms": pct(serial, 0.50),
        "serial_p99_ms": pct(serial, 0.99),
        "serial_statuses": {str(k): v for k, v in sorted(serial_statuses.items())},
        # Where the CPU went during the open-loop run, per request: the server, PostgreSQL's backends, this
        # load generator; and how busy the machine's cores were, everyone else's work included.
        "server_cpu_ms_per_request": round(server_cpu / n * 1e3, 3),
        "database_cpu_ms_per_request": round(db_cpu / n * 1e3, 3),
        "client_cpu_ms_per_request": round(client_cpu / n * 1e3, 3),
        "machine_busy_cores": round(busy / elapsed, 2),
        "others_busy_cores": round(max(0.0, busy - server_cpu - db_cpu - client_cpu) / elapsed, 2),
        "client_send_lag_p99_ms": pct(lags, 0.99),
    }


def run_one(
    backend: str, rows: int, url: str, rate: float, seconds: float, connections: int, pg: Postgres | None
) -> dict[str, Any]:
    t = time.perf_counter()
    triples = populate(url, rows)
    fill_s = time.perf_counter() - t
    proc, port = serve(url)
    try:
        result = run(load(port, triples, rate, seconds, connections, proc.pid, pg.backends if pg is not None else list))
    finally:
        proc.terminate()
        proc.wait(30)
    result.update(backend=backend, rows=rows, populate_s=round(fill_s, 1))
    print(json.dumps(result), file=sys.stderr)
    return result


def run(main: Any) -> Any:
    """asyncio.run, on uvloop when it is installed (uvicorn[standard] brings it): a cheaper client."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def main() -> None:
    from coconet.tuner import fingerprint

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=300.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rows", type=int, nargs="+", default=[1000, 1_000_000])
    ap.add_argument("--backends", nargs="+", default=["sqlite", "postgresql"])
    ap.add_argument("--connections", type=int, default=32, help="keep-alive connections the load spreads over")
    ap.add_argument("-o", "--out", type=Path, default=OUT)
    args = ap.parse_args()
    load_before = os.getloadavg()
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
                url = (
                    pg.new_database(f"b{rows}")
                    if backend == "postgresql" and pg
                    else f"sqlite:///{tmp / f'b{rows}.db'}"
                )
                results.append(
                    run_one(
                        backend,
                        rows,
                        url,
                        args.rate,
                        args.seconds,
                        args.connections,
                        pg if backend == "postgresql" else None,
                    )
                )
    finally:
        if pg is not None:
            pg.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    doc = {
        "benchmark": "GET /api/v1/best latency, open loop",
        "rate": args.rate,
        "seconds": args.seconds,
        "connections": args.connections,
        "machine": {
            "cpus": os.cpu_count(),
            "cpu": fingerprint.cpu_model(),
            "machine": platform.machine(),
            "python": platform.python_version(),
        },
        "note": "client and server share this machine's cores (and other benchmarks may run beside them)",
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
