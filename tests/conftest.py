import os
import uuid

import pytest

RUN_MARK = "COCONET_TEST_RUN"


def pytest_configure(config):
    # Every process this run starts inherits the mark, so the checks that no rank process or shared-memory
    # segment outlived a launch see this run's alone, not those of coconet jobs running beside the tests.
    os.environ[RUN_MARK] = uuid.uuid4().hex


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
