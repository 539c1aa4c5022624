"""Bounds on what one request may make the server read: body size and JSON nesting, checked before any
parser sees the body (Python's json recursion on 10,000 nested lists, or a 64 MiB body held in memory,
would be the server's problem, not the client's); and on how many writes run at once. The request head's
bounds are the HTTP server's (``coconet.server.http``)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Awaitable, Callable

MAX_BODY = 2**20
MAX_DEPTH = 32

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(rb"[\[\]{}]")


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in ``body`` (strings skipped); a linear scan, no parse."""
    depth = deepest = 0
    for m in _BRACKET.finditer(_STRING.sub(b'""', body)):
        if m.group() in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


class BodyLimit:
    """ASGI middleware: a body over ``max_body`` bytes gets 413 — by its Content-Length before a byte is
    read, else as soon as the stream passes the limit; a JSON body nested deeper than ``max_depth`` gets
    400. A body within the limits is buffered (at most ``max_body``) and replayed to the app."""

    def __init__(self, app: ASGIApp, max_body: int = MAX_BODY, max_depth: int = MAX_DEPTH) -> None:
        self.app = app
        self.max_body = max_body
        self.max_depth = max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await _reply(send, 400, "Content-Length is not a number")
                return
            if declared > self.max_body:
                await _reply(send, 413, f"request body of {declared} bytes; at most {self.max_body} are accepted")
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                await _reply(
                    send, 413, f"request body over {self.max_body} bytes; at most {self.max_body} are accepted"
                )
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if b"json" in headers.get(b"content-type", b"json") and json_depth(body) > self.max_depth:
            await _reply(send, 400, f"JSON nested deeper than {self.max_depth} levels")
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _reply(send: Send, status: int, detail: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class WriteSlots:
    """ASGI middleware: at most ``slots`` writes (any method but GET, HEAD and OPTIONS) run at once; one more
    waits for a slot without a thread, ``wait_s`` at most, then gets 503. Writes waiting for the database each
    hold a server thread: unbounded, they would take every thread the sync routes run on, and reads would queue
    behind them. Inside BodyLimit, so a slot is taken only once the body has arrived."""

    def __init__(self, app: ASGIApp, slots: int = 15, wait_s: float = 5.0) -> None:
        self.app = app
        self.slots = slots
        self.wait_s = wait_s
        self._free: tuple[Any, asyncio.Semaphore] | None = None

    def _semaphore(self) -> asyncio.Semaphore:
        # one per event loop: a semaphore waited on in one loop cannot be used in another (TestClient's)
        loop = asyncio.get_running_loop()
        if self._free is None or self._free[0] is not loop:
            self._free = (loop, asyncio.Semaphore(self.slots))
        return self._free[1]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        free = self._semaphore()
        try:
            await asyncio.wait_for(free.acquire(), self.wait_s)
        except asyncio.TimeoutError:
            await _reply(send, 503, "the results store is busy; retry", [(b"retry-after", b"1")])
            return
        try:
            await self.app(scope, receive, send)
        finally:
            free.release()
