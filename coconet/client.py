"""A client of the coconet REST API (docs/service.md), for ``coconet submit``: send a program's JSON IR, start
tuning jobs, follow them, fetch the winner and its generated code. Every failure is a ``ServiceError``."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import httpx

from coconet.errors import CoconetError
from coconet.schedules.dims import format_sizes
from coconet.schedules.ir import Program
from coconet.schedules.serialize import export as to_json

API = "/api/v1"
ENV_TOKEN = "COCONET_API_TOKEN"
FINAL_STATES = ("done", "failed")


class ServiceError(CoconetError):
    """The server could not be reached, or refused or failed a request."""


@dataclass
class Client:
    """A connection to a coconet server's REST API (``/api/v1``, docs/service.md). Every method is one request
    and returns its JSON answer; every failure (unreachable, a 4xx or 5xx, an answer that is not JSON) raises
    ``ServiceError`` naming the request and the server's reason, with ``status`` the HTTP status.

    ::

        from coconet.client import Client, follow

        with Client.open("http://tuner:8000", token=os.environ["COCONET_API_TOKEN"]) as c:
            prog = c.send_program(coconet.load("examples/adam.py"))          # its hash
            job = c.post_job(prog, {"N": 2**22}, topology="local", world=2, budget=32)
            follow(c, [job["id"]])                                           # until done or failed
            c.best(prog, {"N": 2**22}, topology="local", world=2)            # the winner
    """

    http: httpx.Client

    @classmethod
    def open(
        cls,
        server: str,
        token: str | None = None,
        *,
        timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> Client:
        """A client of ``server`` (an http:// or https:// URL); ``token`` authorises writes (POST)."""
        if not server.startswith(("http://", "https://")):
            raise ServiceError(f"--server {server!r} is not an http:// or https:// URL")
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        try:
            return cls(
                httpx.Client(base_url=server.rstrip("/"), headers=headers, timeout=timeout_s, transport=transport)
            )
        except httpx.InvalidURL as e:
            raise ServiceError(f"--server {_shown(server)!r} is not a valid URL: {e}") from None

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def post_program(self, ir_json: str) -> dict[str, Any]:
        """POST /programs with a program's JSON IR (``coconet export``): ``{"hash": ..., ...}``."""
        return self._call("POST", "/programs", content=ir_json, headers={"Content-Type": "application/json"})

    def send_program(self, prog: Program) -> str:
        """POST /programs with ``prog``'s JSON IR; its hash, refused where the server hashes it otherwise (it
        would tune something other than what this coconet holds)."""
        got = self.post_program(to_json(prog, indent=None))["hash"]
        if got != prog.hash:
            raise ServiceError(
                f"the server hashed {prog.name} as {got}, this coconet as {prog.hash}: are the versions the same?"
            )
        return got

    def post_job(
        self,
        program: str,
        sizes: Mapping[str, int],
        *,
        topology: str,
        world: int,
        budget: int,
        shardable: list[str] | str | None = None,
    ) -> dict[str, Any]:
        """POST /jobs: a tuning job for ``program`` (its hash) at ``sizes``, queued on the server: the job's
        record (``id``, ``state``)."""
        body: dict[str, Any] = {
            "program": program,
            "sizes": dict(sizes),
            "topology": topology,
            "world": world,
            "budget": budget,
        }
        if shardable is not None:  # else the server's default for the program
            body["shardable"] = shardable
        return self._call("POST", "/jobs", json=body)

    def job(self, job_id: int) -> dict[str, Any]:
        """GET /jobs/{id}: its state (queued, running, done, failed, interrupted), progress and result."""
        return self._call("GET", f"/jobs/{job_id}")

    def best(
        self,
        program: str,
        sizes: Mapping[str, int],
        *,
        topology: str,
        world: int | None = None,
        shardable: str | None = None,
        backend: str | None = None,
        source: str | None = None,
    ) -> dict[str, Any]:
        """GET /best: the winner for the key (measured before predicted; ``source`` asks for one kind)."""
        params: dict[str, Any] = {"program": program, "sizes": format_sizes(sizes), "topology": topology}
        for name, value in (("world", world), ("shardable", shardable), ("backend", backend), ("source", source)):
            if value is not None:
                params[name] = value
        return self._call("GET", "/best", params=params)

    def best_or_tune(
        self,
        program: str,
        sizes: Mapping[str, int],
        *,
        topology: str,
        world: int,
        backend: str | None = None,
        budget: int = 32,
        shardable: list[str] | str | None = None,
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """POST /best (needs the token): ``(best, None)`` when the key was tuned at these exact sizes, else
        ``(None, started)``, the tuning job the server started for it (``job``, ``state``, and ``nearest``, the
        best of the nearest tuned sizes meanwhile, or None)."""
        body: dict[str, Any] = {
            "program": program,
            "sizes": dict(sizes),
            "topology": topology,
            "world": world,
            "budget": budget,
        }
        if backend is not None:
            body["backend"] = backend
        if shardable is not None:  # else the server's default for the program
            body["shardable"] = shardable
        resp = self._request("POST", "/best", json=body)
        return (None, _json(resp)) if resp.status_code == 202 else (_json(resp), None)

    def code(self, schedule_hash: str, *, program: str, backend: str) -> dict[str, Any]:
        """GET /schedules/{hash}/code: the module generated for a schedule of ``program`` on ``backend``."""
        params = {"program": program, "backend": backend}
        return self._call("GET", f"/schedules/{schedule_hash}/code", params=params)

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        return _json(self._request(method, path, **kwargs))

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """The server's answer, a 2xx; anything else a ServiceError."""
        where = f"{method} {_shown(self.http.base_url)}{API}{path}"
        try:
            resp = self.http.request(method, API + path, **kwargs)
        except httpx.TimeoutException as e:
            raise ServiceError(f"{where}: no answer in time ({type(e).__name__})") from e
        except httpx.HTTPError as e:
            raise ServiceError(f"cannot reach {_shown(self.http.base_url)}: {e or type(e).__name__}") from e
        if resp.status_code >= 400:
            raise ServiceError(f"{where}: HTTP {resp.status_code}: {_detail(resp)}", status=resp.status_code)
        return resp


def _json(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError as e:
        where = f"{resp.request.method} {_shown(resp.request.url)}"
        raise ServiceError(f"{where}: the answer is not JSON ({resp.text[:80]!r})") from e


def _shown(url: str | httpx.URL) -> str:
    """The URL as an error may print it: without a password it carries (http://user:secret@host)."""
    try:
        u = httpx.URL(url)
    except httpx.InvalidURL:
        return re.sub(r"//[^/@]*@", "//", str(url))
    return str(u.copy_with(password=None)) if u.password else str(u)


def follow(
    client: Client,
    job_ids: list[int],
    *,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
    on_update: Callable[[dict[str, Any]], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[int, dict[str, Any]]:
    """Poll the jobs until each is done or failed; ``on_update`` sees every answer. ``interrupted`` is not
    final: the server queues such a job again (it was cut short by a restart)."""
    start = time.monotonic()
    last: dict[int, dict[str, Any]] = {}
    while True:
        for job_id in job_ids:
            if last.get(job_id, {}).get("state") in FINAL_STATES:
                continue
            last[job_id] = client.job(job_id)
            if on_update:
                on_update(last[job_id])
        if all(j["state"] in FINAL_STATES for j in last.values()):
            return last
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            waiting = [str(i) for i, j in last.items() if j["state"] not in FINAL_STATES]
            raise ServiceError(
                f"job{'s' if len(waiting) > 1 else ''} {', '.join(waiting)} not finished after "
                f"{timeout_s:g} s (queued or running: it goes on on the server)"
            )
        sleep(poll_s)


def _detail(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return " ".join(resp.text.split())[:300] or resp.reason_phrase
    detail = body.get("detail", body) if isinstance(body, dict) else body
    return detail if isinstance(detail, str) else json.dumps(detail)[:300]
