"""The dashboard's plots as plain JSON: time vs size and speed-up over the baseline, one plot per shape family.

A shape family is a set of tuned sizes that differ along one dim only (Megatron's S at B=4, H=1024): its x-axis
is that dim. Sizes of different families never share an axis, where a product such as B·S·H would merge
different shapes into one saw-toothed line. Measured and predicted timings are separate series, each saying
which it is."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from sqlalchemy import select

from coconet.schedules import shardable as shard
from coconet.server.dashboard_data import Current, Filters, context, elements, plot_context
from coconet.server.keys import parse_sizes_key
from coconet.server.models import MeasurementRow
from coconet.server.records import answer_source
from coconet.server.store import Store

# A sweep records model predictions for hundreds of schedules; a plot with that many lines says nothing.
MAX_SERIES = 12
# Past this many plots the page asks for a narrower filter instead of drawing them all.
MAX_PLOTS = 24
BASELINE = "baseline"
_M = MeasurementRow.__table__
_Series = tuple[str, str, str]  # (backend, schedule, source)
# a timing: (sizes key, topology, world, backend, schedule, median, stored source)
Point = tuple[str, str, int, str, str, float, str]


@dataclass(frozen=True)
class Family:
    """Sizes keys along one line: ``dim`` varies, the other dims hold ``fixed``. ``dim`` None: shapes on no
    line of two or more, plotted side by side by their sizes."""

    dim: str | None
    fixed: dict[str, int]
    keys: tuple[str, ...]

    @property
    def label(self) -> str:
        if self.dim is None:
            return "other shapes"
        held = ", ".join(f"{k}={v}" for k, v in self.fixed.items())
        return f"{self.dim} varies" + (f" · {held}" if held else "")

    def x(self, sizes: Mapping[str, int]) -> int | str:
        return sizes[self.dim] if self.dim is not None else _sizes_text(sizes)

    def axis(self) -> dict[str, str]:
        if self.dim is None:
            return {"type": "category", "title": "sizes"}
        return {"type": "log", "title": self.dim}


def families(keys: Mapping[str, Mapping[str, int]]) -> list[Family]:
    """``keys`` (sizes key: sizes) as lines along one dim each, longest first; each key is on one line. Keys of
    different dim names never share one; keys on no line of two or more form one ``dim=None`` family per set of
    dim names (a program with a single dim always has its one line)."""
    by_names: dict[tuple[str, ...], dict[str, Mapping[str, int]]] = defaultdict(dict)
    for key, sizes in keys.items():
        by_names[tuple(sorted(sizes))][key] = sizes
    out = []
    for names, group in sorted(by_names.items()):
        if len(names) == 1:
            out.append(Family(names[0], {}, tuple(sorted(group, key=lambda k: group[k][names[0]]))))
            continue
        lines: list[tuple[str, tuple[tuple[str, int], ...], list[str]]] = []
        for dim in names:
            along: dict[tuple[tuple[str, int], ...], list[str]] = defaultdict(list)
            for key, sizes in group.items():
                along[tuple((n, sizes[n]) for n in names if n != dim)].append(key)
            lines += [(dim, fixed, ks) for fixed, ks in along.items()]
        placed: set[str] = set()
        for dim, fixed, ks in sorted(lines, key=lambda line: (-len(line[2]), line[0], line[1])):
            free = [k for k in ks if k not in placed]
            if len(free) >= 2:
                placed.update(free)
                out.append(Family(dim, dict(fixed), tuple(sorted(free, key=lambda k: group[k][dim]))))
        rest = [k for k in group if k not in placed]
        if rest:
            out.append(Family(None, {}, tuple(sorted(rest, key=lambda k: (elements(dict(group[k])), k)))))
    return out


def timing_points(store: Store, program_hash: str, filters: Filters) -> list[Point]:
    """Every successful timing the filters leave, oldest first."""
    q = select(
        _M.c.sizes_key, _M.c.topology, _M.c.world, _M.c.backend, _M.c.schedule, _M.c.median_s, _M.c.source
    ).where(_M.c.program_hash == program_hash, _M.c.status == "ok", _M.c.median_s.is_not(None))
    with store.reading("dashboard timings") as s:
        rows = s.execute(filters.apply(q, _M).order_by(_M.c.id))
        return [(k, t, w, b, sch, m, src) for k, t, w, b, sch, m, src in rows]


def plots(points: Iterable[Point], winners: list[Current]) -> dict[str, Any]:
    """The page's plots: speed-ups per family, then time vs size per (topology, world) and family, at most
    MAX_PLOTS of those (``timings_total`` says how many there are)."""
    timings = _timings(points, winners)
    return {"speedups": _speedups(winners), "timings": timings[:MAX_PLOTS], "timings_total": len(timings)}


def _timings(points: Iterable[Point], winners: list[Current]) -> list[dict]:
    """Per (topology, world) and family: time vs the family's dim, one series per (backend, schedule, source)
    with its newest timing per size. Backends share a plot because the tuner races them against each other."""
    by_ctx: dict[str, dict[_Series, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for key, topology, world, backend, schedule, median, source in points:  # a later re-time replaces an earlier
        by_ctx[plot_context(topology, world)][(backend, schedule, answer_source(source))][key] = median
    won: dict[str, set[_Series]] = defaultdict(set)
    for c in winners:
        won[plot_context(c.topology, c.world)].add((c.backend, c.schedule, answer_source(c.source)))
    out = []
    for ctx in sorted(by_ctx):
        by_series = by_ctx[ctx]
        keys = {k: parse_sizes_key(k) for pts in by_series.values() for k in pts}
        for fam in families(keys):
            inside = {s: {k: pts[k] for k in fam.keys if k in pts} for s, pts in by_series.items()}
            inside = {s: pts for s, pts in inside.items() if pts}
            chosen = _pick(inside, won[ctx])
            out.append(
                {
                    "context": ctx,
                    "family": fam.label,
                    "axis": fam.axis(),
                    "schedules": len(inside),
                    "shown": len(chosen),
                    "series": [_series(fam, keys, s, inside[s]) for s in chosen],
                }
            )
    return out


def _series(fam: Family, keys: Mapping[str, Mapping[str, int]], s: _Series, pts: dict[str, float]) -> dict:
    backend, schedule, source = s
    order = [k for k in fam.keys if k in pts]
    return {
        "name": f"{source} · {backend}: {schedule}",
        "backend": backend,
        "schedule": schedule,
        "source": source,
        "x": [fam.x(keys[k]) for k in order],
        "median_s": [pts[k] for k in order],
    }


def _pick(by_series: dict[_Series, dict[str, float]], winners: set[_Series]) -> list[_Series]:
    """The baselines and the winners first, then the fastest others, up to MAX_SERIES."""
    first = sorted(k for k in by_series if k[1] == BASELINE) + sorted(
        k for k in winners if k in by_series and k[1] != BASELINE
    )
    rest = sorted((k for k in by_series if k not in first), key=lambda k: (min(by_series[k].values()), k))
    return (first + rest)[:MAX_SERIES]


def _speedups(winners: list[Current]) -> list[dict[str, Any]]:
    """Per family: the current winners' speed-ups, one series per (topology, world, backend, source) and, where
    searches of the program allowed different state to stay sharded, per what each allowed."""
    timed = [c for c in winners if c.speedup is not None]
    several = len({c.shardable for c in timed}) > 1
    keys = {c.sizes_key: c.sizes for c in timed}
    out = []
    for fam in families(keys):
        members = set(fam.keys)
        by_series: dict[tuple[str, str], list[Current]] = defaultdict(list)
        for c in timed:
            if c.sizes_key in members:
                by_series[(_winner_context(c, several), answer_source(c.source))].append(c)
        order = {k: i for i, k in enumerate(fam.keys)}
        series = []
        for (ctx, source), cs in sorted(by_series.items()):
            cs.sort(key=lambda c: order[c.sizes_key])
            series.append(
                {
                    "name": f"{source} · {ctx}",
                    "context": ctx,
                    "source": source,
                    "x": [fam.x(c.sizes) for c in cs],
                    "speedup": [c.speedup for c in cs],
                    "schedule": [c.schedule for c in cs],
                }
            )
        out.append({"family": fam.label, "axis": fam.axis(), "series": series[:MAX_SERIES], "contexts": len(series)})
    return out


def _winner_context(c: Current, by_shardable: bool) -> str:
    """A winner's series: its topology, world and backend, and, where searches of the program allowed different
    state to stay sharded, what its search allowed (two answers, not one series going back and forth)."""
    if not by_shardable:
        return context(c.topology, c.world, c.backend)
    allowed = "all state whole" if c.shardable == "" else f"{shard.words(c.shardable)} sharded"
    return f"{context(c.topology, c.world, c.backend)} · {allowed}"


def _sizes_text(sizes: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in sizes.items())
