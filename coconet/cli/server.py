"""Commands of the service: ``coconet serve`` (the REST API and dashboard, tuning jobs run in the server) and
``coconet submit`` (a program tuned on a server, its jobs followed, their winners printed)."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from pathlib import Path
from typing import Any, List, Optional

import typer
from rich.console import Console

from coconet.cli.common import JSON_OPT, SHARDABLE_HELP, SIZE_OPT, echo_json, program_path, require_sizes, writable
from coconet.cli.output import failure_text, fmt_s, progress_bar, sharded_note
from coconet.codegen.baselines import shardable_text
from coconet.codegen.runtime import write as write_module
from coconet.errors import CoconetError
from coconet.loader import load_file
from coconet.schedules import shardable as shard
from coconet.schedules.dims import format_sizes, parse_sizes


def serve(
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Address to listen on; other than loopback only with a token in $COCONET_API_TOKEN."
    ),
    port: int = typer.Option(8000, "--port", min=0, max=65535),
    db: Optional[str] = typer.Option(
        None, "--db", help="Store URL (default $COCONET_DATABASE_URL, else SQLite in the user data dir)."
    ),
    workers: int = typer.Option(
        1, "--workers", min=0, max=64, help="Tuning jobs run at once (threads driving Ray); 0: serve results only."
    ),
    ray_address: Optional[str] = typer.Option(
        None, "--ray-address", help="Join this Ray cluster instead of starting a local one."
    ),
    open_writes: bool = typer.Option(
        False,
        "--open",
        help="Take writes without a token (loopback --host only): "
        "any program on this machine can then start tuning jobs.",
    ),
    allow_host: List[str] = typer.Option(
        [],
        "--allow-host",
        help="Another name clients reach the server by "
        "(besides 127.0.0.1, localhost, ::1 and --host); repeatable, * for any.",
    ),
    as_json: bool = JSON_OPT,
) -> None:
    """Serve the REST API (/api/v1, OpenAPI at /docs) and the dashboard (/); tuning jobs run in the server.
    Writes need `Authorization: Bearer $COCONET_API_TOKEN` (or --open, on loopback). Ctrl-C or SIGTERM stop it
    after the trial in progress; a job cut short is queued again and resumes on the next start."""
    import uvicorn

    from coconet.server.app import ENV_TOKEN, create_app
    from coconet.server.http import server_config

    token = os.environ.get(ENV_TOKEN) or None
    if open_writes and not _is_loopback(host):
        raise CoconetError(
            f"--open takes writes from anyone who reaches the server: only on a loopback --host, not {host}"
        )
    if token is None and not _is_loopback(host):
        raise CoconetError(
            f"--host {host} is reachable from other machines: set {ENV_TOKEN} to the token that "
            "writes must carry (or serve on 127.0.0.1)"
        )
    if open_writes and token is not None:
        raise CoconetError(f"--open and {ENV_TOKEN} together: with a token, writes carry it; leave out one of them")
    _require_listenable(host, port)  # uvicorn logs the failure and exits the process: say it here first
    hosts = [*_served_names(host), *allow_host]
    app_ = create_app(db, token=token, workers=workers, ray_address=ray_address, open_writes=open_writes, hosts=hosts)
    if as_json:
        echo_json(
            {
                "url": f"http://{host}:{port}",
                "api": "/api/v1",
                "docs": "/docs",
                "store": app_.state.store.url,
                "workers": workers,
                "auth": token is not None,
                "open": open_writes,
                "hosts": hosts,
            }
        )
        sys.stdout.flush()
    elif open_writes:
        Console(stderr=True, highlight=False, soft_wrap=True).print(
            f"note: --open: writes need no token; any program on this machine can post programs and start "
            f"tuning jobs on http://{host}:{port}",
            markup=False,
        )
    server = uvicorn.Server(
        server_config(
            app_, host=host, port=port, log_level="info", access_log=not as_json, timeout_graceful_shutdown=30
        )
    )
    try:
        server.run()
    except KeyboardInterrupt:
        pass  # uvicorn stopped cleanly and re-raised the signal it caught: that is how serve ends
    except SystemExit:  # uvicorn's way of failing to start (the port taken between the check and now)
        pass
    if not server.started and not server.should_exit:
        raise CoconetError(f"could not serve on {host}:{port} (see the log above)")


def _require_listenable(host: str, port: int) -> None:
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise CoconetError(f"--host {host}: {e.strerror or e}") from None
    family, kind, proto, _, addr = infos[0]
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            sock.bind(addr)
    except OSError as e:
        raise CoconetError(f"cannot serve on {host}:{port}: {e.strerror or e}") from None


def _served_names(host: str) -> list[str]:
    """The names clients may reach a server bound to ``host`` by, besides the loopback ones: the host itself,
    or for every interface (0.0.0.0, ::) this machine's name."""
    if host.strip("[]") in ("0.0.0.0", "::", ""):
        return sorted({socket.gethostname(), socket.getfqdn()} - {""})
    return [host]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def submit(
    file: Path = typer.Argument(
        ...,
        callback=program_path,
        help="The program: a .py file defining `program` (run here; only its JSON IR is sent), or its JSON IR.",
    ),
    server: str = typer.Option(..., "--server", help="The coconet server, e.g. http://127.0.0.1:8000."),
    world: int = typer.Option(2, "--world", min=1, help="Ranks to tune on."),
    size: Optional[List[str]] = SIZE_OPT,
    token: Optional[str] = typer.Option(None, "--token", help="The server's write token (default $COCONET_API_TOKEN)."),
    topology: str = typer.Option("local", "--topology", help="The topology the server tunes on."),
    budget: int = typer.Option(32, "--budget", min=1, help="Candidates measured per size."),
    poll: float = typer.Option(1.0, "--poll", min=0.05, help="Seconds between progress checks."),
    timeout: Optional[float] = typer.Option(
        None, "--timeout", min=1.0, help="Stop following after this many seconds (the jobs go on on the server)."
    ),
    code: bool = typer.Option(
        False,
        "--code/--no-code",
        help="Print each winner's generated module after its summary (in --json: its `code`).",
    ),
    emit: Optional[Path] = typer.Option(
        None,
        "--emit",
        help="Write each winner's generated module into this folder (NAME_HASH_BACKEND.py, as `coconet run --emit`).",
    ),
    shardable: List[str] = typer.Option([], "--shardable", help=SHARDABLE_HELP),
    as_json: bool = JSON_OPT,
) -> None:
    """Submit a program to a coconet server, tune it there (one job per --size), follow the jobs and print each
    winner: its schedule, time and speed-up (its generated module with --code, or into files with --emit). With
    one --size the JSON is one result; with several, a list."""
    from coconet.client import ENV_TOKEN, Client, ServiceError

    writable(emit, "--emit", folder=True)
    prog = load_file(file)
    size = require_sizes(prog, size)
    points = [parse_sizes(spec, prog.dims) for spec in size]
    with Client.open(server, token or os.environ.get(ENV_TOKEN) or None) as client:
        program = client.send_program(prog)
        # checked here; none given, the server's default
        names = list(shard.spelled(shardable_text(prog, shardable))) if shardable else None
        jobs = [
            client.post_job(program, sizes, topology=topology, world=world, budget=budget, shardable=names)["id"]
            for sizes in points
        ]
        try:
            final = _follow_jobs(client, jobs, poll, timeout, quiet=as_json)
        except KeyboardInterrupt:
            raise ServiceError(
                f"stopped following; job{'s' if len(jobs) > 1 else ''} {', '.join(map(str, jobs))} go on on the server"
            ) from None
        docs = [_submitted(client, final[j], code or emit is not None) for j in jobs]
    if emit is not None:
        emit.mkdir(parents=True, exist_ok=True)
        for d in docs:
            if d["code"] is not None:
                path = write_module(
                    d["code"], d["best"]["backend"], emit / f"{prog.name}_{d['best']['hash']}_{d['best']['backend']}.py"
                )
                Console(stderr=True, highlight=False, soft_wrap=True).print(f"wrote {path}", markup=False)
            if not code:
                d["code"] = None
    failed = [d for d in docs if d["state"] != "done" or d["best"] is None]
    if as_json:
        echo_json(docs[0] if len(docs) == 1 else docs)
    else:
        for d in docs:
            _print_submitted(prog.name, d)
    if failed:
        raise ServiceError("; ".join(f"job {d['job']} {d['state']}: {d['error'] or 'no reason given'}" for d in failed))


def _follow_jobs(client: Any, jobs: list[int], poll: float, timeout: Optional[float], quiet: bool) -> dict:
    from coconet.client import follow

    if quiet:
        return follow(client, jobs, poll_s=poll, timeout_s=timeout)
    with progress_bar() as bar:
        tasks = {j: bar.add_task(f"job {j}", total=None, status="submitted") for j in jobs}

        def show(job: dict) -> None:
            p = job["progress"]
            sizes = format_sizes(job["sizes"])
            best = f"best {fmt_s(p['best_s'])}" if p.get("best_s") else "no result yet"
            bar.update(
                tasks[job["id"]],
                description=f"job {job['id']} {sizes}",
                completed=p["done"],
                total=p["total"],
                status=f"{job['state']}  failed {p['failed']}  {best}",
            )

        return follow(client, jobs, poll_s=poll, timeout_s=timeout, on_update=show)


def _submitted(client: Any, job: dict, with_code: bool) -> dict:
    """A finished job as `submit` reports it: the winner from GET /best (the server's public answer) and its code."""
    from coconet.client import ServiceError

    doc: dict[str, Any] = {
        "job": job["id"],
        "state": job["state"],
        "error": job.get("error"),
        "program_hash": job["program"],
        "sizes": job["sizes"],
        "topology": job["topology"],
        "world": job["world"],
        "best": None,
        "runner_up": None,
        "baseline": None,
        "speedup": None,
        "code": None,
    }
    if job["state"] != "done":
        return doc
    asked = job["shardable"]
    try:
        best = client.best(
            job["program"],
            job["sizes"],
            topology=job["topology"],
            world=job["world"],
            shardable=asked if isinstance(asked, str) else ",".join(asked),
        )
    except ServiceError as e:
        if getattr(e, "status", None) != 404:  # 404: nothing for the key, nor near it: this job found no winner
            raise
        best = {}
    if not best.get("exact"):
        why = (job.get("result") or {}).get("failures") or []
        doc["error"] = "the job finished without a winner (no schedule ran correctly)" + (
            f"; commonest failure: {failure_text(why[0])}" if why else ""
        )
        return doc
    stats, base = best["stats"], best.get("baseline")
    doc["best"] = {
        "schedule": best["schedule"],
        "backend": best["backend"],
        "hash": best["schedule_hash"],
        "median_s": stats["median_s"],
        "ci95_s": stats["ci95_s"],
        "source": best["source"],
        "sharded": best.get("sharded", []),
        "shardable": best.get("shardable"),
        "job": best.get("job"),
        "order_reversed": best.get("order_reversed", False),
    }
    if base:
        doc["baseline"] = {
            "schedule": base["schedule"],
            "backend": base["backend"],
            "median_s": base["stats"]["median_s"],
            "ci95_s": base["stats"]["ci95_s"],
        }
    up = best.get("runner_up")
    doc["runner_up"] = (
        None
        if not up
        else {
            "schedule": up["schedule"],
            "backend": up["backend"],
            "median_s": up["stats"]["median_s"],
            "ci95_s": up["stats"]["ci95_s"],
        }
    )
    doc["speedup"] = best.get("speedup")
    if with_code:
        doc["code"] = client.code(best["schedule_hash"], program=job["program"], backend=best["backend"])["source"]
    return doc


def _print_submitted(name: str, d: dict) -> None:
    console = Console(highlight=False, soft_wrap=True)  # a schedule's text is copied from here: never wrapped
    sizes = format_sizes(d["sizes"])
    head = f"{name}  world={d['world']}  {sizes}  topology={d['topology']}  job {d['job']}"
    b = d["best"]
    if b is None:
        console.print(f"{head}: {d['state']}, no winner", markup=False)
        return
    ci = b["ci95_s"]
    console.print(
        f"{head}\nwinner ({b['source']}): {b['backend']}: {b['schedule']}  {fmt_s(b['median_s'])}"
        + (f" [{fmt_s(ci[0])}, {fmt_s(ci[1])}]" if ci else "")
        + (f"  {d['speedup']:.2f}x over the baseline" if d["speedup"] else ""),
        markup=False,
    )
    up = d.get("runner_up")
    if up:  # the winner, the runner-up and the baseline are timed again in turns: the same machine state
        console.print(
            f"runner-up, timed again in turns with the winner: {up['backend']}: {up['schedule']}  "
            f"{fmt_s(up['median_s'])}",
            markup=False,
        )
    if b.get("order_reversed"):
        console.print(
            "note: timed again in turns, the winner beat the runner-up that the search had found faster", markup=False
        )
    if b["sharded"]:
        console.print(sharded_note(b["sharded"]), markup=False)
    if b["job"] != d["job"]:  # GET /best answers the fastest winner of the key, whoever found it
        console.print(
            "note: the server's best for this key, "
            + (f"found by job {b['job']}" if b["job"] is not None else "recorded outside a job")
            + f": faster than the winner of job {d['job']}",
            markup=False,
        )
    if d["code"] is not None:
        console.rule(f"generated code ({b['backend']})")
        sys.stdout.write(d["code"] if d["code"].endswith("\n") else d["code"] + "\n")
