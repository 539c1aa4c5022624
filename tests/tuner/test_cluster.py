"""A real Ray cluster of two nodes on this machine (`ray start --head`, then `ray start --address`, each node
one CPU, token authentication on as Ray starts it): what a study needs is checked before any trial, ranks
span the nodes, shm (one node only) is left out, a refused token is one error line, every node is read for the
fingerprint (a topology the cluster is not is refused; `calibrate --ray-address` measures it within and between
nodes), and a node killed mid-study stops the study with a clear message and nothing left placed. Plus the
placement rules on their own. One cluster serves them all: the node-killing test runs last."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from coconet.errors import ClusterError, TopologyError
from coconet.server.store import Store
from coconet.tuner.cluster import Need, Node, Offer, plan
from coconet.tuner.fingerprint import Fingerprint, check_topology, detect_local
from coconet.tuner.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]
RAY = Path(sys.executable).parent / "ray"


def offer(*cpus: float, gpus: float = 0.0) -> Offer:
    return Offer(tuple(Node(f"n{i}", "127.0.0.1", c, gpus) for i, c in enumerate(cpus)))


def test_a_cluster_that_cannot_hold_one_candidate_is_refused_naming_both_sides():
    with pytest.raises(ClusterError, match=r"needs 3 ranks of 1 CPU, and offers 2 nodes \(1 CPU, 1 CPU\)"):
        plan(Need(3), ("gloo",), offer(1, 1))
    with pytest.raises(ClusterError, match=r"needs 2 ranks of 1 CPU and 1 GPU"):
        plan(Need(2, gpu=True), ("nccl",), offer(8, gpus=1))


def test_backends_share_the_cluster_or_take_turns():
    wide = plan(Need(2), ("gloo", "shm"), offer(4))
    assert (wide.backends, wide.shared, wide.left_out) == (("gloo", "shm"), True, {})
    tight = plan(Need(2), ("gloo", "shm"), offer(2))
    assert (tight.backends, tight.shared) == (("gloo", "shm"), False)  # one group at a time


def test_shm_runs_only_where_one_node_holds_every_rank():
    spread = plan(Need(2), ("gloo", "shm"), offer(1, 1))
    assert spread.backends == ("gloo",) and "no node holds 2 CPUs" in spread.left_out["shm"]
    with pytest.raises(ClusterError, match="backend shm cannot run here"):
        plan(Need(2), ("shm",), offer(1, 1), asked=True)
    assert "spread" in plan(Need(2), ("gloo", "shm"), offer(4), placement="spread").left_out["shm"]
    with pytest.raises(ClusterError, match="no backend can run"):
        plan(Need(2), ("shm",), offer(1, 1))


# -- a cluster of two nodes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(roots: set[int]) -> list[int]:
    """``roots`` and every process descending from them (Ray's agents rename themselves: found by parent)."""
    children: dict[int, list[int]] = {}
    for line in subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout.splitlines():
        pid, ppid = map(int, line.split())
        children.setdefault(ppid, []).append(pid)
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _matching(pattern: str) -> set[int]:
    """The processes whose command line matches ``pattern`` (read whole from /proc: ps cuts it to the terminal)."""
    found, regex = set(), re.compile(pattern)
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if regex.search((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")):
                    found.add(int(proc.name))
            except OSError:
                continue
    return found


def _ours(marker: str) -> set[int]:
    return _matching(re.escape(marker))


@dataclass
class TwoNodes:
    address: str
    temp: Path
    worker_port: int
    env: dict

    def worker_raylet(self) -> int:
        [raylet] = [
            p
            for p in _ours(f"--node_manager_port={self.worker_port}")
            if (Path("/proc") / str(p) / "exe").resolve().name == "raylet"
        ]
        return raylet


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[TwoNodes]:
    # a temp dir of its own (short: Ray's sockets live in it) keeps this cluster's files, and the note of
    # "the current cluster" that a plain ray.init() would join, away from every other Ray on the machine
    temp = Path(tempfile.mkdtemp(prefix="ccr-", dir="/tmp"))
    port, head_nm, worker_nm = _free_port(), _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    try:
        subprocess.run(
            [
                str(RAY),
                "start",
                "--head",
                "--port",
                str(port),
                "--num-cpus",
                "1",
                "--temp-dir",
                str(temp),
                "--include-dashboard=false",
                "--node-manager-port",
                str(head_nm),
            ],
            env=env,
            check=True,
            capture_output=True,
            timeout=120,
        )
        # as Ray documents it for a head with token authentication: every node speaks token
        subprocess.run(
            [
                str(RAY),
                "start",
                "--address",
                f"127.0.0.1:{port}",
                "--num-cpus",
                "1",
                "--node-manager-port",
                str(worker_nm),
            ],
            env={**env, "RAY_AUTH_MODE": "token"},
            check=True,
            capture_output=True,
            timeout=120,
        )
        yield TwoNodes(f"127.0.0.1:{port}", temp, worker_nm, env)
    finally:
        pids = _tree(_ours(str(temp)) | _ours(f"--node_manager_port={worker_nm}"))
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp, ignore_errors=True)


def coconet(nodes: TwoNodes, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "coconet", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**nodes.env, **(env or {})},
        timeout=timeout,
    )


def test_a_study_spans_the_nodes_and_records_where_its_ranks_ran(two_nodes, tmp_path):
    db = f"sqlite:///{tmp_path / 'c.db'}"
    proc = coconet(
        two_nodes,
        "tune",
        "examples/sgd.py",
        "--world",
        "2",
        "--size",
        "N=2^12",
        "--budget",
        "3",
        "--kernels",
        "eager",
        "--ray-address",
        two_nodes.address,
        "--db",
        db,
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["best"] is not None and {doc["best"]["backend"]} == {"gloo"}
    assert "no node holds 2 CPUs" in doc["backends_left_out"]["shm"]
    with Store.open(db) as store:
        rows = store.measurements(doc["program_hash"])
        assert rows and {m.versions.get("placement") for m in rows} == {"2 ranks on 2 nodes"}
        assert store.best(doc["program_hash"], {"N": 4096}, "local", 2).winner.id == doc["record_id"]


def test_a_study_the_cluster_cannot_hold_is_refused_before_any_trial(two_nodes, tmp_path):
    db = f"sqlite:///{tmp_path / 'c.db'}"
    t0 = time.monotonic()
    proc = coconet(
        two_nodes,
        "tune",
        "examples/sgd.py",
        "--world",
        "3",
        "--size",
        "N=2^12",
        "--ray-address",
        two_nodes.address,
        "--db",
        db,
    )
    assert time.monotonic() - t0 < 60
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "error: the Ray cluster cannot hold one candidate: it needs 3 ranks of 1 CPU, and offers 2 nodes "
        "(1 CPU, 1 CPU); add nodes or lower --world"
    )
    with Store.open(db) as store:
        assert store.jobs() == []  # refused before a job was taken


def test_a_cluster_refusing_the_token_is_one_error_line(two_nodes, tmp_path):
    proc = coconet(
        two_nodes,
        "tune",
        "examples/sgd.py",
        "--world",
        "2",
        "--size",
        "N=2^12",
        "--ray-address",
        two_nodes.address,
        "--db",
        f"sqlite:///{tmp_path / 'c.db'}",
        env={"RAY_AUTH_TOKEN": "wrong"},
        timeout=120,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert re.match(
        r"error: --ray-address \S+: the Ray cluster asks for its token and refused this one: copy it "
        r"from the head \(`ray get-auth-token` there\)",
        lines[0],
    ), lines[0]


def test_every_node_is_read_and_a_topology_the_cluster_is_not_is_refused(two_nodes, tmp_path):
    here = detect_local().nodes[0]  # both nodes run on this machine: each reads as it
    db = f"sqlite:///{tmp_path / 'c.db'}"
    proc = coconet(
        two_nodes,
        "tune",
        "examples/sgd.py",
        "--world",
        "2",
        "--size",
        "N=2^12",
        "--topology",
        "dgx-h100-8",
        "--ray-address",
        two_nodes.address,
        "--db",
        db,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(
        "error: --topology dgx-h100-8 does not describe the machines that would run the "
        "ranks (1 nodes declared, 2 found;"
    )
    assert "topology dgx-h100-8: 1 node, device cuda, 8 x H100-SXM5-80GB" in lines[0]
    assert f"found {Fingerprint((here, here)).text()}." in lines[0]
    with Store.open(db) as store:
        assert store.jobs() == [] and store.programs() == []  # refused before a job or a trial


def test_calibrate_measures_the_cluster_within_and_between_nodes(two_nodes, tmp_path):
    """Short figures (tiny buffers, few samples): what is checked is where they come from and go, not their values."""
    proc = coconet(
        two_nodes,
        "calibrate",
        "--ray-address",
        two_nodes.address,
        "--name",
        "two",
        "--quick",
        "--max-log2",
        "12",
        "--repeats",
        "3",
        "--json",
        env={"COCONET_DATA_DIR": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    path = tmp_path / "topologies" / "two.yaml"
    assert doc["path"] == str(path)
    topo = load_topology(path)
    here = detect_local().nodes[0]
    assert (topo.name, topo.nodes, topo.ranks_per_node, topo.backends) == ("two", 2, 2, ("gloo",))
    assert topo.inter is not None and topo.inter.kind == "network" and topo.inter.alpha_s > 0
    assert topo.inter.bandwidth_GBps > 0 and topo.intra.kind == "loopback" and topo.measured == {}
    assert [n for n, _ in doc["samples"]["between_nodes"]["allreduce"]] == [2**k for k in range(8, 13)]
    assert topo.fingerprint["hardware_hash"] == Fingerprint((here, here)).digest
    check_topology(topo, Fingerprint((here, here)))  # what `coconet tune --topology two` on it checks
    with pytest.raises(TopologyError, match="2 nodes declared, 1 found"):
        check_topology(topo, Fingerprint((here,)))


def test_a_node_lost_mid_study_stops_it_with_nothing_left_placed(two_nodes, tmp_path):
    """The worker node's raylet SIGKILLed while the study runs: the trial in flight is ``killed``, naming the
    node, and the next candidate finds a cluster that cannot hold it: the study stops with that message, its
    job failed, and no placement group of it is left on the cluster. (Runs last: the node stays dead.)"""
    db = f"sqlite:///{tmp_path / 'c.db'}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "coconet",
            "tune",
            "examples/sgd.py",
            "--world",
            "2",
            "--size",
            "N=2^18",
            "--budget",
            "8",
            "--kernels",
            "eager",
            "--ray-address",
            two_nodes.address,
            "--db",
            db,
        ],
        cwd=ROOT,
        env=two_nodes.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the first trial recorded: the ranks are placed across the nodes
            time.sleep(1)
            if Path(db.removeprefix("sqlite:///")).exists():
                with Store.open(db) as store:
                    if any(m.job_id for p in store.programs() for m in store.measurements(p.hash)):
                        break
        os.kill(two_nodes.worker_raylet(), signal.SIGKILL)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(
            "error: the Ray cluster cannot hold one candidate: it needs 2 ranks of 1 CPU, and offers 1 node (1 CPU)"
        )
    )
    with Store.open(db) as store:
        [job] = store.jobs()
        assert job.state == "failed" and "cannot hold one candidate" in job.error
        killed = [m for m in store.measurements(job.program_hash) if m.status == "killed"]
        assert killed and all(re.match(r"rank [01] \(node \w+ at [^)]+\) died", m.error) for m in killed)
    check = subprocess.run(
        [
            sys.executable,
            "-c",
            "import ray, json; ray.init(address=__import__('sys').argv[1], "
            "logging_level='ERROR'); print(json.dumps([g['state'] for g in "
            "ray.util.placement_group_table().values()]))",
            two_nodes.address,
        ],
        capture_output=True,
        text=True,
        env={**two_nodes.env, "RAY_AUTH_MODE": "token"},
        timeout=120,
    )
    assert check.returncode == 0, check.stderr
    assert set(json.loads(check.stdout.strip().splitlines()[-1])) <= {"REMOVED"}


def _recipe() -> list[str]:
    text = (ROOT / "docs" / "cluster.md").read_text()
    block = re.search(r"<!-- cluster-commands:.*?-->\n```bash\n(.*?)```", text, re.S)
    assert block, "docs/cluster.md has no cluster-commands block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_the_cluster_recipe_runs_as_written(tmp_path):
    """docs/cluster.md's commands, each as written, with HEAD and PORT set: a head and a worker node by
    `ray start` (token authentication on, as Ray starts it), then `coconet tune` across them."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        HEAD="127.0.0.1",
        PORT=str(port),
        RAY_USAGE_STATS_ENABLED="0",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        COCONET_DATABASE_URL=f"sqlite:///{tmp_path / 'c.db'}",
    )
    *starts, tune = _recipe()
    assert tune.startswith("coconet tune ")
    try:
        for line in starts:
            subprocess.run(["bash", "-c", line], env=env, cwd=ROOT, check=True, capture_output=True, timeout=120)
        proc = subprocess.run(["bash", "-c", tune], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert "winner, timed again in turns" in proc.stdout
        assert "note: backend shm not tried: its ranks share memory on one node" in proc.stderr
        with Store.open(env["COCONET_DATABASE_URL"]) as store:
            [prog] = store.programs()
            assert {m.versions.get("placement") for m in store.measurements(prog.hash)} == {"2 ranks on 2 nodes"}
    finally:
        # the processes of this cluster: its GCS, and everything that names it (raylets, agents), with their
        # children; and Ray's note of "the current cluster" where it names this one
        pids = _tree(_matching(rf"--gcs_server_port={port}(?!\d)|--gcs[-_]address[= ]\S+:{port}(?!\d)"))
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        note = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        if note.exists() and note.read_text().strip().endswith(f":{port}"):
            note.unlink()
