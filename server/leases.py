"""Who holds a job: the store side of the job queue, shared by the service's workers (``coconet.server.jobs``)
and by ``coconet tune`` driving a job from another process. A running job is held by its driver's heartbeat;
one whose driver has gone, or whose heartbeat is stale, is abandoned and queued again.

The tuner imports this module, so it imports nothing of the tuner: only the store and what the store keeps.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Iterator

from coconet.errors import StoreError
from coconet.server.driver import gone
from coconet.server.records import JobRecord
from coconet.server.store import Store

log = logging.getLogger("coconet.server")

HEARTBEAT_S = 10.0
# A running job whose heartbeat is older than this has lost its driver: every driver (a worker here, `coconet
# tune` sharing the database) beats from a thread of its own, whatever a trial takes, so six beats missed
# mean a process gone or stuck. The key is free again after that long.
STALE_S = 60.0
ORPHANED = "the process running it stopped; queued again (finished trials are kept)"


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
