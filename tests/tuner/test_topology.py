import json
import math
import os
import pickle
import subprocess
import sys

import pytest
import yaml

from coconet.errors import CoconetError, TopologyError
from coconet.tuner.calibrate import fit_alpha_beta
from coconet.tuner.fingerprint import detect_local
from coconet.tuner.topology import (
    BACKENDS,
    from_dict,
    from_yaml,
    list_topologies,
    load_topology,
    package_dir,
    save_topology,
    user_dir,
)

SHIPPED = ("dgx2-v100-16", "dgx-a100-8", "dgx-h100-8", "h100-4node-ib", "h100-16node-ib", "cpu-25gbe")


def minimal(**over):
    d = {
        "name": "t",
        "device": "cpu",
        "nodes": 1,
        "ranks_per_node": 2,
        "backends": ["gloo", "shm"],
        "links": {"intra": {"alpha_s": 1e-5, "bandwidth_GBps": 2}},
        "memory_bandwidth_GBps": 10,
        "matmul_TFLOPS": {"float32": 0.1},
    }
    d.update(over)
    return d


def test_every_shipped_topology_loads_and_round_trips():
    assert set(SHIPPED) <= set(list_topologies())
    for name in SHIPPED:
        t = load_topology(name)
        assert t.name == name and t.world == t.nodes * t.ranks_per_node >= 2
        assert t.memory_bandwidth_GBps > 0 and t.flops("float32") > 0 and t.intra.beta > 0
        assert set(t.backends) <= set(BACKENDS)
        back = from_yaml(t.to_yaml(), name)
        assert back == t and back.digest == t.digest and hash(back) == hash(t)
        if t.nodes > 1:
            assert t.inter is not None and t.inter.bandwidth_GBps < t.intra.bandwidth_GBps


def test_the_package_ships_published_machines_only():
    assert not (package_dir() / "local.yaml").exists()
    assert set(p.stem for p in package_dir().glob("*.yaml")) == set(SHIPPED)


def test_local_is_read_from_the_data_dir_only(tmp_path, monkeypatch):
    t = load_topology("local")  # the run's fixture (tests/conftest.py), in its temporary data dir
    assert t.fit("gloo", "allreduce") is not None and "hardware_hash" in t.fingerprint
    assert t.backends == ("gloo", "shm") and t.device == "cpu"
    monkeypatch.setenv("COCONET_DATA_DIR", str(tmp_path))
    assert user_dir() == tmp_path / "topologies" and "local" not in list_topologies()
    with pytest.raises(TopologyError, match="no topology named 'local'.*coconet calibrate"):
        load_topology("local")


def test_round_trip_through_a_file(tmp_path):
    t = from_dict(
        minimal(
            fresh_cost=[[2**20, 1e-10], [2**24, 5e-10]],
            measured={"gloo": {"allreduce": {"alpha_s": 3e-4, "beta_s_per_byte": 1e-9}}},
            fingerprint={"cpu": "x", "cores": 2},
        )
    )
    path = save_topology(t, tmp_path / "t.yaml", header="# a header")
    assert load_topology(path) == t
    assert t.fresh_s_per_byte(2**19) == 0 and t.fresh_s_per_byte(2**30) == 5e-10
    assert 1e-10 < t.fresh_s_per_byte(2**22) < 5e-10


def test_beta_may_be_given_instead_of_bandwidth():
    t = from_dict(minimal(links={"intra": {"alpha_s": 0, "beta_s_per_byte": 1e-9}}))
    assert math.isclose(t.intra.bandwidth_GBps, 1.0) and math.isclose(t.intra.beta, 1e-9)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"links": {"intra": {"alpha_s": 1e-5, "bandwidth_GBps": -2}}}, "links.intra.bandwidth_GBps"),
        ({"links": {"intra": {"alpha_s": 1e-5}}}, "links.intra.bandwidth_GBps"),
        ({"links": {"intra": {"alpha_s": "fast", "bandwidth_GBps": 1}}}, "links.intra.alpha_s"),
        ({"links": {}}, "links.intra"),
        ({"device": "tpu"}, "device"),
        ({"nodes": 0}, "nodes"),
        ({"nodes": 1.5}, "nodes"),
        ({"backends": ["mpi"]}, "backends[0]"),
        (
            {
                "nodes": 2,
                "links": {"intra": {"alpha_s": 0, "bandwidth_GBps": 1}, "inter": {"alpha_s": 0, "bandwidth_GBps": 1}},
            },
            "backends",
        ),  # shm across nodes
        ({"nodes": 2, "backends": ["gloo"]}, "links.inter"),
        ({"matmul_TFLOPS": {"float16": 1}}, "matmul_TFLOPS.float32"),
        ({"overlap": 1.5}, "overlap"),
        ({"algorithms": {"gloo": {"allreduce": ["butterfly"]}}}, "algorithms.gloo.allreduce"),
        ({"measured": {"gloo": {"allreduce": {"alpha_s": 1}}}}, "measured.gloo.allreduce.beta_s_per_byte"),
        ({"fresh_cost": [[4, 1e-9], [2, 1e-9]]}, "fresh_cost[1]"),
        ({"memory_bandwidth": 10}, "memory_bandwidth"),  # unknown key (a typo)
        ({"fingerprint": {"cpu": [1, 2]}}, "fingerprint.cpu"),
    ],
)
def test_malformed_topology_names_the_field(change, field):
    data = minimal()
    data.update(change)
    with pytest.raises(TopologyError) as e:
        from_dict(data, "bad.yaml")
    assert e.value.field == field and field in str(e.value) and "bad.yaml" in str(e.value)
    assert isinstance(e.value, CoconetError)


def test_missing_field_and_bad_yaml():
    data = minimal()
    del data["memory_bandwidth_GBps"]
    with pytest.raises(TopologyError, match="memory_bandwidth_GBps: is required"):
        from_dict(data)
    with pytest.raises(TopologyError, match="not valid YAML"):
        from_yaml("name: [unclosed", "x.yaml")
    with pytest.raises(TopologyError, match="must be a mapping"):
        from_yaml("- a list", "x.yaml")


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(TopologyError, match="dgx-h100-8"):
        load_topology("no-such-cluster")
    with pytest.raises(TopologyError, match="no topology file"):
        load_topology("/nonexistent/t.yaml")


def test_user_dir_comes_first(tmp_path, monkeypatch):
    monkeypatch.setenv("COCONET_DATA_DIR", str(tmp_path))
    mine = from_dict(minimal(name="dgx-h100-8"))
    save_topology(mine, tmp_path / "topologies" / "dgx-h100-8.yaml")
    save_topology(from_dict(minimal(name="mine")), tmp_path / "topologies" / "mine.yaml")
    assert load_topology("dgx-h100-8") == mine
    assert "mine" in list_topologies() and "cpu-25gbe" in list_topologies()


def test_error_pickles_with_its_field():
    e = pickle.loads(pickle.dumps(TopologyError("bad", field="links.intra")))
    assert e.field == "links.intra" and str(e) == "bad"


def test_backend_check():
    with pytest.raises(TopologyError, match="does not run backend 'gloo'"):
        load_topology("dgx-h100-8").check_backend("gloo")


def test_fit_recovers_alpha_beta_despite_an_outlier():
    pts = [(2**k, 3e-4 + 1e-9 * 2**k) for k in range(8, 25)]
    pts[5] = (pts[5][0], pts[5][1] * 5)  # another process ran then
    f = fit_alpha_beta(pts)
    assert f.alpha_s == pytest.approx(3e-4, rel=0.05) and f.beta_s_per_byte == pytest.approx(1e-9, rel=0.05)


def test_calibrate_writes_local_into_the_data_dir_with_the_fingerprint(tmp_path):
    env = {**os.environ, "COCONET_DATA_DIR": str(tmp_path)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "coconet",
            "calibrate",
            "--world",
            "2",
            "--quick",
            "--max-log2",
            "12",
            "--repeats",
            "3",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "topologies" / "local.yaml"
    assert json.loads(proc.stdout)["path"] == str(out)
    assert not (package_dir() / "local.yaml").exists()
    t = load_topology(out)
    doc = yaml.safe_load(out.read_text())
    assert t.name == "local" and t.ranks_per_node == 2 and doc["fingerprint"]["ranks"] == 2
    here = detect_local()
    assert doc["fingerprint"]["hardware_hash"] == here.digest and doc["fingerprint"]["hardware"] == here.text()
    for op in ("allreduce", "reduce_scatter", "all_gather"):
        fit = t.fit("gloo", op)
        assert fit.alpha_s > 0 and fit.time(2**20) > 0
    assert t.intra.alpha_s > 0 and t.intra.bandwidth_GBps > 0 and t.memory_bandwidth_GBps > 0
    assert t.flops("float32") > 0 and t.launch_s > 0 and t.shm_barrier_s > 0 and 0 <= t.overlap <= 1


def test_the_published_schema_is_the_files():
    """docs/topology.schema.json is what topology files are validated against: regenerated when the model
    changes (python -c "import json; from coconet.tuner.topology_file import TopologyFile; print(json.dumps(
    TopologyFile.model_json_schema(), indent=2))" > docs/topology.schema.json)."""
    import json
    from pathlib import Path

    from coconet.tuner.topology_file import TopologyFile

    published = Path(__file__).resolve().parents[2] / "docs" / "topology.schema.json"
    assert json.loads(published.read_text()) == TopologyFile.model_json_schema()
