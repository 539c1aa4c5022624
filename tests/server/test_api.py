"""The REST API: a held-out program posted and tuned end to end by the server's worker, /best and its
nearest-size fallback, generated code, a corpus of bad requests (each a 4xx with a message, the server
still serving after it), restart recovery, and Schemathesis against the OpenAPI schema."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from fastapi.testclient import TestClient

from coconet.server.app import create_app
from coconet.server.limits import BodyLimit, json_depth
from coconet.server.records import NewMeasurement
from coconet.server.store import Store
from coconet.tuner.runner import Protocol

TOKEN = "t0ken-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HOSTS = ("testserver",)  # the Host TestClient and Schemathesis send
FAST = Protocol(warmup=1, min_repeats=5, max_repeats=10, max_time_s=1.0, kernels="eager", timeout_s=60.0)
API = "/api/v1"


def held_out_program() -> Any:
    """Not one of the examples: SGD on an exponential moving average of the averaged gradient."""
    from coconet import Local, Program, Replicated, allreduce

    p = Program("ema_sgd", dims=("N",))
    g = p.tensor("g", ("N",), layout=Local)
    w = p.tensor("w", ("N",), layout=Replicated)
    avg = p.tensor("avg", ("N",), layout=Replicated)
    lr, beta = p.scalars("lr beta")
    avg1 = beta * avg + (1 - beta) * allreduce(g)
    p.update(avg, avg1)
    p.update(w, w - lr * avg1)
    return p.ir


def ir_of(program: Any) -> dict[str, Any]:
    from coconet.schedules.serialize import to_dict

    return to_dict(program)


@pytest.fixture
def client(db_url: str) -> Iterator[TestClient]:
    with TestClient(create_app(db_url, token=TOKEN, hosts=HOSTS, start_workers=False)) as c:
        yield c


def _seed_winner(store: Store, prog: Any, n: int) -> tuple[str, str]:
    """Baseline and a transformed schedule measured at N=n, the transformed one the winner; their hashes."""
    from coconet.schedules.space import generate

    base, other = list(generate(prog, depth=1))[:2]
    common = dict(sizes={"N": n}, topology="local", world=2, backend="gloo", samples=[1e-3] * 5, n=5)
    ids = store.add_measurements(
        [
            NewMeasurement.of(base, median_s=2e-3, ci_lo_s=1.9e-3, ci_hi_s=2.1e-3, **common),
            NewMeasurement.of(other, median_s=1e-3, ci_lo_s=0.9e-3, ci_hi_s=1.1e-3, **common),
        ]
    )
    store.add_winner(ids[1], runner_up_id=ids[0], baseline_id=ids[0])
    return base.hash, other.hash


# -- end to end: posted, tuned by the server's worker on Ray, served


@pytest.mark.slow
def test_a_posted_program_is_tuned_by_a_job_and_served(ray_local, tmp_path: Path) -> None:
    app = create_app(f"sqlite:///{tmp_path / 'api.db'}", token=TOKEN, hosts=HOSTS, workers=1, protocol=FAST)
    prog = held_out_program()
    with TestClient(app) as c:
        r = c.post(f"{API}/programs", json=ir_of(prog), headers=AUTH)
        assert r.status_code == 201, r.text
        h = r.json()["hash"]
        assert h == prog.hash
        r = c.post(
            f"{API}/jobs",
            json={
                "program": h,
                "sizes": {"N": 2000},
                "topology": "local",
                "world": 2,
                "budget": 2,
                "backends": ["gloo"],
            },
            headers=AUTH,
        )
        assert r.status_code == 202, r.text
        job_id = r.json()["id"]
        deadline = time.monotonic() + 240
        while True:
            job = c.get(f"{API}/jobs/{job_id}").json()
            if job["state"] in ("done", "failed") or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert job["state"] == "done", job
        assert job["progress"]["done"] == 2
        result = job["result"]

        best = c.get(f"{API}/best", params={"program": h, "sizes": "N=2000", "topology": "local", "world": 2})
        assert best.status_code == 200, best.text
        b = best.json()
        assert b["exact"] is True and b["distance"] == 0
        assert (b["schedule_hash"], b["backend"]) == (result["best"]["hash"], result["best"]["backend"])
        assert b["schedule"] == result["best"]["schedule"]
        assert b["stats"]["n"] >= 5 and b["stats"]["ci95_s"][0] <= b["stats"]["median_s"] <= b["stats"]["ci95_s"][1]
        assert b["baseline"] is not None and b["source"] == "measured"

        near = c.get(f"{API}/best", params={"program": h, "sizes": "N=8000", "world": 2}).json()
        assert near["exact"] is False and near["distance"] == pytest.approx(2.0)
        assert near["tuned_sizes"] == {"N": 2000} and near["schedule_hash"] == b["schedule_hash"]

        code = c.get(f"{API}/schedules/{b['schedule_hash']}/code", params={"backend": "gloo"})
        assert code.status_code == 200, code.text
        assert "def step(" in code.json()["source"]

        assert [w["schedule_hash"] for w in c.get(f"{API}/results", params={"program": h}).json()["winners"]] == [
            b["schedule_hash"]
        ]
        assert len(c.get(f"{API}/measurements", params={"program": h}).json()) >= 2
        assert [j["id"] for j in c.get(f"{API}/jobs", params={"program": h}).json()] == [job_id]


# -- /best and code on both backends, without Ray


def test_best_exact_nearest_and_code(client: TestClient) -> None:
    prog = held_out_program()
    h = client.post(f"{API}/programs", json=ir_of(prog), headers=AUTH).json()["hash"]
    base_hash, win_hash = _seed_winner(client.app.state.store, prog, 1024)

    b = client.get(f"{API}/best", params={"program": h, "sizes": "N=1024", "topology": "local"}).json()
    assert (b["exact"], b["schedule_hash"], b["backend"], b["source"]) == (True, win_hash, "gloo", "measured")
    assert b["stats"] == {"median_s": 1e-3, "ci95_s": [0.9e-3, 1.1e-3], "n": 5}
    assert b["speedup"] == pytest.approx(2.0)
    assert b["runner_up"]["schedule_hash"] == b["baseline"]["schedule_hash"] == base_hash

    near = client.get(f"{API}/best", params={"program": h, "sizes": "N=2^14", "world": 2}).json()
    assert (near["exact"], near["distance"], near["sizes"], near["tuned_sizes"]) == (
        False,
        4.0,
        {"N": 16384},
        {"N": 1024},
    )
    missing = client.get(f"{API}/best", params={"program": h, "sizes": "N=1024", "world": 4})
    assert missing.status_code == 404 and "nothing tuned" in missing.json()["detail"]

    ask = {"program": h, "sizes": {"N": 4096}, "world": 2}
    started = client.post(f"{API}/best", json={**ask, "budget": 2}, headers=AUTH)
    assert started.status_code == 202, started.text
    assert started.json()["nearest"]["exact"] is False
    again = client.post(f"{API}/best", json=ask, headers=AUTH)
    assert again.json()["job"] == started.json()["job"]  # asked twice, tuned once
    assert client.get(f"{API}/jobs/{started.json()['job']}").json()["state"] == "queued"
    exact = client.post(f"{API}/best", json={**ask, "sizes": {"N": 1024}}, headers=AUTH)
    assert exact.status_code == 200 and exact.json()["schedule_hash"] == win_hash  # tuned already: no job
    assert [j["id"] for j in client.get(f"{API}/jobs", params={"program": h}).json()] == [started.json()["job"]]

    code = client.get(f"{API}/schedules/{win_hash}/code", params={"backend": "gloo"})
    assert code.status_code == 200 and "def step(" in code.json()["source"]
    shm = client.get(f"{API}/schedules/{win_hash}/code", params={"backend": "shm", "kernels": "eager"})
    assert shm.status_code == 200 and "def step(" in shm.json()["source"]


def test_best_answers_only_for_the_state_the_question_lets_stay_sharded(client: TestClient) -> None:
    from coconet.schedules.space import generate

    prog = held_out_program()
    h = client.post(f"{API}/programs", json=ir_of(prog), headers=AUTH).json()["hash"]
    space = list(generate(prog))
    base, zero = space[0], next(s for s in space if s.sharded)
    common = dict(sizes={"N": 512}, topology="local", world=2, backend="shm", samples=[1e-3] * 3, n=3)
    store = client.app.state.store
    ids = store.add_measurements(
        [NewMeasurement.of(base, median_s=2e-3, **common), NewMeasurement.of(zero, median_s=1e-3, **common)]
    )
    store.add_winner(ids[1], runner_up_id=ids[0], baseline_id=ids[0])  # a search over every schedule
    ask = {"program": h, "sizes": "N=512", "world": 2}
    # ema_sgd has no hand-written baseline: by default nothing may stay sharded
    miss = client.get(f"{API}/best", params=ask)
    assert miss.status_code == 404 and "leaves at most nothing sharded" in miss.json()["detail"]
    b = client.get(f"{API}/best", params={**ask, "shardable": "all"}).json()
    assert b["schedule"] == zero.text and b["sharded"] == sorted(zero.sharded) != []
    assert b["shardable"] == "all" and b["baseline"]["sharded"] == b["runner_up"]["sharded"] == []
    # the sharded state named: answered too, since the search that found it covered every schedule
    named = client.get(f"{API}/best", params={**ask, "shardable": ",".join(zero.sharded)}).json()
    assert named["schedule"] == zero.text
    # a newer search that kept everything whole answers the default, but not `all`: it never tried the rest
    store.add_winner(ids[0], baseline_id=ids[0], shardable="")
    whole = client.get(f"{API}/best", params=ask).json()
    assert whole["schedule"] == base.text and whole["shardable"] == [] and whole["sharded"] == []
    assert client.get(f"{API}/best", params={**ask, "shardable": "all"}).json()["schedule"] == zero.text
    bad = client.get(f"{API}/best", params={**ask, "shardable": "g"})
    assert bad.status_code == 422 and "shardable g: not replicated state ema_sgd updates" in bad.json()["detail"]


# -- the hot path of /best: the same answers as the route, and nothing stale


def test_the_fast_path_answers_as_the_route_does(db_url: str, monkeypatch) -> None:
    """Plain /best requests are answered by FastBest; every request gets the bytes the route alone would send."""
    from coconet.server import app as app_module
    from coconet.server import fastbest

    fast = create_app(db_url, token=TOKEN, hosts=HOSTS, start_workers=False)
    route = create_app(db_url, token=TOKEN, hosts=HOSTS, start_workers=False)
    route.user_middleware = [m for m in route.user_middleware if m.cls is not app_module.FastBest]
    prog = held_out_program()
    fast.state.store.add_program(prog)
    _seed_winner(fast.state.store, prog, 1024)
    h = prog.hash
    answered = []
    plain = fastbest._plain_best

    def counted(state: Any, query: bytes) -> bytes | None:
        body = plain(state, query)
        answered.append(body is not None)
        return body

    monkeypatch.setattr(fastbest, "_plain_best", counted)
    cases = {  # query -> whether the fast path answers it
        f"program={h}&sizes=N=1024": True,
        f"program={h}&sizes=N%3D2%5E10&topology=local&world=2&backend=gloo&other=ignored": True,
        f"program={h}&sizes=N=2^14&world=2": True,  # the nearest tuned size
        f"program={h}&sizes=N=3": True,
        f"program={h}&sizes=N=1024&shardable=all": True,
        f"program={h}&sizes=N=1024&shardable=avg,w": True,
        f"program={h}&sizes=N=1024&shardable=": True,
        f"program={h}&sizes=N=1024&shardable=g": False,  # not state the program updates: 422
        f"program={h}&sizes=N=1024&shardable=w;x": False,  # 422
        f"program={h}&sizes=N=1024&world=02": False,  # the route's to coerce
        f"program={h}&sizes=N=1024&tune=false": False,
        f"program={h}&sizes=N=1024&budget=32": False,
        f"program={h}&program={h}&sizes=N=1024": False,
        f"program={h}&sizes=N=1024&world=4": False,  # nothing tuned: 404
        f"program={h}&sizes=M=4": False,  # wrong dims: 422
        f"program={h}&sizes=N=2^41": False,
        f"program={h}&sizes=N=1024&topology=": False,
        f"program={'f' * 16}&sizes=N=1024": False,
        f"program={h.upper()}&sizes=N=1024": False,
        "sizes=N=1024": False,
    }
    with TestClient(fast) as f, TestClient(route) as r:
        for query, expected in cases.items():
            answered.clear()
            got, want = f.get(f"{API}/best?{query}"), r.get(f"{API}/best?{query}")
            assert (got.status_code, got.content) == (want.status_code, want.content), query
            assert got.headers["content-type"] == want.headers["content-type"], query
            assert answered == [expected], query
        assert f.get(f"{API}/best?program={h}&sizes=N=1024").json()["exact"] is True


def test_a_new_winner_is_served_at_once(db_url: str, monkeypatch) -> None:
    """Nothing between /best and the store keeps an answer: a winner the server's own job worker records is the
    answer of the next request, and so is one another process records."""
    from coconet.schedules.space import generate
    from coconet.server.records import Progress

    prog = held_out_program()
    base, other, third = list(generate(prog, depth=1))[:3]
    common = dict(sizes={"N": 1024}, topology="local", world=2, backend="gloo", samples=[1e-3] * 5, n=5)

    def tune(request: Any, store: Store, *, job_id: int, on_progress: Any, prior: Any) -> list:
        mid = store.add_measurement(NewMeasurement.of(other, median_s=5e-4, job_id=job_id, **common))
        store.add_winner(mid, job_id=job_id)
        store.update_job(job_id, state="done", progress=Progress(done=1, total=1))
        return []

    monkeypatch.setattr("coconet.tuner.tune.tune", tune)
    app = create_app(db_url, token=TOKEN, hosts=HOSTS, workers=1, protocol=FAST)
    with TestClient(app) as c:
        c.post(f"{API}/programs", json=ir_of(prog), headers=AUTH)
        store = app.state.store
        store.add_winner(store.add_measurement(NewMeasurement.of(base, median_s=1e-3, **common)))
        ask = f"{API}/best?program={prog.hash}&sizes=N=1024&world=2"
        assert c.get(ask).json()["schedule_hash"] == base.hash
        job = c.post(
            f"{API}/jobs", json={"program": prog.hash, "sizes": {"N": 1024}, "world": 2, "budget": 1}, headers=AUTH
        ).json()["id"]
        assert _wait_for(store, job, "done").state == "done"
        assert c.get(ask).json()["schedule_hash"] == other.hash
        with Store.open(db_url) as elsewhere:
            elsewhere.add_winner(elsewhere.add_measurement(NewMeasurement.of(third, median_s=4e-4, **common)))
        assert c.get(ask).json()["schedule_hash"] == third.hash


# -- bad requests


def _corpus(h: str) -> list[tuple[str, str, str, dict[str, Any], int]]:
    good_ir = ir_of(held_out_program())
    unknown_op = json.loads(json.dumps(good_ir))
    unknown_op["statements"][-1]["op"] = "teleport"
    deep = "[" * 10_000 + "]" * 10_000
    deep_ir = json.loads(json.dumps(good_ir))
    deep_ir["statements"][0]["attrs"]["shape"] = "@@"
    deep_text = json.dumps(deep_ir).replace('"@@"', "[" * 5000 + "]" * 5000)

    def shaped(length: int) -> dict[str, Any]:  # every shape the same, so only its length can be wrong
        ir = json.loads(json.dumps(good_ir))
        for s in ir["statements"]:
            if "shape" in s.get("attrs", {}):
                s["attrs"]["shape"] = [length]
        return ir

    huge_const = json.loads(json.dumps(good_ir))
    next(s for s in huge_const["statements"] if s["op"] == "const")["attrs"]["value"] = 2**100
    job = {"program": h, "sizes": {"N": 1024}, "world": 2, "budget": 2}
    best = {"program": h, "sizes": {"N": 1024}, "world": 2}
    post, get = "POST", "GET"
    big = b"x" * (64 * 2**20)
    return [
        ("no token", post, "/programs", dict(json=good_ir), 401),
        ("wrong token", post, "/programs", dict(json=good_ir, headers={"Authorization": "Bearer nope"}), 401),
        ("basic auth", post, "/programs", dict(json=good_ir, headers={"Authorization": f"Basic {TOKEN}"}), 401),
        ("no token for a job", post, "/jobs", dict(json=job), 401),
        ("no token to tune", post, "/best", dict(json={**best, "sizes": {"N": 4096}}), 401),
        (
            "tune by GET",
            get,
            "/best",
            dict(params={"program": h, "sizes": "N=4096", "world": 2, "tune": "true"}, headers=AUTH),
            400,
        ),
        ("tune by GET, even false", get, "/best", dict(params={"program": h, "sizes": "N=4", "tune": "false"}), 400),
        ("POST best without world", post, "/best", dict(json={"program": h, "sizes": {"N": 4}}, headers=AUTH), 422),
        ("POST best sizes as text", post, "/best", dict(json={**best, "sizes": "N=4"}, headers=AUTH), 422),
        ("POST best wrong dim", post, "/best", dict(json={**best, "sizes": {"M": 4}}, headers=AUTH), 422),
        ("POST best unknown program", post, "/best", dict(json={**best, "program": "0" * 16}, headers=AUTH), 404),
        ("POST best remote topology", post, "/best", dict(json={**best, "topology": "dgx2"}, headers=AUTH), 400),
        ("broken JSON", post, "/programs", dict(content=b'{"version": 1, "name": ', headers=AUTH), 422),
        ("not JSON at all", post, "/programs", dict(content=b"\xff\xfe\x00garbage", headers=AUTH), 422),
        ("unknown op", post, "/programs", dict(json=unknown_op, headers=AUTH), 422),
        ("wrong types", post, "/programs", dict(json={**good_ir, "statements": "x"}, headers=AUTH), 422),
        ("wrong version", post, "/programs", dict(json={**good_ir, "version": 99}, headers=AUTH), 422),
        # no coercion: the store would keep another IR than the one sent
        ("version as text", post, "/programs", dict(json={**good_ir, "version": "1"}, headers=AUTH), 422),
        ("version as true", post, "/programs", dict(json={**good_ir, "version": True}, headers=AUTH), 422),
        ("version 0", post, "/programs", dict(json={**good_ir, "version": 0}, headers=AUTH), 422),
        ("version 2^64", post, "/programs", dict(json={**good_ir, "version": 2**64}, headers=AUTH), 422),
        ("shapes of 2^1000", post, "/programs", dict(json=shaped(2**1000), headers=AUTH), 422),  # was stored
        ("shapes over 2^40", post, "/programs", dict(json=shaped(2**40 + 1), headers=AUTH), 422),
        ("const of 2^100", post, "/programs", dict(json=huge_const, headers=AUTH), 422),
        ("job size true", post, "/jobs", dict(json={**job, "sizes": {"N": True}}, headers=AUTH), 422),
        ("job world as text", post, "/jobs", dict(json={**job, "world": "2"}, headers=AUTH), 422),
        ("extra key", post, "/programs", dict(json={**good_ir, "exec": "rm -rf /"}, headers=AUTH), 422),
        ("huge name", post, "/programs", dict(json={**good_ir, "name": "a" * 5000}, headers=AUTH), 422),
        (
            "too many statements",
            post,
            "/programs",
            dict(json={**good_ir, "statements": good_ir["statements"] * 200}, headers=AUTH),
            422,
        ),
        ("64 MiB body", post, "/programs", dict(content=big, headers=AUTH), 413),
        ("10,000 levels", post, "/programs", dict(content=deep.encode(), headers=AUTH), 400),
        ("deep attrs", post, "/programs", dict(content=deep_text.encode(), headers=AUTH), 400),
        ("job wrong types", post, "/jobs", dict(json={**job, "world": "two"}, headers=AUTH), 422),
        ("job sizes 2^80", post, "/jobs", dict(json={**job, "sizes": {"N": 2**80}}, headers=AUTH), 422),
        ("job size 0", post, "/jobs", dict(json={**job, "sizes": {"N": 0}}, headers=AUTH), 422),
        ("job too large to fit", post, "/jobs", dict(json={**job, "sizes": {"N": 2**40}}, headers=AUTH), 422),
        ("job size negative", post, "/jobs", dict(json={**job, "sizes": {"N": -4}}, headers=AUTH), 422),
        ("job wrong dim", post, "/jobs", dict(json={**job, "sizes": {"M": 4}}, headers=AUTH), 422),
        ("job 9 dims", post, "/jobs", dict(json={**job, "sizes": {f"D{i}": 2 for i in range(9)}}, headers=AUTH), 422),
        ("world 0", post, "/jobs", dict(json={**job, "world": 0}, headers=AUTH), 422),
        ("world 10^6", post, "/jobs", dict(json={**job, "world": 10**6}, headers=AUTH), 422),
        ("budget 10^9", post, "/jobs", dict(json={**job, "budget": 10**9}, headers=AUTH), 422),
        ("remote topology", post, "/jobs", dict(json={**job, "topology": "dgx2"}, headers=AUTH), 400),
        ("missing backend", post, "/jobs", dict(json={**job, "backends": ["nccl"]}, headers=AUTH), 400),
        ("job of an unknown program", post, "/jobs", dict(json={**job, "program": "0" * 16}, headers=AUTH), 404),
        ("job shardable not state", post, "/jobs", dict(json={**job, "shardable": ["g"]}, headers=AUTH), 422),
        ("job shardable not a name", post, "/jobs", dict(json={**job, "shardable": ["m;v"]}, headers=AUTH), 422),
        ("job shardable a word", post, "/jobs", dict(json={**job, "shardable": "every"}, headers=AUTH), 422),
        ("best N=2^80", get, "/best", dict(params={"program": h, "sizes": "N=2^80"}), 422),
        ("best N huge", get, "/best", dict(params={"program": h, "sizes": f"N={2**80}"}), 422),
        ("best N negative", get, "/best", dict(params={"program": h, "sizes": "N=-5"}), 422),
        ("best N=0", get, "/best", dict(params={"program": h, "sizes": "N=0"}), 422),
        ("best garbage sizes", get, "/best", dict(params={"program": h, "sizes": "N==;DROP"}), 422),
        ("best world 10^6", get, "/best", dict(params={"program": h, "sizes": "N=4", "world": 10**6}), 422),
        ("best unknown program", get, "/best", dict(params={"program": "f" * 16, "sizes": "N=4"}), 404),
        ("best not a hash", get, "/best", dict(params={"program": "../etc", "sizes": "N=4"}), 422),
        ("best shardable not state", get, "/best", dict(params={"program": h, "sizes": "N=4", "shardable": "g"}), 422),
        ("best shardable garbage", get, "/best", dict(params={"program": h, "sizes": "N=4", "shardable": "m v"}), 422),
        ("unknown program", get, f"/programs/{'a' * 16}", {}, 404),
        ("unknown job", get, "/jobs/987654", {}, 404),
        ("job id 0", get, "/jobs/0", {}, 422),
        ("job id 2^70", get, f"/jobs/{2**70}", {}, 422),
        ("job id text", get, "/jobs/abc", {}, 422),
        ("unknown schedule", get, f"/schedules/{'b' * 16}/code", {}, 404),
        ("unknown backend", get, f"/schedules/{'b' * 16}/code", dict(params={"backend": "mpi"}), 422),
        ("best sizes 000", get, "/best", dict(params={"program": h, "sizes": "000"}), 422),
        ("measurements after 2^63", get, "/measurements", dict(params={"program": h, "after": 2**63}), 422),
        # a 500 (OverflowError in the database driver) before ids were bounded
        ("dashboard measurement 2^63", get, f"/dashboard/programs/{h}/code", dict(params={"measurement": 2**63}), 422),
        ("dashboard not a hash", get, "/dashboard/programs/DROP%20TABLE", {}, 422),
        # the largest ids the schema allows reach the database, and are not there
        ("job id 2^31-1", get, f"/jobs/{2**31 - 1}", {}, 404),
        ("job id 2^31", get, f"/jobs/{2**31}", {}, 422),
        (
            "dashboard measurement 2^31-1",
            get,
            f"/dashboard/programs/{h}/code",
            dict(params={"measurement": 2**31 - 1}),
            404,
        ),
        ("results of an unknown program", get, "/results", dict(params={"program": "c" * 16}), 404),
    ]


def test_bad_requests_get_a_4xx_with_a_message_and_the_server_goes_on(client: TestClient) -> None:
    h = client.post(f"{API}/programs", json=ir_of(held_out_program()), headers=AUTH).json()["hash"]
    wrong = []
    for name, method, path, kwargs, status in _corpus(h):
        r = client.request(method, API + path, **kwargs)
        detail = r.json().get("detail") if r.headers.get("content-type") == "application/json" else None
        if r.status_code != status or not detail:
            wrong.append(f"{name}: {r.status_code} {r.text[:200]}")
        ok = client.get(f"{API}/programs/{h}")
        assert ok.status_code == 200, f"after {name}: {ok.status_code}"
    assert not wrong, "\n".join(wrong)


def test_refusals_are_documented_and_say_why_in_one_line(client: TestClient) -> None:
    h = client.post(f"{API}/programs", json=ir_of(held_out_program()), headers=AUTH).json()["hash"]
    schema = client.get("/openapi.json").json()
    assert "HTTPValidationError" not in json.dumps(schema)  # FastAPI's 422 body, which the API does not send
    for path, item in schema["paths"].items():
        for method, op in item.items():
            for status, response in op["responses"].items():
                if int(status) >= 400:
                    assert response["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorOut"), (
                        method,
                        path,
                        status,
                    )
    r = client.options(f"{API}/programs")
    assert r.status_code == 405 and r.headers["allow"] == "GET, POST" and "GET, POST" in r.json()["detail"]
    assert client.put(f"{API}/jobs/1").headers["allow"] == "GET"
    r = client.get(f"{API}/best", params={"program": h, "sizes": "N=0"})
    assert r.json()["detail"].startswith("query.sizes: 'N=0' is not NAME=VALUE")
    assert r.json()["errors"][0]["loc"] == ["query", "sizes"]
    ir = ir_of(held_out_program())
    ir["statements"][0]["attrs"]["shape"] = [2**41]  # of a union's alternatives, the bound it missed
    detail = client.post(f"{API}/programs", json=ir, headers=AUTH).json()["detail"]
    assert detail == f"body.statements.0.attrs.shape.0: Input should be less than or equal to {2**40}, not {2**41}"
    # JSON Schema's integer is a number without a fraction, 1.0 too: the schema allows it, so the API takes it
    r = client.post(f"{API}/programs", json={**ir_of(held_out_program()), "version": 1.0}, headers=AUTH)
    assert r.status_code == 201 and r.json()["hash"] == h


def test_unknown_schedule_backend_is_refused_for_a_known_schedule(client: TestClient) -> None:
    prog = held_out_program()
    client.post(f"{API}/programs", json=ir_of(prog), headers=AUTH)
    _, win = _seed_winner(client.app.state.store, prog, 64)
    r = client.get(f"{API}/schedules/{win}/code", params={"backend": "mpi"})
    assert r.status_code == 422 and "mpi" in r.json()["detail"]


def test_a_streamed_body_is_cut_off_at_the_limit() -> None:
    import asyncio

    reached = []
    sent: list[dict] = []

    async def app(scope, receive, send):  # pragma: no cover - must not be reached
        reached.append(scope)

    chunks = iter([{"type": "http.request", "body": b"x" * 2**20, "more_body": True}] * 64)
    pulled = 0

    async def receive():
        nonlocal pulled
        pulled += 1
        return next(chunks)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "headers": [(b"content-type", b"application/json")]}
    asyncio.run(BodyLimit(app, max_body=2**20)(scope, receive, send))
    assert sent[0]["status"] == 413 and not reached
    assert pulled == 2  # one chunk at the limit, one past it: the other 62 MiB never read
    assert json_depth(b'{"a": "[[[[", "b": [[1], {"c": []}]}') == 4


# -- restart


def test_a_job_left_running_is_requeued_when_the_server_starts(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'restart.db'}"
    prog = held_out_program()
    with Store.open(url) as store:
        store.add_program(prog)
        left = store.create_job(prog.hash, {"N": 1024}, "local", 2, budget=2)
        store.claim_job(left)
    with TestClient(create_app(url, token=TOKEN, hosts=HOSTS, start_workers=False, stale_s=0)) as c:
        job = c.get(f"{API}/jobs/{left}").json()
        assert job["state"] == "queued" and "stopped" in job["error"]
    # With the default staleness a job whose driver beat recently (e.g. `coconet tune` sharing the database)
    # is left alone.
    with Store.open(url) as store:
        store.claim_job(left)
    with TestClient(create_app(url, token=TOKEN, hosts=HOSTS, start_workers=False)) as c:
        assert c.get(f"{API}/jobs/{left}").json()["state"] == "running"
    # ... unless its driver, a process of this machine, has ended: then it is queued again at once
    from coconet.server.driver import Driver, this_process

    me = this_process()
    with Store.open(url) as store:
        store.update_job(left, state="interrupted")
        store.update_job(left, state="queued")
        store.claim_job(left, driver=Driver(me.host, me.machine, 2**22 + 1, "1").text)
    with TestClient(create_app(url, token=TOKEN, hosts=HOSTS, start_workers=False)) as c:
        assert c.get(f"{API}/jobs/{left}").json()["state"] == "queued"
    with Store.open(url) as store:  # the server's own process, beating: left alone
        store.claim_job(left, driver=me.text)
    with TestClient(create_app(url, token=TOKEN, hosts=HOSTS, start_workers=False)) as c:
        job = c.get(f"{API}/jobs/{left}", headers=AUTH).json()
        assert job["state"] == "running" and job["driver"] == f"pid {me.pid} on {me.host}"
        assert c.get(f"{API}/jobs/{left}").json()["driver"] is None  # pid and host name: for the token's holder
    with Store.open(url) as store:  # a driver text this version cannot read: shown as unknown, not a 500
        store.update_job(left, state="interrupted")
        store.update_job(left, state="queued")
        store.claim_job(left, driver="garbled")
    with TestClient(create_app(url, token=TOKEN, hosts=HOSTS, start_workers=False)) as c:
        assert c.get(f"{API}/jobs/{left}", headers=AUTH).json()["driver"] is None


def test_a_running_job_beats_until_its_block_ends(tmp_path: Path) -> None:
    from coconet.server.leases import heartbeat

    prog = held_out_program()
    with Store.open(f"sqlite:///{tmp_path / 'beat.db'}") as store:
        store.add_program(prog)
        job = store.create_job(prog.hash, {"N": 1024}, "local", 2, budget=2)
        store.claim_job(job)
        first = store.job(job).heartbeat_at
        with heartbeat(store, job, every_s=0.02):
            deadline = time.monotonic() + 10
            while store.job(job).heartbeat_at == first and time.monotonic() < deadline:
                time.sleep(0.02)
            assert store.job(job).heartbeat_at > first  # beat from its thread, nothing else wrote the job
        last = store.job(job).heartbeat_at
        time.sleep(0.1)
        assert store.job(job).heartbeat_at == last  # the thread ended with the block
        store.update_job(job, state="done")
        with heartbeat(store, job, every_s=0.02):  # a finished job: the beat stops without raising
            time.sleep(0.1)


# -- Schemathesis


SCHEMATHESIS_TOML = Path(__file__).with_name("schemathesis.toml")


def _schemathesis(app: Any, headers: dict[str, str], examples: int) -> tuple[int, set[str], dict[str, str]]:
    """Schemathesis' run on the app as `schemathesis run --checks all` makes it (its coverage, fuzzing and stateful
    phases, every check), with tests/server/schemathesis.toml, derandomized: the cases sent, the operations
    tested, and each distinct failure with a request that shows it. (The engine, not the pytest plugin: the
    plugin cannot load a schema from a fixture under pytest 9, and walks no coverage or stateful phase.)"""
    import schemathesis
    import tomllib
    from schemathesis.engine import events, from_schema

    settings = tomllib.loads(SCHEMATHESIS_TOML.read_text())
    config = schemathesis.Config.from_dict(
        {
            **settings,
            "headers": headers,
            "seed": 1,
            "suppress-health-check": ["all"],
            "generation": {"max-examples": examples, "deterministic": True},
        }
    )
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=config)
    cases, labels, failures = 0, set(), {}
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            cases += len(event.recorder.cases)
            labels.add(event.recorder.label)
            for checks in event.recorder.checks.values():
                for check in checks:
                    if check.failure_info is not None:
                        title = f"{event.recorder.label}: {check.name}: {check.failure_info.failure.title}"
                        failures.setdefault(title, check.failure_info.code_sample)
        elif isinstance(event, (events.NonFatalError, events.FatalError)):
            failures[f"schemathesis could not run: {event}"] = ""
    return cases, labels, failures


def test_schemathesis_finds_no_failure(db_url: str) -> None:
    """Every operation and check, 20 examples an operation and phase, with the token and without, and on an open
    server (no token, writes taken), on SQLite; with the token on PostgreSQL too (their integers differ; who may
    write does not depend on the database): no 5xx, every status and body as documented, what the schema allows
    taken and what it forbids refused, the right Allow.
    object_level_authorization does not run: it needs two identities, and the API has one token. The exceptions
    to positive_data_acceptance, and why, are in tests/server/schemathesis.toml."""
    app = create_app(db_url, token=TOKEN, hosts=HOSTS, start_workers=False)
    prog = held_out_program()
    app.state.store.add_program(prog)
    _seed_winner(app.state.store, prog, 1024)
    open_app = create_app(db_url, hosts=HOSTS, start_workers=False, open_writes=True)
    found = []
    ways = (("with the token", app, AUTH), ("without a token", app, {}), ("open, without a token", open_app, {}))
    for name, served, headers in ways if db_url.startswith("sqlite") else ways[:1]:
        cases, labels, failures = _schemathesis(served, headers, examples=20)
        found += [f"{name}: {title}\n{sample}" for title, sample in failures.items()]
        assert {
            "POST /api/v1/programs",
            "POST /api/v1/jobs",
            "GET /api/v1/best",
            "GET /api/v1/dashboard/programs/{program_hash}/code",
        } <= labels
        assert cases > 1000
    assert not found, "\n\n".join(found)


# -- workers, without Ray: tune replaced by a stand-in that behaves as tune does with its job row


def _fake_tune(behaviour: str):
    def fake(request: Any, store: Store, *, job_id: int, on_progress: Any, prior: Any) -> list:
        from coconet.errors import CoconetError
        from coconet.server.records import Progress

        if behaviour == "refused":
            raise CoconetError("backend nccl cannot run here")  # before the search: the job is still running
        try:
            for i in range(2000):
                store.update_job(job_id, progress=Progress(done=min(i, 1), total=2))
                on_progress(dict(request.sizes[0]), None)
                time.sleep(0.01)
        except BaseException as e:  # as tune does: the job is recorded interrupted, then re-raised
            store.update_job(
                job_id,
                state="interrupted" if isinstance(e, KeyboardInterrupt) else "failed",
                error=f"{type(e).__name__}: {e}",
            )
            raise
        return []

    return fake


def _worker_store(tmp_path: Path) -> tuple[Store, int]:
    store = Store.open(f"sqlite:///{tmp_path / 'workers.db'}")
    prog = held_out_program()
    store.add_program(prog)
    return store, store.create_job(prog.hash, {"N": 1024}, "local", 2, budget=2)


def _wait_for(store: Store, job_id: int, state: str, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while (job := store.job(job_id)).state != state and time.monotonic() < deadline:
        time.sleep(0.02)
    return job


def test_a_stopping_server_puts_its_running_job_back_in_the_queue(tmp_path: Path, monkeypatch) -> None:
    from coconet.server.jobs import Workers, WorkerSettings

    monkeypatch.setattr("coconet.tuner.tune.tune", _fake_tune("runs"))
    store, job_id = _worker_store(tmp_path)
    pool = Workers(store, WorkerSettings(workers=1, poll_s=0.05, protocol=FAST))
    pool.start()
    assert _wait_for(store, job_id, "running").state == "running"
    deadline = time.monotonic() + 20  # a trial finished before the stop: its progress must survive it
    while store.job(job_id).progress.done < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    pool.stop(timeout=20)
    job = store.job(job_id)
    assert job.state == "queued" and job.progress.done == 1
    store.close()


def test_a_job_the_tuner_refuses_is_failed_with_its_reason(tmp_path: Path, monkeypatch) -> None:
    from coconet.server.jobs import Workers, WorkerSettings

    monkeypatch.setattr("coconet.tuner.tune.tune", _fake_tune("refused"))
    store, job_id = _worker_store(tmp_path)
    pool = Workers(store, WorkerSettings(workers=1, poll_s=0.05, protocol=FAST))
    pool.start()
    job = _wait_for(store, job_id, "failed")
    pool.stop(timeout=5)
    assert job.state == "failed" and job.error == "backend nccl cannot run here"
    store.close()
