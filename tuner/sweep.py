"""``coconet sweep``: programs × sizes × topologies × worlds, offline.

Keys on the local topology are tuned (measured, as ``coconet tune``) unless the sweep is simulated;
every other key is predicted by the cost model over the whole space (every backend the topology
has, every schedule that shards at most the entry's ``shardable``, every knob value) and recorded
with ``source: model`` — the prediction of the winner, of the runner-up and of the baseline, and a
winner record. A key that already has a winner
of that source is skipped, so a sweep that was stopped picks up where it was; a key with a measured
winner is not predicted at all (a measurement outranks a prediction: ``Store.best``).

The config (YAML)::

    programs:
      - example: adam                 # an example's name, or
      - file: ../../examples/adam.py  # a program file (relative to the config) ...
        sizes: ["N=2^10..2^30:4"]     # 2^10 to 2^30, 4 points per doubling
        shardable: [m, v]             # state a schedule may leave sharded, or `all`; default: the program's
                                      # (what its baseline's caller never reads: Adam's m, v; else none)
    topologies: [dgx-h100-8, h100-4node-ib, local]
    worlds: {dgx-h100-8: [2, 4, 8], local: [2]}   # ranks per stage; default: every rank of the topology
    budget: 16                                    # trials per measured key
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

import coconet
from coconet.codegen.backends import get as backend_of
from coconet.codegen.baselines import shardable_text
from coconet.errors import CoconetError, SizeError
from coconet.loader import examples_dir, load_file
from coconet.schedules import shardable as shard
from coconet.schedules.dims import parse_sizes
from coconet.schedules.ir import Program
from coconet.schedules.schedule import Schedule
from coconet.schedules.space import generate
from coconet.server.keys import sizes_key
from coconet.server.records import NewMeasurement
from coconet.tuner.calibrate import local_topology
from coconet.tuner.cost import predict
from coconet.tuner.search import knob_variants
from coconet.tuner.topology import LOCAL, load_topology

STAGES = 2  # a pipeline program's stages in a sweep, as in coconet run and tune
BATCH = 500  # keys per transaction: a stopped sweep loses at most this many


@dataclass(frozen=True)
class Entry:
    program: Program
    file: str | None
    sizes: tuple[dict[str, int], ...]
    shardable: str = shard.EVERY  # what its schedules may leave sharded (coconet.schedules.shardable's text)


@dataclass(frozen=True)
class SweepConfig:
    entries: tuple[Entry, ...]
    topologies: tuple[str, ...]
    worlds: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    budget: int = 16
    depth: int = 6

    @classmethod
    def load(cls, path: str | Path) -> "SweepConfig":
        path = Path(path)
        shipped = Path(str(resources.files("coconet.configs"))) / "sweeps" / f"{path}.yaml"
        if not path.exists() and len(path.parts) == 1 and not path.suffix and shipped.is_file():
            path = shipped  # a name: the sweep coconet ships (``paper``), from a source tree or a wheel alike
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as e:
            raise CoconetError(f"cannot read sweep config {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise CoconetError(f"sweep config {path} is not YAML: {e}") from None
        try:
            doc = SweepFile.model_validate(data)
        except ValidationError as e:
            raise CoconetError(f"sweep config {path}: {_first_error(e)}") from None
        entries = []
        for i, item in enumerate(doc.programs):
            where = f"sweep config {path}: programs[{i}]"
            if item.file is not None:
                file = (path.parent / item.file).resolve()
            else:
                file = examples_dir() / f"{item.example}.py"
                if not file.exists():
                    raise CoconetError(f"{where}: no example {item.example!r}")
            prog = load_file(file)
            sizes = tuple(s for spec in item.sizes for s in expand_sizes(spec, prog.dims, where))
            entries.append(Entry(prog, str(file), sizes, _shardable(item.shardable, prog, where)))
        worlds = {name: tuple(ws) for name, ws in doc.worlds.items()}
        return cls(tuple(entries), tuple(doc.topologies), worlds, doc.budget, doc.depth)


class SweepProgram(BaseModel):
    """One entry of ``programs:``: an example's name or a program file, its sizes, and what its schedules may
    leave sharded."""

    model_config = ConfigDict(extra="forbid")
    example: str | None = Field(None, description="The name of an example shipped with coconet (adam, sgd, ...).")
    file: str | None = Field(None, description="A program file, relative to the config.")
    sizes: list[str] = Field(
        min_length=1,
        description="Size bindings; `a..b` runs over powers of two, `a..b:k` "
        "with k points per doubling (`N=2^10..2^30:4`, `B=1..16,S=512..2048`).",
    )
    shardable: list[str] | None = Field(
        None,
        description="State a schedule may leave sharded, or `all`; "
        "left out: what the program's baseline's caller never reads.",
    )

    @field_validator("shardable", mode="before")
    @classmethod
    def _one_name_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_source(self) -> "SweepProgram":
        if (self.example is None) == (self.file is None):
            raise ValueError("give `example: NAME` or `file: PATH`")
        return self


class SweepFile(BaseModel):
    """A sweep config as written (YAML): programs × sizes × topologies × worlds."""

    model_config = ConfigDict(extra="forbid")
    programs: list[SweepProgram] = Field(min_length=1)
    topologies: list[str] = Field(
        min_length=1,
        description="Topology names: shipped, or calibrated into the "
        "data dir; `local` is measured, every other one predicted.",
    )
    worlds: dict[str, list[PositiveInt]] = Field(
        default_factory=dict, description="Ranks per stage for each topology; left out: every rank of the topology."
    )
    budget: PositiveInt = Field(16, description="Trials per measured key.")
    depth: NonNegativeInt = Field(6, description="Longest transform sequence of the space.")

    @field_validator("worlds", mode="before")
    @classmethod
    def _one_world_is_a_list(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: v if isinstance(v, list) else [v] for k, v in value.items()}
        return value


def _first_error(e: ValidationError) -> str:
    """The first of pydantic's complaints as `programs[0].sizes: ...`, the field's path first."""
    first = e.errors()[0]
    loc = list(first["loc"])
    if first["type"] == "extra_forbidden":
        key, loc = loc[-1], loc[:-1]
        message = f"unknown key {key!r}"
    else:
        message = first["msg"]
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
    return f"{where}: {message}{more}" if where else f"{message}{more}"


def _shardable(names: list[str] | None, prog: Program, where: str) -> str:
    """An entry's ``shardable:`` (names, or ``[all]``); left out, the program's default."""
    try:
        return shardable_text(prog, names)
    except CoconetError as e:
        raise CoconetError(f"{where}: {e}") from None


def expand_sizes(spec: str, dims: Sequence[str], where: str = "sizes") -> list[dict[str, int]]:
    """``B=8,H=2^10..2^14`` → one binding per combination; ``a..b`` runs over powers of two from a to
    b, ``a..b:k`` with k points per doubling (rounded to integers)."""
    axes: list[list[tuple[str, str]]] = []
    for part in spec.split(","):
        name, sep, value = part.partition("=")
        if not sep:
            raise CoconetError(f"{where}: {part!r} is not NAME=VALUE")
        name, value = name.strip(), value.strip()
        if ".." not in value:
            axes.append([(name, value)])
            continue
        lo_s, hi_s = value.split("..", 1)
        hi_s, _, per = hi_s.partition(":")
        lo = parse_sizes(f"{name}={lo_s}")[name]
        hi = parse_sizes(f"{name}={hi_s}")[name]
        steps = int(per) if per else 1
        if lo < 1 or hi < lo or steps < 1:
            raise CoconetError(f"{where}: range {value!r} must go up from a positive size")
        n = int(round(math.log2(hi / lo) * steps))
        values = sorted({int(round(lo * 2 ** (i / steps))) for i in range(n + 1)})
        axes.append([(name, str(v)) for v in values])
    out = []
    for combo in itertools.product(*axes):
        out.append(parse_sizes(",".join(f"{k}={v}" for k, v in combo), tuple(dims)))
    return out


@dataclass
class SweepReport:
    keys: int = 0
    skipped: int = 0  # already done by an earlier run of the sweep
    kept_measured: int = 0  # left alone by a prediction: they have a measured winner
    unfit: int = 0  # (program, world) pairs that need more ranks than the topology has
    too_large: int = 0  # local keys this machine cannot hold (the tuner refuses them before starting)
    too_large_why: str | None = None  # the first one's reason
    predicted: int = 0
    measured: int = 0
    predictions: int = 0
    seconds: float = 0.0
    by_topology: dict[str, int] = field(default_factory=dict)

    @property
    def keys_per_s(self) -> float | None:
        done = self.predicted + self.measured
        return done / self.seconds if self.seconds > 0 and done else None

    def to_json(self) -> dict[str, Any]:
        return {
            "keys": self.keys,
            "skipped": self.skipped,
            "kept_measured": self.kept_measured,
            "unfit": self.unfit,
            "too_large": self.too_large,
            "too_large_why": self.too_large_why,
            "predicted": self.predicted,
            "measured": self.measured,
            "predictions": self.predictions,
            "seconds": self.seconds,
            "keys_per_s": self.keys_per_s,
            "by_topology": self.by_topology,
        }


def _backends_for(prog: Program, backends: Sequence[str]) -> list[str]:
    """The backends a program is predicted on. A pipeline's stages hand their values on over the backend's
    transport; where another backend carries them (shm's over gloo), the pipeline is left to that backend's
    prediction, unless the topology has no other."""
    if not prog.is_pipeline:
        return list(backends)
    return [b for b in backends if backend_of(b).transport == b] or list(backends)


def _candidates(program: Program, depth: int, shardable: str) -> list[Schedule]:
    """Every schedule of the space that shards at most ``shardable``, with every value of its knobs."""
    allowed = shard.names(shardable)
    return [
        v
        for s in generate(program, depth).schedules
        if allowed is None or set(s.sharded) <= allowed
        for v in knob_variants(s)
    ]


def sweep(
    config: SweepConfig,
    store,
    *,
    simulate: bool = False,
    on_progress: Callable[[SweepReport], None] | None = None,
    tune_key: Callable[[Entry, dict, int], Any] | None = None,
) -> SweepReport:
    """Run the sweep into ``store``; ``tune_key(entry, sizes, world)`` measures a local key."""
    t0 = time.perf_counter()
    report = SweepReport()
    # `local` is this machine: calibrated here on first use, as coconet tune does
    topos = {name: local_topology() if name == LOCAL else load_topology(name) for name in config.topologies}
    for entry in config.entries:
        prog = entry.program
        store.add_program(prog)
        cands = _candidates(prog, config.depth, entry.shardable)
        base = Schedule(prog)
        stages = STAGES if prog.is_pipeline else 1
        for name, topo in topos.items():
            model = simulate or name != LOCAL
            worlds = config.worlds.get(name) or ((2,) if name == LOCAL else (max(1, topo.world // stages),))
            winners = [w for w in store.winners(prog.hash, topology=name) if w.shardable == entry.shardable]
            done = {(w.sizes_key, w.world) for w in winners if w.source == ("model" if model else "measured")}
            # a prediction would never answer for a measured key (Store.best): not worth computing
            measured = {(w.sizes_key, w.world) for w in winners if w.source == "measured"} if model else set()
            backends = _backends_for(prog, topo.backends)
            pending = []
            for world in worlds:
                if world * stages > topo.world and name != LOCAL:  # a pipeline's stages need more ranks
                    report.unfit += len(entry.sizes)
                    continue
                for sizes in entry.sizes:
                    report.keys += 1
                    if (sizes_key(sizes), world) in measured:
                        report.kept_measured += 1
                        continue
                    if (sizes_key(sizes), world) in done:
                        report.skipped += 1
                        continue
                    pending.append((sizes, world))
            if not model:
                if tune_key is None:
                    raise CoconetError("a measured sweep needs the tuner")
                for sizes, world in pending:
                    try:
                        tune_key(entry, sizes, world)
                    except SizeError as e:  # refused before anything ran: the sweep's other keys go on
                        report.too_large += 1
                        report.too_large_why = report.too_large_why or str(e)
                        continue
                    report.measured += 1
                    report.by_topology[name] = report.by_topology.get(name, 0) + 1
                    if on_progress:
                        on_progress(report)
                continue
            for i in range(0, len(pending), BATCH):
                batch = pending[i : i + BATCH]
                _predict_batch(store, prog, cands, base, topo, name, backends, batch, stages, report, entry.shardable)
                report.predicted += len(batch)
                report.by_topology[name] = report.by_topology.get(name, 0) + len(batch)
                report.seconds = time.perf_counter() - t0
                if on_progress:
                    on_progress(report)
    report.seconds = time.perf_counter() - t0
    return report


def _predict_batch(
    store,
    prog: Program,
    cands: list[Schedule],
    base: Schedule,
    topo,
    name: str,
    backends: Sequence[str],
    batch,
    stages: int,
    report: SweepReport,
    shardable: str,
) -> None:
    versions = {"coconet": coconet.__version__, "model": "alpha-beta roofline", "topology": topo.digest}
    rows, triples = [], []
    for sizes, world in batch:
        scored = []
        for b in backends:
            for s in cands:
                scored.append((predict(s, sizes, topo, b, world=world * stages, stages=stages).seconds, b, s))
        report.predictions += len(scored)
        scored.sort(key=lambda x: x[0])
        base_t = next(t for t, b, s in scored if b == backends[0] and s.hash == base.hash)
        picks = [scored[0], scored[1] if len(scored) > 1 else None, (base_t, backends[0], base)]
        k = len(rows)
        for p in picks:
            if p is None:
                continue
            t, b, s = p
            rows.append(
                NewMeasurement.of(
                    s,
                    sizes=sizes,
                    topology=name,
                    world=world,
                    backend=b,
                    status="ok",
                    n=0,
                    median_s=t,
                    source="model",
                    versions=versions,
                )
            )
        triples.append((k, 1 if picks[1] is not None else None, len(rows) - 1 - k))
    ids = store.add_measurements(rows)
    store.add_winners(
        [(ids[k], ids[k + ru] if ru is not None else None, ids[k + bl]) for k, ru, bl in triples], shardable=shardable
    )
