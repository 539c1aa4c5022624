"""What the dashboard shows, read from the store and shaped as plain JSON (no plotting here: the page does that).

Every listing is filtered in its query (program, topology, world, backend, source) and the winners table is paged:
a program with ten thousand tuned keys sends one page of rows, and plots of what the filters leave
(``dashboard_plots``)."""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sqlalchemy import case, func, select

from coconet.codegen.lower import lower
from coconet.schedules import shardable as shard
from coconet.schedules.schedule import Schedule, sharded_by
from coconet.schedules.serialize import load
from coconet.server.keys import parse_sizes_key
from coconet.server.models import JobRow, MeasurementRow, WinnerRow
from coconet.server.records import answer_source
from coconet.server.store import Store

PAGE_MAX = 500
# the page's word for a source, and the store's
SOURCES = {"measured": "measured", "predicted": "model"}
_W, _M, _J = WinnerRow.__table__, MeasurementRow.__table__, JobRow.__table__
_BASE = _M.alias("baseline")


@dataclass(frozen=True)
class Filters:
    """What the page narrows to; None is any. ``source`` is "measured" or "predicted"."""

    topology: str | None = None
    world: int | None = None
    backend: str | None = None
    source: str | None = None

    def apply(self, q: Any, table: Any) -> Any:
        for column, value in (
            ("topology", self.topology),
            ("world", self.world),
            ("backend", self.backend),
            ("source", None if self.source is None else SOURCES[self.source]),
        ):
            if value is not None:
                q = q.where(table.c[column] == value)
        return q


@dataclass(frozen=True)
class Current:
    """A key's current winner, as the winners table and the speed-up plots show it."""

    winner_id: int
    measurement_id: int
    sizes: dict[str, int]
    sizes_key: str
    topology: str
    world: int
    backend: str
    shardable: str
    source: str
    schedule: str
    median_s: float
    ci_lo_s: float | None
    ci_hi_s: float | None
    baseline_s: float | None
    speedup: float | None
    job_id: int | None

    def order(self) -> tuple:
        return self.topology, self.backend, self.world, sorted(self.sizes.items()), self.shardable


def program_list(store: Store) -> list[dict[str, Any]]:
    counts = store.result_counts()
    return [
        {"hash": p.hash, "name": p.name, "created_at": p.created_at.isoformat(), "results": counts.get(p.hash, 0)}
        for p in store.programs(newest_first=True)
    ]


def program_summary(store: Store, program_hash: str) -> dict[str, Any] | None:
    """A program's name and the values its filters offer (those its winners and measurements have)."""
    record = store.program(program_hash)
    if record is None:
        return None
    facets: dict[str, set[Any]] = {"topology": set(), "world": set(), "backend": set(), "source": set()}
    with store.reading("dashboard facets") as s:
        for table in (_W, _M):
            q = select(table.c.topology, table.c.world, table.c.backend, table.c.source).distinct()
            for row in s.execute(q.where(table.c.program_hash == program_hash)):
                for name, value in zip(facets, row):
                    facets[name].add(answer_source(value) if name == "source" else value)
    return {"hash": record.hash, "name": record.name, "facets": {k: sorted(v) for k, v in facets.items()}}


def current_winners(store: Store, program_hash: str, filters: Filters) -> list[Current]:
    """The current winner of every (sizes, topology, world, backend, shardable) the filters leave, in the order
    ``Store.results`` lists them: as there, a key's current winner is its newest measured one, a predicted one
    where none is (with a source filter, the newest of that source)."""
    measured_first = case((_W.c.source == "measured", 0), else_=1)
    rank = func.row_number().over(
        partition_by=(_W.c.sizes_key, _W.c.topology, _W.c.world, _W.c.backend, _W.c.shardable),
        order_by=(measured_first, _W.c.created_at.desc(), _W.c.id.desc()),
    )
    q = (
        select(
            _W.c.id,
            _W.c.measurement_id,
            _W.c.sizes_key,
            _W.c.topology,
            _W.c.world,
            _W.c.backend,
            _W.c.shardable,
            _W.c.source,
            _M.c.schedule,
            _M.c.median_s,
            _M.c.ci_lo_s,
            _M.c.ci_hi_s,
            _BASE.c.median_s.label("baseline_s"),
            _W.c.speedup,
            _W.c.job_id,
            rank.label("rank"),
        )
        .join(_M, _M.c.id == _W.c.measurement_id)
        .outerjoin(_BASE, _BASE.c.id == _W.c.baseline_id)
        .where(_W.c.program_hash == program_hash, _M.c.status == "ok", _M.c.median_s.is_not(None))
    )
    ranked = filters.apply(q, _W).subquery()
    sizes: dict[str, dict[str, int]] = {}
    out = []
    with store.reading("dashboard winners") as s:
        for row in s.execute(select(ranked).where(ranked.c.rank == 1)).all():
            *values, _rank = row
            key = values[2]
            if key not in sizes:
                sizes[key] = parse_sizes_key(key)
            out.append(Current(values[0], values[1], sizes[key], *values[2:]))
    out.sort(key=Current.order)
    return out


class WinnersCache:
    """``current_winners`` of the last few (program, filters), kept until a winner is added (winners and the
    measurements they name are never changed): the table, its next pages and the plots read them once."""

    def __init__(self, size: int = 16) -> None:
        self._size = size
        self._kept: OrderedDict[tuple, list[Current]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, store: Store, program_hash: str, filters: Filters) -> list[Current]:
        with store.reading("dashboard newest winner") as s:
            key = (program_hash, filters, s.scalar(select(func.max(_W.c.id))))
        with self._lock:
            found = self._kept.get(key)
            if found is not None:
                self._kept.move_to_end(key)
                return found
        found = current_winners(store, program_hash, filters)
        with self._lock:
            self._kept[key] = found
            while len(self._kept) > self._size:
                self._kept.popitem(last=False)
        return found


def winners_page(rows: list[Current], limit: int, offset: int) -> dict[str, Any]:
    """One page of the winners table and how many rows the filters leave in all."""
    return {
        "total": len(rows),
        "offset": offset,
        "limit": limit,
        "rows": [winner_row(c) for c in rows[offset : offset + limit]],
    }


def winner_row(c: Current) -> dict[str, Any]:
    return {
        "winner_id": c.winner_id,
        "measurement_id": c.measurement_id,
        "sizes": c.sizes,
        "sizes_key": c.sizes_key,
        "elements": elements(c.sizes),
        "topology": c.topology,
        "world": c.world,
        "backend": c.backend,
        "context": context(c.topology, c.world, c.backend),
        "schedule": c.schedule,
        "sharded": sharded_by(c.schedule),
        "shardable": c.shardable,
        "shardable_words": shard.words(c.shardable),
        "median_s": c.median_s,
        "ci95_s": [c.ci_lo_s, c.ci_hi_s],
        "baseline_median_s": c.baseline_s,
        "speedup": c.speedup,
        "source": answer_source(c.source),
        "job_id": c.job_id,
    }


def version(store: Store) -> dict[str, Any]:
    """What changes whenever anything the page shows may have: the newest measurement and winner, the jobs'
    newest update and how many run or wait. Each is an index's end or a small table's scan."""
    with store.reading("dashboard version") as s:
        newest_m = s.scalar(select(func.max(_M.c.id))) or 0
        newest_w = s.scalar(select(func.max(_W.c.id))) or 0
        touched = s.scalar(select(func.max(_J.c.updated_at)))
        by_state = select(_J.c.state, func.count()).group_by(_J.c.state)
        states: dict[str, int] = {state: n for state, n in s.execute(by_state)}
    running, queued = states.get("running", 0), states.get("queued", 0)
    stamp = touched.isoformat() if touched is not None else "-"
    return {"version": f"{newest_m}.{newest_w}.{stamp}.{running}.{queued}", "running": running, "queued": queued}


def studies(store: Store, program_hash: str, filters: Filters, limit: int) -> list[dict[str, Any]]:
    """The program's tuning jobs on the filters' topology and world, newest first, without their trials."""
    out = []
    for job in store.jobs(program_hash=program_hash, newest_first=True):
        if filters.topology not in (None, job.topology) or filters.world not in (None, job.world):
            continue
        p = job.progress
        out.append(
            {
                "job_id": job.id,
                "state": job.state,
                "sizes": job.sizes,
                "topology": job.topology,
                "world": job.world,
                "done": p.done,
                "total": p.total,
                "failed": p.failed,
            }
        )
        if len(out) == limit:
            break
    return out


def study(store: Store, program_hash: str, job_id: int) -> dict[str, Any] | None:
    """One tuning job's measurements in the order they were recorded (trials, then the re-timing of the two
    fastest)."""
    job = store.job(job_id)
    if job is None or job.program_hash != program_hash:
        return None
    trials = store.measurements(program_hash, job_id=job_id)
    return {
        "job_id": job.id,
        "state": job.state,
        "sizes": job.sizes,
        "topology": job.topology,
        "world": job.world,
        "trials": [
            {"schedule": t.schedule, "backend": t.backend, "status": t.status, "median_s": t.median_s, "error": t.error}
            for t in sorted(trials, key=lambda t: (t.created_at, t.id))
        ],
    }


def winner_code(store: Store, program_hash: str, measurement_id: int, backend: str | None = None) -> str | None:
    record = store.program(program_hash)
    m = store.measurement(measurement_id)
    if record is None or m is None or m.program_hash != program_hash or m.schedule_json is None:
        return None
    schedule = Schedule.from_json(m.schedule_json, load(record.ir))
    return lower(schedule, backend or m.backend, "compiled").source


def elements(sizes: dict[str, int]) -> int:
    """One number per size binding (the product of its dims): the order of shapes no one dim orders."""
    return math.prod(sizes.values()) if sizes else 1


def context(topology: str, world: int, backend: str) -> str:
    return f"{plot_context(topology, world)} · {backend}"


def plot_context(topology: str, world: int) -> str:
    return f"{topology} · {world} ranks"
