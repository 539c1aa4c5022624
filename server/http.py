"""The HTTP server for the API: uvicorn on httptools, with bounds on the request head that uvicorn's httptools
protocol lacks. ``server_config(app)`` is the one place a server is configured (``coconet serve``, the tests,
the benchmarks), so no server runs without them.

httptools takes a header of any size and copies it again at every read while it grows: one 64 MiB header kept
the event loop, and every other request, waiting for seconds, and 256 MiB for minutes. Here a head (request
line and headers) longer than ``max_head`` bytes or with more than ``max_headers`` fields gets 431, and one not
complete ``head_timeout_s`` after its first byte (or after the connection opened) gets 408; either way the
connection closes. (h11, which has a size bound of its own, spent 30% more CPU per plain GET /best: 630 µs against
480 µs, the same as httptools without these bounds.)
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

MAX_HEAD = 2**16
MAX_HEADERS = 100
HEAD_TIMEOUT_S = 10.0

log = logging.getLogger("coconet.server")


@dataclass(frozen=True)
class HeadLimits:
    max_head: int = MAX_HEAD  # bytes of the request line and headers together
    max_headers: int = MAX_HEADERS
    head_timeout_s: float = HEAD_TIMEOUT_S


class _Refused(Exception):
    """Raised from a parser callback to stop the parser; the refusal itself is in ``_refusal``."""


class LimitedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol, refusing request heads over the class's ``limits``."""

    limits = HeadLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._in_head = True  # the bytes that arrive belong to a request's head
        self._head_bytes = 0
        self._header_count = 0
        self._refusal: tuple[int, str] | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # Fed a piece at a time so that the head's bytes are counted without the body's: a body read together
        # with a small head is not taken for a large head. The head of a request pipelined behind a body in
        # the same read is not counted; a read is at most 256 KiB.
        while data and not self.transport.is_closing():
            if self._in_head:
                self._arm()
                room = self.limits.max_head - self._head_bytes
                if room <= 0:
                    self._refuse(
                        431,
                        f"request head (request line and headers) over {self.limits.max_head} "
                        "bytes; at most that many are accepted",
                    )
                    return
                piece, data = data[:room], data[room:]
                self._head_bytes += len(piece)
            else:
                piece, data = data, b""
            super().data_received(piece)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_headers:
            self._refusal = (431, f"more than {self.limits.max_headers} header fields; at most that many are accepted")
            raise _Refused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_head = True
        self._head_bytes = self._header_count = 0
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to a parser error, which a refusing callback causes: send the refusal instead.
        if self._refusal is not None:
            self._refuse(*self._refusal)
        else:
            super().send_400_response(msg)

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.limits.head_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False  # a response on its way: the connection closes after it
        elif self._head_bytes == 0:
            self.transport.close()  # nothing asked: closed as an idle keep-alive connection is
        else:
            self._refuse(408, f"request head not complete after {self.limits.head_timeout_s:g} s")

    def _refuse(self, status: int, detail: str) -> None:
        self._disarm()
        log.warning("%s: refused with %d: %s", _peer(self.client), status, detail)
        if self.cycle is None or self.cycle.response_complete:
            body = json.dumps({"detail": detail}).encode()
            head = [STATUS_LINE[status]]
            head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
            head += [
                b"content-type: application/json\r\n",
                b"content-length: %d\r\n" % len(body),
                b"connection: close\r\n\r\n",
            ]
            self.transport.write(b"".join(head) + body)
        self.transport.close()


def _peer(client: Any) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


def protocol(limits: HeadLimits = HeadLimits()) -> type[LimitedHttpTools]:
    """The protocol class uvicorn instantiates per connection, bound to ``limits``."""
    if limits == LimitedHttpTools.limits:
        return LimitedHttpTools
    return type("LimitedHttpTools", (LimitedHttpTools,), {"limits": limits})


def server_config(
    app: Any, *, host: str = "127.0.0.1", port: int = 8000, limits: HeadLimits = HeadLimits(), **options: Any
) -> uvicorn.Config:
    """uvicorn's config for serving ``app`` with the request-head ``limits``; ``options`` go to
    ``uvicorn.Config`` as they are (log_level, access_log, ...)."""
    return uvicorn.Config(app, host=host, port=port, http=protocol(limits), ws="none", **options)
