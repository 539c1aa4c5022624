"""Static files from installed packages, sent gzip-compressed to a client that accepts it, and the API's
``/docs`` (Swagger UI) and ``/redoc`` pages on local copies of their scripts (the fastapi-offline package's):
nothing the server's pages load comes from another host, so they work offline."""

from __future__ import annotations

import gzip
import hashlib
import threading
from dataclasses import dataclass
from importlib import resources
from importlib.abc import Traversable

from fastapi import FastAPI, HTTPException, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse, Response

FAVICON = "/static/favicon.svg"
DOCS_STATIC = "/static/docs"
# The docs pages may load images, fonts and data from this server only: ReDoc's footer links its logo from its
# maker's CDN (it hides the image when the load fails, as it does offline), and nothing else should leave.
_LOCAL_ONLY = {"Content-Security-Policy": "img-src 'self' data:; font-src 'self' data:; connect-src 'self'"}
# text compresses 3-5x; an image already compressed would only cost the time
_COMPRESSIBLE = ("text/", "application/json", "image/svg+xml")


@dataclass(frozen=True)
class _Loaded:
    raw: bytes
    gz: bytes | None
    etag: str


class Assets:
    """Files by name, each read (and compressed) on its first request and kept for the life of the app that
    serves them: plotly.min.js is 4.8 MB, 1.4 MB compressed, and compressing it takes a quarter of a second."""

    def __init__(self, files: dict[str, tuple[Traversable, str]]) -> None:
        self._files = files
        self._loaded: dict[str, _Loaded] = {}
        self._lock = threading.Lock()

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def response(self, name: str, request: Request) -> Response:
        if name not in self._files:
            raise HTTPException(404, f"no asset {name!r}")
        media_type = self._files[name][1]
        found = self._load(name)
        # no-cache: the browser keeps its copy and asks whether it is still current, which costs a 304
        headers = {"ETag": found.etag, "Cache-Control": "no-cache", "Vary": "Accept-Encoding"}
        if request.headers.get("if-none-match") == found.etag:
            return Response(status_code=304, headers=headers)
        if found.gz is not None and accepts_gzip(request.headers.get("accept-encoding", "")):
            return Response(found.gz, media_type=media_type, headers={**headers, "Content-Encoding": "gzip"})
        return Response(found.raw, media_type=media_type, headers=headers)

    def _load(self, name: str) -> _Loaded:
        found = self._loaded.get(name)
        if found is None:
            with self._lock:
                found = self._loaded.get(name)
                if found is None:
                    path, media_type = self._files[name]
                    raw = path.read_bytes()
                    gz = gzip.compress(raw, compresslevel=6, mtime=0) if media_type.startswith(_COMPRESSIBLE) else None
                    found = _Loaded(raw, gz, '"' + hashlib.sha256(raw).hexdigest()[:32] + '"')
                    self._loaded[name] = found
        return found


def accepts_gzip(header: str) -> bool:
    """Whether an Accept-Encoding header takes gzip (named, or ``*``, without ``q=0``)."""
    for item in header.split(","):
        coding, _, params = item.strip().partition(";")
        if coding.strip().lower() in ("gzip", "*"):
            q = params.strip().lower()
            return not (q.startswith("q=") and _zero(q[2:]))
    return False


def _zero(q: str) -> bool:
    try:
        return float(q) == 0
    except ValueError:
        return False


def mount_docs(app: FastAPI) -> None:
    """``/docs`` and ``/redoc`` on local scripts, for an app made with ``docs_url=None, redoc_url=None``."""
    bundled = resources.files("fastapi_offline") / "static"
    assets = Assets(
        {
            "swagger-ui-bundle.js": (bundled / "swagger-ui-bundle.js", "text/javascript"),
            "swagger-ui.css": (bundled / "swagger-ui.css", "text/css"),
            "redoc.standalone.js": (bundled / "redoc.standalone.js", "text/javascript"),
        }
    )
    openapi_url = app.openapi_url or "/openapi.json"
    redirect = app.swagger_ui_oauth2_redirect_url or "/docs/oauth2-redirect"

    @app.get(DOCS_STATIC + "/{name}", include_in_schema=False)
    def docs_asset(name: str, request: Request) -> Response:
        return assets.response(name, request)

    @app.get("/docs", include_in_schema=False)
    def swagger(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        page = get_swagger_ui_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=root + redirect,
            swagger_js_url=f"{root}{DOCS_STATIC}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{DOCS_STATIC}/swagger-ui.css",
            swagger_favicon_url=root + FAVICON,
            swagger_ui_parameters=app.swagger_ui_parameters,
        )
        page.headers.update(_LOCAL_ONLY)
        return page

    @app.get(redirect, include_in_schema=False)
    def swagger_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        # no Google Fonts: they would be a request to another host
        page = get_redoc_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{DOCS_STATIC}/redoc.standalone.js",
            redoc_favicon_url=root + FAVICON,
            with_google_fonts=False,
        )
        page.headers.update(_LOCAL_ONLY)
        return page
