"""Request and response bodies of the REST API (docs/service.md), with the service's bounds on input.

The bounds are the service's, tighter than the library's: one request must not make the server
hold or compute much (a program of 10,000 statements is fine for the CLI, not for a public POST).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints

from coconet.codegen.lower import BACKENDS
from coconet.schedules.dims import MAX_DIM_TEXT
from coconet.schedules.ir import SCHEMA_VERSION

MAX_STATEMENTS = 1000
MAX_DIMS = 8
MAX_SIZE = 2**40
MAX_WORLD = 1024
MAX_BUDGET = 10_000
MAX_NAME = 200  # the store's name columns are String(200)
MAX_ARGS = 64
MAX_ATTRS = 32
# Row ids: the store's keys are INTEGER columns, 32-bit on PostgreSQL; a larger id is refused as input rather
# than overflowing the database (a 503 there, an OverflowError in SQLite's driver past 2^63).
MAX_ID = 2**31 - 1
# Any other integer of a program's attributes (a constant, a seed, an axis): the IR keeps 64-bit integers.
MAX_INT = 2**62

Hash = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{8,64}$", min_length=8, max_length=64)]
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_.\-]*$", min_length=1, max_length=MAX_NAME)]
DIM_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
DimName = Annotated[str, StringConstraints(pattern=DIM_NAME, min_length=1, max_length=64)]


def _whole(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# JSON Schema's "integer" is any number without a fraction: 2.0 is one (schema-valid, so accepted, as 2); true
# and "2" are not. The bounds go before the validator: after it, the schema would lose them.
Whole = BeforeValidator(_whole)
Size = Annotated[int, Field(ge=1, le=MAX_SIZE), Whole]
World = Annotated[int, Field(ge=1, le=MAX_WORLD), Whole]
Budget = Annotated[int, Field(ge=1, le=MAX_BUDGET), Whole]
# Pydantic puts a key's pattern in patternProperties, which leaves keys that miss it allowed: propertyNames
# says every key is a dim name.
Sizes = Annotated[
    dict[DimName, Size],
    Field(
        max_length=MAX_DIMS, json_schema_extra={"propertyNames": {"pattern": DIM_NAME, "minLength": 1, "maxLength": 64}}
    ),
]
# the backends code is generated for (an unknown one could only be refused later, by the tuner)
Backend = Literal[BACKENDS]


def _decimal_at_most(n: int) -> str:
    """A regex of the decimal numbers 1..n, without leading zeros: the shorter ones, then n's length digit by
    digit (a smaller digit where n has one, any digits after it)."""
    s = str(n)
    alternatives = [f"[1-9][0-9]{{0,{len(s) - 2}}}"] if len(s) > 1 else []
    for i, digit in enumerate(s):
        lowest = 1 if i == 0 else 0
        if int(digit) > lowest:
            alternatives.append(f"{s[:i]}[{lowest}-{int(digit) - 1}][0-9]{{{len(s) - i - 1}}}")
    return "(?:" + "|".join([*alternatives, s]) + ")"


# The sizes query parameter as the client writes it (format_sizes): NAME=VALUE pairs, VALUE in 1..MAX_SIZE
# written out or as 2^k. parse_sizes reads more (spaces, leading zeros, other bases) and refuses what is out of
# range; the schema says only what it accepts.
_SIZE_ITEM = rf"[A-Za-z_][A-Za-z0-9_]{{0,63}}=(?:{_decimal_at_most(MAX_SIZE)}|2\^(?:[0-9]|[1-3][0-9]|40))"
SIZES_PATTERN = rf"^{_SIZE_ITEM}(?:,{_SIZE_ITEM}){{0,{MAX_DIMS - 1}}}$"
# Numbers share the integers' bound: JSON's 2^100 is a valid "number", and must not pass as a float either.
AttrInt = Annotated[int, Field(ge=-MAX_INT, le=MAX_INT)]
AttrFloat = Annotated[float, Field(ge=-MAX_INT, le=MAX_INT, allow_inf_nan=False)]
# A shape's entry: a length, or a dim expression over the program's dims ("N", "4*H")
ShapeDim = Size | Annotated[str, StringConstraints(min_length=1, max_length=MAX_DIM_TEXT)]
AttrValue = (
    Annotated[str, StringConstraints(max_length=MAX_NAME)]
    | AttrInt
    | AttrFloat
    | bool
    | None
    | Annotated[list[ShapeDim], Field(max_length=MAX_DIMS * 4)]
)


class ErrorItem(BaseModel):
    """One cause of a request that did not validate: where (``["query", "sizes"]``), what, and its kind."""

    loc: list[str | int]
    msg: str
    type: str


class ErrorOut(BaseModel):
    """The body of every 4xx and 5xx: ``detail``, one line for a person (the CLI and the client print it), and for
    a request that did not validate (422) ``errors``, each cause."""

    detail: str
    errors: list[ErrorItem] | None = None


ERROR_STATUSES: dict[int, str] = {
    400: "Bad request: not HTTP the server reads (a Host it does not serve, a bad Content-Length, JSON nested too "
    "deeply), or a request the server cannot carry out here",
    401: "No valid `Authorization: Bearer <token>`",
    403: "Not allowed for this client",
    404: "Not found",
    405: "Method not allowed (the `Allow` header lists the path's methods)",
    408: "The request's head did not arrive in time",
    413: "Request body too large",
    422: "The request does not validate, or names what the program does not have",
    431: "Request head too large (too long, or too many header fields)",
    500: "Internal error (a bug in the server)",
    503: "The results store is unavailable, or the server is busy; try again (after `Retry-After` seconds when given)",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these error statuses, each with the ``ErrorOut`` body: pass it as a route's or a
    router's ``responses=`` (merge dicts with ``|``)."""
    return {s: {"model": ErrorOut, "description": ERROR_STATUSES[s]} for s in statuses}


# What any operation may answer whatever it is: refusals ahead of routing (Host, the request head), the store, a bug.
ANY_ERROR = error_responses(400, 408, 431, 500, 503)


class _Strict(BaseModel):
    # strict: "1" and true are not the integer 1, and an attribute's 2.0 stays a float (the store would keep
    # another IR than the one sent); a whole float where only an integer fits is read as one (Whole)
    model_config = ConfigDict(extra="forbid", strict=True)


class StatementIn(_Strict):
    name: Name
    op: Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_.]*$", max_length=64)]
    args: Annotated[list[Name], Field(max_length=MAX_ARGS)] = []
    attrs: Annotated[
        dict[Annotated[str, StringConstraints(max_length=64)], AttrValue], Field(max_length=MAX_ATTRS)
    ] = {}


class ProgramIn(_Strict):
    """A program's JSON IR, as ``coconet export`` prints it."""

    version: Annotated[
        int, Field(ge=SCHEMA_VERSION, le=SCHEMA_VERSION, json_schema_extra={"const": SCHEMA_VERSION}), Whole
    ]
    name: Name
    dims: Annotated[list[DimName], Field(max_length=MAX_DIMS, json_schema_extra={"uniqueItems": True})]
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
    sizes: Sizes
    topology: Name = "local"
    world: World = 2
    budget: Budget = 32
    backends: Annotated[list[Backend], Field(max_length=4)] = []
    # state a schedule may leave sharded (as_slice, ZeRO-style): names, or "all"; left out, the program's
    # default (what its baseline's caller never reads: Adam's m and v; for other programs nothing)
    shardable: Annotated[list[DimName], Field(max_length=MAX_ARGS)] | Literal["all"] | None = None


class BestIn(_Strict):
    """POST /best: the key's best if it was tuned at these exact sizes, else a tuning job started for it."""

    program: Hash
    sizes: Sizes
    topology: Name = "local"
    world: World
    backend: Backend | None = None  # left out: any backend answers, and the job tunes on every one
    budget: Budget = 32
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


class PredictionOut(BaseModel):
    """Where a predicted time came from: never a measurement, and never in place of one."""

    model: str  # the cost model
    topology: str  # the topology description it priced
    calibration: str | None  # that description's digest: which calibration of it
    coconet: str | None  # the version that predicted


class MachinesOut(BaseModel):
    """Where a measurement ran: the fingerprint of the machines its ranks were placed on (coconet.tuner.fingerprint)."""

    fingerprint: str | None = None  # a short hash of it: equal on the same machines
    machines: str | None = None  # the fingerprint in words: nodes, CPU model and count, memory, GPUs
    placement: str | None = None  # how the ranks sat on them: "2 ranks on 1 node"


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
    source: Literal["measured", "predicted"]
    prediction: PredictionOut | None = None  # what predicted it, when predicted
    machines: MachinesOut | None = None  # where it ran, when measured (None for records older than fingerprints)
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
    # measured on the topology's machines, or predicted by the cost model (an offline sweep): a measured
    # winner always answers where the key has one
    source: Literal["measured", "predicted"]
    prediction: PredictionOut | None = None  # what predicted it, when predicted
    machines: MachinesOut | None = None  # where the winner ran, when measured
    speedup: float | None  # baseline median / winner median
    # the final re-timing (winner, runner-up and baseline alternating) put the winner ahead of the runner-up
    # that the search had found faster
    order_reversed: bool = False
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
    store: str | None = None  # only to a caller with the token, without its password
    workers: int
