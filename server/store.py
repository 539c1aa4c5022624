"""The results store: programs, topologies, tuning jobs, measurements and winners (docs/architecture.md, "Data flow").

``Store.open(url)`` takes any SQLAlchemy URL (SQLite by default, PostgreSQL at
scale), upgrades the schema to head and hands back plain frozen records, never
ORM objects. Measurements and winners are append-only: a newer tuning adds a
winner and ``best`` takes the newest one whose measurement is valid.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import time
from collections import Counter
from contextlib import AbstractContextManager, contextmanager
from dataclasses import fields
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

from sqlalchemy import Engine, Text, bindparam, case, cast, create_engine, event, func, inspect, select, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session

from coconet import __version__
from coconet.errors import CoconetError, KeyBusy, StoreError
from coconet.paths import data_dir
from coconet.schedules import shardable as shard
from coconet.schedules.dsl import Program as DslProgram
from coconet.schedules.ir import Program
from coconet.schedules.schedule import sharded_by
from coconet.schedules.serialize import to_dict
from coconet.server.keys import parse_sizes_key, size_distance, sizes_key
from coconet.server.models import (
    JOB_STATES,
    SOURCES,
    STATUSES,
    VERSION_TABLE,
    Base,
    JobRow,
    MeasurementRow,
    ProgramRow,
    TopologyRow,
    WinnerRow,
    utcnow,
)
from coconet.server.records import (
    Best,
    DoneKey,
    JobRecord,
    MeasurementDigest,
    MeasurementRecord,
    NewMeasurement,
    ProgramRecord,
    ProgramSummary,
    Progress,
    TopologyRecord,
    WinnerRecord,
)

ENV_URL = "COCONET_DATABASE_URL"
# The newest migration in server/migrations/versions (a test keeps the two equal). Knowing it here
# lets an up-to-date database open without importing Alembic, which costs half a second per CLI call.
SCHEMA_HEAD = "0005"
SQLITE_BUSY_S = 30  # how long a write waits for SQLite's lock or a connection, unless opened with wait_s
OPTUNA_CREATE_TRIES = 5
MIGRATIONS = Path(__file__).resolve().parent / "migrations"

# Which job states may follow which; "done" is final, a failed or interrupted job may be queued again.
NEXT_STATES: dict[str, frozenset[str]] = {
    "queued": frozenset({"running", "failed", "interrupted"}),
    "running": frozenset({"running", "done", "failed", "interrupted"}),
    "interrupted": frozenset({"queued", "running", "failed"}),
    "failed": frozenset({"queued"}),
    "done": frozenset(),
}
ACTIVE_STATES = ("queued", "running")
# A job's error says why it stopped or why it was queued again; once it runs again or is done, that no
# longer describes it (a resumed job that then finished is not an error).
_CLEARS_ERROR = frozenset({"running", "done"})
# why take_job marked a running job interrupted: its tuner is gone, and the key is tuned again
RETAKEN = "left by the process that ran it; the key was tuned again (finished trials are kept)"
_WRITE = "coconet_write"


def default_url() -> str:
    """``$COCONET_DATABASE_URL``, else ``sqlite:///<data dir>/coconet.db`` (``coconet.paths.data_dir``)."""
    env = os.environ.get(ENV_URL)
    if env:
        return env

    return f"sqlite:///{data_dir() / 'coconet.db'}"


class Store:
    """A results store on one database. Open with ``Store.open(url)``; close with ``close()`` or ``with``."""

    def __init__(self, engine: Engine, url: str, wait_s: float = SQLITE_BUSY_S) -> None:
        self._engine = engine
        # Reads have pools of their own: writers waiting for a lock, as many as the write pool holds, leave
        # reads a connection. _reads runs transactions (the ORM's reads), _reader the hot path's statements.
        self._reads = _reads_engine(engine)
        self._reader = _read_engine(engine, self._reads)
        self._wait_s = wait_s
        self._newest = {n: _Rendered(q, self._reader.dialect) for n, q in _NEWEST.items()}
        self._tuned_keys = {n: _Rendered(q, self._reader.dialect) for n, q in _TUNED_KEYS.items()}
        self.url = url

    @classmethod
    def open(cls, url: str | None = None, *, create: bool = True, wait_s: float | None = None) -> Store:
        """Open (and create or migrate) the store; ``url`` beats ``$COCONET_DATABASE_URL`` beats the default.
        ``create=False``, for a lookup: a SQLite file that does not exist is refused, not made (a mistyped path
        would otherwise leave an empty store, and its folders, behind). With ``wait_s``, a write waits at most
        that long for a connection of the pool and as long again for the database's lock (SQLite's file,
        PostgreSQL's rows and key locks), then fails with a StoreError whose ``busy`` is True; without, it waits
        SQLITE_BUSY_S for SQLite's lock and as long as it takes for PostgreSQL's."""
        engine, shown = _engine(url or default_url(), create=create, wait_s=wait_s)
        store = cls(engine, shown, SQLITE_BUSY_S if wait_s is None else wait_s)
        try:
            store._upgrade()
        except BaseException:
            store.close()
            raise
        return store

    def close(self) -> None:
        self._reader.dispose()
        self._reads.dispose()
        self._engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def optuna_storage(self) -> Any:
        """Optuna's RDB storage on this store's database: studies live beside the results they led to."""
        import optuna

        url = self._engine.url.render_as_string(hide_password=False)
        kwargs = {"connect_args": {"timeout": 30}} if self.dialect == "sqlite" else {"pool_pre_ping": True}
        # Optuna makes its tables on first use, looking before it creates: of the processes doing that at once on
        # a fresh database all but one fail ("table studies already exists", a second revision row). Making them
        # is idempotent, so a loser makes them again and finds them there.
        tries = 0
        while True:
            try:
                return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
            except SQLAlchemyError as err:
                tries += 1
                message = str(getattr(err, "orig", None) or err).lower()
                lost = any(m in message for m in ("already exists", "unique constraint", "duplicate key", "locked"))
                if not lost or tries == OPTUNA_CREATE_TRIES:
                    raise StoreError(f"Optuna's storage on {self.url}: {_cause(err)}", url=self.url) from err
                time.sleep(0.05 * tries)

    @property
    def dialect(self) -> str:
        return self._engine.dialect.name

    # -- programs and topologies

    def add_program(self, program: Program | DslProgram) -> str:
        """Record a program (IR, or a DSL ``Program``); returns its hash. Idempotent."""
        ir = program.ir if isinstance(program, DslProgram) else program
        if not isinstance(ir, Program):
            raise StoreError(f"add_program takes a Program, not {type(program).__name__} (JSON: coconet.load it first)")
        values = {"hash": ir.hash, "name": ir.name, "ir": to_dict(ir), "created_at": utcnow()}
        with self._tx("add_program", write=True) as s:
            _insert_missing(s, ProgramRow, values)
        return ir.hash

    def program(self, program_hash: str) -> ProgramRecord | None:
        with self._tx("program") as s:
            row = s.get(ProgramRow, program_hash)
            return _record(ProgramRecord, row) if row else None

    def programs(self, limit: int | None = None, *, newest_first: bool = False) -> list[ProgramSummary]:
        """The recorded programs, oldest first (or newest first), at most ``limit`` of them."""
        p = ProgramRow
        order = (p.created_at.desc(), p.hash.desc()) if newest_first else (p.created_at, p.hash)
        with self._tx("programs") as s:
            rows = s.execute(select(p.hash, p.name, p.ir, p.created_at).order_by(*order).limit(limit))
            return [ProgramSummary(h, name, list(ir.get("dims", [])), len(ir.get("statements", [])), _utc(created))
                    for h, name, ir, created in rows]

    def add_topology(self, name: str, fingerprint: Mapping[str, Any], source: str = "config") -> str:
        """Record a topology; the same name again must come with the same fingerprint (records are not overwritten)."""
        # As it will read back from JSON (tuples become lists), so that equal fingerprints compare equal.
        try:
            fingerprint = json.loads(json.dumps(dict(fingerprint)))
        except (TypeError, ValueError) as err:
            raise StoreError(f"the fingerprint of topology {name!r} is not JSON: {err}", topology=name) from None
        values = {"name": name, "fingerprint": fingerprint, "source": source, "created_at": utcnow()}
        with self._tx("add_topology", write=True) as s:
            _insert_missing(s, TopologyRow, values)
            recorded = s.get(TopologyRow, name).fingerprint
            if recorded != values["fingerprint"]:
                raise StoreError(
                    f"topology {name!r} is already recorded with another fingerprint: this store's results for it "
                    f"are of other machines ({_fingerprint_text(recorded)}), not these "
                    f"({_fingerprint_text(values['fingerprint'])}); tune into another store (--db), or calibrate "
                    f"these machines under a name of their own (coconet calibrate --name NAME) and pass "
                    f"--topology NAME", topology=name)
        return name

    def topology(self, name: str) -> TopologyRecord | None:
        with self._tx("topology") as s:
            row = s.get(TopologyRow, name)
            return _record(TopologyRecord, row) if row else None

    # -- jobs

    def create_job(
        self,
        program_hash: str,
        sizes: Mapping[str, int],
        topology: str,
        world: int,
        *,
        budget: int | None = None,
        backends: Sequence[str] = (),
        running: bool = False,
        shardable: str = shard.EVERY,
    ) -> int:
        """A new job, queued for the service's workers; ``running``: already taken by its caller (a tuner that
        runs it itself), so that no worker can claim it between its creation and a claim."""
        key = sizes_key(sizes)
        _check_world(world)
        _check_shardable(shardable)
        with self._tx("create_job", write=True) as s:
            _require_programs(s, {program_hash})
            row = _new_job(program_hash, sizes, key, topology, world, shardable, budget, backends, running)
            s.add(row)
            s.flush()
            return row.id

    def update_job(
        self,
        job_id: int,
        *,
        state: str | None = None,
        progress: Progress | None = None,
        result: Mapping[str, Any] | None = None,
        error: str | None = None,
    ) -> JobRecord:
        """Move a job on (see ``NEXT_STATES``) and/or record its progress; every call is also a heartbeat."""
        if state is not None and state not in JOB_STATES:
            raise StoreError(f"job state {state!r} is not one of {', '.join(JOB_STATES)}")
        with self._tx("update_job", write=True) as s:
            row = s.get(JobRow, job_id, with_for_update=True)
            if row is None:
                raise StoreError(f"no job {job_id}", job_id=job_id)
            if row.state == "done":
                raise StoreError(f"job {job_id} is done; its record is final", job_id=job_id)
            if state is not None:
                if state not in NEXT_STATES[row.state]:
                    raise StoreError(f"job {job_id} cannot go from {row.state} to {state}", job_id=job_id)
                _enter(row, state)
            if progress is not None:
                row.trials_done, row.trials_total = progress.done, progress.total
                row.trials_failed, row.best_s = progress.failed, progress.best_s
            if result is not None:
                row.result = dict(result)
            if error is not None:
                row.error = error
            row.updated_at = row.heartbeat_at = utcnow()
            s.flush()
            return _job(row)

    def claim_job(self, job_id: int | None = None, *, driver: str | None = None) -> JobRecord | None:
        """Atomically take a queued job (the given one, else the oldest) and mark it running, by ``driver``
        (``coconet.server.driver``'s text of the process that runs it); None if there is none."""
        with self._tx("claim_job", write=True) as s:
            q = select(JobRow).where(JobRow.state == "queued")
            if job_id is not None:
                q = q.where(JobRow.id == job_id)
            row = s.scalars(q.order_by(JobRow.id).limit(1).with_for_update(skip_locked=True)).first()
            if row is None:
                return None
            _enter(row, "running")
            row.driver = driver
            row.updated_at = row.heartbeat_at = utcnow()
            s.flush()
            return _job(row)

    def job(self, job_id: int) -> JobRecord | None:
        with self._tx("job") as s:
            row = s.get(JobRow, job_id)
            return _job(row) if row else None

    def jobs(self, state: str | None = None, *, program_hash: str | None = None, newest_first: bool = False,
             limit: int | None = None) -> list[JobRecord]:
        """Jobs in the order they were created (or newest first), of one state and/or one program if given."""
        with self._tx("jobs") as s:
            q = select(JobRow).order_by(JobRow.id.desc() if newest_first else JobRow.id).limit(limit)
            if state is not None:
                q = q.where(JobRow.state == state)
            if program_hash is not None:
                q = q.where(JobRow.program_hash == program_hash)
            return [_job(r) for r in s.scalars(q)]

    def active_job(self, program_hash: str, sizes: Mapping[str, int], topology: str, world: int, *,
                   shardable: str = shard.EVERY) -> JobRecord | None:
        """The oldest queued or running job for this key, if any: a second request for it joins that job."""
        with self._tx("active_job") as s:
            row = _oldest_job(s, program_hash, sizes_key(sizes), topology, world, shardable, ACTIVE_STATES)
            return _job(row) if row is not None else None

    def join_job(self, program_hash: str, sizes: Mapping[str, int], topology: str, world: int, *,
                 budget: int | None = None, backends: Sequence[str] = (),
                 shardable: str = shard.EVERY) -> tuple[JobRecord, bool]:
        """The key's queued or running job, else a new queued one, in one transaction: requests for one key
        arriving together get one job. Returns the job and whether it is new."""
        key = sizes_key(sizes)
        _check_world(world)
        with self._key_tx("join_job", program_hash, key, topology, world, shardable) as s:
            row = _oldest_job(s, program_hash, key, topology, world, shardable, ACTIVE_STATES)
            if row is not None:
                return _job(row), False
            row = _new_job(program_hash, sizes, key, topology, world, shardable, budget, backends, running=False)
            s.add(row)
            s.flush()
            return _job(row), True

    def take_job(self, program_hash: str, sizes: Mapping[str, int], topology: str, world: int, *,
                 budget: int | None = None, backends: Sequence[str] = (), shardable: str = shard.EVERY,
                 driver: str | None = None, abandoned: Callable[[JobRecord], bool] | None = None) -> JobRecord:
        """A running job for a tuner that tunes the key itself (``coconet tune``, ``driver`` its process): the
        key's queued job, claimed and given this run's budget and backends (the service's workers would only
        tune the key again), else a new one. A job already running elsewhere is left to run; with
        ``abandoned``, it is looked at in the same transaction: one that nobody runs any more is marked
        interrupted, and one that is still run refuses the take (``KeyBusy``)."""
        key = sizes_key(sizes)
        _check_world(world)
        with self._key_tx("take_job", program_hash, key, topology, world, shardable) as s:
            # The queued job first, waiting for a worker that is claiming it (claim_job holds no key lock): had it
            # been passed over, the worker and this tuner would both tune the key. Under READ COMMITTED the look
            # at the running jobs that follows then sees that claim.
            row = _oldest_job(s, program_hash, key, topology, world, shardable, ("queued",), lock=True)
            if abandoned is not None:
                running = _key_jobs(program_hash, key, topology, world, shardable, ("running",)).with_for_update()
                for other in s.scalars(running).all():
                    if not abandoned(_job(other)):
                        raise KeyBusy(f"job {other.id} of this key is running", running=other.id, driver=other.driver)
                    other.state, other.error, other.updated_at = "interrupted", RETAKEN, utcnow()
            if row is None:
                row = _new_job(program_hash, sizes, key, topology, world, shardable, budget, backends, running=True)
                s.add(row)
            else:
                _enter(row, "running")
                row.budget, row.trials_total, row.backends = budget, budget, list(backends)
                row.updated_at = row.heartbeat_at = utcnow()
            row.driver = driver
            s.flush()
            return _job(row)

    @contextmanager
    def _key_tx(self, what: str, program_hash: str, key: str, topology: str, world: int,
                shardable: str) -> Iterator[Session]:
        """A write transaction on the jobs of one key, of a program the store holds. Under READ COMMITTED two of
        them could both find no job and both add one: on PostgreSQL a lock per key, held to the commit, orders
        them (SQLite's write transactions run one at a time already)."""
        _check_shardable(shardable)
        with self._tx(what, write=True) as s:
            _require_programs(s, {program_hash})
            if s.get_bind().dialect.name == "postgresql":
                s.execute(text("SELECT pg_advisory_xact_lock(:id)"),
                          {"id": _lock_id("job", program_hash, key, topology, str(world), shardable)})
            yield s

    # -- measurements

    def add_measurement(self, measurement: NewMeasurement | None = None, /, **fields: Any) -> int:
        """Record one measurement, given as a ``NewMeasurement`` or as its fields; returns its id."""
        return self.add_measurements([measurement if measurement is not None else NewMeasurement(**fields)])[0]

    def add_measurements(self, rows: Iterable[NewMeasurement]) -> list[int]:
        """Record many measurements in one transaction (an offline sweep's predictions); ids in order."""
        values = [_measurement_values(m) for m in rows]
        if not values:
            return []
        table = MeasurementRow.__table__
        with self._tx("add_measurements", write=True) as s:
            _require_programs(s, {v["program_hash"] for v in values})
            _require_jobs(s, {v["job_id"] for v in values if v["job_id"] is not None})
            # Core executemany: the ORM's per-object bookkeeping would dominate a 10,000-row sweep.
            conn = s.connection()
            if conn.dialect.name == "postgresql":
                # psycopg parses a multi-row INSERT … RETURNING in Python (5 s for 10,000 rows); ids drawn from the
                # sequence first let the rows go as a plain pipelined executemany (under 1 s).
                draw = text("SELECT nextval(pg_get_serial_sequence(:t, 'id')) FROM generate_series(1, :n)")
                ids = list(conn.execute(draw, {"t": table.name, "n": len(values)}).scalars())
                conn.execute(table.insert(), [{**v, "id": i} for v, i in zip(values, ids)])
                return ids
            result = conn.execute(table.insert().returning(table.c.id, sort_by_parameter_order=True), values)
            return list(result.scalars())

    def measurement_digests(self, program_hash: str) -> list[MeasurementDigest]:
        """Every measurement of a program in the order recorded, as digests: the columns a listing shows, read
        without building ORM objects or decoding the JSON ones."""
        names = [f.name for f in fields(MeasurementDigest) if f.name != "sizes"]
        with self._tx("measurement_digests") as s:
            q = select(*(getattr(MeasurementRow, n) for n in names)).where(MeasurementRow.program_hash == program_hash)
            sizes: dict[str, dict[str, int]] = {}
            out = []
            for row in s.execute(q.order_by(MeasurementRow.id)):
                values = dict(zip(names, row))
                values["created_at"] = _utc(values["created_at"])
                key = values["sizes_key"]
                if key not in sizes:
                    sizes[key] = parse_sizes_key(key)
                out.append(MeasurementDigest(sizes=sizes[key], **values))
            return out

    def measurement(self, measurement_id: int) -> MeasurementRecord | None:
        with self._tx("measurement") as s:
            row = s.get(MeasurementRow, measurement_id)
            return _record(MeasurementRecord, row) if row else None

    def measurements(
        self,
        program_hash: str,
        sizes: Mapping[str, int] | None = None,
        topology: str | None = None,
        job_id: int | None = None,
        *,
        world: int | None = None,
        backend: str | None = None,
        source: str | None = None,
        after: int = 0,
        limit: int | None = None,
    ) -> list[MeasurementRecord]:
        """Measurements of a program in the order they were recorded; ``after`` (an id) and ``limit`` page through
        them, as a sweep may have recorded millions."""
        with self._tx("measurements") as s:
            q = _key_filter(select(MeasurementRow), MeasurementRow, program_hash, sizes, topology, world, backend)
            if job_id is not None:
                q = q.where(MeasurementRow.job_id == job_id)
            if source is not None:
                q = q.where(MeasurementRow.source == source)
            if after:
                q = q.where(MeasurementRow.id > after)
            q = q.order_by(MeasurementRow.id).limit(limit)
            return [_record(MeasurementRecord, r) for r in s.scalars(q)]

    def measurement_count(
        self, program_hash: str, sizes: Mapping[str, int] | None = None, topology: str | None = None
    ) -> int:
        with self._tx("measurement_count") as s:
            q = _key_filter(select(func.count()).select_from(MeasurementRow), MeasurementRow, program_hash, sizes,
                            topology, None, None)
            return s.scalar(q) or 0

    def schedule_measurement(self, schedule_hash: str, program_hash: str | None = None) -> MeasurementRecord | None:
        """A measurement of the schedule with this hash that kept the schedule's JSON (what its code is generated
        from): one that won first, the schedules people ask code for, else any."""
        m = MeasurementRow
        with self._tx("schedule_measurement") as s:
            # Without the JSON a measurement holds JSON null, not SQL NULL (the column's type writes None so).
            anyq = select(m).where(m.schedule_hash == schedule_hash, m.schedule_json.is_not(None),
                                   cast(m.schedule_json, Text) != "null")
            if program_hash is not None:
                anyq = anyq.where(m.program_hash == program_hash)
            won = anyq.join(WinnerRow, WinnerRow.measurement_id == m.id)
            row = s.scalars(won.limit(1)).first() or s.scalars(anyq.limit(1)).first()
            return _record(MeasurementRecord, row) if row is not None else None

    def done_keys(
        self,
        program_hash: str,
        sizes: Mapping[str, int] | None = None,
        topology: str | None = None,
        *,
        world: int | None = None,
        backend: str | None = None,
        source: str | None = None,
    ) -> set[DoneKey]:
        """The (program, sizes, topology, world, backend, schedule, source) that already have a record, any status:
        a failure is a result too, so a resumed sweep or study does not run it again."""
        m = MeasurementRow
        cols = (m.program_hash, m.sizes_key, m.topology, m.world, m.backend, m.schedule_hash, m.source)
        with self._tx("done_keys") as s:
            q = _key_filter(select(*cols).distinct(), m, program_hash, sizes, topology, world, backend)
            if source is not None:
                q = q.where(m.source == source)
            return {DoneKey(*r) for r in s.execute(q)}

    # -- winners

    def add_winner(
        self,
        measurement_id: int,
        *,
        runner_up_id: int | None = None,
        baseline_id: int | None = None,
        speedup: float | None = None,
        job_id: int | None = None,
        shardable: str = shard.EVERY,
        order_reversed: bool = False,
    ) -> int:
        """Record a measurement as the winner of its (program, sizes, topology, world, backend) among the schedules
        that shard at most ``shardable``; returns the id. ``order_reversed``: the re-timing that chose it reversed
        the search's order of it and the runner-up.

        The key and source come from the measurement; ``speedup`` defaults to baseline median / winner median.
        """
        return self.add_winners([(measurement_id, runner_up_id, baseline_id)], speedups=[speedup], job_id=job_id,
                                shardable=shardable, order_reversed=[order_reversed])[0]

    def add_winners(
        self,
        rows: Sequence[tuple[int, int | None, int | None]],
        *,
        speedups: Sequence[float | None] | None = None,
        job_id: int | None = None,
        shardable: str = shard.EVERY,
        order_reversed: Sequence[bool] | None = None,
    ) -> list[int]:
        """Many winners in one transaction (an offline sweep's): (winner, runner-up, baseline) measurement ids."""
        if not rows:
            return []
        _check_shardable(shardable)
        allowed = shard.names(shardable)
        speedups = list(speedups) if speedups is not None else [None] * len(rows)
        flips = list(order_reversed) if order_reversed is not None else [False] * len(rows)
        with self._tx("add_winners", write=True) as s:
            wanted = {i for r in rows for i in r if i is not None}
            by_id = {m.id: m for m in s.scalars(select(MeasurementRow).where(MeasurementRow.id.in_(wanted)))}
            if job_id is not None:
                _require_jobs(s, {job_id})
            now = utcnow()
            values = [{**_winner_values(by_id, *r, speedup, job_id, shardable, allowed, now), "order_reversed": flip}
                      for r, speedup, flip in zip(rows, speedups, flips)]
            table = WinnerRow.__table__
            conn = s.connection()
            if conn.dialect.name == "postgresql":  # as in add_measurements: ids first, then a plain executemany
                draw = text("SELECT nextval(pg_get_serial_sequence(:t, 'id')) FROM generate_series(1, :n)")
                ids = list(conn.execute(draw, {"t": table.name, "n": len(values)}).scalars())
                conn.execute(table.insert(), [{**v, "id": i} for v, i in zip(values, ids)])
                return ids
            result = conn.execute(table.insert().returning(table.c.id, sort_by_parameter_order=True), values)
            return list(result.scalars())

    def winners(
        self, program_hash: str, sizes: Mapping[str, int] | None = None, topology: str | None = None
    ) -> list[WinnerRecord]:
        """Every winner recorded, oldest first: the tuning history behind ``best``."""
        with self._tx("winners") as s:
            q = _key_filter(select(WinnerRow), WinnerRow, program_hash, sizes, topology, None, None)
            return [_record(WinnerRecord, r) for r in s.scalars(q.order_by(WinnerRow.created_at, WinnerRow.id))]

    def best(
        self,
        program_hash: str,
        sizes: Mapping[str, int],
        topology: str,
        world: int | None = None,
        *,
        backend: str | None = None,
        shardable: str | None = None,
        source: str | None = None,
    ) -> Best | None:
        """The winner for these exact sizes; else, flagged ``exact=False``, the one of the nearest tuned sizes
        (same program, topology and dim names); None when nothing comparable was tuned. The winner of a key is
        the fastest of the current ones of its (world, backend) pairs, the current one of a pair being its
        newest (a tuning again replaces it): a tuning narrowed to gloo after one on shm does not hide the
        faster shm winner, as GET /results lists both. ``world`` and ``backend`` narrow the search; left out,
        any world or backend counts. ``shardable``: only a winner that answers a question allowing that state
        to stay sharded (``shardable.answers``); left out, any winner.

        A measurement outranks a prediction (``source`` "model", an offline sweep's): a pair's current winner is
        its newest measured one, a predicted one only where the pair has none, and a key with any measured pair
        answers with the fastest of those. Among the nearest sizes, those with a measured winner come first.
        ``source`` ("measured" or "model") takes only winners of that source."""
        # The API's hot path: statements rendered once, one round trip for an exact answer.
        params = {"program": program_hash, "topology": topology, "key": sizes_key(sizes), "world": world,
                  "backend": backend}
        narrowed = (world is not None, backend is not None)
        if shardable is not None:
            _check_shardable(shardable)
        if source is not None and source not in SOURCES:
            raise StoreError(f"source {source!r} is not one of {', '.join(SOURCES)}")
        one_pair = all(narrowed)
        # one (world, backend) pair without a question on sharding: its newest row answers, read alone
        newest = self._newest[(*narrowed, one_pair and shardable is None and source is None)]

        def answers(row: Sequence[Any]) -> bool:  # the columns are plain strings on every driver
            return ((source is None or row[_W_SOURCE] == source) and
                    (shardable is None or shard.answers(row[_W_SHARDABLE], shardable, sharded_by(row[_M_SCHEDULE]))))

        def winner(cursor: Any, values: Mapping[str, Any]) -> list[Any] | None:
            if one_pair:
                return newest.first(cursor, values, answers)
            current: dict[tuple[Any, Any], Sequence[Any]] = {}
            # measured first, then newest first: the first row of a pair is its current one
            for row in newest.each(cursor, values):
                if answers(row):
                    current.setdefault((row[_W_WORLD], row[_W_BACKEND]), row)
            measured = [r for r in current.values() if r[_W_SOURCE] == "measured"]
            # a predicted time is no rival for a measured one, whatever the two numbers say
            rivals = measured or list(current.values())
            if not rivals:
                return None
            # min keeps the first of equals: of equally fast pairs, the one tuned last
            return newest.processed(cursor, min(rivals, key=lambda r: float(r[_M_MEDIAN])))

        def read(cursor: Any) -> Best | None:
            row = winner(cursor, params)
            if row is not None:
                return _best_of_row(row, exact=True, distance=0.0)
            near = []
            for other, measured in self._tuned_keys[narrowed].rows(cursor, params):
                d = size_distance(sizes, parse_sizes_key(other))
                if d is not None:
                    near.append((not measured, d, other))
            for _, d, other in sorted(near):
                row = winner(cursor, {**params, "key": other})
                if row is not None:
                    return _best_of_row(row, exact=False, distance=d)
            return None

        return self._read("best", read)

    def results(self, program_hash: str, topology: str | None = None) -> list[Best]:
        """The current winner of every (sizes, topology, world, backend, shardable) tuned for a program, smallest
        sizes first."""
        with self._tx("results") as s:
            q = _valid_winners().where(WinnerRow.program_hash == program_hash)
            if topology is not None:
                q = q.where(WinnerRow.topology == topology)
            newest: dict[tuple, WinnerRow] = {}
            # as in best: a key's current winner is its newest measured one, a predicted one where none is
            for row in s.scalars(q.order_by(_MEASURED_FIRST, WinnerRow.created_at.desc(), WinnerRow.id.desc())):
                newest.setdefault((row.sizes_key, row.topology, row.world, row.backend, row.shardable), row)
            rows = sorted(
                newest.values(), key=lambda r: (r.topology, r.backend, r.world, sorted(r.sizes.items()), r.shardable)
            )
            return _best(s, rows, exact=True, distance=0.0)

    def result_counts(self) -> dict[str, int]:
        """``len(results(h))`` for every program with a result, in one statement: the keys with a valid winner."""
        with self._tx("result_counts") as s:
            q = _valid_winners().with_only_columns(WinnerRow.program_hash, WinnerRow.sizes_key, WinnerRow.topology,
                                                   WinnerRow.world, WinnerRow.backend, WinnerRow.shardable).distinct()
            return dict(Counter(row[0] for row in s.execute(q)))

    def reading(self, what: str) -> AbstractContextManager[Session]:
        """A read-only transaction for queries written outside the store (the dashboard's filtered pages), on
        the read pool; SQLAlchemy's errors leave as a StoreError naming ``what``."""
        return self._tx(what)

    # -- plumbing

    def _read(self, what: str, read: Callable[[Any], _R]) -> _R:
        """``read(cursor)`` on a DB-API cursor of the read engine, outside a transaction: for reads of rows that
        are never updated (each statement sees one snapshot). The pool does not ping a connection before each
        use; one the database dropped (a restart) fails on first use instead, and the read, which changes
        nothing, runs once more on a fresh connection."""
        dialect = self._reader.dialect
        for attempt in (1, 2):
            try:
                conn = self._reader.raw_connection()
            except SQLAlchemyError as err:
                raise self._failed(what, err) from err
            try:
                cursor = conn.cursor()
                try:
                    return read(cursor)
                finally:
                    cursor.close()
            except dialect.loaded_dbapi.Error as err:
                if attempt == 1 and dialect.is_disconnect(err, conn.dbapi_connection, None):
                    conn.invalidate(err)
                    continue
                raise self._failed(what, err) from err
            finally:
                conn.close()
        raise AssertionError("unreachable: the second attempt returns or raises")

    @contextmanager
    def _tx(self, what: str, write: bool = False) -> Iterator[Session]:
        """One transaction, on the write pool if ``write``, else on the read pool; SQLAlchemy's errors leave as a
        StoreError naming the operation and the cause."""
        try:
            with (self._engine if write else self._reads).connect() as conn:
                if write:
                    conn.execution_options(**{_WRITE: True})
                with Session(bind=conn, expire_on_commit=False) as session, session.begin():
                    yield session
        except SQLAlchemyError as err:
            raise self._failed(what, err) from err

    def _failed(self, what: str, err: Exception) -> StoreError:
        """The StoreError for ``what`` failing with ``err``: ``operation`` names what failed, ``busy`` says whether
        it only waited too long (for a connection of the pool, or for a lock another connection held)."""
        busy = _busy(err)
        cause = _cause(err, self._wait_s) if isinstance(err, SQLAlchemyError) else " ".join(str(err).split())
        if busy and "locked" not in cause:
            cause += f" (waited {self._wait_s:g} s)"
        return StoreError(f"{what} on {self.url}: {cause}", url=self.url, operation=what, busy=busy)

    def _upgrade(self) -> None:
        try:
            with self._engine.connect() as conn:
                if _revision(conn) == SCHEMA_HEAD:
                    return
                conn.rollback()
                conn.execution_options(**{_WRITE: True})
                from alembic import command
                from alembic.util import CommandError

                config = alembic_config()
                config.attributes["connection"] = conn
                try:
                    command.upgrade(config, "head")
                except CommandError as err:
                    raise StoreError(
                        f"the database at {self.url} has a schema this coconet does not know ({err}); "
                        "is it from a newer coconet?",
                        url=self.url,
                    ) from err
        except SQLAlchemyError as err:
            raise StoreError(f"cannot open the store at {self.url}: {_cause(err)}", url=self.url) from err


def alembic_config() -> Any:
    """An Alembic config for the store's migrations, no alembic.ini needed; set ``attributes["connection"]``."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


def _engine(url_text: str, create: bool = True, wait_s: float | None = None) -> tuple[Engine, str]:
    try:
        url = make_url(url_text)
    except ArgumentError:
        raise StoreError(
            f"{url_text!r} is not a database URL (e.g. sqlite:////path/coconet.db or postgresql://user@host/db)"
        ) from None
    if url.drivername == "postgresql":
        # psycopg 3 is the driver coconet declares; SQLAlchemy would otherwise look for psycopg2.
        url = url.set(drivername="postgresql+psycopg")
    shown = url.render_as_string(hide_password=True)
    is_sqlite = url.get_backend_name() == "sqlite"
    if is_sqlite and not create and _sqlite_file(url) and not _sqlite_file(url).exists():
        raise StoreError(f"no store at {shown}: the file does not exist (coconet tune makes one)", url=shown)
    if is_sqlite:
        _make_parent_dir(url)
    busy_s = SQLITE_BUSY_S if wait_s is None else wait_s
    # an in-memory SQLite database lives in one connection (SingletonThreadPool): no pool to wait for
    in_memory = is_sqlite and _sqlite_file(url) is None
    options: dict[str, Any] = {} if in_memory else {"pool_timeout": busy_s}
    if wait_s is not None and not is_sqlite:  # PostgreSQL waits for a lock as long as it is held, unless told
        options["connect_args"] = {"options": f"-c lock_timeout={round(wait_s * 1000)}"}
    try:
        engine = create_engine(url, pool_pre_ping=not is_sqlite, **options)
    except (ArgumentError, NoSuchModuleError, ImportError) as err:
        raise StoreError(f"cannot open the store at {shown}: {err}", url=shown) from err
    if is_sqlite:
        event.listen(engine, "connect", partial(_sqlite_connect, busy_s=busy_s))
        event.listen(engine, "begin", _sqlite_begin)
    return engine, shown


def _reads_engine(engine: Engine) -> Engine:
    """The engine of the store's read transactions: the write engine's settings on a pool of its own."""
    if engine.dialect.name == "postgresql":
        return create_engine(engine.url, pool_pre_ping=True)
    if _sqlite_file(engine.url) is None:  # an in-memory database is its one connection: another would be empty
        return engine
    reads = create_engine(engine.url)
    event.listen(reads, "connect", _sqlite_connect)
    event.listen(reads, "begin", _sqlite_begin)
    return reads


def _read_engine(engine: Engine, reads: Engine) -> Engine:
    """The engine Store._read uses. On PostgreSQL its own pool: connections in autocommit for good (no BEGIN and
    ROLLBACK round trips) and no ping before each use (a round trip per lookup). On SQLite the read pool (its
    connections are in sqlite3's autocommit mode until the store emits BEGIN, which _read never does)."""
    if engine.dialect.name == "postgresql":
        return create_engine(engine.url, isolation_level="AUTOCOMMIT")
    return reads


class _Rendered:
    """A Core statement rendered once for one dialect and run on a plain DB-API cursor: on the API's hot path
    SQLAlchemy's work per execution (a Connection, the compiled-cache lookup, result metadata, row objects)
    cost more than the indexed read itself. Values still go through SQLAlchemy's own result processors (JSON,
    SQLite's datetimes), chosen once from the cursor's description. Parameters go as they are: the statements
    bind only strings and integers, which no dialect here converts."""

    def __init__(self, statement: Any, dialect: Any) -> None:
        self._compiled = statement.compile(dialect=dialect)
        self._sql = str(self._compiled)
        self._types = [c.type.dialect_impl(dialect) for c in statement.selected_columns]
        self._dialect = dialect
        self._processors: list[Any] | None = None

    def rows(self, cursor: Any, values: Mapping[str, Any]) -> list[list[Any]]:
        self._execute(cursor, values)
        return [self.processed(cursor, row) for row in cursor.fetchall()]

    def first(self, cursor: Any, values: Mapping[str, Any], keep: Callable[[Sequence[Any]], bool]) -> list[Any] | None:
        """The first row ``keep`` takes, judged on the values as the driver gives them (before JSON and dates are
        processed: only the row kept pays for that)."""
        for row in self.each(cursor, values):
            if keep(row):
                return self.processed(cursor, row)
        return None

    def each(self, cursor: Any, values: Mapping[str, Any]) -> Iterator[Sequence[Any]]:
        """The rows as the driver gives them; ``processed`` turns the one kept into values, before the cursor
        runs anything else."""
        self._execute(cursor, values)
        while rows := cursor.fetchmany(64):
            yield from rows

    def _execute(self, cursor: Any, values: Mapping[str, Any]) -> None:
        params = self._compiled.construct_params(values)
        cursor.execute(self._sql, tuple(params[k] for k in self._compiled.positiontup)
                       if self._compiled.positional else params)

    def processed(self, cursor: Any, row: Sequence[Any]) -> list[Any]:
        if self._processors is None:
            self._processors = [t.result_processor(self._dialect, d[1])
                                for t, d in zip(self._types, cursor.description)]
        return [f(v) if f else v for f, v in zip(self._processors, row)]


def _sqlite_file(url: URL) -> Path | None:
    db = url.database or ""
    return Path(db).expanduser() if db and db != ":memory:" and not db.startswith("file:") else None


def _make_parent_dir(url: URL) -> None:
    path = _sqlite_file(url)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StoreError(f"cannot create the directory of {path}: {err.strerror}") from None


def _sqlite_connect(dbapi_conn: Any, _record: Any, busy_s: float = SQLITE_BUSY_S) -> None:
    # We emit BEGIN ourselves (below), so sqlite3's own transaction handling is turned off.
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout = {round(busy_s * 1000)}")
    _sqlite_wal(cur, dbapi_conn.OperationalError, busy_s)
    cur.execute("PRAGMA synchronous = NORMAL")  # durable enough under WAL, and much faster per commit
    cur.execute("PRAGMA foreign_keys = ON")
    cur.close()


def _sqlite_wal(cur: Any, busy: type[Exception], busy_s: float = SQLITE_BUSY_S) -> None:
    """Puts the file in WAL mode, where readers never wait for the writer. Processes opening a fresh file at
    once can meet mid-change, and SQLite then fails one with "database is locked" at once instead of calling
    the busy handler: that one tries again, for as long as the busy timeout would have waited."""
    deadline = time.monotonic() + busy_s
    pause = 0.001
    while True:
        try:
            if cur.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                cur.execute("PRAGMA journal_mode = WAL")
            return
        except busy as err:
            if "locked" not in str(err) or time.monotonic() + pause > deadline:
                raise
            time.sleep(pause)
            pause = min(2 * pause, 0.1)


def _sqlite_begin(conn: Any) -> None:
    # A deferred transaction that reads and then writes fails at once with "database is locked" when another
    # process wrote in between (busy_timeout cannot help); writers take the lock up front and wait for it instead.
    conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITE) else "BEGIN")


def _revision(conn: Any) -> str | None:
    if not inspect(conn).has_table(VERSION_TABLE):
        return None
    return conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()


def _cause(err: SQLAlchemyError, busy_s: float = SQLITE_BUSY_S) -> str:
    cause = getattr(err, "orig", None) or err
    message = " ".join(str(cause).split())
    if "database is locked" in message:
        message += f" (another process kept the SQLite file locked; busy timeout {busy_s:g} s)"
    return message[:500]


def unavailable(err: StoreError) -> str:
    """What a client may be told of a failure of the store: whether it was busy, and what failed; never the
    cause's text, which names the database (its URL, host and port, the driver's words)."""
    if getattr(err, "busy", False):
        return "the results store is busy; retry"
    what = getattr(err, "operation", None)
    return f"the results store is unavailable ({f'{what} failed; ' if what else ''}the server's log says why)"


def _busy(err: Exception) -> bool:
    """Whether ``err`` is a wait given up: for a connection of the pool, SQLite's file lock, a PostgreSQL lock."""
    if isinstance(err, PoolTimeout):
        return True
    cause = getattr(err, "orig", None)
    if getattr(cause, "sqlstate", None) == "55P03":  # lock_not_available: lock_timeout ran out
        return True
    return isinstance(err, OperationalError) and any(m in str(cause) for m in ("database is locked",
                                                                               "database is busy"))


_R = TypeVar("_R")


def _utc(value: Any) -> Any:
    # SQLite keeps no zone; every time we write is UTC.
    if isinstance(value, datetime) and value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value


def _record(cls: type[_R], row: Base) -> _R:
    return cls(**{f.name: _utc(getattr(row, f.name)) for f in fields(cls)})  # type: ignore[arg-type]


def _job(row: JobRow) -> JobRecord:
    values = {f.name: _utc(getattr(row, f.name)) for f in fields(JobRecord) if f.name != "progress"}
    progress = Progress(row.trials_done, row.trials_total, row.trials_failed, row.best_s)
    return JobRecord(progress=progress, **values)


def _fingerprint_text(fp: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(fp.items()) if k in ("machine", "cpu", "cpus", "gpus", "cores"))


def _new_job(program_hash: str, sizes: Mapping[str, int], key: str, topology: str, world: int, shardable: str,
             budget: int | None, backends: Sequence[str], running: bool) -> JobRow:
    now = utcnow()
    return JobRow(program_hash=program_hash, sizes=_sorted(sizes), sizes_key=key, topology=topology, world=world,
                  shardable=shardable, budget=budget, backends=list(backends),
                  state="running" if running else "queued", trials_done=0, trials_total=budget, trials_failed=0,
                  created_at=now, updated_at=now,
                  heartbeat_at=now if running else None)


def _enter(row: JobRow, state: str) -> None:
    """Moves a job to ``state``; an error that no longer describes it goes (see _CLEARS_ERROR)."""
    if state in _CLEARS_ERROR and state != row.state:
        row.error = None
    row.state = state


def _oldest_job(s: Session, program_hash: str, key: str, topology: str, world: int, shardable: str,
                states: Sequence[str], *, lock: bool = False) -> JobRow | None:
    """The key's oldest job in one of ``states``; ``lock``: its row locked for update, after any transaction
    holding it ends (a row it took out of ``states`` is then not returned)."""
    q = _key_jobs(program_hash, key, topology, world, shardable, states).limit(1)
    return s.scalars(q.with_for_update() if lock else q).first()


def _key_jobs(program_hash: str, key: str, topology: str, world: int, shardable: str, states: Sequence[str]):
    """The key's jobs in one of ``states``, oldest first."""
    return select(JobRow).where(JobRow.program_hash == program_hash, JobRow.sizes_key == key,
                                JobRow.topology == topology, JobRow.world == world, JobRow.shardable == shardable,
                                JobRow.state.in_(states)).order_by(JobRow.id)


def _lock_id(*parts: str) -> int:
    """A signed 64-bit PostgreSQL advisory-lock id for ``parts``."""
    digest = hashlib.sha256("\x00".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _sorted(sizes: Mapping[str, int]) -> dict[str, int]:
    return {k: sizes[k] for k in sorted(sizes)}


def _check_shardable(text: Any) -> None:
    try:
        shard.check(text)
    except CoconetError as e:
        raise StoreError(str(e)) from None


def _check_world(world: Any) -> None:
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise StoreError(f"world {world!r} must be a positive integer")


def _optional_float(name: str, value: Any) -> float | None:
    if value is None:
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise StoreError(f"{name} {value!r} is not a number") from None
    if not math.isfinite(out):
        raise StoreError(f"{name} {value!r} is not finite")
    return out


def _measurement_values(m: NewMeasurement) -> dict[str, Any]:
    if not isinstance(m, NewMeasurement):
        raise StoreError(f"a measurement is a NewMeasurement, not {type(m).__name__}")
    if m.status not in STATUSES:
        raise StoreError(f"measurement status {m.status!r} is not one of {', '.join(STATUSES)}")
    if m.source not in SOURCES:
        raise StoreError(f"measurement source {m.source!r} is not one of {', '.join(SOURCES)}")
    _check_world(m.world)
    samples = [_optional_float("sample", x) for x in m.samples]
    median = _optional_float("median_s", m.median_s)
    if m.status == "ok" and median is None:
        raise StoreError(f"an ok measurement of {m.schedule!r} needs median_s")
    return {
        "job_id": m.job_id,
        "program_hash": m.program_hash,
        "sizes": _sorted(m.sizes),
        "sizes_key": sizes_key(m.sizes),
        "topology": m.topology,
        "world": m.world,
        "backend": m.backend,
        "schedule": m.schedule,
        "schedule_hash": m.schedule_hash,
        "schedule_json": dict(m.schedule_json) if m.schedule_json is not None else None,
        "knobs": dict(m.knobs),
        "status": m.status,
        "error": m.error,
        "samples": samples,
        "n": m.n if m.n is not None else len(samples),
        "median_s": median,
        "ci_lo_s": _optional_float("ci_lo_s", m.ci_lo_s),
        "ci_hi_s": _optional_float("ci_hi_s", m.ci_hi_s),
        "max_rel_err": _optional_float("max_rel_err", m.max_rel_err),
        "source": m.source,
        "versions": {"coconet": __version__, **m.versions},
        "created_at": utcnow(),
    }


def _insert_missing(s: Session, model: type[Base], values: dict[str, Any]) -> None:
    """Insert unless the primary key exists, without a race between two writers (PostgreSQL does not lock as
    SQLite's BEGIN IMMEDIATE does)."""
    name = s.get_bind().dialect.name
    if name in ("postgresql", "sqlite"):
        dialect = importlib.import_module(f"sqlalchemy.dialects.{name}")
        s.execute(dialect.insert(model).values(**values).on_conflict_do_nothing())
    elif s.get(model, values[inspect(model).primary_key[0].name]) is None:
        s.add(model(**values))


def _require_programs(s: Session, hashes: set[str]) -> None:
    known = set(s.scalars(select(ProgramRow.hash).where(ProgramRow.hash.in_(hashes))))
    missing = sorted(hashes - known)
    if missing:
        raise StoreError(
            f"unknown program {missing[0]}: record the program (add_program) before its jobs and measurements",
            program_hash=missing[0],
        )


def _require_jobs(s: Session, ids: set[int]) -> None:
    known = set(s.scalars(select(JobRow.id).where(JobRow.id.in_(ids)))) if ids else set()
    missing = sorted(ids - known)
    if missing:
        raise StoreError(f"no job {missing[0]}", job_id=missing[0])


def _problem(m: MeasurementRow) -> tuple:
    return (m.program_hash, m.sizes_key, m.topology, m.world)


def _world_backend(q: Any, model: Any, world: int | None, backend: str | None) -> Any:
    if world is not None:
        q = q.where(model.world == world)
    if backend is not None:
        q = q.where(model.backend == backend)
    return q


def _key_filter(q: Any, model: Any, program_hash: str, sizes: Mapping[str, int] | None, topology: str | None,
                world: int | None, backend: str | None) -> Any:
    q = q.where(model.program_hash == program_hash)
    if sizes is not None:
        q = q.where(model.sizes_key == sizes_key(sizes))
    if topology is not None:
        q = q.where(model.topology == topology)
    return _world_backend(q, model, world, backend)


def _winner_values(by_id: Mapping[int, MeasurementRow], measurement_id: int, runner_up_id: int | None,
                   baseline_id: int | None, speedup: float | None, job_id: int | None, shardable: str,
                   allowed: frozenset[str] | None, now: datetime) -> dict:
    """``allowed``: ``shardable``'s names (None: any)."""
    win = by_id.get(measurement_id)
    if win is None:
        raise StoreError(f"no measurement {measurement_id}", measurement_id=measurement_id)
    if win.status != "ok" or win.median_s is None:
        raise StoreError(
            f"measurement {measurement_id} is {win.status} without a time; only a valid one can win",
            measurement_id=measurement_id,
        )
    outside = sorted(set(sharded_by(win.schedule)) - allowed) if allowed is not None else []
    if outside:
        raise StoreError(f"measurement {measurement_id} leaves {', '.join(outside)} sharded, which shardable "
                         f"{shardable!r} does not allow", measurement_id=measurement_id)
    for role, other_id in (("runner-up", runner_up_id), ("baseline", baseline_id)):
        if other_id is None:
            continue
        other = by_id.get(other_id)
        if other is None:
            raise StoreError(f"no {role} measurement {other_id}", measurement_id=other_id)
        if _problem(other) != _problem(win):
            raise StoreError(
                f"{role} measurement {other_id} is for another program, sizes, topology or world than "
                f"measurement {measurement_id}",
                measurement_id=other_id,
            )
    base = by_id.get(baseline_id) if baseline_id is not None else None
    if speedup is None and base is not None and base.median_s and win.median_s > 0:
        speedup = base.median_s / win.median_s
    return dict(
        program_hash=win.program_hash, sizes=win.sizes, sizes_key=win.sizes_key, topology=win.topology,
        world=win.world, shardable=shardable, backend=win.backend, measurement_id=win.id, runner_up_id=runner_up_id,
        baseline_id=baseline_id, speedup=speedup, source=win.source,
        job_id=job_id if job_id is not None else win.job_id, created_at=now,
    )


def _valid_winners() -> Any:
    return select(WinnerRow).join(MeasurementRow, WinnerRow.measurement_id == MeasurementRow.id).where(
        MeasurementRow.status == "ok", MeasurementRow.median_s.is_not(None)
    )


# best()'s statements, built once per combination of the optional filters. The newest valid winner of a key
# comes with its measurement, runner-up and baseline in one row, its columns in the records' field order.
_W, _M = WinnerRow.__table__, MeasurementRow.__table__
_MEASURED_FIRST = case((_W.c.source == "measured", 0), else_=1)
_RUNNER_UP, _BASELINE = _M.alias("runner_up"), _M.alias("baseline")
_W_FIELDS, _M_FIELDS = [f.name for f in fields(WinnerRecord)], [f.name for f in fields(MeasurementRecord)]


def _world_backend_params(q: Any, by_world: bool, by_backend: bool) -> Any:
    if by_world:
        q = q.where(_W.c.world == bindparam("world"))
    if by_backend:
        q = q.where(_W.c.backend == bindparam("backend"))
    return q


def _newest_statement(by_world: bool, by_backend: bool, first: bool) -> Any:
    columns = [_W.c[n].label(f"w_{n}") for n in _W_FIELDS] + [
        t.c[n].label(f"{p}_{n}") for p, t in (("m", _M), ("r", _RUNNER_UP), ("b", _BASELINE)) for n in _M_FIELDS]
    q = (select(*columns)
         .join_from(_W, _M, _M.c.id == _W.c.measurement_id)
         .outerjoin(_RUNNER_UP, _RUNNER_UP.c.id == _W.c.runner_up_id)
         .outerjoin(_BASELINE, _BASELINE.c.id == _W.c.baseline_id)
         .where(_W.c.program_hash == bindparam("program"), _W.c.topology == bindparam("topology"),
                _W.c.sizes_key == bindparam("key"), _M.c.status == "ok", _M.c.median_s.is_not(None)))
    q = _world_backend_params(q, by_world, by_backend).order_by(_MEASURED_FIRST, _W.c.created_at.desc(),
                                                                 _W.c.id.desc())
    return q.limit(1) if first else q


def _tuned_keys_statement(by_world: bool, by_backend: bool) -> Any:
    """Each tuned key of a program and topology, with whether any of its winners was measured."""
    measured = func.max(case((_W.c.source == "measured", 1), else_=0))
    q = (select(_W.c.sizes_key, measured)
         .where(_W.c.program_hash == bindparam("program"), _W.c.topology == bindparam("topology")))
    return _world_backend_params(q, by_world, by_backend).group_by(_W.c.sizes_key)


_NARROWED = [(w, b) for w in (False, True) for b in (False, True)]
_NEWEST = {(*n, first): _newest_statement(*n, first) for n in _NARROWED for first in (False, True)}
_W_SHARDABLE, _W_WORLD, _W_BACKEND, _W_SOURCE = (_W_FIELDS.index(n)
                                                  for n in ("shardable", "world", "backend", "source"))
_M_SCHEDULE, _M_MEDIAN = (len(_W_FIELDS) + _M_FIELDS.index(n) for n in ("schedule", "median_s"))
_TUNED_KEYS = {n: _tuned_keys_statement(*n) for n in _NARROWED}


def _best_of_row(row: Sequence[Any], *, exact: bool, distance: float) -> Best:
    nw, nm = len(_W_FIELDS), len(_M_FIELDS)

    def measurement(start: int) -> MeasurementRecord | None:
        values = row[start:start + nm]
        if values[0] is None:  # an outer join that found no runner-up or baseline
            return None
        return MeasurementRecord(*(_utc(v) for v in values))

    return Best(exact=exact, distance=distance, winner=WinnerRecord(*(_utc(v) for v in row[:nw])),
                measurement=measurement(nw), runner_up=measurement(nw + nm), baseline=measurement(nw + 2 * nm))


def _best(s: Session, rows: Sequence[WinnerRow], *, exact: bool, distance: float) -> list[Best]:
    ids = {i for r in rows for i in (r.measurement_id, r.runner_up_id, r.baseline_id) if i is not None}
    found = s.scalars(select(MeasurementRow).where(MeasurementRow.id.in_(ids)))
    by_id = {m.id: _record(MeasurementRecord, m) for m in found}
    return [
        Best(
            exact=exact,
            distance=distance,
            winner=_record(WinnerRecord, r),
            measurement=by_id[r.measurement_id],
            runner_up=by_id.get(r.runner_up_id) if r.runner_up_id is not None else None,
            baseline=by_id.get(r.baseline_id) if r.baseline_id is not None else None,
        )
        for r in rows
    ]
