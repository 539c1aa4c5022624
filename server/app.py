"""The REST API (docs/service.md; docs/architecture.md, "Data flow"): programs in, tuning jobs run by
the server's workers, the best schedule per (program, sizes, topology) out, with its generated code.
``create_app`` builds one; nothing happens at import (uvicorn gets ``coconet.server.app:create_app`` with
``factory=True``). Its routes are ``coconet.server.routes``; a plain ``GET /best`` is answered by
``coconet.server.fastbest`` before them.
"""

import logging
import os
import re
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Iterable, Sequence

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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
from coconet.server import dashboard
from coconet.server.assets import mount_docs
from coconet.server.facts import ProgramFacts
from coconet.server.fastbest import FastBest
from coconet.server.hosts import HostCheck
from coconet.server.jobs import Workers, WorkerSettings
from coconet.server.leases import requeue_orphans
from coconet.server.limits import MAX_BODY, MAX_DEPTH, BodyLimit, WriteSlots
from coconet.server.routes import ENV_TOKEN, PREFIX, Settings, router
from coconet.server.schemas import ANY_ERROR
from coconet.server.store import Store, unavailable
from coconet.tuner.runner import Protocol

__all__ = ["ENV_TOKEN", "PREFIX", "WRITE_SLOTS", "WRITE_WAIT_S", "FastBest", "Settings", "create_app"]

# How long a request's write waits for a database connection, and again for the database's lock, before it is
# answered 503: a client can retry, where a request held for the store's default 30 s holds a server thread too.
WRITE_WAIT_S = 5.0
# Writes in progress at once: as many as the store's write pool has connections (SQLAlchemy's 5 + 10 overflow).
WRITE_SLOTS = 15
log = logging.getLogger("coconet.server")


def create_app(
    store_url: str | None = None,
    *,
    token: str | None = None,
    workers: int = 1,
    start_workers: bool = True,
    protocol: Protocol | None = None,
    ray_address: str | None = None,
    stale_s: float | None = None,
    open_writes: bool = False,
    hosts: Iterable[str] = (),
    wait_s: float = WRITE_WAIT_S,
) -> FastAPI:
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
    app = FastAPI(
        title="coconet",
        version=__version__,
        lifespan=lifespan,
        responses=ANY_ERROR,
        description="Best schedules of distributed ML programs, tuned on demand.",
        docs_url=None,
        redoc_url=None,
    )
    app.state.store = store
    app.state.settings = settings
    app.state.workers = None
    app.state.programs = ProgramFacts(store)
    _handlers(app)
    app.include_router(router(settings), prefix=PREFIX)

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
                return JSONResponse(
                    {
                        "detail": f"{request.method} is not allowed on {request.url.path} "
                        f"(allowed: {', '.join(allowed)})"
                    },
                    status_code=405,
                    headers={"Allow": ", ".join(allowed)},
                )
        return await http_exception_handler(request, err)

    @app.exception_handler(RecursionError)
    async def too_deep(request: Request, err: RecursionError) -> JSONResponse:
        return JSONResponse({"detail": "input nested too deeply"}, status_code=400)

    @app.exception_handler(Exception)
    async def bug(request: Request, err: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse({"detail": f"internal error: {type(err).__name__}"}, status_code=500)


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
    first = next(
        (e for e in errors if where(e)[: len(within)] == within and not e.get("type", "").endswith("_type")), errors[0]
    )
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
