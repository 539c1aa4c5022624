"""The fingerprint on a real Ray cluster of two nodes (test_cluster.py's, started the same way): a topology the
cluster is not is refused before any trial, naming both, the cluster as read node by node."""

from __future__ import annotations

from coconet.server.store import Store
from coconet.tuner.fingerprint import Fingerprint, detect_local
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
