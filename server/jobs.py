"""The service's tuning workers: threads in the server process that claim queued jobs from the store and
run ``tune`` on Ray for them. The store is the queue: a job's state and progress are rows, so a restarted
server finds what its predecessor left (``requeue_orphans``) and the Optuna study in the same database
gives back every trial that had finished.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Iterator

from coconet.errors import CoconetError, StoreError
from coconet.schedules import shardable as shard
from coconet.server.driver import gone, this_process
from coconet.server.records import JobRecord
from coconet.server.store import Store
from coconet.tuner.runner import Protocol

log = logging.getLogger("coconet.server")

HEARTBEAT_S = 10.0
# A running job whose heartbeat is older than this has lost its driver: every driver (a worker here, `coconet
# tune` sharing the database) beats from a thread of its own, whatever a trial takes, so six beats missed
# mean a process gone or stuck. The key is free again after that long.
STALE_S = 60.0
ORPHANED = "the process running it stopped; queued again (finished trials are kept)"


class _Stop(KeyboardInterrupt):
    """Raised from tune's progress callback when the server stops: tune records the job interrupted, the
    trial that just finished is kept, and the worker puts the job back in the queue."""


@dataclass(frozen=True)
class WorkerSettings:
    workers: int = 1
    protocol: Protocol = Protocol()
    ray_address: str | None = None
    poll_s: float = 1.0
    stale_s: float = STALE_S


def abandoned(job: JobRecord, stale_s: float = STALE_S) -> bool:
    """A running job nobody runs any more: its driver, a process on this machine, has ended, or its
    heartbeat is older than ``stale_s`` (a driver elsewhere, or one the store does not name)."""
    beat = job.heartbeat_at or job.updated_at
    return gone(job.driver) is not None or beat < datetime.now(timezone.utc) - timedelta(seconds=stale_s)


def requeue_orphans(store: Store, stale_s: float = STALE_S) -> list[int]:
    """Running jobs that are ``abandoned``: marked interrupted, then queued again."""
    out = []
    for job in store.jobs("running"):
        if not abandoned(job, stale_s):
            continue
        try:
            store.update_job(job.id, state="interrupted", error=ORPHANED)
            store.update_job(job.id, state="queued")
        except StoreError as err:  # another server took it first
            log.info("job %s not requeued: %s", job.id, err)
            continue
        out.append(job.id)
    if out:
        log.warning("requeued jobs %s, left running by a process that stopped", out)
    return out


class Workers:
    """``settings.workers`` threads, each running one job at a time; ``wake()`` after queueing a job."""

    def __init__(self, store: Store, settings: WorkerSettings) -> None:
        self.store = store
        self.settings = settings
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._running: dict[int, threading.Thread] = {}
        self._lock = threading.Lock()
        me = this_process()
        self._driver = me.text if me else None

    def start(self) -> None:
        for i in range(self.settings.workers):
            t = threading.Thread(target=self._loop, name=f"coconet-worker-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the trial in progress; a job still running at ``timeout`` is queued again by hand (its
        thread dies with the process)."""
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout)
        with self._lock:
            left = list(self._running)
        for job_id in left:
            _requeue(self.store, job_id)

    def _loop(self) -> None:
        idle = 0.0
        while not self._stop.is_set():
            try:
                if idle <= 0:
                    requeue_orphans(self.store, self.settings.stale_s)
                    idle = self.settings.stale_s / 4
                job = self.store.claim_job(driver=self._driver)
            except StoreError as err:
                log.error("worker: %s", err)
                job = None
            if job is None:
                self._wake.wait(self.settings.poll_s)
                self._wake.clear()
                idle -= self.settings.poll_s
                continue
            with self._lock:
                self._running[job.id] = threading.current_thread()
            try:
                self._run(job)
            finally:
                with self._lock:
                    self._running.pop(job.id, None)

    def _run(self, job: JobRecord) -> None:
        def follow(sizes: dict, progress: Any) -> None:
            if self._stop.is_set():
                raise _Stop("the server is stopping")

        try:
            with heartbeat(self.store, job.id):
                self._tune(job, follow)
            log.info("job %s done", job.id)
        except _Stop:
            _requeue(self.store, job.id)
        except Exception as err:  # a job's failure is recorded on the job; the worker goes on
            log.exception("job %s failed", job.id)
            _fail(self.store, job.id, err)

    def _tune(self, job: JobRecord, follow: Any) -> None:
        from coconet.schedules.serialize import load
        from coconet.tuner.tune import Request, cost_prior, tune

        record = self.store.program(job.program_hash)
        if record is None:
            raise CoconetError(f"program {job.program_hash} is not in the store")
        request = Request(load(record.ir), (job.sizes,), job.world, job.topology, job.budget or 32,
                          tuple(job.backends), self.settings.protocol, ray_address=self.settings.ray_address,
                          shardable=shard.spelled(job.shardable))
        tune(request, self.store, job_id=job.id, on_progress=follow, prior=cost_prior)


@contextmanager
def heartbeat(store: Store, job_id: int, every_s: float = HEARTBEAT_S) -> Iterator[None]:
    """The job's heartbeat, every ``every_s`` from a thread while the block runs: the job is seen alive
    however long one trial takes, and seen abandoned ``STALE_S`` after its process is gone."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(every_s):
            try:
                store.update_job(job_id)
            except StoreError:  # the job moved on (finished, failed, taken back): nothing left to beat
                return

    thread = threading.Thread(target=beat, name=f"coconet-heartbeat-{job_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _requeue(store: Store, job_id: int) -> None:
    job = store.job(job_id)
    if job is None or job.state not in ("running", "interrupted"):
        return
    try:
        if job.state == "running":
            store.update_job(job_id, state="interrupted", error=ORPHANED)
        store.update_job(job_id, state="queued")
    except StoreError as err:
        log.warning("job %s not requeued: %s", job_id, err)


def _fail(store: Store, job_id: int, err: BaseException) -> None:
    # tune marks the job failed when its search raises; errors before the search (a program the tuner refuses,
    # Ray not reachable) leave it running, so the worker closes it.
    job = store.job(job_id)
    if job is None or job.state in ("done", "failed"):
        return
    message = str(err) if isinstance(err, CoconetError) else f"{type(err).__name__}: {err}"
    try:
        store.update_job(job_id, state="failed", error=message[:2000])
    except StoreError as e:
        log.warning("job %s not marked failed: %s", job_id, e)
