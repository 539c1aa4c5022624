"""What keeps one client from stalling, steering or reading more of the server than it should: bounds on the
request head (size, field count, time) on a real uvicorn server, no state change through GET, the token for
every write, the Host and Origin checks, nothing about the database or the machine in anonymous answers, and
reads and /health answered while writers wait for the database's lock. All traffic goes to 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from fastapi.testclient import TestClient

from coconet.errors import StoreError
from coconet.server.app import create_app
from coconet.server.http import HeadLimits, server_config
from coconet.server.store import Store, unavailable

from .test_api import _seed_winner, held_out_program, ir_of

TOKEN = "guard-t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
API = "/api/v1"
HOSTS = ("testserver",)  # the Host TestClient sends


def other_program() -> Any:
    """A second program to write: SGD with weight decay."""
    from coconet import Local, Program, Replicated, allreduce

    p = Program("sgd_decay", dims=("N",))
    g = p.tensor("g", ("N",), layout=Local)
    w = p.tensor("w", ("N",), layout=Replicated)
    lr, decay = p.scalars("lr decay")
    p.update(w, w - lr * (allreduce(g) + decay * w))
    return p.ir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """``app`` on a real uvicorn server on a free loopback port, configured by ``server_config``."""

    def __init__(self, app: Any, limits: HeadLimits | None = None) -> None:
        import uvicorn

        self.port = _free_port()
        self.server = uvicorn.Server(
            server_config(app, port=self.port, limits=limits or HeadLimits(), log_level="critical")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def get(self, path: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("GET", path, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def post(self, path: str, body: bytes, timeout: float = 30.0) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", path, body=body, headers={**AUTH, "Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    app = create_app(f"sqlite:///{tmp_path / 'guards.db'}", token=TOKEN, workers=0, start_workers=False)
    with Served(app) as s:
        yield s


def _answer(sock: socket.socket) -> bytes:
    """What the server sent before closing (or what it sent first); b"" for a closed connection."""
    try:
        return sock.recv(65536)
    except (ConnectionResetError, BrokenPipeError):
        return b""


# -- the request head, on a real server


def test_a_64_mib_header_is_refused_at_once_and_health_answers_meanwhile(served: Served) -> None:
    slowest: list[float] = []
    done = threading.Event()

    def health() -> None:
        while not done.is_set():
            t = time.perf_counter()
            status, _ = served.get(f"{API}/health", timeout=10)
            slowest.append(time.perf_counter() - t)
            assert status == 200
            time.sleep(0.02)

    watcher = threading.Thread(target=health)
    watcher.start()
    try:
        with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
            t0 = time.perf_counter()
            sock.sendall(b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
            sent, chunk = 0, b"a" * 2**16
            try:
                while sent < 64 * 2**20:
                    sock.sendall(chunk)
                    sent += len(chunk)
            except (ConnectionResetError, BrokenPipeError):
                pass  # the server stopped reading: as it should
            answer = _answer(sock)
            took = time.perf_counter() - t0
        assert sent < 8 * 2**20, f"the server read {sent} bytes of one header"
        assert answer == b"" or answer.startswith(b"HTTP/1.1 431 "), answer[:100]
        assert took < 5.0
        time.sleep(0.2)
    finally:
        done.set()
        watcher.join(20)
    assert slowest and max(slowest) < 1.0, slowest


def test_too_many_headers_get_431_with_a_json_detail(served: Served) -> None:
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
        head = b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        head += b"".join(b"X-%d: 1\r\n" % i for i in range(500)) + b"\r\n"
        sock.sendall(head)
        answer = _answer(sock)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]
    assert b"connection: close" in answer.lower() and b'{"detail": "more than 100 header fields' in answer
    assert served.get(f"{API}/health")[0] == 200


def test_a_large_body_is_not_taken_for_a_large_head_and_heads_are_counted_per_request(served: Served) -> None:
    # one read holding a small head and 300 KB of body: the body does not count against the head's bound
    body = b'{"pad": "' + b"x" * 300_000 + b'"}'
    status, answer = served.post(f"{API}/programs", body)
    assert status == 422, answer[:200]
    # two requests on one connection, each with a 40 KB header: 80 KB together, each within the bound
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
    try:
        for _ in range(2):
            conn.request("GET", f"{API}/health", headers={"X-Pad": "p" * 40_000})
            resp = conn.getresponse()
            assert resp.status == 200 and resp.read()
    finally:
        conn.close()


def test_a_client_that_stalls_in_its_request_head_is_cut_off(tmp_path: Path) -> None:
    app = create_app(f"sqlite:///{tmp_path / 'slow.db'}", token=TOKEN, workers=0, start_workers=False)
    with Served(app, HeadLimits(head_timeout_s=1.0)) as served:
        with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
            t0 = time.perf_counter()
            sock.sendall(b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            answer = _answer(sock)
            took = time.perf_counter() - t0
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:100]
        assert 0.9 < took < 5.0
        # a byte at a time keeps no connection open past the deadline either
        with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
            t0 = time.perf_counter()
            try:
                for b in b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"s" * 100:
                    sock.sendall(bytes([b]))
                    time.sleep(0.05)
            except OSError:
                pass  # closed by the server
            sock.settimeout(5)
            answer = _answer(sock)
            assert answer.startswith(b"HTTP/1.1 408 ") and time.perf_counter() - t0 < 5.0, answer[:100]
        # a connection that sends nothing is closed, without an answer
        with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
            t0 = time.perf_counter()
            assert _answer(sock) == b"" and 0.9 < time.perf_counter() - t0 < 5.0
        assert served.get(f"{API}/health")[0] == 200


# -- no state change through GET; the token for every write


@pytest.fixture
def seeded(tmp_path: Path) -> dict[str, Any]:
    url = f"sqlite:///{tmp_path / 'seeded.db'}"
    prog = held_out_program()
    with Store.open(url) as store:
        store.add_program(prog)
        _seed_winner(store, prog, 1024)
    return {"url": url, "hash": prog.hash}


def test_a_cross_origin_get_with_tune_queues_no_job(seeded: dict[str, Any]) -> None:
    h = seeded["hash"]
    for token, open_writes in ((TOKEN, False), (None, True)):
        app = create_app(seeded["url"], token=token, open_writes=open_writes, start_workers=False, hosts=HOSTS)
        with TestClient(app) as c:
            r = c.get(
                f"{API}/best",
                params={"program": h, "sizes": "N=4096", "world": 2, "tune": "true"},
                headers={"Origin": "http://evil.example", **AUTH},
            )
            assert r.status_code == 400 and "POST /api/v1/best" in r.json()["detail"]
            assert c.get(f"{API}/jobs", params={"program": h}).json() == []


def test_a_server_without_a_token_refuses_writes_unless_it_is_open(seeded: dict[str, Any]) -> None:
    h = seeded["hash"]
    ask = {"program": h, "sizes": {"N": 4096}, "world": 2, "budget": 2}
    with TestClient(create_app(seeded["url"], token=None, start_workers=False, hosts=HOSTS)) as c:
        for path, body in (("/programs", ir_of(held_out_program())), ("/best", ask), ("/jobs", ask)):
            r = c.post(API + path, json=body)
            assert r.status_code == 403, (path, r.text)
            assert "$COCONET_API_TOKEN" in r.json()["detail"] and "--open" in r.json()["detail"]
        assert c.get(f"{API}/jobs", params={"program": h}).json() == []
        assert c.get(f"{API}/best", params={"program": h, "sizes": "N=1024"}).status_code == 200  # reads stay open
    with TestClient(create_app(seeded["url"], token=None, open_writes=True, start_workers=False, hosts=HOSTS)) as c:
        assert c.post(f"{API}/programs", json=ir_of(held_out_program())).status_code == 201
        started = c.post(f"{API}/best", json=ask)
        assert started.status_code == 202 and started.json()["state"] == "queued", started.text
        exact = c.post(f"{API}/best", json={**ask, "sizes": {"N": 1024}})
        assert exact.status_code == 200 and exact.json()["exact"] is True


def test_the_client_asks_for_the_best_or_a_tuning_by_post(seeded: dict[str, Any]) -> None:
    from coconet.client import Client, ServiceError

    app = create_app(seeded["url"], token=TOKEN, start_workers=False, hosts=HOSTS)
    with TestClient(app, headers=AUTH) as http:
        client = Client(http)
        best, started = client.best_or_tune(seeded["hash"], {"N": 1024}, topology="local", world=2)
        assert started is None and best["exact"] is True
        best, started = client.best_or_tune(
            seeded["hash"], {"N": 4096}, topology="local", world=2, budget=2, backend="gloo", shardable="all"
        )
        assert best is None and started["state"] == "queued" and started["nearest"]["tuned_sizes"] == {"N": 1024}
        job = client.job(started["job"])
        assert (job["backends"], job["budget"], job["shardable"]) == (["gloo"], 2, "all")
        http.headers.pop("Authorization")
        with pytest.raises(ServiceError, match="HTTP 401"):
            client.best_or_tune(seeded["hash"], {"N": 4096}, topology="local", world=2)


# -- Host and Origin


def test_only_allowed_hosts_are_answered(seeded: dict[str, Any]) -> None:
    h = seeded["hash"]
    app = create_app(seeded["url"], token=TOKEN, start_workers=False, hosts=["coconet.internal"])
    best = f"{API}/best?program={h}&sizes=N=1024"  # the fast path, which answers ahead of the routes
    for base in ("http://127.0.0.1:8000", "http://localhost", "http://[::1]:8000", "http://coconet.internal:80"):
        with TestClient(app, base_url=base) as c:
            assert c.get(f"{API}/health").status_code == 200, base
            assert c.get(best).status_code == 200, base
    for base in ("http://evil.example", "http://127.0.0.1.evil.example:8000", "http://testserver"):
        with TestClient(app, base_url=base) as c:
            for path in (f"{API}/health", best, "/", f"{API}/dashboard/programs"):
                r = c.get(path)
                assert (r.status_code, r.text) == (400, "Invalid host header"), (base, path)
            assert c.post(f"{API}/programs", json=ir_of(held_out_program()), headers=AUTH).status_code == 400
    with TestClient(
        create_app(seeded["url"], token=TOKEN, start_workers=False, hosts=["*"]), base_url="http://anything.example"
    ) as c:
        assert c.get(best).status_code == 200


def test_a_write_from_a_page_of_another_site_is_refused(seeded: dict[str, Any]) -> None:
    h = seeded["hash"]
    ask = {"program": h, "sizes": {"N": 4096}, "world": 2}
    app = create_app(seeded["url"], token=None, open_writes=True, start_workers=False, hosts=HOSTS)
    with TestClient(app) as c:
        for origin in ("http://evil.example", "null", "https://localhost.evil.example", "file://"):
            r = c.post(f"{API}/best", json=ask, headers={"Origin": origin})
            assert r.status_code == 403 and "another site" in r.json()["detail"], origin
            r = c.post(f"{API}/programs", content=b"name=x", headers={"Origin": origin, "Content-Type": "text/plain"})
            assert r.status_code == 403, origin
        assert c.get(f"{API}/jobs", params={"program": h}).json() == []
        # reads carry no risk (the browser keeps their answers from the page): answered
        assert (
            c.get(
                f"{API}/best", params={"program": h, "sizes": "N=1024"}, headers={"Origin": "http://evil.example"}
            ).status_code
            == 200
        )
        for origin in ("http://localhost:5173", "http://127.0.0.1:8000", "https://[::1]", "http://testserver"):
            assert (
                c.post(f"{API}/programs", json=ir_of(held_out_program()), headers={"Origin": origin}).status_code == 201
            ), origin


# -- what anonymous clients are told


def test_anonymous_health_names_no_store(seeded: dict[str, Any]) -> None:
    with TestClient(create_app(seeded["url"], token=TOKEN, workers=3, start_workers=False, hosts=HOSTS)) as c:
        anonymous = c.get(f"{API}/health").json()
        assert anonymous == {"status": "ok", "version": anonymous["version"], "workers": 3}
        assert c.get(f"{API}/health", headers={"Authorization": "Bearer wrong"}).json() == anonymous
        assert c.get(f"{API}/health", headers=AUTH).json()["store"] == c.app.state.store.url


def test_a_503_names_no_database_host_or_driver(seeded: dict[str, Any], tmp_path: Path) -> None:
    from sqlalchemy import create_engine

    app = create_app(seeded["url"], token=TOKEN, start_workers=False, hosts=HOSTS)
    with TestClient(app) as c:
        store = app.state.store
        # the read pool pointed at a database server that is not there: the driver's message names its host
        # and port
        store._reads.dispose()
        store._reads = create_engine("postgresql+psycopg://coconet:pw@127.0.0.1:1/results?connect_timeout=5")
        for path in (f"{API}/programs", f"{API}/jobs?program={seeded['hash']}", f"{API}/dashboard/programs"):
            r = c.get(path)
            assert r.status_code == 503, (path, r.text)
            detail = r.json()["detail"]
            assert detail.startswith("the results store is unavailable ("), detail
            for leak in ("127.0.0.1", "port", "psycopg", "postgresql", "sqlite", "pw", str(tmp_path), "Connection"):
                assert leak not in r.text, (path, leak, r.text)


# -- writers waiting for the database: reads and /health go on


def _hold_write_lock(url: str) -> Any:
    """Another connection holding the lock every write of the store's needs; release with ``.close()``."""
    if url.startswith("sqlite"):
        conn = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        return conn
    import psycopg
    from sqlalchemy import make_url

    u = make_url(url)
    conn = psycopg.connect(host=u.query["host"], port=int(u.query["port"]), user=u.username, dbname=u.database)
    # EXCLUSIVE: every write of the table waits; plain reads (ACCESS SHARE) do not
    conn.execute("LOCK TABLE coconet_programs IN EXCLUSIVE MODE")
    return conn


def test_a_busy_store_refuses_writes_quickly_and_still_reads(db_url: str) -> None:
    prog = held_out_program()
    store = Store.open(db_url, wait_s=1.0)
    try:
        store.add_program(prog)
        other = other_program()
        lock = _hold_write_lock(db_url)
        try:
            t0 = time.perf_counter()
            with pytest.raises(StoreError) as caught:
                store.add_program(other)
            assert caught.value.busy and time.perf_counter() - t0 < 5.0
            assert unavailable(caught.value) == "the results store is busy; retry"
            t0 = time.perf_counter()
            assert store.program(prog.hash) is not None and store.programs()  # reads do not wait for the lock
            assert time.perf_counter() - t0 < 1.0
        finally:
            lock.close()
        assert store.add_program(other) == other.hash
        assert {p.hash for p in store.programs()} == {prog.hash, other.hash}  # nothing recorded was lost
        # every connection of the write pool taken: a write gives up after wait_s, a read does not wait
        taken = [store._engine.connect() for _ in range(15)]
        try:
            t0 = time.perf_counter()
            with pytest.raises(StoreError) as caught:
                store.add_program(prog)
            assert caught.value.busy and time.perf_counter() - t0 < 5.0
            assert "QueuePool" not in unavailable(caught.value)
            t0 = time.perf_counter()
            assert store.program(prog.hash) is not None
            assert time.perf_counter() - t0 < 1.0
        finally:
            for conn in taken:
                conn.close()
    finally:
        store.close()


def test_writers_waiting_for_the_lock_starve_neither_health_nor_reads(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'starve.db'}"
    prog = held_out_program()
    with Store.open(url) as store:
        store.add_program(prog)
        _seed_winner(store, prog, 1024)
    app = create_app(url, token=TOKEN, workers=0, start_workers=False)  # writes wait WRITE_WAIT_S, 5 s
    other = other_program()
    body = json.dumps(ir_of(other)).encode()
    with Served(app) as served:
        lock = _hold_write_lock(url)
        answers: list[tuple[int, bytes, float]] = []

        def write() -> None:
            t = time.perf_counter()
            status, text = served.post(f"{API}/programs", body)
            answers.append((status, text, time.perf_counter() - t))

        # more than the write pool holds, and than the server's threads for sync routes (40)
        writers = [threading.Thread(target=write) for _ in range(48)]
        try:
            for w in writers:
                w.start()
            time.sleep(1.0)
            for _ in range(3):
                for path in (
                    f"{API}/health",
                    f"{API}/best?program={prog.hash}&sizes=N=1024",
                    f"{API}/programs/{prog.hash}",
                    f"{API}/dashboard/programs",
                ):
                    t = time.perf_counter()
                    status, _ = served.get(path)
                    assert status == 200 and time.perf_counter() - t < 1.0, (path, time.perf_counter() - t)
                time.sleep(0.5)
            for w in writers:
                w.join(30)
        finally:
            lock.close()
        assert len(answers) == len(writers)
        for status, text, took in answers:
            assert status == 503 and json.loads(text) == {"detail": "the results store is busy; retry"}, text
            assert took < 12.0  # a slot within WRITE_WAIT_S, then the lock within WRITE_WAIT_S
        status, text = served.post(f"{API}/programs", body)  # the lock released: the write goes through
        assert status == 201, text
        assert served.get(f"{API}/programs/{other.hash}")[0] == 200


def test_serve_opens_writes_only_on_loopback_and_without_a_token(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from coconet.cli.server import _served_names

    env = {k: v for k, v in os.environ.items() if k != "COCONET_API_TOKEN"}
    db = f"sqlite:///{tmp_path / 's.db'}"
    for extra, args, message in (
        ({}, ["--open", "--host", "0.0.0.0"], "--open takes writes from anyone"),
        ({"COCONET_API_TOKEN": "t"}, ["--open", "--host", "10.0.0.1"], "only on a loopback --host, not 10.0.0.1"),
        ({"COCONET_API_TOKEN": "t"}, ["--open"], "--open and COCONET_API_TOKEN together"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "coconet", "serve", "--db", db, *args],
            capture_output=True,
            text=True,
            env={**env, **extra},
            timeout=60,
            check=False,
        )
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert _served_names("10.1.2.3") == ["10.1.2.3"]
    assert socket.gethostname() in _served_names("0.0.0.0")
