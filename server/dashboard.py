"""The dashboard: one static page at ``/`` plus its assets, all served from the package (no CDN), and the
read-only JSON it plots under ``/api/v1/dashboard`` (shaped in ``dashboard_data``)."""

from __future__ import annotations

import logging
from importlib import resources
from typing import Annotated, Any, Callable, TypeVar

from fastapi import APIRouter, FastAPI, HTTPException, Path, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, PlainTextResponse, Response

from coconet.errors import CoconetError, StoreError
from coconet.server import dashboard_data as data
from coconet.server.schemas import MAX_ID, error_responses
from coconet.server.store import Store, unavailable

PREFIX = "/api/v1/dashboard"
log = logging.getLogger("coconet.server")
T = TypeVar("T")
_ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
Hash = Annotated[str, Path(pattern=r"^[0-9a-f]{8,64}$", max_length=64)]


def mount(app: FastAPI) -> None:
    """Serve the page at ``/``, its assets under ``/static``, and its data under ``/api/v1/dashboard``.
    The data routes read ``app.state.store`` (a ``coconet.server.store.Store``)."""
    static = resources.files("coconet.server") / "static"

    @app.get("/", include_in_schema=False)
    def index() -> HTMLResponse:
        return HTMLResponse((static / "index.html").read_text(encoding="utf-8"))

    @app.get("/static/plotly.min.js", include_in_schema=False)
    def plotly_js() -> Response:
        path = resources.files("plotly") / "package_data" / "plotly.min.js"
        return FileResponse(str(path), media_type="text/javascript")

    @app.get("/static/{name}", include_in_schema=False)
    def asset(name: str) -> Response:
        if name not in _ASSETS:
            raise HTTPException(404, f"no asset {name!r}")
        return Response((static / name).read_bytes(), media_type=_ASSETS[name])

    app.include_router(_data_router())


def _data_router() -> APIRouter:
    router = APIRouter(prefix=PREFIX, tags=["dashboard"])

    @router.get("/programs")
    def programs(request: Request) -> list[dict[str, Any]]:
        return _guard(lambda: data.program_list(_store(request)))

    @router.get("/programs/{program_hash}", responses=error_responses(404, 422))
    def program(request: Request, program_hash: Hash) -> dict[str, Any]:
        view = _guard(lambda: data.program_view(_store(request), program_hash))
        if view is None:
            raise HTTPException(404, f"no program {program_hash}")
        return view

    # The code is text, its errors JSON: a plain Response class leaves each documented with its own type.
    @router.get("/programs/{program_hash}/code", response_class=Response,
                responses={200: {"description": "The generated module",
                                 "content": {"text/plain": {"schema": {"type": "string"}}}}}
                | error_responses(404, 422))
    def code(request: Request, program_hash: Hash, measurement: int = Query(ge=1, le=MAX_ID),
             backend: str | None = Query(default=None, pattern="^(gloo|nccl|shm)$")) -> Response:
        source = _guard(lambda: data.winner_code(_store(request), program_hash, measurement, backend))
        if source is None:
            raise HTTPException(404, f"no schedule recorded as measurement {measurement} of program {program_hash}")
        return PlainTextResponse(source)

    return router


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
