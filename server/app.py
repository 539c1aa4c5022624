"""The REST API (DESIGN §8, §9): programs in, tuning jobs run by the server's workers, the best schedule
per (program, sizes, topology) out, with its generated code. ``create_app`` builds one; nothing happens at
import (uvicorn gets ``coconet.server.app:create_app`` with ``factory=True``).
"""


import logging
import math
import os
import re
import secrets
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any, AsyncIterator, Callable
from urllib.parse import parse_qsl

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from coconet import __version__
from coconet.errors import (
    BackendError,
    CoconetError,
    IllegalTransform,
    ProgramError,
    ScheduleError,
    SizeError,
    StoreError,
)
from coconet.codegen.baselines import shardable_text
from coconet.schedules import shardable as shard
from coconet.schedules.ir import Program
from coconet.schedules.schedule import sharded_by
from coconet.server.driver import describe as describe_driver
from coconet.server.jobs import WorkerSettings, Workers, requeue_orphans
from coconet.server.limits import MAX_BODY, MAX_DEPTH, ASGIApp, BodyLimit, Receive, Scope, Send
from coconet.server.records import Best, JobRecord, MeasurementRecord
from coconet.server.schemas import (
    MAX_DIMS,
    MAX_SIZE,
    MAX_WORLD,
    BestOut,
    CodeOut,
    Health,
    JobCreated,
    JobIn,
    JobOut,
    MeasurementOut,
    ProgramCreated,
    ProgramIn,
    ProgramOut,
    ProgramSummary,
    ProgressOut,
    ResultsOut,
    ScheduleOut,
    Stats,
    TuningStarted,
)
from coconet.server.store import Store
from coconet.tuner.runner import Protocol

ENV_TOKEN = "COCONET_API_TOKEN"
PREFIX = "/api/v1"
log = logging.getLogger("coconet.server")

_HASH = dict(pattern=r"^[0-9a-f]{8,64}$", max_length=64)
_SIZES = dict(min_length=3, max_length=400, description="NAME=VALUE[,NAME=VALUE…], VALUE an integer or 2^k, "
              "e.g. N=1048576 or B=8,S=1024,H=3072")
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


@dataclass(frozen=True)
class Settings:
    token: str | None
    workers: WorkerSettings
    start_workers: bool


def create_app(store_url: str | None = None, *, token: str | None = None, workers: int = 1,
               start_workers: bool = True, protocol: Protocol | None = None, ray_address: str | None = None,
               stale_s: float | None = None) -> FastAPI:
    """The API on the store at ``store_url`` (default: as ``Store.open``). Writes need ``token`` (default
    ``$COCONET_API_TOKEN``; with neither, writes are open: keep such a server on loopback). ``workers``
    threads run tuning jobs with ``protocol`` on Ray (``ray_address``, or a local cluster)."""
    token = token if token is not None else (os.environ.get(ENV_TOKEN) or None)
    ws = WorkerSettings(workers=workers, protocol=protocol or Protocol(), ray_address=ray_address)
    if stale_s is not None:
        ws = WorkerSettings(ws.workers, ws.protocol, ws.ray_address, ws.poll_s, stale_s)
    settings = Settings(token, ws, start_workers)
    store = Store.open(store_url)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        requeue_orphans(store, ws.stale_s)
        pool = Workers(store, ws)
        app.state.workers = pool
        if start_workers and ws.workers > 0:
            pool.start()
        try:
            yield
        finally:
            pool.stop()
            store.close()

    app = FastAPI(title="coconet", version=__version__, lifespan=lifespan,
                  description="Best schedules of distributed ML programs, tuned on demand (DESIGN §9).")
    app.state.store = store
    app.state.settings = settings
    app.state.workers = None
    app.state.programs = ProgramFacts(store)
    _handlers(app)
    app.include_router(_router(settings), prefix=PREFIX)
    from coconet.server import dashboard

    dashboard.mount(app)
    app.add_middleware(BodyLimit, max_body=MAX_BODY, max_depth=MAX_DEPTH)
    app.add_middleware(FastBest)
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
        return JSONResponse({"detail": " ".join(str(err).split())}, status_code=_status(err))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        # Pydantic's list, plus one line naming the first cause for people reading it in a terminal.
        errors = err.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(x) for x in first.get("loc", ()))
        message = f"{where}: {first.get('msg', 'invalid request')}"
        detail = [{k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in errors[:20]]
        return JSONResponse({"detail": message, "errors": jsonable_encoder(detail)}, status_code=422)

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
    from fastapi import APIRouter

    router = APIRouter()
    bearer = HTTPBearer(auto_error=False, description=f"The server's token (${ENV_TOKEN}); needed for writes.")

    def writer(creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
        if settings.token is None:
            return
        given = creds.credentials.encode() if creds is not None and creds.scheme.lower() == "bearer" else b""
        if not secrets.compare_digest(given, settings.token.encode()):
            raise HTTPException(401, "a valid 'Authorization: Bearer <token>' is needed to write",
                                headers={"WWW-Authenticate": "Bearer"})

    @router.get("/health", tags=["service"])
    def health(request: Request) -> Health:
        return Health(status="ok", version=__version__, store=_store(request).url, workers=settings.workers.workers)

    @router.post("/programs", status_code=201, tags=["programs"], dependencies=[Depends(writer)],
                 responses={401: {}, 413: {}, 422: {}})
    def post_program(request: Request, body: ProgramIn) -> ProgramCreated:
        from coconet.schedules.serialize import load

        prog = load(body.model_dump())
        _store(request).add_program(prog)
        return ProgramCreated(hash=prog.hash, name=prog.name)

    @router.get("/programs", tags=["programs"])
    def list_programs(request: Request, limit: int = Query(1000, ge=1, le=10_000)) -> list[ProgramSummary]:
        return [ProgramSummary(**vars(p)) for p in _store(request).programs(limit)]

    @router.get("/programs/{program_hash}", tags=["programs"], responses={404: {}})
    def get_program(request: Request, program_hash: Annotated[str, _hash_path()]) -> ProgramOut:
        rec = _program(_store(request), program_hash)
        return ProgramOut(hash=rec.hash, name=rec.name, dims=list(rec.ir.get("dims", [])),
                          statements=len(rec.ir.get("statements", [])), created_at=rec.created_at, ir=rec.ir)

    @router.post("/jobs", status_code=202, tags=["jobs"], dependencies=[Depends(writer)],
                 responses={401: {}, 404: {}, 413: {}, 422: {}})
    def post_job(request: Request, body: JobIn) -> JobCreated:
        facts = _facts(request, body.program)
        _check_dims(facts.name, facts.dims, body.sizes)
        shardable = body.shardable if body.shardable is None or isinstance(body.shardable, list) else [body.shardable]
        job = _start_job(request, facts.program, body.sizes, body.topology, body.world, body.budget,
                         tuple(body.backends), facts.shardable(shardable))
        return JobCreated(id=job.id, state=job.state)

    @router.get("/jobs", tags=["jobs"])
    def list_jobs(request: Request, program: HashPath, limit: int = Query(100, ge=1, le=1000)) -> list[JobOut]:
        return [_job_out(j) for j in _store(request).jobs(program_hash=program, newest_first=True, limit=limit)]

    @router.get("/jobs/{job_id}", tags=["jobs"], responses={404: {}})
    def get_job(request: Request, job_id: Annotated[int, _id_path()]) -> JobOut:
        job = _store(request).job(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id}")
        return _job_out(job)

    @router.get("/best", tags=["results"], response_model=BestOut, responses={202: {"model": TuningStarted}, 401: {}, 404: {}, 422: {}})
    def best(request: Request, program: HashPath, sizes: SizesQuery, topology: TopologyQuery = "local",
             world: int | None = Query(None, ge=1, le=MAX_WORLD), backend: MaybeBackend = None,
             tune: bool = Query(False, description="On a miss (no result for these exact sizes) start a tuning "
                                "job and answer 202 with its id (needs the token)"),
             budget: int = Query(32, ge=1, le=10_000), shardable: MaybeShardable = None,
             authorization: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)] = None) -> Any:
        store = _store(request)
        asked = _parse_sizes(sizes)
        facts = _facts(request, program)
        allowed = facts.shardable(None if shardable is None else [shardable])
        found = store.best(program, asked, topology, world, backend=backend, shardable=allowed)
        if found is not None and found.exact:
            return _best_out(found, asked)
        # A miss: say why (wrong dims, nothing tuned).
        _check_dims(facts.name, facts.dims, asked)
        nearest = _best_out(found, asked) if found is not None else None
        if not tune:
            if nearest is not None:
                return nearest
            raise HTTPException(404, f"nothing tuned for program {program} on topology {topology!r}"
                                     + (f" with world {world}" if world else "")
                                     + (f" and backend {backend}" if backend else "")
                                     + f" that leaves at most {shard.words(allowed)} sharded"
                                     + " at these or comparable sizes (add tune=true to start a job)")
        writer(authorization)
        if world is None:
            raise HTTPException(422, "tune=true needs world (the ranks to tune on)")
        job = _start_job(request, facts.program, asked, topology, world, budget, (backend,) if backend else (),
                         allowed)
        body = TuningStarted(detail=f"no result for these exact sizes; tuning job {job.id} is {job.state}",
                             job=job.id, state=job.state, nearest=nearest)
        return JSONResponse(jsonable_encoder(body), status_code=202)

    @router.get("/schedules/{schedule_hash}/code", tags=["results"], responses={404: {}, 422: {}})
    def code(request: Request, schedule_hash: Annotated[str, _hash_path()], backend: BackendQuery = "gloo",
             kernels: str = Query("compiled", pattern="^(compiled|eager)$"),
             program: MaybeHash = None) -> CodeOut:
        from coconet.codegen.lower import BACKENDS, lower
        from coconet.schedules.schedule import Schedule

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

    @router.get("/results", tags=["results"], responses={404: {}})
    def results(request: Request, program: HashPath, topology: MaybeTopology = None) -> ResultsOut:
        store = _store(request)
        _program(store, program)
        rows = store.results(program, topology)
        return ResultsOut(program=program, winners=[_best_out(b, b.winner.sizes) for b in rows])

    @router.get("/measurements", tags=["results"], responses={404: {}})
    def measurements(request: Request, program: HashPath, sizes: MaybeSizes = None,
                     topology: MaybeTopology = None, after: int = Query(0, ge=0, le=2**62),
                     limit: int = Query(1000, ge=1, le=10_000)) -> list[MeasurementOut]:
        store = _store(request)
        _program(store, program)
        rows = store.measurements(program, _parse_sizes(sizes) if sizes else None, topology, after=after,
                                  limit=limit)
        return [MeasurementOut(**_schedule_fields(m), sizes=m.sizes, topology=m.topology, world=m.world)
                for m in rows]

    return router


def _hash_path() -> Any:
    from fastapi import Path

    return Path(pattern=r"^[0-9a-f]{8,64}$", max_length=64)


def _id_path() -> Any:
    from fastapi import Path

    return Path(ge=1, le=2**62)


def _program(store: Store, program_hash: str) -> Any:
    rec = store.program(program_hash)
    if rec is None:
        raise HTTPException(404, f"no program {program_hash} (POST it to {PREFIX}/programs first)")
    return rec


def _loaded(store: Store, program_hash: str) -> Any:
    from coconet.schedules.serialize import load

    return load(_program(store, program_hash).ir)


def _parse_sizes(spec: str) -> dict[str, int]:
    from coconet.schedules.dims import parse_sizes

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
    from coconet.tuner.tune import Request as TuneRequest, check

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
                source=m.source, job_id=m.job_id, created_at=m.created_at)


def _schedule_out(m: MeasurementRecord | None) -> ScheduleOut | None:
    return ScheduleOut(**_schedule_fields(m)) if m is not None else None


def _best_out(b: Best, asked: dict[str, int]) -> BestOut:
    m, w = b.measurement, b.winner
    return BestOut(program=w.program_hash, sizes=asked, tuned_sizes=w.sizes, exact=b.exact, distance=b.distance,
                   topology=w.topology, world=w.world, backend=w.backend, schedule=m.schedule,
                   schedule_hash=m.schedule_hash, schedule_json=m.schedule_json, sharded=sharded_by(m.schedule),
                   shardable=_shardable_out(w.shardable), stats=_stats(m), source=w.source,
                   speedup=w.speedup, runner_up=_schedule_out(b.runner_up), baseline=_schedule_out(b.baseline),
                   winner_id=w.id, job=w.job_id, created_at=w.created_at)


def _job_out(j: JobRecord) -> JobOut:
    p = j.progress
    return JobOut(id=j.id, program=j.program_hash, sizes=j.sizes, topology=j.topology, world=j.world,
                  shardable=_shardable_out(j.shardable), budget=j.budget, backends=j.backends, state=j.state,
                  progress=ProgressOut(done=p.done, total=p.total, failed=p.failed, best_s=p.best_s),
                  error=j.error, result=j.result, created_at=j.created_at, updated_at=j.updated_at,
                  heartbeat_at=j.heartbeat_at, driver=describe_driver(j.driver))


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
        from coconet.schedules.serialize import load

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
          "world": lambda v: _WORLD.fullmatch(v) is not None}


class FastBest:
    """ASGI middleware answering a plain ``GET /api/v1/best``: parameters the route would take as they are,
    neither ``tune`` nor ``budget``, and a winner to answer with. It answers on the event loop with the body the
    route would send (``_best_out``), without FastAPI's per-request work (parameter models, dependencies, the hop
    to a worker thread, validating the response again), which cost several times the lookup itself. Anything
    else goes on to the route: every error, every request nothing answers, every tuning request, as before.

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
    shardable = params.get("shardable")
    if program is None or sizes is None:
        return None
    for name, value in (("program", program), ("sizes", sizes), ("topology", topology), ("world", world),
                        ("backend", backend), ("shardable", shardable)):
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
                                 shardable=allowed)
        if found is None:
            return None
        if not found.exact:  # the route first checks the sizes against the program's dims
            _check_dims(facts.name, facts.dims, asked)
    except (CoconetError, HTTPException):
        return None
    return _best_out(found, asked).model_dump_json().encode()
