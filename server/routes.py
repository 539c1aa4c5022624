"""The REST API's routes (docs/service.md): programs, jobs, the best schedule of a key (read, or tuned on a miss),
its generated code, results and measurements; and the declarations of their parameters."""

import secrets
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from coconet import __version__
from coconet.codegen.backends import DEFAULT
from coconet.codegen.lower import BACKENDS, lower
from coconet.schedules import shardable as shard
from coconet.schedules.schedule import Schedule
from coconet.schedules.serialize import load
from coconet.server.facts import Facts, check_dims, request_sizes
from coconet.server.jobs import WorkerSettings
from coconet.server.outputs import best_out, job_out, schedule_fields
from coconet.server.records import STORED_SOURCE, JobRecord
from coconet.server.schemas import (
    MAX_ID,
    MAX_WORLD,
    SIZES_PATTERN,
    BestIn,
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
    ResultsOut,
    TuningStarted,
    error_responses,
)
from coconet.server.store import Store
from coconet.tuner.tune import Request as TuneRequest
from coconet.tuner.tune import check

ENV_TOKEN = "COCONET_API_TOKEN"
PREFIX = "/api/v1"

HASH = dict(pattern=r"^[0-9a-f]{8,64}$", max_length=64)
SIZES = dict(
    pattern=SIZES_PATTERN,
    min_length=3,
    max_length=400,
    description="NAME=VALUE[,NAME=VALUE…], each NAME once, VALUE an integer in 1..2^40 or 2^k, e.g. "
    "N=1048576 or B=8,S=1024,H=3072",
)
TOPOLOGY = dict(pattern=r"^[A-Za-z_][A-Za-z0-9_.\-]*$", max_length=200)
BACKEND = dict(pattern=r"^[a-z][a-z0-9_]*$", max_length=32)
SHARDABLE = dict(
    pattern=r"^(all|\*|[A-Za-z_][A-Za-z0-9_]*(,[A-Za-z_][A-Za-z0-9_]*)*|)$",
    max_length=400,
    description="State the schedule may leave sharded (as_slice, ZeRO-style): names joined by "
    "commas, `all` for any, empty for none. Left out: the program's default (Adam: m,v; else none)",
)
HashPath = Annotated[str, Query(**HASH)]
SizesQuery = Annotated[str, Query(**SIZES)]
TopologyQuery = Annotated[str, Query(**TOPOLOGY)]
BackendQuery = Annotated[str, Query(**BACKEND)]
MaybeHash = Annotated[str | None, Query(**HASH)]
MaybeSizes = Annotated[str | None, Query(**SIZES)]
MaybeTopology = Annotated[str | None, Query(**TOPOLOGY)]
MaybeBackend = Annotated[str | None, Query(**BACKEND)]
MaybeShardable = Annotated[str | None, Query(**SHARDABLE)]
SourceQuery = Annotated[
    Literal["measured", "predicted"] | None,
    Query(
        description="Only a winner of this source; left out, a measured winner where the key "
        "has one, else a predicted one"
    ),
]


@dataclass(frozen=True)
class Settings:
    token: str | None
    workers: WorkerSettings
    start_workers: bool
    open_writes: bool = False


def _store(request: Request) -> Store:
    return request.app.state.store


_BEARER = HTTPBearer(auto_error=False, description=f"The server's token (${ENV_TOKEN}); needed for writes.")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)]
Trusted = Callable[[HTTPAuthorizationCredentials | None], bool]


def router(settings: Settings) -> APIRouter:
    """The API's routes on a server of these settings: writes need its token (or none, with ``open_writes``),
    and a few reads show more to the token's holder."""

    def trusted(creds: HTTPAuthorizationCredentials | None) -> bool:
        """Whether the caller carries the server's token."""
        if settings.token is None or creds is None or creds.scheme.lower() != "bearer":
            return False
        return secrets.compare_digest(creds.credentials.encode(), settings.token.encode())

    def writer(creds: Credentials) -> None:
        if settings.token is None:
            if settings.open_writes:
                return
            raise HTTPException(
                403,
                f"this server takes no writes: start it with ${ENV_TOKEN} set (writes then "
                "carry 'Authorization: Bearer <token>'), or with --open on a loopback host",
            )
        if not trusted(creds):
            raise HTTPException(
                401,
                "a valid 'Authorization: Bearer <token>' is needed to write",
                headers={"WWW-Authenticate": "Bearer"},
            )

    # Without a token the server's writes are open or refused, whatever a request carries: no token is required.
    writes: dict[str, Any] = {
        "dependencies": [Depends(writer)],
        "openapi_extra": None if settings.token is not None else _TOKEN_OPTIONAL,
    }
    out = APIRouter()
    _service_routes(out, settings, trusted)
    _program_routes(out, writes)
    _job_routes(out, writes, trusted)
    _best_routes(out, writes)
    _result_routes(out)
    return out


def _service_routes(router: APIRouter, settings: Settings, trusted: Trusted) -> None:
    # async, and no database: answered on the event loop even while every worker thread waits for the store
    @router.get("/health", tags=["service"], response_model_exclude_none=True, openapi_extra=_TOKEN_OPTIONAL)
    async def health(request: Request, creds: Credentials = None) -> Health:
        store = _store(request).url if trusted(creds) else None
        return Health(status="ok", version=__version__, store=store, workers=settings.workers.workers)


def _program_routes(router: APIRouter, writes: dict[str, Any]) -> None:
    @router.post(
        "/programs", status_code=201, tags=["programs"], **writes, responses=error_responses(401, 403, 413, 422)
    )
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
        return ProgramOut(
            hash=rec.hash,
            name=rec.name,
            dims=list(rec.ir.get("dims", [])),
            statements=len(rec.ir.get("statements", [])),
            created_at=rec.created_at,
            ir=rec.ir,
        )


def _job_routes(router: APIRouter, writes: dict[str, Any], trusted: Trusted) -> None:
    @router.post("/jobs", status_code=202, tags=["jobs"], **writes, responses=error_responses(401, 403, 404, 413, 422))
    def post_job(request: Request, body: JobIn) -> JobCreated:
        facts = _facts(request, body.program)
        check_dims(facts.name, facts.dims, body.sizes)
        shardable = body.shardable if body.shardable is None or isinstance(body.shardable, list) else [body.shardable]
        job = _start_job(
            request,
            facts.program,
            body.sizes,
            body.topology,
            body.world,
            body.budget,
            tuple(body.backends),
            facts.shardable(shardable),
        )
        return JobCreated(id=job.id, state=job.state)

    @router.get("/jobs", tags=["jobs"], responses=error_responses(422), openapi_extra=_TOKEN_OPTIONAL)
    def list_jobs(
        request: Request, program: HashPath, limit: int = Query(100, ge=1, le=1000), creds: Credentials = None
    ) -> list[JobOut]:
        jobs = _store(request).jobs(program_hash=program, newest_first=True, limit=limit)
        return [job_out(j, trusted(creds)) for j in jobs]

    @router.get("/jobs/{job_id}", tags=["jobs"], responses=error_responses(404, 422), openapi_extra=_TOKEN_OPTIONAL)
    def get_job(request: Request, job_id: Annotated[int, _id_path()], creds: Credentials = None) -> JobOut:
        job = _store(request).job(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id}")
        return job_out(job, trusted(creds))


def _best_routes(router: APIRouter, writes: dict[str, Any]) -> None:
    _best_read_route(router)
    _best_or_tune_route(router, writes)


def _best_read_route(router: APIRouter) -> None:
    @router.get("/best", tags=["results"], response_model=BestOut, responses=error_responses(400, 404, 422))
    def best(
        request: Request,
        program: HashPath,
        sizes: SizesQuery,
        topology: TopologyQuery = "local",
        world: int | None = Query(None, ge=1, le=MAX_WORLD),
        backend: MaybeBackend = None,
        shardable: MaybeShardable = None,
        source: SourceQuery = None,
        tune: str | None = Query(None, include_in_schema=False),
    ) -> Any:
        if tune is not None:  # a GET changes nothing: a web page could make any browser send one
            raise HTTPException(
                400,
                f"GET {PREFIX}/best only reads; to tune on a miss, POST {PREFIX}/best with "
                "a JSON body (program, sizes as an object, topology, world, backend, budget, "
                "shardable) and the token",
            )
        store = _store(request)
        asked = request_sizes(sizes)
        facts = _facts(request, program)
        allowed = facts.shardable(None if shardable is None else [shardable])
        found = store.best(
            program, asked, topology, world, backend=backend, shardable=allowed, source=STORED_SOURCE.get(source or "")
        )
        if found is not None and found.exact:
            return best_out(found, asked)
        # A miss: say why (wrong dims, nothing tuned).
        check_dims(facts.name, facts.dims, asked)
        if found is not None:
            return best_out(found, asked)
        raise HTTPException(
            404,
            f"nothing tuned for program {program} on topology {topology!r}"
            + (f" with world {world}" if world else "")
            + (f" and backend {backend}" if backend else "")
            + f" that leaves at most {shard.words(allowed)} sharded"
            + f" at these or comparable sizes (POST {PREFIX}/best starts a job)",
        )


def _best_or_tune_route(router: APIRouter, writes: dict[str, Any]) -> None:
    @router.post(
        "/best",
        tags=["results"],
        response_model=BestOut,
        **writes,
        responses={
            202: {
                "model": TuningStarted,
                "description": "Not measured at these exact sizes: a "
                "tuning job started (or the one already running for the key), and the nearest "
                "tuned sizes' best meanwhile",
            }
        }
        | error_responses(401, 403, 404, 413, 422),
    )
    def best_or_tune(request: Request, body: BestIn) -> Any:
        store = _store(request)
        facts = _facts(request, body.program)
        check_dims(facts.name, facts.dims, body.sizes)
        shardable = body.shardable if body.shardable is None or isinstance(body.shardable, list) else [body.shardable]
        allowed = facts.shardable(shardable)
        found = store.best(body.program, body.sizes, body.topology, body.world, backend=body.backend, shardable=allowed)
        if found is not None and found.exact and found.source == "measured":
            return best_out(found, body.sizes)
        # a prediction is no answer to a request to tune: it goes back as the nearest, the job measures the key
        job = _start_job(
            request,
            facts.program,
            body.sizes,
            body.topology,
            body.world,
            body.budget,
            (body.backend,) if body.backend else (),
            allowed,
        )
        out = TuningStarted(
            detail=f"no measured result for these exact sizes; tuning job {job.id} is {job.state}",
            job=job.id,
            state=job.state,
            nearest=best_out(found, body.sizes) if found is not None else None,
        )
        return JSONResponse(jsonable_encoder(out), status_code=202)


def _result_routes(router: APIRouter) -> None:
    @router.get("/schedules/{schedule_hash}/code", tags=["results"], responses=error_responses(404, 422))
    def code(
        request: Request,
        schedule_hash: Annotated[str, _hash_path()],
        backend: Annotated[str, Query(pattern=f"^({'|'.join(_backends())})$")] = DEFAULT,
        kernels: str = Query("compiled", pattern="^(compiled|eager)$"),
        program: MaybeHash = None,
    ) -> CodeOut:
        if backend not in BACKENDS:
            raise HTTPException(422, f"unknown backend {backend!r} (use {', '.join(BACKENDS)})")
        store = _store(request)
        m = store.schedule_measurement(schedule_hash, program)
        if m is None:
            raise HTTPException(404, f"no recorded schedule with hash {schedule_hash}")
        prog = _loaded(store, m.program_hash)
        generated = lower(Schedule.from_json(m.schedule_json, prog), backend, kernels)
        return CodeOut(
            schedule_hash=schedule_hash,
            schedule=m.schedule,
            program=prog.hash,
            backend=backend,
            kernels=kernels,
            source=generated.source,
        )

    @router.get("/results", tags=["results"], responses=error_responses(404, 422))
    def results(request: Request, program: HashPath, topology: MaybeTopology = None) -> ResultsOut:
        store = _store(request)
        _program(store, program)
        rows = store.results(program, topology)
        return ResultsOut(program=program, winners=[best_out(b, b.winner.sizes) for b in rows])

    @router.get("/measurements", tags=["results"], responses=error_responses(404, 422))
    def measurements(
        request: Request,
        program: HashPath,
        sizes: MaybeSizes = None,
        topology: MaybeTopology = None,
        after: int = Query(0, ge=0, le=MAX_ID),
        limit: int = Query(1000, ge=1, le=10_000),
    ) -> list[MeasurementOut]:
        store = _store(request)
        _program(store, program)
        rows = store.measurements(program, request_sizes(sizes) if sizes else None, topology, after=after, limit=limit)
        return [MeasurementOut(**schedule_fields(m), sizes=m.sizes, topology=m.topology, world=m.world) for m in rows]


# A read that shows more to the token's holder: OpenAPI's empty requirement beside the bearer one (FastAPI
# appends it to the one the dependency declares) says the token is optional.
_TOKEN_OPTIONAL: dict[str, Any] = {"security": [{}]}


def _hash_path() -> Any:
    return Path(pattern=r"^[0-9a-f]{8,64}$", max_length=64)


def _id_path() -> Any:
    return Path(ge=1, le=MAX_ID)


def _backends() -> tuple[str, ...]:
    return BACKENDS


def _program(store: Store, program_hash: str) -> Any:
    rec = store.program(program_hash)
    if rec is None:
        raise HTTPException(404, f"no program {program_hash} (POST it to {PREFIX}/programs first)")
    return rec


def _loaded(store: Store, program_hash: str) -> Any:
    return load(_program(store, program_hash).ir)


def _facts(request: Request, program_hash: str) -> "Facts":
    found = request.app.state.programs.get(program_hash)
    if found is None:
        raise HTTPException(404, f"no program {program_hash} (POST it to {PREFIX}/programs first)")
    return found


def _start_job(
    request: Request,
    prog: Any,
    sizes: dict[str, int],
    topology: str,
    world: int,
    budget: int,
    backends: tuple[str, ...],
    shardable: str,
) -> JobRecord:
    """A queued job for the key, or the one already queued or running for it; refused here if the tuner would
    refuse it (a topology without its cluster, a backend this machine lacks)."""
    settings: Settings = request.app.state.settings
    ws = settings.workers
    check(TuneRequest(prog, (sizes,), world, topology, budget, backends, ws.protocol, ray_address=ws.ray_address))
    store = _store(request)
    job, _ = store.join_job(
        prog.hash, sizes, topology, world, budget=budget, backends=list(backends), shardable=shardable
    )
    pool = request.app.state.workers
    if pool is not None:
        pool.wake()
    return job
