"""The REST API (docs/service.md; docs/architecture.md, "Data flow"): programs in, tuning jobs run by
the server's workers, the best schedule per (program, sizes, topology) out, with its generated code.
``create_app`` builds one; nothing happens at import (uvicorn gets ``coconet.server.app:create_app`` with
``factory=True``).
"""


import logging
import math
import os
import re
import secrets
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any, AsyncIterator, Callable, Iterable, Literal, Sequence
from urllib.parse import parse_qsl

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from coconet import __version__
from coconet.codegen.baselines import shardable_text
from coconet.codegen.lower import BACKENDS, lower
from coconet.errors import (
    BackendError,
    CoconetError,
    IllegalTransform,
    ProgramError,
    ScheduleError,
    SizeError,
    StoreError,
)
from coconet.schedules import shardable as shard
from coconet.schedules.dims import parse_sizes
from coconet.schedules.ir import Program
from coconet.schedules.schedule import Schedule, sharded_by
from coconet.schedules.serialize import load
from coconet.server import dashboard
from coconet.server.assets import mount_docs
from coconet.server.driver import describe as describe_driver
from coconet.server.hosts import HostCheck
from coconet.server.jobs import Workers, WorkerSettings
from coconet.server.leases import requeue_orphans
from coconet.server.limits import MAX_BODY, MAX_DEPTH, ASGIApp, BodyLimit, Receive, Scope, Send, WriteSlots
from coconet.server.records import (
    STORED_SOURCE,
    Best,
    JobRecord,
    MeasurementRecord,
    answer_source,
    machines_of,
    prediction_of,
)
from coconet.server.schemas import (
    ANY_ERROR,
    MAX_DIMS,
    MAX_ID,
    MAX_SIZE,
    MAX_WORLD,
    SIZES_PATTERN,
    BestIn,
    BestOut,
    CodeOut,
    Health,
    JobCreated,
    JobIn,
    JobOut,
    MachinesOut,
    MeasurementOut,
    PredictionOut,
    ProgramCreated,
    ProgramIn,
    ProgramOut,
    ProgramSummary,
    ProgressOut,
    ResultsOut,
    ScheduleOut,
    Stats,
    TuningStarted,
    error_responses,
)
from coconet.server.store import Store, unavailable
from coconet.tuner.runner import Protocol
from coconet.tuner.tune import Request as TuneRequest
from coconet.tuner.tune import check

ENV_TOKEN = "COCONET_API_TOKEN"
PREFIX = "/api/v1"
# How long a request's write waits for a database connection, and again for the database's lock, before it is
# answered 503: a client can retry, where a request held for the store's default 30 s holds a server thread too.
WRITE_WAIT_S = 5.0
# Writes in progress at once: as many as the store's write pool has connections (SQLAlchemy's 5 + 10 overflow).
WRITE_SLOTS = 15
log = logging.getLogger("coconet.server")

_HASH = dict(pattern=r"^[0-9a-f]{8,64}$", max_length=64)
_SIZES = dict(pattern=SIZES_PATTERN, min_length=3, max_length=400,
              description="NAME=VALUE[,NAME=VALUE…], each NAME once, VALUE an integer in 1..2^40 or 2^k, e.g. "
              "N=1048576 or B=8,S=1024,H=3072")
_TOPOLOGY = dict(pattern=r"^[A-Za-z_][A-Za-z0-9_.\-]*$", max_length=200)
_BACKEND = dict(pattern=r"^[a-z][a-z0-9_]*$", max_length=32)
_SHARDABLE = dict(pattern=r"^(all|\*|[A-Za-z_][A-Za-z0-9_]*(,[A-Za-z_][A-Za-z0-9_]*)*|)$", max_length=400,
                  description="State the schedule may leave sharded (as_slice, ZeRO-style): names joined by "
                  "commas, `all` for any, empty for none. Left out: the program's default (Adam: m,v; else none)")
HashPath = Annotated[str, Query(**_HASH)]
SizesQuery = Annotated[str, Query(**_SIZES)]
TopologyQuery = Annotated[str, Query(**_TOPOLOGY)]
BackendQuery = Annotated[str, Query(**_BACKEND)]
MaybeHash = Annotated[str | None, Query(**_HASH)]
MaybeSizes = Annotated[str | None, Query(**_SIZES)]
MaybeTopology = Annotated[str | None, Query(**_TOPOLOGY)]
MaybeBackend = Annotated[str | None, Query(**_BACKEND)]
MaybeShardable = Annotated[str | None, Query(**_SHARDABLE)]
SourceQuery = Annotated[Literal["measured", "predicted"] | None,
                        Query(description="Only a winner of this source; left out, a measured winner where the key "
                              "has one, else a predicted one")]


@dataclass(frozen=True)
class Settings:
    token: str | None
    workers: WorkerSettings
    start_workers: bool
    open_writes: bool = False


def create_app(store_url: str | None = None, *, token: str | None = None, workers: int = 1,
               start_workers: bool = True, protocol: Protocol | None = None, ray_address: str | None = None,
               stale_s: float | None = None, open_writes: bool = False, hosts: Iterable[str] = (),
               wait_s: float = WRITE_WAIT_S) -> FastAPI:
    """The API on the store at ``store_url`` (default: as ``Store.open``). Writes need ``token`` (default
    ``$COCONET_API_TOKEN``); with none, writes are refused unless ``open_writes`` (keep such a server on
    loopback). It answers requests for loopback names and ``hosts`` (``*``: any), and takes writes from web
    pages of those hosts only. A request's write waits ``wait_s`` at most for the database, then gets 503.
    ``workers`` threads run tuning jobs with ``protocol`` on Ray (``ray_address``, or a local cluster)."""
    token = token if token is not None else (os.environ.get(ENV_TOKEN) or None)
    ws = WorkerSettings(workers=workers, protocol=protocol or Protocol(), ray_address=ray_address)
    if stale_s is not None:
        ws = WorkerSettings(ws.workers, ws.protocol, ws.ray_address, ws.poll_s, stale_s)
    settings = Settings(token, ws, start_workers, open_writes)
    store = Store.open(store_url, wait_s=wait_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The workers record what trials measured: they wait for the database as long as the store's default,
        # where a request gives up after wait_s.
        jobs = Store.open(store_url)
        try:
            requeue_orphans(jobs, ws.stale_s)
            pool = Workers(jobs, ws)
            app.state.workers = pool
            if start_workers and ws.workers > 0:
                pool.start()
            try:
                yield
            finally:
                pool.stop()
        finally:
            jobs.close()
            store.close()

    # /docs and /redoc come from assets.mount_docs, on local scripts: FastAPI's own load theirs from a CDN
    app = FastAPI(title="coconet", version=__version__, lifespan=lifespan, responses=ANY_ERROR,
                  description="Best schedules of distributed ML programs, tuned on demand.",
                  docs_url=None, redoc_url=None)
    app.state.store = store
    app.state.settings = settings
    app.state.workers = None
    app.state.programs = ProgramFacts(store)
    _handlers(app)
    app.include_router(_router(settings), prefix=PREFIX)

    dashboard.mount(app)
    mount_docs(app)
    app.add_middleware(WriteSlots, slots=WRITE_SLOTS, wait_s=wait_s)
    app.add_middleware(BodyLimit, max_body=MAX_BODY, max_depth=MAX_DEPTH)
    app.add_middleware(FastBest)
    app.add_middleware(HostCheck, hosts=tuple(hosts))  # the outermost: no route, fast or not, answers before it
    return app


# -- errors: every refusal is a 4xx with {"detail": "..."}; a 500 only for a bug

_UNPROCESSABLE = (ProgramError, SizeError, ScheduleError, IllegalTransform, BackendError)


def _status(err: CoconetError) -> int:
    if isinstance(err, StoreError):
        # Refusals name what was refused (a program, a job, a measurement); the rest is the database failing.
        if any(hasattr(err, f) for f in ("program_hash", "job_id", "measurement_id")):
            return 404
        return 503 if hasattr(err, "url") else 422
    return 422 if isinstance(err, _UNPROCESSABLE) else 400


def _handlers(app: FastAPI) -> None:
    @app.exception_handler(CoconetError)
    async def coconet_error(request: Request, err: CoconetError) -> JSONResponse:
        status = _status(err)
        if status == 503:  # the cause names the database (its URL, host, driver): for the log, not the client
            log.error("%s %s: %s", request.method, request.url.path, err)
            return JSONResponse({"detail": unavailable(err)}, status_code=503, headers={"Retry-After": "1"})
        return JSONResponse({"detail": " ".join(str(err).split())}, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        # Pydantic's list, plus one line naming the first cause for people reading it in a terminal.
        errors = err.errors()
        detail = [{k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in errors[:20]]
        return JSONResponse({"detail": _one_line(errors), "errors": jsonable_encoder(detail)}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> Any:
        if err.status_code == 405:
            # The router names one route's methods; a path served by several routes (GET and POST /programs)
            # allows all of theirs.
            allowed = _methods(request.app, request.url.path)
            if allowed:
                return JSONResponse({"detail": f"{request.method} is not allowed on {request.url.path} "
                                     f"(allowed: {', '.join(allowed)})"}, status_code=405,
                                    headers={"Allow": ", ".join(allowed)})
        return await http_exception_handler(request, err)

    @app.exception_handler(RecursionError)
    async def too_deep(request: Request, err: RecursionError) -> JSONResponse:
        return JSONResponse({"detail": "input nested too deeply"}, status_code=400)

    @app.exception_handler(Exception)
    async def bug(request: Request, err: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse({"detail": f"internal error: {type(err).__name__}"}, status_code=500)


# -- routes


def _store(request: Request) -> Store:
    return request.app.state.store


def _router(settings: Settings) -> Any:
    router = APIRouter()
    bearer = HTTPBearer(auto_error=False, description=f"The server's token (${ENV_TOKEN}); needed for writes.")

    Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]

    def trusted(creds: HTTPAuthorizationCredentials | None) -> bool:
        """Whether the caller carries the server's token."""
        if settings.token is None or creds is None or creds.scheme.lower() != "bearer":
            return False
        return secrets.compare_digest(creds.credentials.encode(), settings.token.encode())

    def writer(creds: Credentials) -> None:
        if settings.token is None:
            if settings.open_writes:
                return
            raise HTTPException(403, f"this server takes no writes: start it with ${ENV_TOKEN} set (writes then "
                                     "carry 'Authorization: Bearer <token>'), or with --open on a loopback host")
        if not trusted(creds):
            raise HTTPException(401, "a valid 'Authorization: Bearer <token>' is needed to write",
                                headers={"WWW-Authenticate": "Bearer"})

    # Without a token the server's writes are open or refused, whatever a request carries: no token is required.
    writes: dict[str, Any] = {"dependencies": [Depends(writer)],
                              "openapi_extra": None if settings.token is not None else _TOKEN_OPTIONAL}

    # async, and no database: answered on the event loop even while every worker thread waits for the store
    @router.get("/health", tags=["service"], response_model_exclude_none=True, openapi_extra=_TOKEN_OPTIONAL)
    async def health(request: Request, creds: Credentials = None) -> Health:
        store = _store(request).url if trusted(creds) else None
        return Health(status="ok", version=__version__, store=store, workers=settings.workers.workers)

    @router.post("/programs", status_code=201, tags=["programs"], **writes,
                 responses=error_responses(401, 403, 413, 422))
    def post_program(request: Request, body: ProgramIn) -> ProgramCreated:
        prog = load(body.model_dump())
        _store(request).add_program(prog)
        return ProgramCreated(hash=prog.hash, name=prog.name)

    @router.get("/programs", tags=["programs"], responses=error_responses(422))
    def list_programs(request: Request, limit: int = Query(1000, ge=1, le=10_000)) -> list[ProgramSummary]:
        return [ProgramSummary(**vars(p)) for p in _store(request).programs(limit)]

    @router.get("/programs/{program_hash}", tags=["programs"], responses=error_responses(404, 422))
    def get_program(request: Request, program_hash: Annotated[str, _hash_path()]) -> ProgramOut:
        rec = _program(_store(request), program_hash)
        return ProgramOut(hash=rec.hash, name=rec.name, dims=list(rec.ir.get("dims", [])),
                          statements=len(rec.ir.get("statements", [])), created_at=rec.created_at, ir=rec.ir)

    @router.post("/jobs", status_code=202, tags=["jobs"], **writes,
                 responses=error_responses(401, 403, 404, 413, 422))
    def post_job(request: Request, body: JobIn) -> JobCreated:
        facts = _facts(request, body.program)
        _check_dims(facts.name, facts.dims, body.sizes)
        shardable = body.shardable if body.shardable is None or isinstance(body.shardable, list) else [body.shardable]
        job = _start_job(request, facts.program, body.sizes, body.topology, body.world, body.budget,
                         tuple(body.backends), facts.shardable(shardable))
        return JobCreated(id=job.id, state=job.state)

    @router.get("/jobs", tags=["jobs"], responses=error_responses(422), openapi_extra=_TOKEN_OPTIONAL)
    def list_jobs(request: Request, program: HashPath, limit: int = Query(100, ge=1, le=1000),
                  creds: Credentials = None) -> list[JobOut]:
        jobs = _store(request).jobs(program_hash=program, newest_first=True, limit=limit)
        return [_job_out(j, trusted(creds)) for j in jobs]

    @router.get("/jobs/{job_id}", tags=["jobs"], responses=error_responses(404, 422), openapi_extra=_TOKEN_OPTIONAL)
    def get_job(request: Request, job_id: Annotated[int, _id_path()], creds: Credentials = None) -> JobOut:
        job = _store(request).job(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id}")
        return _job_out(job, trusted(creds))

    @router.get("/best", tags=["results"], response_model=BestOut, responses=error_responses(400, 404, 422))
    def best(request: Request, program: HashPath, sizes: SizesQuery, topology: TopologyQuery = "local",
             world: int | None = Query(None, ge=1, le=MAX_WORLD), backend: MaybeBackend = None,
             shardable: MaybeShardable = None, source: SourceQuery = None,
             tune: str | None = Query(None, include_in_schema=False)) -> Any:
        if tune is not None:  # a GET changes nothing: a web page could make any browser send one
            raise HTTPException(400, f"GET {PREFIX}/best only reads; to tune on a miss, POST {PREFIX}/best with "
                                     "a JSON body (program, sizes as an object, topology, world, backend, budget, "
                                     "shardable) and the token")
        store = _store(request)
        asked = _parse_sizes(sizes)
        facts = _facts(request, program)
        allowed = facts.shardable(None if shardable is None else [shardable])
        found = store.best(program, asked, topology, world, backend=backend, shardable=allowed,
                           source=STORED_SOURCE.get(source or ""))
        if found is not None and found.exact:
            return _best_out(found, asked)
        # A miss: say why (wrong dims, nothing tuned).
        _check_dims(facts.name, facts.dims, asked)
        if found is not None:
            return _best_out(found, asked)
        raise HTTPException(404, f"nothing tuned for program {program} on topology {topology!r}"
                                 + (f" with world {world}" if world else "")
                                 + (f" and backend {backend}" if backend else "")
                                 + f" that leaves at most {shard.words(allowed)} sharded"
                                 + f" at these or comparable sizes (POST {PREFIX}/best starts a job)")

    @router.post("/best", tags=["results"], response_model=BestOut, **writes,
                 responses={202: {"model": TuningStarted, "description": "Not measured at these exact sizes: a "
                                  "tuning job started (or the one already running for the key), and the nearest "
                                  "tuned sizes' best meanwhile"}} | error_responses(401, 403, 404, 413, 422))
    def best_or_tune(request: Request, body: BestIn) -> Any:
        store = _store(request)
        facts = _facts(request, body.program)
        _check_dims(facts.name, facts.dims, body.sizes)
        shardable = body.shardable if body.shardable is None or isinstance(body.shardable, list) else [body.shardable]
        allowed = facts.shardable(shardable)
        found = store.best(body.program, body.sizes, body.topology, body.world, backend=body.backend,
                           shardable=allowed)
        if found is not None and found.exact and found.source == "measured":
            return _best_out(found, body.sizes)
        # a prediction is no answer to a request to tune: it goes back as the nearest, the job measures the key
        job = _start_job(request, facts.program, body.sizes, body.topology, body.world, body.budget,
                         (body.backend,) if body.backend else (), allowed)
        out = TuningStarted(detail=f"no measured result for these exact sizes; tuning job {job.id} is {job.state}",
                            job=job.id, state=job.state,
                            nearest=_best_out(found, body.sizes) if found is not None else None)
        return JSONResponse(jsonable_encoder(out), status_code=202)

    @router.get("/schedules/{schedule_hash}/code", tags=["results"], responses=error_responses(404, 422))
    def code(request: Request, schedule_hash: Annotated[str, _hash_path()],
             backend: Annotated[str, Query(pattern=f"^({'|'.join(_backends())})$")] = "gloo",
             kernels: str = Query("compiled", pattern="^(compiled|eager)$"),
             program: MaybeHash = None) -> CodeOut:
        if backend not in BACKENDS:
            raise HTTPException(422, f"unknown backend {backend!r} (use {', '.join(BACKENDS)})")
        store = _store(request)
        m = store.schedule_measurement(schedule_hash, program)
        if m is None:
            raise HTTPException(404, f"no recorded schedule with hash {schedule_hash}")
        prog = _loaded(store, m.program_hash)
        generated = lower(Schedule.from_json(m.schedule_json, prog), backend, kernels)
        return CodeOut(schedule_hash=schedule_hash, schedule=m.schedule, program=prog.hash, backend=backend,
                       kernels=kernels, source=generated.source)

    @router.get("/results", tags=["results"], responses=error_responses(404, 422))
    def results(request: Request, program: HashPath, topology: MaybeTopology = None) -> ResultsOut:
        store = _store(request)
        _program(store, program)
        rows = store.results(program, topology)
        return ResultsOut(program=program, winners=[_best_out(b, b.winner.sizes) for b in rows])

    @router.get("/measurements", tags=["results"], responses=error_responses(404, 422))
    def measurements(request: Request, program: HashPath, sizes: MaybeSizes = None,
                     topology: MaybeTopology = None, after: int = Query(0, ge=0, le=MAX_ID),
                     limit: int = Query(1000, ge=1, le=10_000)) -> list[MeasurementOut]:
        store = _store(request)
        _program(store, program)
        rows = store.measurements(program, _parse_sizes(sizes) if sizes else None, topology, after=after,
                                  limit=limit)
        return [MeasurementOut(**_schedule_fields(m), sizes=m.sizes, topology=m.topology, world=m.world)
                for m in rows]

    return router


# A read that shows more to the token's holder: OpenAPI's empty requirement beside the bearer one (FastAPI
# appends it to the one the dependency declares) says the token is optional.
_TOKEN_OPTIONAL: dict[str, Any] = {"security": [{}]}


def _hash_path() -> Any:
    return Path(pattern=r"^[0-9a-f]{8,64}$", max_length=64)


def _id_path() -> Any:
    return Path(ge=1, le=MAX_ID)


def _backends() -> tuple[str, ...]:
    return BACKENDS


# Human forms of the parameters whose patterns are too long to print in a message.
_FORMS = {"sizes": "NAME=VALUE[,NAME=VALUE…] with each VALUE in 1..2^40 or 2^k (e.g. N=1048576 or B=8,S=1024)"}


# Pydantic's names for a union's alternatives in an error's loc: no help to a person
_UNION_TAG = re.compile(r"constrained-\w+|int|str|float|bool|none|(list|literal|union|function-\w+)\[.*\]")


def _one_line(errors: Sequence[Any]) -> str:
    """A request's first cause of not validating, for a person: where, what, and the value given. Of a value
    that fits none of a union's types, the alternative it came closest to (a bound it missed, not a type)."""
    if not errors:
        return "invalid request"

    def where(e: Any) -> list[str]:
        return [str(x) for x in e.get("loc", ()) if not (isinstance(x, str) and _UNION_TAG.fullmatch(x))]

    within = where(errors[0])  # a union's alternatives, and the items of a list among them
    first = next((e for e in errors if where(e)[:len(within)] == within and not e.get("type", "").endswith("_type")),
                 errors[0])
    loc = where(first)
    given = first.get("input")
    if first.get("type") == "string_pattern_mismatch" and loc and loc[-1] in _FORMS:
        return f"{'.'.join(loc)}: {_short(given)} is not {_FORMS[loc[-1]]}"
    message = f"{'.'.join(loc)}: {first.get('msg', 'invalid')}"
    if first.get("type") != "missing" and isinstance(given, (str, int, float)):
        message += f", not {_short(given)}"
    return message


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _methods(app: Any, path: str) -> list[str]:
    """The methods the OpenAPI schema gives this path, sorted; none for a path it does not have."""
    paths = getattr(app.state, "path_methods", None)
    if paths is None:
        paths = []
        for template, item in app.openapi().get("paths", {}).items():
            pattern = re.sub(r"\\\{[^/]*?\\\}", "[^/]+", re.escape(template))
            paths.append((re.compile(pattern), sorted(m.upper() for m in item if m in _HTTP_METHODS)))
        app.state.path_methods = paths
    return next((methods for pattern, methods in paths if pattern.fullmatch(path)), [])


_HTTP_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


def _program(store: Store, program_hash: str) -> Any:
    rec = store.program(program_hash)
    if rec is None:
        raise HTTPException(404, f"no program {program_hash} (POST it to {PREFIX}/programs first)")
    return rec


def _loaded(store: Store, program_hash: str) -> Any:
    return load(_program(store, program_hash).ir)


def _parse_sizes(spec: str) -> dict[str, int]:
    sizes = parse_sizes(spec)
    if len(sizes) > MAX_DIMS:
        raise SizeError(f"{len(sizes)} sizes given; at most {MAX_DIMS} dims are accepted")
    return sizes


def _facts(request: Request, program_hash: str) -> "Facts":
    found = request.app.state.programs.get(program_hash)
    if found is None:
        raise HTTPException(404, f"no program {program_hash} (POST it to {PREFIX}/programs first)")
    return found


def _shardable_out(text: str) -> list[str] | str:
    spelled = shard.spelled(text)
    return shard.ALL if spelled == (shard.ALL,) else list(spelled)


def _check_dims(name: str, dims: tuple[str, ...], sizes: dict[str, int]) -> None:
    extra = sorted(set(sizes) - set(dims))
    missing = [d for d in dims if d not in sizes]
    if extra or missing:
        why = [f"no size for {', '.join(missing)}"] if missing else []
        why += [f"{', '.join(extra)} {'is' if len(extra) == 1 else 'are'} not among them"] if extra else []
        raise SizeError(f"program {name} has dims {', '.join(dims) or 'none'}: {'; '.join(why)}")
    for k, v in sizes.items():
        if not 1 <= v <= MAX_SIZE:
            raise SizeError(f"size {k}={v} is outside 1..2^40")


def _start_job(request: Request, prog: Any, sizes: dict[str, int], topology: str, world: int, budget: int,
               backends: tuple[str, ...], shardable: str) -> JobRecord:
    """A queued job for the key, or the one already queued or running for it; refused here if the tuner would
    refuse it (a topology without its cluster, a backend this machine lacks)."""
    settings: Settings = request.app.state.settings
    ws = settings.workers
    check(TuneRequest(prog, (sizes,), world, topology, budget, backends, ws.protocol, ray_address=ws.ray_address))
    store = _store(request)
    job, _ = store.join_job(prog.hash, sizes, topology, world, budget=budget, backends=list(backends),
                            shardable=shardable)
    pool = request.app.state.workers
    if pool is not None:
        pool.wake()
    return job


def _stats(m: MeasurementRecord) -> Stats:
    ci = (m.ci_lo_s, m.ci_hi_s) if m.ci_lo_s is not None and m.ci_hi_s is not None else None
    return Stats(median_s=m.median_s, ci95_s=ci, n=m.n)


def _schedule_fields(m: MeasurementRecord) -> dict[str, Any]:
    return dict(measurement_id=m.id, schedule=m.schedule, schedule_hash=m.schedule_hash, backend=m.backend,
                knobs=m.knobs, sharded=sharded_by(m.schedule), status=m.status, error=m.error, stats=_stats(m),
                source=answer_source(m.source), prediction=_prediction(m), machines=_machines(m), job_id=m.job_id,
                created_at=m.created_at)


def _prediction(m: MeasurementRecord) -> PredictionOut | None:
    found = prediction_of(m)
    return PredictionOut(**found) if found is not None else None


def _machines(m: MeasurementRecord) -> MachinesOut | None:
    found = machines_of(m)
    return MachinesOut(**found) if found is not None else None


def _schedule_out(m: MeasurementRecord | None) -> ScheduleOut | None:
    return ScheduleOut(**_schedule_fields(m)) if m is not None else None


def _best_out(b: Best, asked: dict[str, int]) -> BestOut:
    m, w = b.measurement, b.winner
    return BestOut(program=w.program_hash, sizes=asked, tuned_sizes=w.sizes, exact=b.exact, distance=b.distance,
                   topology=w.topology, world=w.world, backend=w.backend, schedule=m.schedule,
                   schedule_hash=m.schedule_hash, schedule_json=m.schedule_json, sharded=sharded_by(m.schedule),
                   shardable=_shardable_out(w.shardable), stats=_stats(m), source=answer_source(w.source),
                   prediction=_prediction(m), machines=_machines(m), order_reversed=w.order_reversed,
                   speedup=w.speedup, runner_up=_schedule_out(b.runner_up), baseline=_schedule_out(b.baseline),
                   winner_id=w.id, job=w.job_id, created_at=w.created_at)


def _job_out(j: JobRecord, show_driver: bool = False) -> JobOut:
    """The job as the API shows it; which process drives it (pid and host name) only to a caller with the token."""
    p = j.progress
    return JobOut(id=j.id, program=j.program_hash, sizes=j.sizes, topology=j.topology, world=j.world,
                  shardable=_shardable_out(j.shardable), budget=j.budget, backends=j.backends, state=j.state,
                  progress=ProgressOut(done=p.done, total=p.total, failed=p.failed, best_s=p.best_s),
                  error=j.error, result=j.result, created_at=j.created_at, updated_at=j.updated_at,
                  heartbeat_at=j.heartbeat_at, driver=describe_driver(j.driver) if show_driver else None)


# -- the hot path: GET /best without FastAPI's per-request machinery


@dataclass(frozen=True)
class Facts:
    """What requests about a program need to know of it."""

    program: Program
    default_shardable: str

    @property
    def name(self) -> str:
        return self.program.name

    @property
    def dims(self) -> tuple[str, ...]:
        return tuple(self.program.dims)

    def shardable(self, names: list[str] | None) -> str:
        """The text of what a request lets stay sharded: its names (``all`` for every one), else the default."""
        if names is None:
            return self.default_shardable
        try:
            return shardable_text(self.program, names)
        except CoconetError as e:
            raise HTTPException(422, str(e)) from None


class ProgramFacts:
    """Each program's facts by hash, read from the store once: a program's record never changes (its hash is its
    content), so nothing kept here goes stale. At most ``size`` programs, the oldest dropped first."""

    def __init__(self, store: Store, size: int = 4096) -> None:
        self._store, self._size = store, size
        self._known: dict[str, Facts] = {}
        self._lock = threading.Lock()

    def get(self, program_hash: str) -> Facts | None:
        found = self._known.get(program_hash)
        if found is None:
            record = self._store.program(program_hash)
            if record is None:
                return None
            prog = load(record.ir)
            found = Facts(prog, shardable_text(prog))
            with self._lock:
                if len(self._known) >= self._size:
                    self._known.pop(next(iter(self._known)))
                self._known[program_hash] = found
        return found


_BEST_PATH = f"{PREFIX}/best"


def _accepts(spec: dict[str, Any]) -> Callable[[str], bool]:
    """A string Query declaration's constraints (pattern, lengths) as a check on a raw value."""
    pattern = re.compile(spec.get("pattern", r"(?s).*"))
    lo, hi = spec.get("min_length", 0), spec.get("max_length", math.inf)
    return lambda v: lo <= len(v) <= hi and pattern.fullmatch(v) is not None


# Values the route's declarations accept as they are (a subset of what FastAPI would coerce: "02" is left to it).
_WORLD = re.compile(r"[1-9][0-9]{0,3}")
_PLAIN = {"program": _accepts(_HASH), "sizes": _accepts(_SIZES), "topology": _accepts(_TOPOLOGY),
          "backend": _accepts(_BACKEND), "shardable": _accepts(_SHARDABLE),
          "world": lambda v: _WORLD.fullmatch(v) is not None, "source": STORED_SOURCE.__contains__}


class FastBest:
    """ASGI middleware answering a plain ``GET /api/v1/best``: parameters the route would take as they are,
    neither ``tune`` nor ``budget``, and a winner to answer with. It answers on the event loop with the body the
    route would send (``_best_out``), without FastAPI's per-request work (parameter models, dependencies, the hop
    to a worker thread, validating the response again), which cost more than the lookup itself: in process, on
    a SQLite store of 1,000 tuned keys, it answers 2.6x the requests per second the route does (1,036 against
    401, interleaved rounds; ``benchmarks/best_fast_path.py``, ``benchmarks/results/best_fast_path.json``).
    Anything else goes on to the route: every error, every request nothing answers, every tuning request.

    The lookup blocks the event loop for its round trip: an indexed read that never waits for a writer (SQLite
    in WAL mode, PostgreSQL's snapshots), cheaper than the thread hop it saves."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["path"] == _BEST_PATH and scope["method"] == "GET"
                and not scope.get("root_path")):
            body = _plain_best(scope["app"].state, scope["query_string"])
            if body is not None:
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-length", str(len(body)).encode()),
                                        (b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def _plain_best(state: Any, query: bytes) -> bytes | None:
    """The route's 200 body for this query string, or None to leave the request to the route."""
    pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True)  # as Starlette reads a query
    params = dict(pairs)
    if len(params) != len(pairs) or "tune" in params or "budget" in params:
        return None
    program, sizes = params.get("program"), params.get("sizes")
    topology, world, backend = params.get("topology", "local"), params.get("world"), params.get("backend")
    shardable, source = params.get("shardable"), params.get("source")
    if program is None or sizes is None:
        return None
    for name, value in (("program", program), ("sizes", sizes), ("topology", topology), ("world", world),
                        ("backend", backend), ("shardable", shardable), ("source", source)):
        if value is not None and not _PLAIN[name](value):
            return None
    if world is not None and int(world) > MAX_WORLD:
        return None
    try:
        facts = state.programs.get(program)
        if facts is None:
            return None
        allowed = facts.shardable(None if shardable is None else [shardable])
        asked = _parse_sizes(sizes)
        found = state.store.best(program, asked, topology, int(world) if world else None, backend=backend,
                                 shardable=allowed, source=STORED_SOURCE.get(source or ""))
        if found is None:
            return None
        if not found.exact:  # the route first checks the sizes against the program's dims
            _check_dims(facts.name, facts.dims, asked)
    except (CoconetError, HTTPException):
        return None
    return _best_out(found, asked).model_dump_json().encode()
