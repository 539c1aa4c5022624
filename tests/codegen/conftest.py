import pytest


@pytest.fixture(autouse=True, scope="session")
def _generated_code_in_a_temp_dir(temp_code_cache):
    yield
