"""The dashboard: one static page at ``/`` plus its assets, all served from the packages (no CDN) and compressed
for a client that accepts gzip, and the read-only JSON it plots under ``/api/v1/dashboard`` (queried in
``dashboard_data``, shaped into plots in ``dashboard_plots``)."""

from __future__ import annotations

import gzip
import json
import logging
from importlib import resources
from typing import Annotated, Any, Callable, TypeVar

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, Response

from coconet.errors import CoconetError, StoreError
from coconet.server import dashboard_data as data
from coconet.server import dashboard_plots as plots
from coconet.server.assets import Assets, accepts_gzip
from coconet.server.schemas import MAX_ID, MAX_WORLD, error_responses
from coconet.server.store import Store, unavailable

PREFIX = "/api/v1/dashboard"
PAGE_DEFAULT = 25
log = logging.getLogger("coconet.server")
T = TypeVar("T")
Hash = Annotated[str, Path(pattern=r"^[0-9a-f]{8,64}$", max_length=64)]


def filters(
    topology: str | None = Query(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_.\-]*$", max_length=200),
    world: int | None = Query(default=None, ge=1, le=MAX_WORLD),
    backend: str | None = Query(default=None, pattern="^(gloo|nccl|shm)$"),
    source: str | None = Query(default=None, pattern="^(measured|predicted)$"),
) -> data.Filters:
    """The page's filters, each left out for any."""
    return data.Filters(topology, world, backend, source)


Filtered = Annotated[data.Filters, Depends(filters)]


def mount(app: FastAPI) -> None:
    """Serve the page at ``/``, its assets under ``/static``, its favicon, and its data under
    ``/api/v1/dashboard``. The data routes read ``app.state.store`` (a ``coconet.server.store.Store``)."""
    static = resources.files("coconet.server") / "static"
    assets = Assets(
        {
            "dashboard.js": (static / "dashboard.js", "text/javascript"),
            "dashboard.css": (static / "dashboard.css", "text/css"),
            "favicon.svg": (static / "favicon.svg", "image/svg+xml"),
            "plotly.min.js": (resources.files("plotly") / "package_data" / "plotly.min.js", "text/javascript"),
        }
    )

    @app.get("/", include_in_schema=False)
    def index() -> HTMLResponse:
        return HTMLResponse((static / "index.html").read_text(encoding="utf-8"))

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon(request: Request) -> Response:
        return assets.response("favicon.svg", request)

    @app.get("/static/{name}", include_in_schema=False)
    def asset(name: str, request: Request) -> Response:
        return assets.response(name, request)

    app.include_router(_data_router(data.WinnersCache()))


def _data_router(cache: data.WinnersCache) -> APIRouter:
    router = APIRouter(prefix=PREFIX, tags=["dashboard"])

    @router.get("/programs")
    def programs(request: Request) -> list[dict[str, Any]]:
        return _guard(lambda: data.program_list(_store(request)))

    @router.get("/version")
    def version(request: Request) -> dict[str, Any]:
        """A token that changes whenever a measurement, a winner or a job does, with how many jobs run and wait:
        what the page polls while jobs run, fetching the rest again only when it changed."""
        return _guard(lambda: data.version(_store(request)))

    @router.get("/programs/{program_hash}", responses=error_responses(404, 422))
    def program(request: Request, program_hash: Hash) -> dict[str, Any]:
        """The program's name and the values each filter offers."""
        return _found(_guard(lambda: data.program_summary(_store(request), program_hash)), program_hash)

    @router.get("/programs/{program_hash}/winners", responses=error_responses(404, 422))
    def winners(
        request: Request,
        program_hash: Hash,
        f: Filtered,
        limit: int = Query(default=PAGE_DEFAULT, ge=1, le=data.PAGE_MAX),
        offset: int = Query(default=0, ge=0, le=MAX_ID),
    ) -> Response:
        """One page of the current winners the filters leave, and their total."""
        store = _store(request)
        _found(_guard(lambda: store.program(program_hash)), program_hash)
        return _json(request, _guard(lambda: data.winners_page(cache.get(store, program_hash, f), limit, offset)))

    @router.get("/programs/{program_hash}/plots", responses=error_responses(404, 422))
    def plot_data(request: Request, program_hash: Hash, f: Filtered) -> Response:
        """Speed-ups and time vs size per shape family, of what the filters leave."""
        store = _store(request)
        _found(_guard(lambda: store.program(program_hash)), program_hash)
        return _json(
            request,
            _guard(lambda: plots.plots(plots.timing_points(store, program_hash, f), cache.get(store, program_hash, f))),
        )

    @router.get("/programs/{program_hash}/studies", responses=error_responses(404, 422))
    def studies(
        request: Request, program_hash: Hash, f: Filtered, limit: int = Query(default=50, ge=1, le=data.PAGE_MAX)
    ) -> list[dict[str, Any]]:
        """The tuning jobs on the filters' topology and world, newest first."""
        store = _store(request)
        _found(_guard(lambda: store.program(program_hash)), program_hash)
        return _guard(lambda: data.studies(store, program_hash, f, limit))

    @router.get("/programs/{program_hash}/studies/{job_id}", responses=error_responses(404, 422))
    def study(request: Request, program_hash: Hash, job_id: int = Path(ge=1, le=MAX_ID)) -> dict[str, Any]:
        """One tuning job's trials in the order they were measured."""
        found = _guard(lambda: data.study(_store(request), program_hash, job_id))
        if found is None:
            raise HTTPException(404, f"no job {job_id} of program {program_hash}")
        return found

    # The code is text, its errors JSON: a plain Response class leaves each documented with its own type.
    @router.get(
        "/programs/{program_hash}/code",
        response_class=Response,
        responses={
            200: {"description": "The generated module", "content": {"text/plain": {"schema": {"type": "string"}}}}
        }
        | error_responses(404, 422),
    )
    def code(
        request: Request,
        program_hash: Hash,
        measurement: int = Query(ge=1, le=MAX_ID),
        backend: str | None = Query(default=None, pattern="^(gloo|nccl|shm)$"),
    ) -> Response:
        source = _guard(lambda: data.winner_code(_store(request), program_hash, measurement, backend))
        if source is None:
            raise HTTPException(404, f"no schedule recorded as measurement {measurement} of program {program_hash}")
        return PlainTextResponse(source)

    return router


def _json(request: Request, body: Any) -> Response:
    """``body`` as JSON, compressed for a client that accepts gzip when it is large (the plots of ten thousand
    keys are most of a megabyte, a fifth of that compressed)."""
    raw = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    headers = {"Vary": "Accept-Encoding"}
    if len(raw) > 4096 and accepts_gzip(request.headers.get("accept-encoding", "")):
        return Response(
            gzip.compress(raw, compresslevel=5),
            media_type="application/json",
            headers={**headers, "Content-Encoding": "gzip"},
        )
    return Response(raw, media_type="application/json", headers=headers)


def _found(value: T | None, program_hash: str) -> T:
    if value is None:
        raise HTTPException(404, f"no program {program_hash}")
    return value


def _store(request: Request) -> Store:
    store = getattr(request.app.state, "store", None)
    if store is None:
        raise HTTPException(503, "the server has no results store attached")
    return store


def _guard(read: Callable[[], T]) -> T:
    # A database that is down or a record that no longer lowers is the server's state, not the
    # client's mistake: a message the page can show, never a bare 500.
    try:
        return read()
    except StoreError as e:
        log.error("dashboard: %s", e)  # the cause names the database: for the log, not the page
        raise HTTPException(503, unavailable(e)) from e
    except CoconetError as e:
        raise HTTPException(422, str(e)) from e
