"""Which names the server answers to, and which web pages may write to it.

A page on another site can make the user's browser send requests to a server on the user's machine: by
pointing a name it controls at 127.0.0.1 (DNS rebinding; the browser then sends that name as ``Host``), or by
posting a form to it (cross-origin; the browser sends the page's ``Origin``). Checking both closes those: a
``Host`` not in the allow-list gets 400, and a write (any method but GET, HEAD and OPTIONS) carrying an
``Origin`` whose host is not in the list gets 403. Programs (``coconet submit``, curl) send no ``Origin``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from urllib.parse import urlsplit

from coconet.server.limits import ASGIApp, Receive, Scope, Send

LOOPBACK = ("127.0.0.1", "localhost", "::1")
ANY = "*"
_READS = frozenset({"GET", "HEAD", "OPTIONS"})

log = logging.getLogger("coconet.server")


def host_name(value: str) -> str | None:
    """The host of a ``Host`` header or an authority (``name``, ``name:port``, ``[::1]:port``), lowercased,
    IPv6 without brackets; None if it is not one."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        rest = value[end + 1 :]
        if end < 0 or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
        return value[1:end] or None
    if value.count(":") > 1:  # a bare IPv6 address, as --allow-host may give it
        return value
    name, _, port = value.partition(":")
    if port and not port.isdigit():
        return None
    return name.rstrip(".") or None


class HostCheck:
    """ASGI middleware: requests must name an allowed host (loopback names plus ``hosts``; ``*`` allows any),
    and writes may come only from pages of an allowed host."""

    def __init__(self, app: ASGIApp, hosts: Iterable[str] = ()) -> None:
        self.app = app
        names = {h for h in (host_name(x) for x in (*LOOPBACK, *hosts) if x != ANY) if h}
        self.any = ANY in hosts
        self.hosts = frozenset(names)

    def allowed(self, name: str | None) -> bool:
        return name is not None and (self.any or name in self.hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        host = headers.get(b"host", b"").decode("latin-1")
        if not self.allowed(host_name(host)):
            log.warning(
                "refused a request for host %r (allowed: %s; coconet serve --allow-host NAME adds one)",
                host[:100],
                ", ".join(sorted(self.hosts)),
            )
            await _reply(send, 400, b"text/plain; charset=utf-8", b"Invalid host header")
            return
        origin = headers.get(b"origin")
        if origin is not None and scope.get("method", "GET") not in _READS and not self._trusted(origin):
            detail = (
                "writes from a web page of another site are refused (Origin "
                f"{origin.decode('latin-1')[:100]!r} is not an allowed host)"
            )
            await _reply(send, 403, b"application/json", json.dumps({"detail": detail}).encode())
            return
        await self.app(scope, receive, send)

    def _trusted(self, origin: bytes) -> bool:
        try:
            parts = urlsplit(origin.decode("latin-1"))
            return parts.scheme in ("http", "https") and self.allowed(host_name(parts.netloc))
        except ValueError:
            return False  # "null" (a sandboxed page, a file) and anything unreadable


async def _reply(send: Send, status: int, kind: bytes, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", kind),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
