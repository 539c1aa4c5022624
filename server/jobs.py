"""The service's tuning workers: threads in the server process that claim queued jobs from the store and
run ``tune`` on Ray for them. The store is the queue: a job's state and progress are rows, so a restarted
server finds what its predecessor left (``coconet.server.leases.requeue_orphans``) and the Optuna study in
the same database gives back every trial that had finished.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from coconet.errors import CoconetError, StoreError
from coconet.schedules import shardable as shard
from coconet.schedules.serialize import load
from coconet.server.driver import this_process
from coconet.server.leases import ORPHANED, STALE_S, heartbeat, requeue_orphans
from coconet.server.records import JobRecord
from coconet.server.store import Store
from coconet.tuner import tune as tuning  # an attribute at call time: tests stand in for tune
from coconet.tuner.runner import Protocol

log = logging.getLogger("coconet.server")


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
        record = self.store.program(job.program_hash)
        if record is None:
            raise CoconetError(f"program {job.program_hash} is not in the store")
        request = tuning.Request(
            load(record.ir),
            (job.sizes,),
            job.world,
            job.topology,
            job.budget or 32,
            tuple(job.backends),
            self.settings.protocol,
            ray_address=self.settings.ray_address,
            shardable=shard.spelled(job.shardable),
        )
        tuning.tune(request, self.store, job_id=job.id, on_progress=follow, prior=tuning.cost_prior)


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
