import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _generated_code_in_a_temp_dir(tmp_path_factory):
    """Generated modules go to a throwaway cache, not the user's."""
    old = os.environ.get("COCONET_CACHE_DIR")
    os.environ["COCONET_CACHE_DIR"] = str(tmp_path_factory.mktemp("coconet-cache"))
    yield
    if old is None:
        del os.environ["COCONET_CACHE_DIR"]
    else:
        os.environ["COCONET_CACHE_DIR"] = old
