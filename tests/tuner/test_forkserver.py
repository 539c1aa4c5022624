"""Ranks forked from a warm interpreter: they behave as fresh ones, in the caller's environment."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coconet.schedules.schedule import Schedule
from coconet.tuner.forkserver import RANK_NAME, Forked, Servers, kill_group, start_rank
from coconet.tuner.launch import Options, run_schedules
from tests.tuner.test_launch import example, rank_processes

pytestmark = pytest.mark.usefixtures("temp_code_cache")  # generated modules in a throwaway cache


def _pipe_and_log(tmp_path, name="rank0.log"):
    r, w = os.pipe()
    log = open(tmp_path / name, "wb")
    return r, w, log


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_forked_rank_reports_its_exit_its_output_and_runs_in_a_group_of_its_own(tmp_path):
    servers = Servers()
    r, w, log = _pipe_and_log(tmp_path)
    rank = servers.get().spawn(str(tmp_path / "no-such-job.pkl"), 0, log.fileno(), w)
    os.close(w)
    log.close()
    assert isinstance(rank, Forked)
    assert rank.wait(timeout=60) == 1  # the job file is missing: the rank's traceback, then exit 1
    assert "no-such-job.pkl" in (tmp_path / "rank0.log").read_text()
    assert os.read(r, 1) == b""  # its end of the pipe closed with it: the launch sees EOF
    os.close(r)

    fifo = tmp_path / "job.fifo"
    os.mkfifo(fifo)  # opening it blocks: a rank that stays up until it is killed
    r, w, log = _pipe_and_log(tmp_path, "rank3.log")
    rank = servers.get().spawn(str(fifo), 3, log.fileno(), w)
    os.close(w)
    log.close()
    deadline = time.monotonic() + 30
    while Path(f"/proc/{rank.pid}/comm").read_text().strip() != f"{RANK_NAME}3" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert Path(f"/proc/{rank.pid}/comm").read_text().strip() == f"{RANK_NAME}3"
    assert os.getpgid(rank.pid) == rank.pid
    assert rank.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        rank.wait(timeout=0.2)
    kill_group(rank)
    assert rank.wait(timeout=30) == -signal.SIGKILL
    os.close(r)
    for s in servers.by_key.values():
        s.close()


def test_one_server_per_environment_and_an_idle_one_goes_when_the_environment_changes(monkeypatch):
    servers = Servers()
    first = servers.get()
    assert servers.get() is first
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test (call)")  # new for every test: not a new server
    assert servers.get() is first
    monkeypatch.setenv("COCONET_FORKSERVER_TEST", "1")
    second = servers.get()
    assert second is not first and servers.get() is second
    assert first.proc.wait(timeout=30) == 0  # idle: closed, and it exited on its own
    assert list(servers.by_key.values()) == [second]
    second.close()


def test_the_server_goes_with_its_caller(tmp_path):
    code = (
        "import os, sys\nfrom coconet.tuner.forkserver import Servers\n"
        "print(Servers().get().proc.pid, flush=True)\nos._exit(0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def test_ranks_see_the_callers_environment_as_it_is_at_the_launch(monkeypatch):
    prog = example("adam")
    opts = Options(world=2, sizes={"N": 10}, backend="shm", time=False, timeout_s=60, kernels="eager")
    assert run_schedules([Schedule(prog)], opts)[0].status == "ok"
    monkeypatch.setenv("COCONET_SHM_STREAM_BYTES", "lots")  # read by the ranks' shm code, at every step
    res = run_schedules([Schedule(prog)], opts)[0]
    assert res.status == "runtime_error" and "COCONET_SHM_STREAM_BYTES='lots'" in res.error
    assert not rank_processes()


def test_without_the_server_ranks_are_fresh_interpreters(tmp_path, monkeypatch):
    monkeypatch.setenv("COCONET_FORKSERVER", "0")
    r, w, log = _pipe_and_log(tmp_path)
    rank = start_rank(str(tmp_path / "no-such-job.pkl"), 0, log.fileno(), w)
    os.close(w)
    log.close()
    assert isinstance(rank, subprocess.Popen)
    assert rank.wait(timeout=60) == 1 and "no-such-job.pkl" in (tmp_path / "rank0.log").read_text()
    os.close(r)


def test_a_server_warmed_for_compiled_kernels_stays_single_threaded_and_forks_ranks(tmp_path):
    """Warming Inductor in the server (its imports, the ISA probe, the pattern tables) must leave it with
    no thread more than a cold one: a fork copies only the forking thread, and another one's locks with it."""

    def tasks(server):
        return len(os.listdir(f"/proc/{server.proc.pid}/task"))

    def spawn_one(server, name):
        r, w, log = _pipe_and_log(tmp_path, name)
        rank = server.spawn(str(tmp_path / "no-such-job.pkl"), 0, log.fileno(), w)
        os.close(w)
        log.close()
        assert rank.wait(timeout=120) == 1
        os.close(r)

    server = Servers().get()
    server.warm()  # a server's first launch: its ranks warm up side by side, not the server alone first
    spawn_one(server, "first.log")
    assert server.warm_failures is None
    cold = tasks(server)
    server.warm()
    spawn_one(server, "second.log")  # answered after the warm-up
    # every step of the warm-up ran on this torch (one that failed would be left to the ranks)
    assert server.warm_failures == []
    assert tasks(server) == cold
    server.close()
