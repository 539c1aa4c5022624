"""The store's job queue: tuning jobs, one key (program, sizes, topology, world, shardable) at a time, queued for
the service's workers or taken by a tuner that runs the key itself, and moved on from state to state."""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from dataclasses import fields
from typing import Any, Callable, Iterator, Mapping, Sequence

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from coconet.errors import KeyBusy, StoreError
from coconet.schedules import shardable as shard
from coconet.server.keys import sizes_key
from coconet.server.models import JOB_STATES, JobRow, utcnow
from coconet.server.records import JobRecord, Progress
from coconet.server.store.engine import StoreBase
from coconet.server.store.rows import check_shardable, check_world, require_programs, sorted_sizes, utc

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


class JobQueue(StoreBase):
    """The tuning jobs of a store."""

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
        check_world(world)
        check_shardable(shardable)
        with self._tx("create_job", write=True) as s:
            require_programs(s, {program_hash})
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

    def jobs(
        self,
        state: str | None = None,
        *,
        program_hash: str | None = None,
        newest_first: bool = False,
        limit: int | None = None,
    ) -> list[JobRecord]:
        """Jobs in the order they were created (or newest first), of one state and/or one program if given."""
        with self._tx("jobs") as s:
            q = select(JobRow).order_by(JobRow.id.desc() if newest_first else JobRow.id).limit(limit)
            if state is not None:
                q = q.where(JobRow.state == state)
            if program_hash is not None:
                q = q.where(JobRow.program_hash == program_hash)
            return [_job(r) for r in s.scalars(q)]

    def active_job(
        self, program_hash: str, sizes: Mapping[str, int], topology: str, world: int, *, shardable: str = shard.EVERY
    ) -> JobRecord | None:
        """The oldest queued or running job for this key, if any: a second request for it joins that job."""
        with self._tx("active_job") as s:
            row = _oldest_job(s, program_hash, sizes_key(sizes), topology, world, shardable, ACTIVE_STATES)
            return _job(row) if row is not None else None

    def join_job(
        self,
        program_hash: str,
        sizes: Mapping[str, int],
        topology: str,
        world: int,
        *,
        budget: int | None = None,
        backends: Sequence[str] = (),
        shardable: str = shard.EVERY,
    ) -> tuple[JobRecord, bool]:
        """The key's queued or running job, else a new queued one, in one transaction: requests for one key
        arriving together get one job. Returns the job and whether it is new."""
        key = sizes_key(sizes)
        check_world(world)
        with self._key_tx("join_job", program_hash, key, topology, world, shardable) as s:
            row = _oldest_job(s, program_hash, key, topology, world, shardable, ACTIVE_STATES)
            if row is not None:
                return _job(row), False
            row = _new_job(program_hash, sizes, key, topology, world, shardable, budget, backends, running=False)
            s.add(row)
            s.flush()
            return _job(row), True

    def take_job(
        self,
        program_hash: str,
        sizes: Mapping[str, int],
        topology: str,
        world: int,
        *,
        budget: int | None = None,
        backends: Sequence[str] = (),
        shardable: str = shard.EVERY,
        driver: str | None = None,
        abandoned: Callable[[JobRecord], bool] | None = None,
    ) -> JobRecord:
        """A running job for a tuner that tunes the key itself (``coconet tune``, ``driver`` its process): the
        key's queued job, claimed and given this run's budget and backends (the service's workers would only
        tune the key again), else a new one. A job already running elsewhere is left to run; with
        ``abandoned``, it is looked at in the same transaction: one that nobody runs any more is marked
        interrupted, and one that is still run refuses the take (``KeyBusy``)."""
        key = sizes_key(sizes)
        check_world(world)
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
    def _key_tx(
        self, what: str, program_hash: str, key: str, topology: str, world: int, shardable: str
    ) -> Iterator[Session]:
        """A write transaction on the jobs of one key, of a program the store holds. Under READ COMMITTED two of
        them could both find no job and both add one: on PostgreSQL a lock per key, held to the commit, orders
        them (SQLite's write transactions run one at a time already)."""
        check_shardable(shardable)
        with self._tx(what, write=True) as s:
            require_programs(s, {program_hash})
            if s.get_bind().dialect.name == "postgresql":
                s.execute(
                    text("SELECT pg_advisory_xact_lock(:id)"),
                    {"id": _lock_id("job", program_hash, key, topology, str(world), shardable)},
                )
            yield s


def _job(row: JobRow) -> JobRecord:
    values = {f.name: utc(getattr(row, f.name)) for f in fields(JobRecord) if f.name != "progress"}
    progress = Progress(row.trials_done, row.trials_total, row.trials_failed, row.best_s)
    return JobRecord(progress=progress, **values)


def _new_job(
    program_hash: str,
    sizes: Mapping[str, int],
    key: str,
    topology: str,
    world: int,
    shardable: str,
    budget: int | None,
    backends: Sequence[str],
    running: bool,
) -> JobRow:
    now = utcnow()
    return JobRow(
        program_hash=program_hash,
        sizes=sorted_sizes(sizes),
        sizes_key=key,
        topology=topology,
        world=world,
        shardable=shardable,
        budget=budget,
        backends=list(backends),
        state="running" if running else "queued",
        trials_done=0,
        trials_total=budget,
        trials_failed=0,
        created_at=now,
        updated_at=now,
        heartbeat_at=now if running else None,
    )


def _enter(row: JobRow, state: str) -> None:
    """Moves a job to ``state``; an error that no longer describes it goes (see _CLEARS_ERROR)."""
    if state in _CLEARS_ERROR and state != row.state:
        row.error = None
    row.state = state


def _oldest_job(
    s: Session,
    program_hash: str,
    key: str,
    topology: str,
    world: int,
    shardable: str,
    states: Sequence[str],
    *,
    lock: bool = False,
) -> JobRow | None:
    """The key's oldest job in one of ``states``; ``lock``: its row locked for update, after any transaction
    holding it ends (a row it took out of ``states`` is then not returned)."""
    q = _key_jobs(program_hash, key, topology, world, shardable, states).limit(1)
    return s.scalars(q.with_for_update() if lock else q).first()


def _key_jobs(program_hash: str, key: str, topology: str, world: int, shardable: str, states: Sequence[str]):
    """The key's jobs in one of ``states``, oldest first."""
    return (
        select(JobRow)
        .where(
            JobRow.program_hash == program_hash,
            JobRow.sizes_key == key,
            JobRow.topology == topology,
            JobRow.world == world,
            JobRow.shardable == shardable,
            JobRow.state.in_(states),
        )
        .order_by(JobRow.id)
    )


def _lock_id(*parts: str) -> int:
    """A signed 64-bit PostgreSQL advisory-lock id for ``parts``."""
    digest = hashlib.sha256("\x00".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)
