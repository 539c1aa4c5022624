import dataclasses
import os
import runpy
from pathlib import Path

import pytest
import yaml

from coconet.errors import CoconetError, TopologyError
from coconet.server.store import Store
from coconet.tuner import calibrate as cal
from coconet.tuner.fingerprint import Fingerprint, Node, check_topology, detect_local, gpu_family, mismatches, of_nodes
from coconet.tuner.topology import load_topology

EPYC = Node("AMD EPYC 7763 64-Core Processor", 128, 512, "x86_64")
DGX = Node("Intel(R) Xeon(R) Platinum 8480C", 224, 2016, "x86_64", ("NVIDIA H100 80GB HBM3",) * 8)


def test_text_and_hash_are_stable_and_tell_machines_apart():
    a = Fingerprint((EPYC, dataclasses.replace(EPYC, memory_gib=256)))
    b = Fingerprint((dataclasses.replace(EPYC, memory_gib=256), EPYC))  # another order of the same nodes
    assert a == b and a.digest == b.digest and a.text() == b.text()
    assert a.text() == (
        "2 nodes: AMD EPYC 7763 64-Core Processor, 128 CPUs, 256 GiB, x86_64, no GPU; "
        "AMD EPYC 7763 64-Core Processor, 128 CPUs, 512 GiB, x86_64, no GPU"
    )
    assert Fingerprint((DGX, DGX)).text() == (
        "2 nodes: 2 x (Intel(R) Xeon(R) Platinum 8480C, 224 CPUs, 2016 GiB, x86_64, 8 x NVIDIA H100 80GB HBM3)"
    )
    digests = {
        f.digest
        for f in (
            a,
            Fingerprint((EPYC,)),
            Fingerprint((DGX,)),
            Fingerprint((dataclasses.replace(DGX, gpus=DGX.gpus[:4]),)),
        )
    }
    assert len(digests) == 4 and all(len(d) == 12 for d in digests)
    assert Fingerprint.from_dict(a.to_dict()) == a
    with pytest.raises(TopologyError, match="cpus"):
        Fingerprint.from_dict({"nodes": [{"cpu": "x"}]})


def test_this_machine_is_read_the_same_each_time():
    first, again = detect_local(), detect_local()
    assert first == again and first.digest == again.digest and first.node_count == 1
    node = first.nodes[0]
    assert node.cpus == len(os.sched_getaffinity(0)) and node.memory_gib > 0 and node.cpu
    assert first.versions() == {"fingerprint": first.digest, "machines": first.text()}


def test_a_measurement_is_fingerprinted_with_the_nodes_its_ranks_ran_on():
    cluster = {"n1": EPYC, "n2": DGX}
    assert of_nodes(cluster, ["n2", "n2"]) == Fingerprint((DGX,))
    assert of_nodes(cluster) == Fingerprint((EPYC, DGX))


@pytest.mark.parametrize(
    "name, family",
    [
        ("H100-SXM5-80GB", "h100"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("Tesla V100-SXM3-32GB", "v100"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
    ],
)
def test_gpu_models_compare_by_model_number(name, family):
    assert gpu_family(name) == family


def test_a_published_machine_is_checked_against_the_machines_found():
    dgx = load_topology("dgx-h100-8")
    check_topology(dgx, Fingerprint((DGX,)))  # NVIDIA's name for the part the datasheet calls H100-SXM5-80GB
    with pytest.raises(TopologyError) as e:
        check_topology(dgx, Fingerprint((EPYC,)))
    text = str(e.value)
    assert "\n" not in text and isinstance(e.value, CoconetError)
    assert "topology dgx-h100-8: 1 node, device cuda, 8 x H100-SXM5-80GB" in text  # what it claims
    assert "found 1 node: AMD EPYC 7763 64-Core Processor, 128 CPUs, 512 GiB, x86_64, no GPU" in text
    a100 = dataclasses.replace(DGX, gpus=("NVIDIA A100-SXM4-80GB",) * 8)
    assert mismatches(dgx, Fingerprint((a100,))) == ["GPU H100-SXM5-80GB declared, NVIDIA A100-SXM4-80GB found"]
    assert mismatches(dgx, Fingerprint((DGX, DGX))) == ["1 nodes declared, 2 found", "8 GPUs declared, 16 found"]
    cpus = load_topology("cpu-25gbe")
    assert mismatches(cpus, Fingerprint((EPYC,) * 8)) == []
    assert mismatches(cpus, Fingerprint((EPYC,) * 2)) == ["8 nodes declared, 2 found"]
    intel = dataclasses.replace(EPYC, cpu="Intel(R) Xeon(R) Gold 6338")
    assert mismatches(cpus, Fingerprint((intel,) * 8))[0].startswith("CPU AMD EPYC 7763 declared")


def test_a_calibrated_topology_declares_its_cpu_count():
    local = load_topology("local")  # the tests' fixture, fingerprinted as this machine
    here = detect_local()
    check_topology(local, here)
    more = Fingerprint((dataclasses.replace(here.nodes[0], cpus=here.nodes[0].cpus + 2),))
    assert mismatches(local, more) == [f"{here.nodes[0].cpus} CPUs per node declared, [{here.nodes[0].cpus + 2}] found"]


def test_local_on_a_cluster_is_checked_node_by_node():
    """`local` is this machine's kind: a cluster joined by --ray-address passes where every node is of it."""
    local, here = load_topology("local"), detect_local()
    node = here.nodes[0]
    check_topology(local, Fingerprint((node, node, node)), per_node=True)
    other = dataclasses.replace(node, cpu="Intel(R) Xeon(R) Gold 6338", gpus=node.gpus + ("NVIDIA A100-SXM4-80GB",))
    wrong = mismatches(local, Fingerprint((node, other)), per_node=True)
    assert f"CPU {node.cpu} declared, {sorted({node.cpu, other.cpu})} found" in wrong
    assert f"{len(node.gpus)} GPUs per node declared, {[len(node.gpus), len(node.gpus) + 1]} found" in wrong
    with pytest.raises(TopologyError, match="1 nodes declared, 3 found"):
        check_topology(local, Fingerprint((node, node, node)))


# --- `local` on first use ---


@pytest.fixture
def fresh_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("COCONET_DATA_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def fake_calibrate(monkeypatch, request):
    """``calibrate`` replaced by one that hands back the tests' fixture figures with this machine's fingerprint,
    counting its calls: what first use does around a calibration, without the half minute it takes."""
    from tests.conftest import write_local_topology

    calls = []
    fixture = load_topology(write_local_topology(request.config.coconet_data_dir / "fake" / "local.yaml"))

    def run(settings):
        calls.append(settings)
        return cal.Calibration(topology=fixture)

    monkeypatch.setattr(cal, "calibrate", run)
    return calls


def test_first_use_calibrates_local_once_and_says_so(fresh_data_dir, fake_calibrate):
    said = []
    topo = cal.local_topology(say=said.append)
    path = fresh_data_dir / "topologies" / "local.yaml"
    assert fake_calibrate == [cal.FIRST_USE] and path.is_file() and load_topology("local") == topo
    assert len(said) == 1 and "no `local` topology has been calibrated" in said[0] and "calibrating" in said[0]
    assert cal.local_topology(say=said.append) == topo  # found, and this machine's: not measured again
    assert len(fake_calibrate) == 1 and len(said) == 1


def test_local_of_other_hardware_is_calibrated_again(fresh_data_dir, fake_calibrate):
    path = fresh_data_dir / "topologies" / "local.yaml"
    cal.local_topology(say=lambda _: None)
    doc = yaml.safe_load(path.read_text())
    doc["fingerprint"].update(hardware="1 node: another CPU, 64 CPUs", hardware_hash="0123456789ab")
    path.write_text(yaml.safe_dump(doc))
    said = []
    cal.local_topology(say=said.append)
    assert len(fake_calibrate) == 2
    assert "calibrated on 1 node: another CPU, 64 CPUs, and this machine is " + detect_local().text() in said[0]
    assert yaml.safe_load(path.read_text())["fingerprint"]["hardware_hash"] == detect_local().digest


def test_tune_refuses_a_topology_the_cluster_is_not_before_any_trial(tmp_path, monkeypatch):
    import coconet.tuner.tune as tune_mod
    from coconet.tuner.tune import Request

    monkeypatch.setattr(tune_mod, "connect", lambda *a, **k: None)
    monkeypatch.setattr(tune_mod, "detect_cluster", lambda: {"a": EPYC, "b": EPYC})
    prog = runpy.run_path(str(Path(__file__).parents[2] / "examples" / "adam.py"))["program"].ir
    request = Request(prog, ({"N": 1024},), 2, topology="dgx-h100-8", ray_address="127.0.0.1:1", budget=2)
    with Store.open(f"sqlite:///{tmp_path / 's.db'}") as store:
        with pytest.raises(TopologyError, match="1 nodes declared, 2 found.*found 2 nodes: 2 x \\(AMD EPYC"):
            tune_mod.tune(request, store)
        assert store.jobs() == [] and store.measurement_count(prog.hash) == 0
