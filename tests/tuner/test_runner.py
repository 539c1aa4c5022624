"""Candidates measured on Ray actors: correct ones timed, bad ones classified, the group rebuilt."""

import dataclasses
import re
import runpy
import stat
import tempfile
from pathlib import Path

import pytest

from coconet.codegen.lower import lower
from coconet.errors import BackendError, CoconetError
from coconet.schedules.schedule import Schedule
from coconet.schedules.space import generate
from coconet.tuner.runner import Protocol, Runner, private_file
from tests.ports import hold_port

ROOT = Path(__file__).parents[2]
FAST = Protocol(warmup=1, min_repeats=5, max_repeats=12, max_time_s=2.0, kernels="eager", timeout_s=60.0)


def example(name):
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"))["program"].ir


def wrapped(prelude: str, body: str):
    """A lowering whose step runs ``body`` around the generated one (``out = _generated(...)``)."""

    def lowering(schedule, backend, kernels):
        gen = lower(schedule, backend, kernels)
        source = (
            gen.source.replace("\ndef step(", "\ndef _generated(", 1)
            + f"""

{prelude}

def step(tensors, scalars, **kw):
    import os, time
    import torch.distributed as dist
    rank = dist.get_rank()
{body}
    return out
"""
        )
        return dataclasses.replace(gen, source=source)

    return lowering


def _shm_files():
    return {p.name for p in Path("/dev/shm").glob("coconet-*")}


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_correct_schedules_are_checked_and_timed(ray_local, backend):
    prog = example("adam")
    space = generate(prog)
    before = _shm_files()
    with Runner(prog, world=2, sizes={"N": 1000}, backend=backend, protocol=FAST) as r:
        for s in (space[0], space[len(space) - 1]):
            res = r.measure(s)
            assert res.status == "ok", res.error
            assert res.correct is True and res.max_rel_err <= 1e-5
            assert FAST.min_repeats <= len(res.samples) <= FAST.max_repeats
            assert res.median_s > 0
    assert _shm_files() <= before


BAD = {
    "compile_error": wrapped(
        "import torch\n\ndef _broken(gm, example_inputs):\n    raise RuntimeError('this kernel does not compile')\n\n"
        "_kernel = torch.compile(lambda x: x * 2, backend=_broken)",
        "    _kernel(tensors['w'])\n    out = _generated(tensors, scalars, **kw)",
    ),
    # the count: what the rank keeps out of its garbage collections (what it imported, torch's included)
    "runtime_error": wrapped(
        "import gc",
        "    if rank == 1:\n        raise RuntimeError("
        "f'boom on purpose, {gc.get_freeze_count()} objects frozen')\n"
        "    out = _generated(tensors, scalars, **kw)",
    ),
    "wrong_result": wrapped("", "    out = _generated(tensors, scalars, **kw)\n    tensors['w'].add_(1.0)"),
    "timeout": wrapped("", "    if rank == 1:\n        time.sleep(3600)\n    out = _generated(tensors, scalars, **kw)"),
}


def test_bad_candidates_are_classified_and_the_next_one_runs(ray_local):
    """One runner meets every kind of bad candidate between two good ones: each is classified with its
    cause, and the next candidate runs (on a fresh group where a rank failed)."""
    prog = example("adam")
    good = generate(prog)[1]
    kinds = ["compile_error", "runtime_error", "wrong_result", "writes_its_input"]
    # every updated value right, the caller's gradient written over: wrong too
    writes_input = wrapped("", "    out = _generated(tensors, scalars, **kw)\n    tensors['g'].add_(1.0)")
    lowerings = iter([lower, *(BAD.get(k, writes_input) for k in kinds), lower])
    with Runner(prog, world=2, sizes={"N": 1000}, protocol=FAST, lowering=lambda *a: next(lowerings)(*a)) as r:
        assert r.measure(good).status == "ok"
        got = {k: r.measure(Schedule(prog)) for k in kinds}
        assert r.measure(good).status == "ok"
    for kind, res in got.items():
        assert res.status == kind.replace("writes_its_input", "wrong_result"), (kind, res.error)
        assert res.error and res.samples == []
    assert "this kernel does not compile" in got["compile_error"].error
    assert got["runtime_error"].error.startswith("rank 1") and "boom on purpose" in got["runtime_error"].error
    assert int(re.search(r"(\d+) objects frozen", got["runtime_error"].error).group(1)) > 100_000
    assert "state.w" in got["wrong_result"].error and got["wrong_result"].correct is False
    assert got["writes_its_input"].correct is False
    assert re.match(
        r"rank [01]: the step wrote into input g, which the program does not update", got["writes_its_input"].error
    )
    with Runner(
        prog, world=2, sizes={"N": 1000}, protocol=dataclasses.replace(FAST, timeout_s=8.0), lowering=BAD["timeout"]
    ) as bad:
        res = bad.measure(Schedule(prog))
    assert res.status == "timeout" and res.error and res.samples == []
    # each rank's stack says where it was: rank 1 asleep, rank 0 waiting for it
    assert "rank 1 at line" in res.error and "rank 0 in statement ar0 (allreduce)" in res.error


def test_rank_diagnostics_never_follow_a_link_or_use_a_shared_folder(tmp_path):
    private = tmp_path / "run"
    with private_file(private / "rank0.stack") as f:  # made where missing, as on another node
        f.write("x")
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    with pytest.raises(FileExistsError):  # a file put there first is never written through
        private_file(private / "rank0.stack")
    (private / "rank1.stack").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FileExistsError):
        private_file(private / "rank1.stack")
    assert not (tmp_path / "elsewhere").exists()
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(CoconetError, match="not a private folder"):
        private_file(shared / "rank0.stack")
    (tmp_path / "link").symlink_to(private)
    with pytest.raises(CoconetError, match="not a private folder"):
        private_file(tmp_path / "link" / "rank2.stack")


def test_a_dying_rank_and_a_refused_lowering(ray_local):
    prog = example("adam")
    die = wrapped("", "    if rank == 1:\n        os._exit(3)\n    out = _generated(tensors, scalars, **kw)")
    with Runner(prog, world=2, sizes={"N": 1000}, protocol=FAST, lowering=die) as r:
        res = r.measure(Schedule(prog))
        run_dir = r.run_dir
        # the ranks' diagnostics: in a folder of this run only this user enters, under names nobody can guess
        assert run_dir is not None and stat.S_IMODE(run_dir.stat().st_mode) == 0o700
        assert run_dir.parent == Path(tempfile.gettempdir()) and run_dir.name != "coconet-ranks-"
    assert res.status == "killed" and re.match(r"rank 1 \(node \w+ at [^)]+\) died", res.error)
    assert not run_dir.exists() and r.run_dir is None  # gone with the run

    def refuse(schedule, backend, kernels):
        raise BackendError("no code for this", kind="compile_error")

    with Runner(prog, world=2, sizes={"N": 1000}, protocol=FAST, lowering=refuse) as r:
        res = r.measure(Schedule(prog))
    assert res.status == "compile_error" and "no code for this" in res.error


def _state(pid: int) -> str | None:
    """A process's state letter from /proc (None: gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def test_a_local_cluster_started_by_a_thread_outlives_it_and_ends_with_the_process(tmp_path):
    """The service's job threads start the local cluster: it must serve after the thread that started it
    ends, and go with the process when it exits, Ray's agents included (they once stayed on)."""
    import json
    import subprocess
    import sys
    import time

    code = (
        "import json, os, threading, ray\n"
        "from pathlib import Path\n"
        "from coconet.tuner.cluster import connect\n"
        "t = threading.Thread(target=connect, kwargs={'ranks': 1})\n"
        "t.start(); t.join()\n"
        "@ray.remote\n"
        "def one():\n"
        "    return 1\n"
        "assert ray.get(one.remote(), timeout=60) == 1\n"
        "parent = {}\n"
        "for d in Path('/proc').iterdir():\n"
        "    try:\n"
        "        parent[int(d.name)] = int((d / 'stat').read_text().rpartition(')')[2].split()[1])\n"
        "    except (ValueError, OSError):\n"
        "        pass\n"
        "mine, grew = {os.getpid()}, True\n"
        "while grew:\n"
        "    more = {p for p, pp in parent.items() if pp in mine} - mine\n"
        "    mine |= more\n"
        "    grew = bool(more)\n"
        "print(json.dumps(sorted(mine - {os.getpid()})))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pids = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(pids) >= 3  # the raylet, the GCS, the agents, the workers

    def alive():
        return [p for p in pids if _state(p) not in (None, "Z")]

    deadline = time.monotonic() + 30
    while alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(), [Path(f"/proc/{p}/cmdline").read_bytes()[:60] for p in alive()]


@pytest.mark.parametrize("taken", [1, 3])
def test_a_group_whose_port_was_taken_is_formed_again(ray_local, monkeypatch, taken):
    # rank 0 chooses a port free then; another process takes it before rank 0 listens on it, ``taken`` times
    import ray

    from coconet.tuner.runner import PORT_TRIES

    held, real_get = [], ray.get

    def get(refs, *args, **kwargs):
        out = real_get(refs, *args, **kwargs)
        where = isinstance(out, list) and out and isinstance(out[0], tuple) and len(out[0]) == 5
        if where and len(held) < taken:
            out = [(out[0][0], hold_port(held), *out[0][2:])] + out[1:]
        return out

    monkeypatch.setattr(ray, "get", get)
    prog = example("adam")
    try:
        with Runner(prog, world=2, sizes={"N": 100}, backend="gloo", protocol=FAST) as r:
            res = r.measure(Schedule(prog))
    finally:
        for s in held:
            s.close()
    if taken < PORT_TRIES:
        assert res.status == "ok" and res.correct, res.error
    else:
        assert res.status == "runtime_error" and res.error.startswith("the ranks did not form a group: ")
        assert "EADDRINUSE" in res.error, res.error
    assert len(held) == taken
