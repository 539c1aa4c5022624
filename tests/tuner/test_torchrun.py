"""coconet under torchrun, outside Ray: two "nodes" on this machine, each a torchrun launcher process of one rank
(``--nnodes=2``), joined by env:// rendezvous. ``coconet run`` checks and times as one rank per process, rank 0
reporting once; a user's script trains with ``coconet.optim`` and steps ``coconet.compile`` and an emitted module;
bad setups are one ``error:`` line; a failing rank does not hang the other. Plus docs/cluster.md's torchrun recipe
run as written, and its Slurm script parsed and holding the same command."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coconet.errors import BackendError, CoconetError
from coconet.tuner.envlaunch import JobEnv, choose, job_env, require_one_node, world_of

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SLICED = "split(ar0); reorder(ag0); as_slice(buf)"
LIMIT_S = 240  # a launch of two launchers on a loaded 2-core machine; a hang is killed, not waited for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp_path: Path, **extra: str) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        COCONET_CACHE_DIR=str(tmp_path / "cache"),
        COCONET_DATABASE_URL=f"sqlite:///{tmp_path / 'c.db'}",
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        OMP_NUM_THREADS="1",
        **extra,
    )
    return env


def _together(commands: list[list[str]], env: dict | list[dict]) -> list[subprocess.CompletedProcess]:
    """The commands started at once (one per "node"), each in a session of its own (and its own environment when
    ``env`` is a list), waited for together; any still running after LIMIT_S is killed with its whole session,
    and the test fails."""
    envs = env if isinstance(env, list) else [env] * len(commands)
    procs = [
        subprocess.Popen(
            cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        for cmd, e in zip(commands, envs)
    ]
    deadline = time.monotonic() + LIMIT_S
    done = []
    try:
        for p, cmd in zip(procs, commands):
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{' '.join(cmd)} still running after {LIMIT_S} s")
            done.append(subprocess.CompletedProcess(cmd, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return done


def _two_nodes(args: list[str], env: dict) -> list[subprocess.CompletedProcess]:
    """``torchrun --nnodes=2 --node-rank=i --nproc-per-node=1`` for i = 0, 1, as two launcher processes."""
    port = _free_port()
    return _together(
        [
            [
                str(BIN / "torchrun"),
                "--nnodes=2",
                f"--node-rank={i}",
                "--nproc-per-node=1",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                *args,
            ]
            for i in range(2)
        ],
        env,
    )


def _coconet(*args: str) -> list[str]:
    return ["-m", "coconet", *args]


# -- the launcher's variables, on their own


def test_the_launcher_is_the_job_when_its_variables_are_set():
    env = {
        "RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "29500",
    }
    assert choose("auto", env) == JobEnv(1, 4, 1, 2, "h:29500")
    assert choose("auto", {}) is None and choose("local", env) is None
    with pytest.raises(CoconetError, match="--launcher env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set"):
        choose("env", {})
    with pytest.raises(CoconetError, match="RANK=4 is not a rank of WORLD_SIZE=4"):
        job_env({**env, "RANK": "4"})
    with pytest.raises(CoconetError, match="unknown launcher 'slurm'"):
        choose("slurm", env)


def test_world_follows_the_job_and_shm_needs_one_node():
    job = JobEnv(0, 4, 0, 2, "h:1")
    assert world_of(None, job, 1) == 4 and world_of(2, job, 2) == 2
    with pytest.raises(CoconetError, match=r"--world 3 disagrees with the job's WORLD_SIZE=4"):
        world_of(3, job, 1)
    with pytest.raises(CoconetError, match="not a multiple of the program's 3 pipeline stages"):
        world_of(None, job, 3)
    with pytest.raises(BackendError, match=r"runs 2 of its 4 ranks per node \(LOCAL_WORLD_SIZE=2\)"):
        require_one_node("shm", job)
    require_one_node("shm", JobEnv(0, 4, 0, 4, "h:1"))
    require_one_node("gloo", job)


# -- two "nodes" on this machine


@pytest.fixture(scope="module")
def run_on_two_nodes(tmp_path_factory):
    """``coconet run`` of SGD (as written and a ZeRO-style schedule) across the two nodes, its modules emitted."""
    tmp = tmp_path_factory.mktemp("torchrun")
    env = _env(tmp)
    nodes = _two_nodes(
        _coconet(
            "run",
            "examples/sgd.py",
            "--size",
            "N=2^10",
            "--schedule",
            SLICED,
            "--kernels",
            "eager",
            "--repeats",
            "3",
            "--emit",
            str(tmp / "emit"),
            "--json",
        ),
        env,
    )
    return nodes, tmp / "emit", env


def test_coconet_run_spans_two_nodes_checked_and_reported_once(run_on_two_nodes):
    (zero, one), _, _ = run_on_two_nodes
    assert zero.returncode == 0 and one.returncode == 0, zero.stderr[-3000:] + one.stderr[-3000:]
    assert one.stdout == ""  # rank 0 speaks for the job
    doc = json.loads(zero.stdout)
    assert (doc["world"], doc["backend"]) == (2, "gloo")
    assert [r["schedule"] for r in doc["results"]] == ["baseline", SLICED]
    for r in doc["results"]:
        assert r["status"] == "ok" and r["correct"] is True and r["max_rel_err"] < 1e-5, r
        assert r["samples"] == 3 and r["median_s"] > 0


def test_a_training_script_uses_coconet_under_torchrun(run_on_two_nodes, tmp_path):
    """A user's script: init_process_group("gloo") from the environment, then coconet.optim beside torch.optim,
    coconet.compile steps and the module `coconet run --emit` wrote, each against what torch computes, and
    coconet.run in the script's group."""
    _, emit, env = run_on_two_nodes
    [module] = [p for p in emit.iterdir() if "_gloo" in p.name and "9ac3ae40f4cc6d29" in p.name]  # the baseline
    zero, one = _two_nodes([str(ROOT / "tests" / "tuner" / "torchrun_job.py"), str(module)], env)
    assert zero.returncode == 0 and one.returncode == 0, zero.stderr[-3000:] + one.stderr[-3000:]
    assert one.stdout == ""
    found = json.loads(zero.stdout.strip().splitlines()[-1])
    assert found["world"] == 2
    assert found["optim_gap"] < 2e-6
    assert found["compile_err"] < 1e-6 and found["emitted_err"] < 1e-6
    assert found["run"] == {"world": 2, "results": [["baseline", "ok", True, 2], [SLICED, "ok", True, 2]]}


def _error_lines(node: subprocess.CompletedProcess) -> list[str]:
    return [line for line in node.stderr.splitlines() if line.startswith("error: ")]


def test_a_world_that_disagrees_and_shm_across_nodes_are_one_error_line_per_rank(tmp_path):
    env = _env(tmp_path)
    for args, said in (
        (
            ["--world", "3"],
            "error: --world 3 disagrees with the job's WORLD_SIZE=2: leave --world out "
            "under torchrun, or start as many ranks as it says",
        ),
        (
            ["--backend", "shm"],
            "error: the shm backend shares memory between ranks on one node, and "
            "this job runs 1 of its 2 ranks per node (LOCAL_WORLD_SIZE=1): use "
            "gloo or nccl across nodes",
        ),
    ):
        nodes = _two_nodes(_coconet("run", "examples/sgd.py", "--size", "N=2^10", "--kernels", "eager", *args), env)
        for node in nodes:
            assert node.returncode != 0 and node.stdout == ""
            assert _error_lines(node) == [said], node.stderr[-3000:]
            ours = node.stderr.split("torch/distributed/elastic")[0]  # what follows is torchrun's own report
            assert "Traceback" not in ours and "exitcode: 2" in node.stderr


def test_ranks_started_with_other_sizes_are_one_error_line_each(tmp_path):
    """Node 1 asks for other sizes than node 0: every rank says so, instead of waiting in collectives that
    never match."""
    port = _free_port()
    zero, one = _together(
        [
            [
                str(BIN / "torchrun"),
                "--nnodes=2",
                f"--node-rank={i}",
                "--nproc-per-node=1",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                *_coconet("run", "examples/sgd.py", "--size", f"N={n}", "--kernels", "eager"),
            ]
            for i, n in enumerate((1024, 2048))
        ],
        _env(tmp_path),
    )
    for node in (zero, one):
        assert node.returncode != 0 and node.stdout == ""
        assert _error_lines(node) == [
            "error: rank 1 runs sizes N=2048 where rank 0 runs N=1024: start every rank "
            "with the same command and program file"
        ], node.stderr[-3000:]


def test_any_launcher_setting_the_variables_will_do_and_shm_runs_on_one_host(tmp_path):
    """Two processes started by hand with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT only (no LOCAL_WORLD_SIZE:
    the ranks compare hostnames instead) run shm's fused collective, rank 0 reporting."""
    port = _free_port()
    env = _env(tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    zero, one = _together(
        [
            [
                sys.executable,
                "-m",
                "coconet",
                "run",
                "examples/sgd.py",
                "--size",
                "N=2^10",
                "--backend",
                "shm",
                "--launcher",
                "env",
                "--schedule",
                "split(ar0); reorder(ag0); fuse_collective(rs0)",
                "--kernels",
                "eager",
                "--repeats",
                "2",
                "--json",
            ]
        ]
        * 2,
        [{**env, "RANK": str(r)} for r in range(2)],
    )
    assert zero.returncode == 0 and one.returncode == 0, zero.stderr[-3000:] + one.stderr[-3000:]
    assert one.stdout == ""
    doc = json.loads(zero.stdout)
    assert doc["backend"] == "shm" and [(r["status"], r["correct"]) for r in doc["results"]] == [("ok", True)] * 2


BOOM = """
import os

from coconet import Local, Program, Replicated, allreduce
from coconet.schedules.custom import custom_op


def _boom(x):
    if os.environ["RANK"] == "1":
        FAIL
    return x * 2


boom = custom_op("boom", lambda x: x * 2, torch=_boom)
p = Program("boom", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
p.update(w, w + allreduce(boom(g)))
program = p
"""


ONCE = """marker = os.environ["BOOM_ONCE"]
        if not os.path.exists(marker):  # the first call only
            open(marker, "w").close()
            raise RuntimeError("rank 1 gave up")"""


def test_a_rank_that_fails_is_reported_and_leaves_no_rank_waiting(tmp_path):
    """Rank 1 raises before the allreduce rank 0 waits in (the first schedule only): rank 0's collective gives
    up at the timeout, the result names rank 1's error, and the next schedule runs on a fresh group."""
    (tmp_path / "boom.py").write_text(BOOM.replace("FAIL", ONCE))
    t0 = time.monotonic()
    zero, one = _two_nodes(
        _coconet(
            "run",
            str(tmp_path / "boom.py"),
            "--size",
            "N=64",
            "--schedule",
            "split(ar0)",
            "--kernels",
            "eager",
            "--timeout",
            "5",
            "--repeats",
            "2",
            "--json",
        ),
        _env(tmp_path, BOOM_ONCE=str(tmp_path / "once")),
    )
    assert time.monotonic() - t0 < 120
    assert zero.returncode == 1 and one.returncode == 1, zero.stderr[-3000:]
    failed, split = json.loads(zero.stdout)["results"]
    assert failed["status"] == "runtime_error"
    assert re.match(r"rank 1 in statement \w+ \(boom\): RuntimeError: rank 1 gave up", failed["error"]), failed
    assert (split["schedule"], split["status"], split["correct"], split["samples"]) == ("split(ar0)", "ok", True, 2)


def test_a_rank_computing_otherwise_is_a_wrong_result_still_timed(tmp_path):
    """Rank 1's op computes 3x where the reference says 2x: rank 0 finds the allreduced state wrong."""
    (tmp_path / "boom.py").write_text(BOOM.replace("FAIL", "return x * 3"))
    zero, one = _two_nodes(
        _coconet("run", str(tmp_path / "boom.py"), "--size", "N=64", "--kernels", "eager", "--repeats", "2", "--json"),
        _env(tmp_path),
    )
    assert zero.returncode == 1 and one.returncode == 1, zero.stderr[-3000:]
    [result] = json.loads(zero.stdout)["results"]
    assert result["status"] == "wrong_result" and result["correct"] is False and result["samples"] == 2
    assert re.match(
        r"stage0\.state\.w on rank 0 \(relative error \S+ > \S+\) differs from the reference", result["error"]
    ), result


def test_a_rank_that_dies_stops_the_others_with_one_error_line(tmp_path):
    """Rank 1's process exits in the middle of a step: rank 0 does not wait for it, and says what it lost."""
    (tmp_path / "boom.py").write_text(BOOM.replace("FAIL", "os._exit(3)"))
    t0 = time.monotonic()
    zero, one = _two_nodes(
        _coconet("run", str(tmp_path / "boom.py"), "--size", "N=64", "--kernels", "eager", "--timeout", "5"),
        _env(tmp_path),
    )
    assert time.monotonic() - t0 < 120
    assert zero.returncode != 0 and one.returncode != 0 and zero.stdout == ""
    [line] = _error_lines(zero)
    assert line.startswith("error: rank 0: the job lost a rank while running schedule 'baseline' ("), line
    assert "exitcode: 3" in one.stderr  # torchrun's report of the rank that died


# -- docs/cluster.md's recipes


def _block(name: str) -> list[str]:
    text = (ROOT / "docs" / "cluster.md").read_text()
    block = re.search(rf"<!-- {name}:.*?-->\n```bash\n(.*?)```", text, re.S)
    assert block, f"docs/cluster.md has no {name} block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_the_torchrun_recipe_runs_as_written(tmp_path):
    """The recipe's command, as written, on each of two nodes (HEAD and PORT set): one result table, from rank 0."""
    [command] = _block("torchrun-commands")
    env = _env(tmp_path, HEAD="127.0.0.1", PORT=str(_free_port()))
    zero, one = _together([["bash", "-c", command]] * 2, env)
    assert zero.returncode == 0 and one.returncode == 0, zero.stderr[-3000:] + one.stderr[-3000:]
    tables = [node.stdout for node in (zero, one) if node.stdout.strip()]
    assert len(tables) == 1 and re.search(r"^ +0 │ ok .* baseline", tables[0], re.M), tables


def test_the_slurm_script_parses_and_runs_the_tested_command(tmp_path):
    """Slurm cannot run here: the script must parse, and the torchrun it starts on every node must be the
    tested recipe's, with Slurm's variables for the node count."""
    script = "\n".join(_block("slurm-script")) + "\n"
    path = tmp_path / "coconet.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    [command] = _block("torchrun-commands")
    [srun] = [line for line in script.splitlines() if line.startswith("srun ")]
    assert srun.split()[1:] == command.replace("--nnodes=2", "--nnodes=$SLURM_NNODES").split(), (srun, command)
