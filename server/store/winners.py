"""The winners a store records (append-only) and the answers read from them: ``best`` (the API's hot path, its
statements rendered once per store) and ``results``."""

from __future__ import annotations

from collections import Counter
from dataclasses import fields
from datetime import datetime
from typing import Any, Mapping, Sequence

from sqlalchemy import Engine, bindparam, case, func, select
from sqlalchemy.orm import Session

from coconet.errors import StoreError
from coconet.schedules import shardable as shard
from coconet.schedules.schedule import sharded_by
from coconet.server.keys import parse_sizes_key, size_distance, sizes_key
from coconet.server.models import SOURCES, MeasurementRow, WinnerRow, utcnow
from coconet.server.records import Best, MeasurementRecord, WinnerRecord
from coconet.server.store.engine import SQLITE_BUSY_S, Rendered, StoreBase
from coconet.server.store.rows import check_shardable, insert_rows, key_filter, record, require_jobs, utc


class Winners(StoreBase):
    """The winners of a store, and the answers read from them."""

    def __init__(self, engine: Engine, url: str, wait_s: float = SQLITE_BUSY_S) -> None:
        super().__init__(engine, url, wait_s)
        self._newest = {n: Rendered(q, self._reader.dialect) for n, q in _NEWEST.items()}
        self._tuned_keys = {n: Rendered(q, self._reader.dialect) for n, q in _TUNED_KEYS.items()}

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
        return self.add_winners(
            [(measurement_id, runner_up_id, baseline_id)],
            speedups=[speedup],
            job_id=job_id,
            shardable=shardable,
            order_reversed=[order_reversed],
        )[0]

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
        check_shardable(shardable)
        allowed = shard.names(shardable)
        speedups = list(speedups) if speedups is not None else [None] * len(rows)
        flips = list(order_reversed) if order_reversed is not None else [False] * len(rows)
        with self._tx("add_winners", write=True) as s:
            wanted = {i for r in rows for i in r if i is not None}
            by_id = {m.id: m for m in s.scalars(select(MeasurementRow).where(MeasurementRow.id.in_(wanted)))}
            if job_id is not None:
                require_jobs(s, {job_id})
            now = utcnow()
            values = [
                {**_winner_values(by_id, *r, speedup, job_id, shardable, allowed, now), "order_reversed": flip}
                for r, speedup, flip in zip(rows, speedups, flips)
            ]
            return insert_rows(s, WinnerRow.__table__, values)

    def winners(
        self, program_hash: str, sizes: Mapping[str, int] | None = None, topology: str | None = None
    ) -> list[WinnerRecord]:
        """Every winner recorded, oldest first: the tuning history behind ``best``."""
        with self._tx("winners") as s:
            q = key_filter(select(WinnerRow), WinnerRow, program_hash, sizes, topology, None, None)
            return [record(WinnerRecord, r) for r in s.scalars(q.order_by(WinnerRow.created_at, WinnerRow.id))]

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
        params = {
            "program": program_hash,
            "topology": topology,
            "key": sizes_key(sizes),
            "world": world,
            "backend": backend,
        }
        narrowed = (world is not None, backend is not None)
        if shardable is not None:
            check_shardable(shardable)
        if source is not None and source not in SOURCES:
            raise StoreError(f"source {source!r} is not one of {', '.join(SOURCES)}")
        one_pair = all(narrowed)
        # one (world, backend) pair without a question on sharding: its newest row answers, read alone
        newest = self._newest[narrowed + (one_pair and shardable is None and source is None,)]

        def answers(row: Sequence[Any]) -> bool:  # the columns are plain strings on every driver
            return (source is None or row[_W_SOURCE] == source) and (
                shardable is None or shard.answers(row[_W_SHARDABLE], shardable, sharded_by(row[_M_SCHEDULE]))
            )

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
            q = (
                _valid_winners()
                .with_only_columns(
                    WinnerRow.program_hash,
                    WinnerRow.sizes_key,
                    WinnerRow.topology,
                    WinnerRow.world,
                    WinnerRow.backend,
                    WinnerRow.shardable,
                )
                .distinct()
            )
            return dict(Counter(row[0] for row in s.execute(q)))


def _problem(m: MeasurementRow) -> tuple:
    return (m.program_hash, m.sizes_key, m.topology, m.world)


def _winner_values(
    by_id: Mapping[int, MeasurementRow],
    measurement_id: int,
    runner_up_id: int | None,
    baseline_id: int | None,
    speedup: float | None,
    job_id: int | None,
    shardable: str,
    allowed: frozenset[str] | None,
    now: datetime,
) -> dict:
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
        raise StoreError(
            f"measurement {measurement_id} leaves {', '.join(outside)} sharded, which shardable "
            f"{shardable!r} does not allow",
            measurement_id=measurement_id,
        )
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
        program_hash=win.program_hash,
        sizes=win.sizes,
        sizes_key=win.sizes_key,
        topology=win.topology,
        world=win.world,
        shardable=shardable,
        backend=win.backend,
        measurement_id=win.id,
        runner_up_id=runner_up_id,
        baseline_id=baseline_id,
        speedup=speedup,
        source=win.source,
        job_id=job_id if job_id is not None else win.job_id,
        created_at=now,
    )


def _valid_winners() -> Any:
    return (
        select(WinnerRow)
        .join(MeasurementRow, WinnerRow.measurement_id == MeasurementRow.id)
        .where(MeasurementRow.status == "ok", MeasurementRow.median_s.is_not(None))
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
        t.c[n].label(f"{p}_{n}") for p, t in (("m", _M), ("r", _RUNNER_UP), ("b", _BASELINE)) for n in _M_FIELDS
    ]
    q = (
        select(*columns)
        .join_from(_W, _M, _M.c.id == _W.c.measurement_id)
        .outerjoin(_RUNNER_UP, _RUNNER_UP.c.id == _W.c.runner_up_id)
        .outerjoin(_BASELINE, _BASELINE.c.id == _W.c.baseline_id)
        .where(
            _W.c.program_hash == bindparam("program"),
            _W.c.topology == bindparam("topology"),
            _W.c.sizes_key == bindparam("key"),
            _M.c.status == "ok",
            _M.c.median_s.is_not(None),
        )
    )
    q = _world_backend_params(q, by_world, by_backend).order_by(_MEASURED_FIRST, _W.c.created_at.desc(), _W.c.id.desc())
    return q.limit(1) if first else q


def _tuned_keys_statement(by_world: bool, by_backend: bool) -> Any:
    """Each tuned key of a program and topology, with whether any of its winners was measured."""
    measured = func.max(case((_W.c.source == "measured", 1), else_=0))
    q = select(_W.c.sizes_key, measured).where(
        _W.c.program_hash == bindparam("program"), _W.c.topology == bindparam("topology")
    )
    return _world_backend_params(q, by_world, by_backend).group_by(_W.c.sizes_key)


_NARROWED = [(w, b) for w in (False, True) for b in (False, True)]
_NEWEST = {(*n, first): _newest_statement(*n, first) for n in _NARROWED for first in (False, True)}
_W_SHARDABLE, _W_WORLD, _W_BACKEND, _W_SOURCE = (
    _W_FIELDS.index(n) for n in ("shardable", "world", "backend", "source")
)
_M_SCHEDULE, _M_MEDIAN = (len(_W_FIELDS) + _M_FIELDS.index(n) for n in ("schedule", "median_s"))
_TUNED_KEYS = {n: _tuned_keys_statement(*n) for n in _NARROWED}


def _best_of_row(row: Sequence[Any], *, exact: bool, distance: float) -> Best:
    nw, nm = len(_W_FIELDS), len(_M_FIELDS)

    def measurement(start: int) -> MeasurementRecord | None:
        values = row[start : start + nm]
        if values[0] is None:  # an outer join that found no runner-up or baseline
            return None
        return MeasurementRecord(*(utc(v) for v in values))

    return Best(
        exact=exact,
        distance=distance,
        winner=WinnerRecord(*(utc(v) for v in row[:nw])),
        measurement=measurement(nw),
        runner_up=measurement(nw + nm),
        baseline=measurement(nw + 2 * nm),
    )


def _best(s: Session, rows: Sequence[WinnerRow], *, exact: bool, distance: float) -> list[Best]:
    ids = {i for r in rows for i in (r.measurement_id, r.runner_up_id, r.baseline_id) if i is not None}
    found = s.scalars(select(MeasurementRow).where(MeasurementRow.id.in_(ids)))
    by_id = {m.id: record(MeasurementRecord, m) for m in found}
    return [
        Best(
            exact=exact,
            distance=distance,
            winner=record(WinnerRecord, r),
            measurement=by_id[r.measurement_id],
            runner_up=by_id.get(r.runner_up_id) if r.runner_up_id is not None else None,
            baseline=by_id.get(r.baseline_id) if r.baseline_id is not None else None,
        )
        for r in rows
    ]
