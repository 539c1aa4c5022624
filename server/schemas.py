"""Request and response bodies of the REST API (DESIGN §9), with the service's bounds on input.

The bounds are the service's, tighter than the library's: one request must not make the server
hold or compute much (a program of 10,000 statements is fine for the CLI, not for a public POST).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

MAX_STATEMENTS = 1000
MAX_DIMS = 8
MAX_SIZE = 2**40
MAX_WORLD = 1024
MAX_BUDGET = 10_000
MAX_NAME = 200  # the store's name columns are String(200)
MAX_ARGS = 64
MAX_ATTRS = 32

Hash = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{8,64}$", min_length=8, max_length=64)]
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_.\-]*$", min_length=1, max_length=MAX_NAME)]
DimName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", min_length=1, max_length=64)]
Size = Annotated[int, Field(ge=1, le=MAX_SIZE)]
Backend = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]*$", max_length=32)]
AttrValue = Annotated[str, StringConstraints(max_length=MAX_NAME)] | int | float | bool | None \
    | Annotated[list[int | float | Annotated[str, StringConstraints(max_length=MAX_NAME)]], Field(max_length=MAX_DIMS * 4)]


class _Strict(BaseModel):
    # strict: "1", true and 1.0 are not the integer 1 (the store would keep another IR than the one sent)
    model_config = ConfigDict(extra="forbid", strict=True)


class StatementIn(_Strict):
    name: Name
    op: Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_.]*$", max_length=64)]
    args: Annotated[list[Name], Field(max_length=MAX_ARGS)] = []
    attrs: Annotated[dict[Annotated[str, StringConstraints(max_length=64)], AttrValue],
                     Field(max_length=MAX_ATTRS)] = {}


class ProgramIn(_Strict):
    """A program's JSON IR, as ``coconet export`` prints it."""

    version: int
    name: Name
    dims: Annotated[list[DimName], Field(max_length=MAX_DIMS)]
    statements: Annotated[list[StatementIn], Field(min_length=1, max_length=MAX_STATEMENTS)]


class ProgramCreated(BaseModel):
    hash: str
    name: str


class ProgramSummary(BaseModel):
    hash: str
    name: str
    dims: list[str]
    statements: int
    created_at: datetime


class ProgramOut(ProgramSummary):
    ir: dict[str, Any]


class JobIn(_Strict):
    program: Hash
    sizes: Annotated[dict[DimName, Size], Field(min_length=0, max_length=MAX_DIMS)]
    topology: Name = "local"
    world: Annotated[int, Field(ge=1, le=MAX_WORLD)] = 2
    budget: Annotated[int, Field(ge=1, le=MAX_BUDGET)] = 32
    backends: Annotated[list[Backend], Field(max_length=4)] = []
    # state a schedule may leave sharded (as_slice, ZeRO-style): names, or "all"; left out, the program's
    # default (what its baseline's caller never reads: Adam's m and v; for other programs nothing)
    shardable: Annotated[list[DimName], Field(max_length=MAX_ARGS)] | Literal["all"] | None = None


class JobCreated(BaseModel):
    id: int
    state: str


class ProgressOut(BaseModel):
    done: int
    total: int | None
    failed: int
    best_s: float | None


class JobOut(BaseModel):
    id: int
    program: str
    sizes: dict[str, int]
    topology: str
    world: int
    shardable: list[str] | Literal["all"]
    budget: int | None
    backends: list[str]
    state: Literal["queued", "running", "done", "failed", "interrupted"]
    progress: ProgressOut
    # why it failed, was interrupted, or was queued again; cleared when it runs again or is done
    error: str | None
    result: dict[str, Any] | None
    created_at: datetime
    updated_at: datetime
    heartbeat_at: datetime | None
    driver: str | None = None  # the process that runs (or last ran) it, as "pid N on HOST"


class Stats(BaseModel):
    median_s: float | None
    ci95_s: tuple[float, float] | None
    n: int


class ScheduleOut(BaseModel):
    """One measured schedule: what ran, on which backend, how fast."""

    measurement_id: int
    schedule: str
    schedule_hash: str
    backend: str
    knobs: dict[str, Any]
    # updated state the schedule leaves sharded (as_slice): each rank ends the step with only its rows of it
    sharded: list[str]
    status: str
    error: str | None
    stats: Stats
    source: str
    job_id: int | None
    created_at: datetime


class MeasurementOut(ScheduleOut):
    sizes: dict[str, int]
    topology: str
    world: int


class BestOut(BaseModel):
    program: str
    sizes: dict[str, int]  # the sizes asked for
    tuned_sizes: dict[str, int]  # the sizes the answer was tuned at (equal when exact)
    exact: bool
    distance: float  # sum over dims of |log2 asked - log2 tuned|; 0 when exact
    topology: str
    world: int
    backend: str
    schedule: str
    schedule_hash: str
    schedule_json: dict[str, Any] | None
    sharded: list[str]  # as ScheduleOut's: state the winner leaves sharded, ZeRO-style
    shardable: list[str] | Literal["all"]  # what the search that found it let stay sharded
    stats: Stats
    source: Literal["measured", "model"]
    speedup: float | None  # baseline median / winner median
    runner_up: ScheduleOut | None
    baseline: ScheduleOut | None
    winner_id: int
    job: int | None  # the tuning job that recorded the winner (None for one recorded outside a job)
    created_at: datetime


class TuningStarted(BaseModel):
    detail: str
    job: int
    state: str
    nearest: BestOut | None  # what there is meanwhile, flagged exact: false


class CodeOut(BaseModel):
    schedule_hash: str
    schedule: str
    program: str
    backend: str
    kernels: str
    source: str


class ResultsOut(BaseModel):
    program: str
    winners: list[BestOut]


class Health(BaseModel):
    status: Literal["ok"]
    version: str
    store: str
    workers: int
