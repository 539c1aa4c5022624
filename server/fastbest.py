"""The API's hot path: a plain ``GET /api/v1/best`` answered without FastAPI's per-request machinery."""

from __future__ import annotations

import math
import re
from typing import Any, Callable
from urllib.parse import parse_qsl

from fastapi import HTTPException

from coconet.errors import CoconetError
from coconet.server.facts import check_dims, request_sizes
from coconet.server.limits import ASGIApp, Receive, Scope, Send
from coconet.server.outputs import best_out
from coconet.server.records import STORED_SOURCE
from coconet.server.routes import BACKEND, HASH, PREFIX, SHARDABLE, SIZES, TOPOLOGY
from coconet.server.schemas import MAX_WORLD

_BEST_PATH = f"{PREFIX}/best"


def _accepts(spec: dict[str, Any]) -> Callable[[str], bool]:
    """A string Query declaration's constraints (pattern, lengths) as a check on a raw value."""
    pattern = re.compile(spec.get("pattern", r"(?s).*"))
    lo, hi = spec.get("min_length", 0), spec.get("max_length", math.inf)
    return lambda v: lo <= len(v) <= hi and pattern.fullmatch(v) is not None


# Values the route's declarations accept as they are (a subset of what FastAPI would coerce: "02" is left to it).
_WORLD = re.compile(r"[1-9][0-9]{0,3}")
_PLAIN = {
    "program": _accepts(HASH),
    "sizes": _accepts(SIZES),
    "topology": _accepts(TOPOLOGY),
    "backend": _accepts(BACKEND),
    "shardable": _accepts(SHARDABLE),
    "world": lambda v: _WORLD.fullmatch(v) is not None,
    "source": STORED_SOURCE.__contains__,
}


class FastBest:
    """ASGI middleware answering a plain ``GET /api/v1/best``: parameters the route would take as they are,
    neither ``tune`` nor ``budget``, and a winner to answer with. It answers on the event loop with the body the
    route would send (``best_out``), without FastAPI's per-request work (parameter models, dependencies, the hop
    to a worker thread, validating the response again), which cost more than the lookup itself: in process, on
    a SQLite store of 1,000 tuned keys, it answers 2.6x the requests per second the route does (1,036 against
    401, interleaved rounds; ``benchmarks/best_fast_path.py``, ``benchmarks/results/best_fast_path.json``).
    Anything else goes on to the route: every error, every request nothing answers, every tuning request.

    The lookup blocks the event loop for its round trip: an indexed read that never waits for a writer (SQLite
    in WAL mode, PostgreSQL's snapshots), cheaper than the thread hop it saves."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] == _BEST_PATH
            and scope["method"] == "GET"
            and not scope.get("root_path")
        ):
            body = _plain_best(scope["app"].state, scope["query_string"])
            if body is not None:
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [
                            (b"content-length", str(len(body)).encode()),
                            (b"content-type", b"application/json"),
                        ],
                    }
                )
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
    for name, value in (
        ("program", program),
        ("sizes", sizes),
        ("topology", topology),
        ("world", world),
        ("backend", backend),
        ("shardable", shardable),
        ("source", source),
    ):
        if value is not None and not _PLAIN[name](value):
            return None
    if world is not None and int(world) > MAX_WORLD:
        return None
    try:
        facts = state.programs.get(program)
        if facts is None:
            return None
        allowed = facts.shardable(None if shardable is None else [shardable])
        asked = request_sizes(sizes)
        found = state.store.best(
            program,
            asked,
            topology,
            int(world) if world else None,
            backend=backend,
            shardable=allowed,
            source=STORED_SOURCE.get(source or ""),
        )
        if found is None:
            return None
        if not found.exact:  # the route first checks the sizes against the program's dims
            check_dims(facts.name, facts.dims, asked)
    except (CoconetError, HTTPException):
        return None
    return best_out(found, asked).model_dump_json().encode()
