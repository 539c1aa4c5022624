"""The plain records the store hands out and takes in: frozen dataclasses, never ORM objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Sequence

if TYPE_CHECKING:
    from coconet.schedules.schedule import Schedule


# a source as answers say it -> as the store keeps it
STORED_SOURCE = {"measured": "measured", "predicted": "model"}


def answer_source(source: str) -> str:
    """A record's source as answers say it: ``measured``, or ``predicted`` for the cost model's (stored as
    ``model``)."""
    return "predicted" if source == "model" else source


@dataclass(frozen=True)
class ProgramRecord:
    hash: str
    name: str
    ir: dict[str, Any]
    created_at: datetime


@dataclass(frozen=True)
class ProgramSummary:
    """A program as listed: its IR reduced to the dim names and the number of statements."""

    hash: str
    name: str
    dims: list[str]
    statements: int
    created_at: datetime


@dataclass(frozen=True)
class TopologyRecord:
    name: str
    fingerprint: dict[str, Any]
    source: str
    created_at: datetime


@dataclass(frozen=True)
class Progress:
    done: int = 0
    total: int | None = None
    failed: int = 0
    best_s: float | None = None


@dataclass(frozen=True)
class JobRecord:
    id: int
    program_hash: str
    sizes: dict[str, int]
    sizes_key: str
    topology: str
    world: int
    shardable: str
    budget: int | None
    backends: list[str]
    state: str
    progress: Progress
    error: str | None
    result: dict[str, Any] | None
    created_at: datetime
    updated_at: datetime
    heartbeat_at: datetime | None
    driver: str | None = None  # coconet.server.driver's text of the process running it


@dataclass(frozen=True)
class NewMeasurement:
    """One measurement to record: a timed candidate, a classified failure, or a model prediction."""

    program_hash: str
    sizes: Mapping[str, int]
    topology: str
    world: int
    backend: str
    schedule: str
    schedule_hash: str
    schedule_json: Mapping[str, Any] | None = None
    knobs: Mapping[str, int] = field(default_factory=dict)
    status: str = "ok"
    error: str | None = None
    samples: Sequence[float] = ()
    n: int | None = None
    median_s: float | None = None
    ci_lo_s: float | None = None
    ci_hi_s: float | None = None
    max_rel_err: float | None = None
    source: str = "measured"
    versions: Mapping[str, str] = field(default_factory=dict)
    job_id: int | None = None

    @classmethod
    def of(cls, schedule: Schedule, **fields: Any) -> NewMeasurement:
        """Fill the program and schedule fields from a ``Schedule``."""
        return cls(
            program_hash=schedule.program.hash,
            schedule=schedule.text,
            schedule_hash=schedule.hash,
            schedule_json=schedule.to_json(),
            knobs=schedule.knob_values,
            **fields,
        )


@dataclass(frozen=True)
class MeasurementRecord:
    id: int
    job_id: int | None
    program_hash: str
    sizes: dict[str, int]
    sizes_key: str
    topology: str
    world: int
    backend: str
    schedule: str
    schedule_hash: str
    schedule_json: dict[str, Any] | None
    knobs: dict[str, int]
    status: str
    error: str | None
    samples: list[float]
    n: int
    median_s: float | None
    ci_lo_s: float | None
    ci_hi_s: float | None
    max_rel_err: float | None
    source: str
    versions: dict[str, str]
    created_at: datetime


def prediction_of(m: MeasurementRecord) -> dict[str, Any] | None:
    """What predicted a measurement the cost model made (its model, topology, calibration and coconet
    version); None for a measured one."""
    if m.source != "model":
        return None
    v = m.versions or {}
    return {
        "model": v.get("model", "cost model"),
        "topology": m.topology,
        "calibration": v.get("topology"),
        "coconet": v.get("coconet"),
    }


# what a measured record's versions say of the machines it ran on (coconet.tuner.fingerprint): the short hash
# of their fingerprint, the fingerprint in words, and how the ranks were placed on them
MACHINE_KEYS = ("fingerprint", "machines", "placement")


def machines_of(m: MeasurementRecord) -> dict[str, str] | None:
    """Where a measurement ran (``MACHINE_KEYS`` of its versions); None for a prediction, or a measurement
    recorded before fingerprints were."""
    v = m.versions or {}
    found = {k: v[k] for k in MACHINE_KEYS if k in v}
    return found if m.source != "model" and found else None


@dataclass(frozen=True)
class MeasurementDigest:
    """What a listing of many measurements shows of each: no samples, versions or schedule IR, so that a
    program's hundred thousand rows read in a fraction of the time their full records take."""

    id: int
    job_id: int | None
    sizes: dict[str, int]
    sizes_key: str
    topology: str
    world: int
    backend: str
    schedule: str
    status: str
    error: str | None
    median_s: float | None
    source: str
    created_at: datetime


@dataclass(frozen=True)
class WinnerRecord:
    id: int
    program_hash: str
    sizes: dict[str, int]
    sizes_key: str
    topology: str
    world: int
    shardable: str
    backend: str
    measurement_id: int
    runner_up_id: int | None
    baseline_id: int | None
    speedup: float | None
    source: str
    job_id: int | None
    created_at: datetime
    order_reversed: bool = False  # the re-timing found it faster than the runner-up the search had ahead of it


@dataclass(frozen=True)
class Best:
    """The answer to "best schedule for (program, sizes, topology)".

    ``exact`` is False when no winner exists for the asked sizes and this is the
    winner of the nearest tuned sizes (``distance``: sum of |log2| differences).
    """

    exact: bool
    distance: float
    winner: WinnerRecord
    measurement: MeasurementRecord
    runner_up: MeasurementRecord | None
    baseline: MeasurementRecord | None

    @property
    def sizes(self) -> dict[str, int]:
        return self.winner.sizes

    @property
    def schedule(self) -> str:
        return self.measurement.schedule

    @property
    def median_s(self) -> float | None:
        return self.measurement.median_s

    @property
    def source(self) -> str:
        return self.winner.source

    @property
    def speedup(self) -> float | None:
        return self.winner.speedup


class DoneKey(NamedTuple):
    program_hash: str
    sizes_key: str
    topology: str
    world: int
    backend: str
    schedule_hash: str
    source: str
