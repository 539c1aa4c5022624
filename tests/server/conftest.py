"""Backends for the store's tests: SQLite in a temp dir, and a throwaway PostgreSQL 15 server.

The server runs from ``/usr/local/bin`` (initdb, pg_ctl) on a unix socket in a
temp dir, one database per test; without those binaries the PostgreSQL cases skip.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

PG_BIN = Path(os.environ.get("COCONET_PG_BIN", "/usr/local/bin"))


@dataclass
class PostgresServer:
    root: Path
    port: int = 5432
    _names: Iterator[int] = field(default_factory=itertools.count)

    @property
    def sockets(self) -> Path:
        return self.root / "sock"

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@/{database}?host={self.sockets}&port={self.port}"

    def new_database(self) -> str:
        import psycopg

        name = f"t{next(self._names)}"
        with psycopg.connect(
            host=str(self.sockets), port=self.port, user="postgres", dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)


def _as_postgres(cmd: list[str]) -> list[str]:
    # initdb refuses to run as root.
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    initdb, pg_ctl = PG_BIN / "initdb", PG_BIN / "pg_ctl"
    if not (initdb.exists() and pg_ctl.exists()):
        pytest.skip(f"no PostgreSQL server binaries in {PG_BIN} (initdb, pg_ctl)")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg is not installed (pip install 'coconet[postgres]')")
    # Not under pytest's tmp dir: its parents are private to root, and the server runs as postgres.
    server = PostgresServer(Path(tempfile.mkdtemp(prefix="coconet-pg-")))
    data = server.root / "data"
    data.mkdir()
    server.sockets.mkdir()
    if os.geteuid() == 0:
        for p in (server.root, data, server.sockets):
            shutil.chown(p, "postgres", "postgres")
    log = server.root / "server.log"
    try:
        subprocess.run(
            _as_postgres([str(initdb), "-D", str(data), "-A", "trust", "-U", "postgres"]),
            check=True,
            capture_output=True,
        )
        options = (
            f"-k {server.sockets} -p {server.port} -c listen_addresses='' "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        )
        subprocess.run(
            _as_postgres([str(pg_ctl), "-D", str(data), "-o", options, "-l", str(log), "-w", "start"]),
            check=True,
            capture_output=True,
        )
    except subprocess.CalledProcessError as err:
        detail = (err.stderr or b"").decode(errors="replace").strip()
        if log.exists():
            detail += "\n" + log.read_text(errors="replace")
        shutil.rmtree(server.root, ignore_errors=True)
        pytest.fail(f"could not start PostgreSQL: {detail}")
    try:
        yield server
    finally:
        subprocess.run(_as_postgres([str(pg_ctl), "-D", str(data), "-m", "immediate", "stop"]), capture_output=True)
        shutil.rmtree(server.root, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL of an empty database on each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'coconet.db'}"
    return request.getfixturevalue("postgres").new_database()
