"""benchmarks/gpu_fused_prediction.py: the predicted (model-only) gains of a GPU fused collective for Adam.
Runs on the CPU; nothing in it is a measurement."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("gpu_fused_prediction", ROOT / "benchmarks/gpu_fused_prediction.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_writes_json_and_plot_labelled_as_model(script, tmp_path, capsys):
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    script.main(["--out", str(out), "--plot", str(png)])
    data = json.loads(out.read_text())
    assert data["source"] == "model" and png.stat().st_size > 10_000
    assert set(data["topologies"]) == {"dgx-h100-8", "h100-16node-ib"}
    assert data["topologies"]["h100-16node-ib"]["world"] == 128
    for t in data["topologies"].values():
        assert [r["log2_N"] for r in t["rows"]] == list(range(20, 29))
        for r in t["rows"]:
            assert r["baseline"]["seconds"] == pytest.approx(sum(r["baseline"]["terms"].values()))
            assert "as_slice(w)" not in r["best_replicated_w"]["schedule"]
            assert r["best"]["seconds"] <= r["best_replicated_w"]["seconds"]
    assert "predicted" in capsys.readouterr().out


def test_fused_moves_what_the_allreduce_moves_and_drops_the_full_update(script):
    """Inside a node the sequential fused collective's link bytes are the ring allreduce's, 2(R-1)/R of the
    gradient: its predicted gain is the copy and the update of all N that it no longer does, plus α."""
    from coconet.tuner.topology import load_topology

    topo = load_topology("dgx-h100-8")
    n, R = 2**26, 8
    base = script.baseline(topo, R, n)
    fused = script.fused_one_node(topo, n, R)["sequential"]
    link = 2 * (R - 1) / R * 4 * n * topo.intra.beta
    assert sum(fused.values()) == pytest.approx(link + 2 * (topo.launch_s + 2 * topo.intra.alpha_s))
    saved = base["copy_g"] + base["adam_full"]
    assert sum(base.values()) - sum(fused.values()) == pytest.approx(
        saved + base["allreduce"] - link - 2 * (topo.launch_s + 2 * topo.intra.alpha_s)
    )
    # pipelining the loads (inbound) under the stores (outbound) halves the link time, no more
    assert sum(script.fused_one_node(topo, n, R)["pipelined"].values()) == pytest.approx(
        link / 2 + topo.launch_s + 2 * topo.intra.alpha_s
    )
