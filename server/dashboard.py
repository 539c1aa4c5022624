"""The dashboard: one static page at ``/`` plus its assets, all served from the package (no CDN)."""
from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import FileResponse, HTMLResponse, Response

_ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}


def mount(app: FastAPI) -> None:
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
            return Response("not found", status_code=404, media_type="text/plain")
        return Response((static / name).read_bytes(), media_type=_ASSETS[name])
