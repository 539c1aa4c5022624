"""benchmarks/gpu_targets.py: the issue's GPU targets judged from gpu_checks.sh's files (no GPU needed to
check the judging; the figures come from a GPU run)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mod():
    spec = importlib.util.spec_from_file_location("gpu_targets", ROOT / "benchmarks/gpu_targets.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_targets_met_not_met_and_missing(tmp_path, capsys):
    (tmp_path / "bench_adam_nccl_w1.json").write_text(
        json.dumps(
            {"points": [{"sizes": {"N": 2**24}, "best_speedup": 1.6}, {"sizes": {"N": 2**20}, "best_speedup": 0.9}]}
        )
    )
    (tmp_path / "gpu_kernels.json").write_text(
        json.dumps(
            {
                "adam": [{"n": 2**k, "coconet": {"kernels_fraction_of_peak": 0.85}} for k in range(22, 27)],
                "epilogue": {"coconet_compiled": {"kernels_fraction_of_peak": 0.7}},
            }
        )
    )
    rows = _mod().main(tmp_path)
    met = {r["target"].split(":")[0]: r["met"] for r in rows}
    assert met["Adam N=2^24"] is True and met["Adam N=2^20"] is False
    assert met["Megatron B=8,S=1024,H=3072"] is None  # no file: no figure, not a pass
    assert met["Megatron fused epilogue (bias+dropout+residual)"] is False
    assert all(met[f"fused Adam kernel N=2^{k}"] for k in range(22, 27))
    assert json.loads((tmp_path / "targets.json").read_text())["targets"] == rows
    assert "NO FIGURE" in capsys.readouterr().out


def test_gpu_checks_script_is_valid_bash_with_a_budget_under_ten_minutes():
    script = ROOT / "benchmarks/gpu_checks.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert "budget=${2:-540}" in text  # 9 minutes: inside a 10-minute command limit
    for needle in (
        "pytest -q -m gpu",
        "test_cuda_gloo.py",
        "--size N=2^24 --size N=2^20",
        "B=8,S=1024,H=3072",
        "gpu_targets.py",
    ):
        assert needle in text, needle
