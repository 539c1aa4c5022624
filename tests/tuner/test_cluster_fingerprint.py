"""The fingerprint on a real Ray cluster of two nodes (test_cluster.py's, started the same way): a topology the
cluster is not is refused before any trial, naming both, the cluster as read node by node; and `coconet
calibrate --ray-address` measures the cluster as a topology of its own, within and between nodes."""

from __future__ import annotations

import json

import pytest

from coconet.errors import TopologyError
from coconet.server.store import Store
from coconet.tuner.fingerprint import Fingerprint, check_topology, detect_local
from coconet.tuner.topology import load_topology
from tests.tuner.test_cluster import coconet, two_nodes  # noqa: F401 (the fixture, by name)


def test_every_node_is_read_and_a_topology_the_cluster_is_not_is_refused(two_nodes, tmp_path):  # noqa: F811
    here = detect_local().nodes[0]  # both nodes run on this machine: each reads as it
    db = f"sqlite:///{tmp_path / 'c.db'}"
    proc = coconet(two_nodes, "tune", "examples/sgd.py", "--world", "2", "--size", "N=2^12", "--topology",
                   "dgx-h100-8", "--ray-address", two_nodes.address, "--db", db)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: --topology dgx-h100-8 does not describe the machines that would run the "
                               "ranks (1 nodes declared, 2 found;")
    assert "topology dgx-h100-8: 1 node, device cuda, 8 x H100-SXM5-80GB" in lines[0]
    assert f"found {Fingerprint((here, here)).text()}." in lines[0]
    with Store.open(db) as store:
        assert store.jobs() == [] and store.programs() == []  # refused before a job or a trial


def test_calibrate_measures_the_cluster_within_and_between_nodes(two_nodes, tmp_path):  # noqa: F811
    """Short figures (tiny buffers, few samples): what is checked is where they come from and go, not their values."""
    proc = coconet(two_nodes, "calibrate", "--ray-address", two_nodes.address, "--name", "two", "--quick",
                   "--max-log2", "12", "--repeats", "3", "--json", env={"COCONET_DATA_DIR": str(tmp_path)})
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
