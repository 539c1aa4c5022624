"""What the API answers for a key measured and also predicted: the measurement, always, and each answer
saying which it is (and, for a prediction, what predicted it)."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
from fastapi.testclient import TestClient

from coconet.server.app import create_app
from coconet.server.records import NewMeasurement
from coconet.server.store import Store
from tests.server.test_api import API, HOSTS, TOKEN, held_out_program


@pytest.fixture
def served(db_url: str) -> Iterator[tuple[TestClient, Store, Any]]:
    app = create_app(db_url, token=TOKEN, hosts=HOSTS, start_workers=False)
    prog = held_out_program()
    with TestClient(app) as c:
        store = app.state.store
        store.add_program(prog)
        yield c, store, prog


def _winner(store: Store, prog: Any, n: int, median_s: float, source: str, **extra: Any) -> int:
    from coconet.schedules.space import generate

    base, other = list(generate(prog, depth=1))[:2]
    common = dict(
        sizes={"N": n},
        topology="local",
        world=2,
        backend="gloo",
        source=source,
        samples=[] if source == "model" else [median_s] * 5,
        n=0 if source == "model" else 5,
        **extra,
    )
    ids = store.add_measurements(
        [
            NewMeasurement.of(base, median_s=3 * median_s, **common),
            NewMeasurement.of(other, median_s=median_s, **common),
        ]
    )
    return store.add_winner(ids[1], baseline_id=ids[0])


def test_best_answers_the_measurement_and_says_so(served) -> None:
    c, store, prog = served
    measured = _winner(store, prog, 2**16, 1.89e-3, "measured")
    versions = {"coconet": "0.1.0", "model": "alpha-beta roofline", "topology": "abc123"}
    predicted = _winner(store, prog, 2**16, 0.3e-3, "model", versions=versions)
    query = f"{API}/best?program={prog.hash}&sizes=N=65536&topology=local"
    for url in (query, f"{query}&world=2", f"{query}&source=measured"):  # the fast path and the route alike
        body = c.get(url).json()
        assert (body["winner_id"], body["source"], body["prediction"]) == (measured, "measured", None), url
        assert body["stats"]["median_s"] == pytest.approx(1.89e-3) and body["speedup"] == pytest.approx(3.0)
        assert body["order_reversed"] is False
    body = c.get(f"{query}&source=predicted").json()
    assert (body["winner_id"], body["source"]) == (predicted, "predicted")
    assert body["prediction"] == {
        "model": "alpha-beta roofline",
        "topology": "local",
        "calibration": "abc123",
        "coconet": "0.1.0",
    }
    assert body["baseline"]["source"] == "predicted"
    assert c.get(f"{query}&source=guess").status_code == 422
    # the results list the measured winner of the key, not the prediction beside it
    results = c.get(f"{API}/results?program={prog.hash}").json()["winners"]
    assert [(w["winner_id"], w["source"]) for w in results] == [(measured, "measured")]


def test_a_key_only_predicted_answers_with_the_prediction_flagged(served) -> None:
    c, store, prog = served
    predicted = _winner(store, prog, 2**20, 1e-3, "model", versions={"model": "alpha-beta roofline"})
    body = c.get(f"{API}/best?program={prog.hash}&sizes=N=1048576&topology=local").json()
    assert (body["winner_id"], body["source"], body["exact"]) == (predicted, "predicted", True)
    assert body["prediction"]["model"] == "alpha-beta roofline" and body["prediction"]["calibration"] is None
    assert c.get(f"{API}/best?program={prog.hash}&sizes=N=1048576&topology=local&source=measured").status_code == 404


def test_asking_to_tune_a_key_only_predicted_starts_a_job(served) -> None:
    """POST /best tunes on a miss; a key with only a prediction is a miss (the prediction comes back as the
    nearest answer meanwhile, flagged), and a measured one is a hit."""
    c, store, prog = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    predicted = _winner(store, prog, 2**12, 1e-3, "model")
    body = {"program": prog.hash, "sizes": {"N": 2**12}, "topology": "local", "world": 2}
    r = c.post(f"{API}/best", json=body, headers=auth)
    assert r.status_code == 202, r.text
    started = r.json()
    assert started["nearest"]["winner_id"] == predicted and started["nearest"]["source"] == "predicted"
    assert store.job(started["job"]).state == "queued"
    measured = _winner(store, prog, 2**12, 2e-3, "measured")
    r = c.post(f"{API}/best", json=body, headers=auth)
    assert r.status_code == 200 and r.json()["winner_id"] == measured


def test_every_answer_says_where_a_measurement_ran(served) -> None:
    c, store, prog = served
    ran = {
        "fingerprint": "0154706922f8",
        "machines": "1 node: AMD EPYC, 2 CPUs, 24 GiB, x86_64, no GPU",
        "placement": "2 ranks on 1 node",
    }
    measured = _winner(store, prog, 2**14, 1e-3, "measured", versions={"torch": "2.13", **ran})
    older = _winner(store, prog, 2**18, 1e-3, "measured", versions={"torch": "2.13"})  # from before fingerprints
    query = f"{API}/best?program={prog.hash}&sizes=N=16384&topology=local"
    for url in (query, f"{query}&world=2"):  # the fast path and the route alike
        body = c.get(url).json()
        assert body["winner_id"] == measured and body["machines"] == ran, url
        assert body["baseline"]["machines"] == ran
    assert c.get(f"{API}/best?program={prog.hash}&sizes=N=262144&topology=local").json()["machines"] is None
    winners = {w["winner_id"]: w for w in c.get(f"{API}/results?program={prog.hash}").json()["winners"]}
    assert winners[measured]["machines"] == ran and winners[older]["machines"] is None
    rows = c.get(f"{API}/measurements?program={prog.hash}&sizes=N=16384").json()
    assert len(rows) == 2 and all(r["machines"] == ran for r in rows)
    predicted = _winner(store, prog, 2**20, 1e-3, "model", versions={"model": "alpha-beta roofline", **ran})
    body = c.get(f"{API}/best?program={prog.hash}&sizes=N=1048576&topology=local").json()
    assert body["winner_id"] == predicted and body["machines"] is None  # a prediction ran nowhere
