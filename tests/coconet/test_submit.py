"""`coconet submit` end to end: the CLI in a subprocess against the real API (create_app) served by uvicorn.

The server runs no tuning workers here (Ray is not needed): a thread in the test plays the worker, claiming
each queued job and recording SYNTHETIC results through the store API (made-up timings of real schedules of
examples/adam.py). What is tested is the client: IR sent, jobs followed, winner and code fetched, errors.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from coconet.loader import load_file
from coconet.schedules.space import generate
from coconet.server.records import NewMeasurement, Progress
from coconet.server.store import Store
from coconet.tuner.launch import RunResult
from coconet.tuner.search import Candidate, Trial
from coconet.tuner.tune import failures

ROOT = Path(__file__).resolve().parents[2]
ADAM = ROOT / "examples" / "adam.py"
TOKEN = "s3cret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _failed(schedule: Any, error: str) -> Trial:
    return Trial(Candidate(schedule, "gloo"), RunResult(schedule.text, schedule.hash, "runtime_error", error=error))


class _FakeWorker(threading.Thread):
    """Claims queued jobs and finishes them with synthetic timings: the baseline 2x slower than the winner.
    A job for N=8 fails, so the failure path is exercised too; for N=2^16 the winner shards m and v (ZeRO-1)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()

    def run(self) -> None:
        store = Store.open(self.url)
        schedules = list(generate(load_file(ADAM)))
        try:
            while not self.stop.is_set():
                job = store.claim_job()
                if job is None:
                    time.sleep(0.02)
                    continue
                if job.sizes == {"N": 8}:
                    store.update_job(job.id, state="failed", error="synthetic failure: ranks timed out")
                    continue
                if job.sizes == {"N": 16}:  # every trial failed: done, with nothing to serve
                    store.update_job(
                        job.id,
                        state="done",
                        result={"failures": failures([_failed(s, "rank 1: synthetic crash") for s in schedules[:3]])},
                    )
                    continue
                ids = []
                winner = (
                    schedules[3]
                    if job.sizes != {"N": 2**16}
                    else next(s for s in schedules if set(s.sharded) == {"m", "v"})
                )
                runner_up = next(s for s in schedules[1:] if s is not winner and not s.sharded)
                for i, (s, t) in enumerate(((schedules[0], 2e-3), (runner_up, 1.5e-3), (winner, 1e-3))):
                    ids.append(
                        store.add_measurement(
                            NewMeasurement.of(
                                s,
                                sizes=job.sizes,
                                topology=job.topology,
                                world=job.world,
                                backend="gloo",
                                samples=[t] * 5,
                                n=5,
                                median_s=t,
                                ci_lo_s=t * 0.9,
                                ci_hi_s=t * 1.1,
                                job_id=job.id,
                            )
                        )
                    )
                    store.update_job(job.id, progress=Progress(done=i + 1, total=3, best_s=t))
                    time.sleep(0.1)  # slow enough that the client sees progress
                store.add_winner(
                    ids[2], runner_up_id=ids[1], baseline_id=ids[0], job_id=job.id, shardable=job.shardable
                )
                store.update_job(job.id, state="done", result={"synthetic": True})
        finally:
            store.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import uvicorn

    from coconet.server.app import create_app
    from coconet.server.http import server_config

    url = f"sqlite:///{tmp_path_factory.mktemp('submit') / 'store.db'}"
    app = create_app(url, token=TOKEN, workers=0, start_workers=False)
    port = _free_port()
    srv = uvicorn.Server(server_config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    worker = _FakeWorker(url)
    worker.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield {"url": f"http://127.0.0.1:{port}", "db": url, "schedules": [s.text for s in generate(load_file(ADAM))]}
    finally:
        worker.stop.set()
        srv.should_exit = True
        thread.join(10)
        worker.join(10)


def coconet(*args: Any, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("COCONET_DEBUG", "COCONET_API_TOKEN")}
    return subprocess.run(
        [sys.executable, "-m", "coconet", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**base, **(env or {})},
        timeout=120,
    )


def assert_one_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, proc
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def test_submit_json(server: dict[str, Any]) -> None:
    proc = coconet(
        "submit",
        ADAM,
        "--server",
        server["url"],
        "--world",
        "2",
        "--size",
        "N=2^10",
        "--size",
        "N=2^12",
        "--budget",
        "2",
        "--poll",
        "0.05",
        "--json",
        "--code",
        env={"COCONET_API_TOKEN": TOKEN},
    )
    assert proc.returncode == 0, proc.stderr
    docs = json.loads(proc.stdout)
    assert [d["sizes"] for d in docs] == [{"N": 1024}, {"N": 4096}]
    for d in docs:
        assert d["state"] == "done" and d["program_hash"] == load_file(ADAM).hash
        assert d["best"]["schedule"] == server["schedules"][3] and d["best"]["median_s"] == pytest.approx(1e-3)
        assert d["best"]["ci95_s"] == pytest.approx([0.9e-3, 1.1e-3])
        assert d["baseline"]["schedule"] == "baseline" and d["speedup"] == pytest.approx(2.0)
        # the two fastest were timed again back to back: the one behind the winner is named with its time
        assert d["runner_up"]["schedule"] == server["schedules"][1]
        assert d["runner_up"]["median_s"] == pytest.approx(1.5e-3)
        assert "def step(" in d["code"]
    assert proc.stderr == ""  # --json: no progress bar


def test_submit_human_output(server: dict[str, Any], tmp_path: Path) -> None:
    """A summary per job; the generated module only when asked: printed (--code) or written (--emit)."""
    proc = coconet(
        "submit",
        ADAM,
        "--server",
        server["url"],
        "--size",
        "N=2^14",
        "--token",
        TOKEN,
        "--poll",
        "0.05",
        "--emit",
        tmp_path / "out",
    )
    assert proc.returncode == 0, proc.stderr
    assert f"winner (measured): gloo: {server['schedules'][3]}" in proc.stdout
    assert "2.00x over the baseline" in proc.stdout
    assert "def step(" not in proc.stdout and len(proc.stdout.splitlines()) < 10
    [module] = (tmp_path / "out").glob("adam_*_gloo.py")
    assert "def step(" in module.read_text() and f"wrote {module}" in proc.stderr
    printed = coconet(
        "submit", ADAM, "--server", server["url"], "--size", "N=2^14", "--token", TOKEN, "--poll", "0.05", "--code"
    )
    assert printed.returncode == 0 and module.read_text().rstrip() in printed.stdout
    assert "runner-up, timed again in turns with the winner: gloo: " in proc.stdout
    assert "job" in proc.stderr and "N=16384" in proc.stderr  # the progress bar
    assert "sharded" not in proc.stdout


def test_submit_says_when_the_winner_leaves_state_sharded(server: dict[str, Any]) -> None:
    proc = coconet(
        "submit", ADAM, "--server", server["url"], "--size", "N=2^16", "--token", TOKEN, "--poll", "0.05", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # one --size: one result, not a list
    assert doc["best"]["sharded"] == ["m", "v"] and doc["best"]["shardable"] == ["m", "v"]  # Adam's default
    proc = coconet(
        "submit",
        ADAM,
        "--server",
        server["url"],
        "--size",
        "N=2^12",
        "--token",
        TOKEN,
        "--poll",
        "0.05",
        "--shardable",
        "all",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["best"]["shardable"] == "all"  # a job of its own, w allowed too
    proc = coconet("submit", ADAM, "--server", server["url"], "--size", "N=2^16", "--token", TOKEN, "--poll", "0.05")
    assert proc.returncode == 0, proc.stderr
    assert "note: the winner leaves m, v sharded (as_slice)" in proc.stdout


def test_submit_says_when_the_servers_best_was_found_by_another_tuning(server: dict[str, Any]) -> None:
    """GET /best answers the fastest current winner of the key: an shm winner recorded before, faster than the
    gloo one this job finds, is what submit reports, and it says so."""
    sizes = {"N": 2**18}
    with Store.open(server["db"]) as store:
        prog = load_file(ADAM)
        store.add_program(prog)
        sched = next(s for s in generate(prog) if not s.sharded and s.text != "baseline")
        t = 0.5e-3
        mid = store.add_measurement(
            NewMeasurement.of(
                sched,
                sizes=sizes,
                topology="local",
                world=2,
                backend="shm",
                samples=[t] * 5,
                n=5,
                median_s=t,
                ci_lo_s=t,
                ci_hi_s=t,
            )
        )
        store.add_winner(mid)
    proc = coconet(
        "submit", ADAM, "--server", server["url"], "--size", "N=2^18", "--token", TOKEN, "--poll", "0.05", "--no-code"
    )
    assert proc.returncode == 0, proc.stderr
    assert f"winner (measured): shm: {sched.text}" in proc.stdout
    assert "note: the server's best for this key, recorded outside a job: faster than the winner of job" in proc.stdout
    proc = coconet(
        "submit",
        ADAM,
        "--server",
        server["url"],
        "--size",
        "N=2^14",
        "--token",
        TOKEN,
        "--poll",
        "0.05",
        "--json",
        "--no-code",
    )
    doc = json.loads(proc.stdout)
    assert doc["best"]["job"] == doc["job"]  # a key only this job tuned: its own winner


def test_failed_job_is_one_error(server: dict[str, Any]) -> None:
    proc = coconet(
        "submit", ADAM, "--server", server["url"], "--size", "N=8", "--token", TOKEN, "--poll", "0.05", "--json"
    )
    assert_one_error(proc, "failed", "synthetic failure: ranks timed out")
    assert json.loads(proc.stdout)["state"] == "failed"  # the answer is still printed for scripts


def test_a_job_without_a_winner_says_why_its_trials_failed(server: dict[str, Any]) -> None:
    proc = coconet(
        "submit", ADAM, "--server", server["url"], "--size", "N=16", "--token", TOKEN, "--poll", "0.05", "--json"
    )
    assert_one_error(proc, "without a winner", "runtime_error: rank 1: synthetic crash (x3, e.g. gloo: baseline)")


def test_wrong_token_and_unreachable_server(server: dict[str, Any]) -> None:
    proc = coconet("submit", ADAM, "--server", server["url"], "--size", "N=2^10", "--token", "wrong")
    assert_one_error(proc, "POST", "/api/v1/programs", "HTTP 401")
    proc = coconet("submit", ADAM, "--server", server["url"], "--size", "N=2^10")
    assert_one_error(proc, "HTTP 401")
    proc = coconet("submit", ADAM, "--server", f"http://127.0.0.1:{_free_port()}", "--size", "N=2^10")
    assert_one_error(proc, "cannot reach http://127.0.0.1:")
    proc = coconet("submit", ADAM, "--server", "127.0.0.1:8000", "--size", "N=2^10")
    assert_one_error(proc, "not an http:// or https:// URL")
    proc = coconet("submit", ADAM, "--server", server["url"], "--size", "M=4", "--token", TOKEN)
    assert_one_error(proc, "M")


class _Jobs:
    """A stand-in for Client.job: each job answers its states in turn, then stays in the last."""

    def __init__(self, states: dict[int, list[str]]) -> None:
        self.states = states
        self.asked: list[int] = []

    def job(self, job_id: int) -> dict[str, Any]:
        self.asked.append(job_id)
        seq = self.states[job_id]
        return {"id": job_id, "state": seq.pop(0) if len(seq) > 1 else seq[0]}


def test_follow_waits_through_interrupted_and_stops_polling_finished_jobs() -> None:
    from coconet.client import follow

    jobs = _Jobs({1: ["queued", "running", "interrupted", "queued", "done"], 2: ["failed"]})
    final = follow(jobs, [1, 2], poll_s=0, sleep=lambda s: None)  # type: ignore[arg-type]
    assert {k: v["state"] for k, v in final.items()} == {1: "done", 2: "failed"}
    assert jobs.asked.count(2) == 1 and jobs.asked.count(1) == 5


def test_follow_timeout_names_the_jobs_still_running() -> None:
    from coconet.client import ServiceError, follow

    with pytest.raises(
        ServiceError, match=r"job 7 not finished after 0.05 s \(queued or running: it goes on on the server\)"
    ):
        follow(_Jobs({7: ["running"]}), [7], poll_s=0.01, timeout_s=0.05)  # type: ignore[arg-type]


def test_compile_reads_the_servers_winner_and_tunes_a_miss_there(server: dict[str, Any], capsys) -> None:
    """coconet.compile(server=URL) (world 3: no other test tunes it on this server): a key the server never
    tuned, nor near it, is a miss naming `coconet submit`; with tune_on_miss the program is sent, POST /best
    starts the job, it is followed to its end and the step runs the winner it recorded; asked again, the server
    answers at once."""
    import coconet
    from coconet.errors import CoconetError

    sizes = {"N": 2**13}
    with pytest.raises(CoconetError, match="coconet submit FILE --world 3 --size N=8192 --server") as err:
        coconet.compile(ADAM, sizes, server=server["url"], world=3, rank=0, kernels="eager")
    assert err.value.not_tuned
    step = coconet.compile(
        ADAM, sizes, server=server["url"], token=TOKEN, world=3, rank=0, kernels="eager", tune_on_miss=True, budget=3
    )
    assert f"tuning it on server {server['url']} (3 trials)" in capsys.readouterr().err
    assert step.schedule.text == server["schedules"][3] and step.backend == "gloo"
    assert step.origin.how == "measured" and step.origin.exact and step.origin.where == server["url"]
    assert "measured fastest on topology local (1 ms a step)" in step.describe()
    again = coconet.compile(ADAM, sizes, server=server["url"], world=3, rank=1, kernels="eager", tune_on_miss=True)
    assert again.schedule.text == step.schedule.text and "tuning" not in capsys.readouterr().err
    with pytest.raises(CoconetError, match="job .* failed: synthetic failure"):
        coconet.compile(ADAM, {"N": 8}, server=server["url"], token=TOKEN, world=3, rank=0, tune_on_miss=True)
