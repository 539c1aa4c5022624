import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

RUN_MARK = "COCONET_TEST_RUN"
LOCAL_FIGURES = Path(__file__).parent / "data" / "local-topology.yaml"


def pytest_configure(config):
    # Every process this run starts inherits the mark, so the checks that no rank process or shared-memory
    # segment outlived a launch see this run's alone, not those of coconet jobs running beside the tests.
    os.environ[RUN_MARK] = uuid.uuid4().hex
    # ... and the data dir: no test reads or writes the user's store or topologies
    data = Path(tempfile.mkdtemp(prefix="coconet-test-data-"))
    config.coconet_data_dir = data
    os.environ["COCONET_DATA_DIR"] = str(data)
    write_local_topology(data / "topologies" / "local.yaml")


def pytest_unconfigure(config):
    data = getattr(config, "coconet_data_dir", None)
    if data is not None:
        shutil.rmtree(data, ignore_errors=True)


def write_local_topology(path: Path) -> Path:
    """The `local` topology the tests predict with: fixed figures, with the fingerprint of the machine running
    them, so that nothing calibrates on first use (a calibration takes half a minute and varies run to run)."""
    import yaml

    from coconet.tuner.fingerprint import detect_local

    doc = yaml.safe_load(LOCAL_FIGURES.read_text())
    here = detect_local()
    node = here.nodes[0]
    doc["fingerprint"].update(
        hardware=here.text(),
        hardware_hash=here.digest,
        cpu=node.cpu,
        cpus=node.cpus,
        memory_gib=node.memory_gib,
        machine=node.machine,
    )
    if node.gpus:
        doc["fingerprint"].update(gpu=node.gpus[0], gpus=len(node.gpus))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.fixture
def one_thread():
    """torch's ops in this process run on one thread: a parallel region (a convolution's, on any size) leaves
    OpenMP's workers behind, and the children of a test that forks ranks from this process later
    (test_baselines) would hang in their first parallel region."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def temp_code_cache(tmp_path_factory):
    """Generated modules go to a throwaway cache, not the user's."""
    old = os.environ.get("COCONET_CACHE_DIR")
    os.environ["COCONET_CACHE_DIR"] = str(tmp_path_factory.mktemp("coconet-cache"))
    yield
    if old is None:
        del os.environ["COCONET_CACHE_DIR"]
    else:
        os.environ["COCONET_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray cluster for every test that needs one (starting it costs seconds)."""
    ray = pytest.importorskip("ray")
    from coconet.tuner.cluster import connect

    connect(ranks=8)
    yield ray
    ray.shutdown()
