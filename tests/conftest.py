import pytest


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray cluster for every test that needs one (starting it costs seconds)."""
    ray = pytest.importorskip("ray")
    from coconet.tuner.runner import connect

    connect(ranks=8)
    yield ray
    ray.shutdown()
