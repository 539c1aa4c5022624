"""The results store, the same tests on SQLite and on PostgreSQL (see conftest.py)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path

import pytest
from sqlalchemy import create_engine, event, inspect, text

from coconet import Program, Replicated
from coconet.errors import KeyBusy, StoreError
from coconet.loader import load_file
from coconet.schedules.schedule import sharded_by
from coconet.schedules.serialize import load, to_dict
from coconet.schedules.shardable import answers
from coconet.schedules.space import generate
from coconet.server.keys import parse_sizes_key, size_distance, sizes_key
from coconet.server.models import VERSION_TABLE, Base, include_name
from coconet.server.records import MeasurementDigest
from coconet.server.store import (
    ENV_URL,
    SCHEMA_HEAD,
    DoneKey,
    NewMeasurement,
    Progress,
    Store,
    alembic_config,
    default_url,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def adam():
    return load_file(EXAMPLES / "adam.py")


@pytest.fixture(scope="module")
def mlp():
    return load_file(EXAMPLES / "megatron_mlp.py")


@pytest.fixture
def store(db_url):
    with Store.open(db_url) as s:
        yield s


def measure(
    program_hash: str, sizes: dict, schedule: str = "baseline", median_s: float | None = 1e-3, **fields
) -> NewMeasurement:
    defaults = dict(topology="local", world=2, backend="gloo", schedule_hash=f"h-{schedule}", samples=[median_s] * 3)
    return NewMeasurement(
        program_hash=program_hash, sizes=sizes, schedule=schedule, median_s=median_s, **{**defaults, **fields}
    )


def win(store: Store, program_hash: str, sizes: dict, median_s: float, **fields) -> int:
    mid = store.add_measurement(measure(program_hash, sizes, f"s{median_s}", median_s, **fields))
    return store.add_winner(mid)


# -- keys


def test_sizes_key_is_canonical():
    assert sizes_key({"S": 512, "B": 4, "H": 1024}) == "B=4,H=1024,S=512"
    assert parse_sizes_key("B=4,H=1024,S=512") == {"B": 4, "H": 1024, "S": 512}
    assert size_distance({"B": 4, "S": 512}, {"B": 8, "S": 128}) == 3.0
    assert size_distance({"N": 4}, {"M": 4}) is None
    for bad in ({"N": 0}, {"N": 2.5}, {"N": True}, {"a,b": 1}):
        with pytest.raises(StoreError):
            sizes_key(bad)


# -- programs, topologies


def test_programs_are_idempotent_and_round_trip(store, adam):
    h = store.add_program(adam)
    assert h == adam.hash
    assert store.add_program(adam) == h
    rec = store.program(h)
    assert rec.name == "adam" and rec.ir == to_dict(adam)
    assert load(rec.ir).hash == h
    assert store.program("0" * 16) is None

    dsl = Program("scale", dims="N")
    x = dsl.tensor("x", "N", layout=Replicated)
    dsl.update(x, 2 * x)
    assert store.add_program(dsl) == dsl.ir.hash and store.program(dsl.ir.hash).name == "scale"
    with pytest.raises(StoreError, match="takes a Program"):
        store.add_program(to_dict(adam))


def test_topology_is_never_overwritten(store):
    fp = {"cpu": "x86", "cores": 16, "backends": ["gloo", "shm"], "links": {"intra": {"alpha_s": 1e-6}}}
    assert store.add_topology("local", fp, source="calibrate") == "local"
    store.add_topology("local", {**fp, "backends": ("gloo", "shm")}, source="calibrate")
    assert store.topology("local").fingerprint == fp
    with pytest.raises(StoreError, match="another fingerprint"):
        store.add_topology("local", {**fp, "cores": 8})
    assert store.topology("nowhere") is None


def test_unknown_program_hash_is_a_store_error(store, adam):
    with pytest.raises(StoreError, match="unknown program ffff") as err:
        store.add_measurement(measure("ffff", {"N": 1024}))
    assert err.value.program_hash == "ffff"
    with pytest.raises(StoreError, match="unknown program"):
        store.create_job("ffff", {"N": 1024}, "local", 2)
    h = store.add_program(adam)
    with pytest.raises(StoreError, match="no job 99"):
        store.add_measurement(measure(h, {"N": 1024}, job_id=99))
    with pytest.raises(StoreError, match="needs median_s"):
        store.add_measurement(measure(h, {"N": 1024}, median_s=None))
    with pytest.raises(StoreError, match="status"):
        store.add_measurement(measure(h, {"N": 1024}, status="slow"))
    assert store.measurements(h) == []


# -- jobs


def test_job_state_transitions(store, adam):
    h = store.add_program(adam)
    a = store.create_job(h, {"N": 2**20}, "local", 4, budget=16, backends=["gloo", "shm"])
    b = store.create_job(h, {"N": 2**22}, "local", 4)
    job = store.job(a)
    assert (job.state, job.sizes, job.backends) == ("queued", {"N": 2**20}, ["gloo", "shm"])
    assert job.progress == Progress(done=0, total=16)
    assert job.heartbeat_at is None

    with pytest.raises(StoreError, match="cannot go from queued to done"):
        store.update_job(a, state="done")
    assert store.claim_job().id == a  # oldest first
    assert store.claim_job(a) is None  # already taken
    running = store.update_job(a, progress=Progress(done=3, total=16, failed=1, best_s=2.5e-4))
    assert running.state == "running" and running.progress.best_s == 2.5e-4 and running.heartbeat_at is not None
    assert running.updated_at >= job.created_at

    done = store.update_job(a, state="done", result={"best": {"schedule": "baseline", "median_s": 2.5e-4}})
    assert done.result == {"best": {"schedule": "baseline", "median_s": 2.5e-4}}
    with pytest.raises(StoreError, match="is done"):
        store.update_job(a, progress=Progress(done=4))

    store.update_job(b, state="running")
    store.update_job(b, state="failed", error="worker group died")
    assert store.job(b).error == "worker group died"
    store.update_job(b, state="queued")  # retried
    assert store.job(b).error == "worker group died"  # why it is queued again
    assert [j.id for j in store.jobs(state="queued")] == [b]
    assert [j.id for j in store.jobs()] == [a, b]
    with pytest.raises(StoreError, match="not one of"):
        store.update_job(b, state="paused")
    with pytest.raises(StoreError, match="no job 404"):
        store.update_job(404, state="running")
    assert store.job(404) is None
    # running again, the old failure no longer describes it; a failure while it runs does, and stays
    assert store.claim_job(b).error is None
    assert store.update_job(b, error="trial 3 timed out").error == "trial 3 timed out"
    assert store.update_job(b, state="running").error == "trial 3 timed out"
    assert store.update_job(b, state="done").error is None


def test_a_requeued_job_drops_its_error_once_it_runs_again(store, adam):
    h = store.add_program(adam)
    for take in (lambda j: store.claim_job(j), lambda j: store.take_job(h, {"N": 2**20}, "local", 2)):
        j = store.create_job(h, {"N": 2**20}, "local", 2)
        store.claim_job(j)
        store.update_job(j, state="interrupted", error="the process running it stopped")
        assert store.update_job(j, state="queued").error == "the process running it stopped"
        taken = take(j)
        assert (taken.id, taken.state, taken.error) == (j, "running", None)
        store.update_job(j, state="done")
    j = store.create_job(h, {"N": 2**20}, "local", 2)
    store.claim_job(j)
    store.update_job(j, state="interrupted", error="stopped")
    assert store.update_job(j, state="running").error is None


def test_a_job_created_running_is_never_claimed(store, adam):
    """A tuner that runs its own job creates it taken: a service worker polling the same store cannot
    claim it between its creation and a claim."""
    h = store.add_program(adam)
    mine = store.create_job(h, {"N": 2**20}, "local", 2, budget=4, running=True)
    job = store.job(mine)
    assert job.state == "running" and job.heartbeat_at is not None
    assert store.claim_job() is None and store.claim_job(mine) is None
    queued = store.create_job(h, {"N": 2**21}, "local", 2)
    assert store.claim_job().id == queued


# -- measurements


def test_measurement_json_round_trips(store, adam):
    h = store.add_program(adam)
    schedule = max(generate(adam, depth=2), key=lambda s: len(s.transforms))
    samples = [1.2345678901234567e-05, 0.1 + 0.2, 3e-300]
    job = store.create_job(h, {"N": 2**20}, "local", 4)
    mid = store.add_measurement(
        NewMeasurement.of(
            schedule,
            sizes={"N": 2**20},
            topology="local",
            world=4,
            backend="shm",
            samples=samples,
            median_s=samples[0],
            ci_lo_s=1e-5,
            ci_hi_s=1.3e-5,
            max_rel_err=2e-7,
            versions={"torch": "2.4.0"},
            job_id=job,
        )
    )
    m = store.measurement(mid)
    assert m.samples == samples and m.n == 3
    assert m.sizes == {"N": 2**20} and m.sizes_key == "N=1048576"
    assert m.schedule == schedule.text and m.schedule_hash == schedule.hash
    assert m.schedule_json == json.loads(json.dumps(schedule.to_json()))
    assert m.knobs == schedule.knob_values
    assert m.versions == {"coconet": "0.1.0", "torch": "2.4.0"}
    assert (m.source, m.status, m.job_id) == ("measured", "ok", job)
    assert m.created_at.tzinfo is not None

    failed = store.add_measurement(
        measure(h, {"N": 2**20}, "x", median_s=None, status="compile_error", error="no kernel", samples=[])
    )
    assert store.measurement(failed).error == "no kernel"
    assert [x.id for x in store.measurements(h, job_id=job)] == [mid]
    assert [x.id for x in store.measurements(h, {"N": 2**20}, "local")] == [mid, failed]
    assert store.measurements(h, {"N": 2**20}, "dgx") == []


def test_bulk_insert_of_ten_thousand_rows(store, mlp):
    h = store.add_program(mlp)
    rows = [
        measure(
            h,
            {"B": 2 ** (i % 4), "S": 512, "H": 2 ** (10 + i % 5)},
            f"s{i}",
            1e-4 * (1 + i % 97),
            source="model",
            samples=[],
            topology="dgx-a100",
            world=8,
            backend="nccl",
        )
        for i in range(10_000)
    ]
    ids = store.add_measurements(rows)
    assert len(ids) == len(set(ids)) == 10_000 and ids == sorted(ids)
    assert store.measurement(ids[1234]).schedule == "s1234"
    assert len(store.measurements(h, topology="dgx-a100")) == 10_000
    assert len(store.measurements(h, {"B": 1, "S": 512, "H": 1024}, "dgx-a100")) == 500
    assert len(store.done_keys(h, source="model")) == 10_000
    assert store.add_measurements([]) == []


def test_done_keys_let_a_sweep_resume(store, adam):
    h = store.add_program(adam)
    store.add_measurement(measure(h, {"N": 1024}, "a"))
    store.add_measurement(measure(h, {"N": 1024}, "b", median_s=None, status="timeout"))
    store.add_measurement(measure(h, {"N": 1024}, "a", source="model"))
    store.add_measurement(measure(h, {"N": 2048}, "a"))
    store.add_measurement(measure(h, {"N": 1024}, "c", topology="dgx"))
    done = store.done_keys(h, {"N": 1024}, "local")
    assert done == {
        DoneKey(h, "N=1024", "local", 2, "gloo", "h-a", "measured"),
        DoneKey(h, "N=1024", "local", 2, "gloo", "h-b", "measured"),
        DoneKey(h, "N=1024", "local", 2, "gloo", "h-a", "model"),
    }
    todo = [
        s
        for s in ("a", "b", "c", "d")
        if f"h-{s}" not in {k.schedule_hash for k in store.done_keys(h, {"N": 1024}, "local", source="measured")}
    ]
    assert todo == ["c", "d"]
    assert len(store.done_keys(h)) == 5
    assert store.done_keys(h, world=8) == set()


# -- winners


def test_winners_are_append_only(store, adam):
    h = store.add_program(adam)
    sizes = {"N": 2**20}
    base = store.add_measurement(measure(h, sizes, "baseline", 4e-3))
    first = store.add_measurement(measure(h, sizes, "split(ar0)", 2e-3))
    w1 = store.add_winner(first, baseline_id=base)
    best = store.best(h, sizes, "local")
    assert best.exact and best.distance == 0 and best.winner.id == w1
    assert best.speedup == pytest.approx(2.0)
    assert best.baseline.id == base and best.runner_up is None

    second = store.add_measurement(measure(h, sizes, "split(ar0); fuse_collective(rs0)", 1e-3))
    w2 = store.add_winner(second, runner_up_id=first, baseline_id=base, speedup=3.9)
    best = store.best(h, sizes, "local")
    assert (best.winner.id, best.median_s, best.speedup) == (w2, 1e-3, 3.9)
    assert best.schedule == "split(ar0); fuse_collective(rs0)"
    assert best.runner_up.id == first and best.source == "measured"
    assert [w.id for w in store.winners(h, sizes, "local")] == [w1, w2]  # the old row is still there
    assert [r.winner.id for r in store.results(h)] == [w2]


def test_only_valid_measurements_of_the_same_problem_win(store, adam):
    h = store.add_program(adam)
    failed = store.add_measurement(measure(h, {"N": 1024}, "x", median_s=None, status="wrong_result"))
    with pytest.raises(StoreError, match="only a valid one can win"):
        store.add_winner(failed)
    ok = store.add_measurement(measure(h, {"N": 1024}, "y"))
    other_size = store.add_measurement(measure(h, {"N": 2048}, "baseline"))
    with pytest.raises(StoreError, match="baseline measurement .* another program, sizes"):
        store.add_winner(ok, baseline_id=other_size)
    with pytest.raises(StoreError, match="no measurement 12345"):
        store.add_winner(12345)
    assert store.winners(h) == []


def test_best_falls_back_to_the_nearest_tuned_size(store, mlp, adam):
    h = store.add_program(mlp)
    store.add_program(adam)
    near = win(store, h, {"B": 4, "S": 512, "H": 1024}, 1e-3)
    far = win(store, h, {"B": 16, "S": 4096, "H": 1024}, 5e-3)
    win(store, h, {"B": 4, "S": 512, "H": 1024}, 2e-3, topology="dgx")

    exact = store.best(h, {"B": 4, "S": 512, "H": 1024}, "local")
    assert exact.exact and exact.winner.id == near

    got = store.best(h, {"B": 4, "S": 1024, "H": 1024}, "local")  # |log2 512 - log2 1024| = 1
    assert not got.exact and got.distance == 1.0 and got.winner.id == near
    assert got.sizes == {"B": 4, "H": 1024, "S": 512} and got.median_s == 1e-3 and got.source == "measured"

    got = store.best(h, {"B": 16, "S": 2048, "H": 1024}, "local")  # 1 from far, 2 + 2 from near
    assert not got.exact and got.distance == 1.0 and got.winner.id == far

    got = store.best(h, {"B": 8, "S": 1448, "H": 1024}, "local")
    assert got.winner.id == near and got.distance == pytest.approx(1 + size_distance({"S": 512}, {"S": 1448}))

    # Never across topologies, programs, dim names or worlds.
    assert store.best(h, {"B": 4, "S": 512, "H": 1024}, "dgx").winner.topology == "dgx"
    assert store.best(h, {"B": 4, "S": 1024, "H": 1024}, "dgx").winner.topology == "dgx"
    assert store.best(h, {"B": 4, "S": 512, "H": 1024}, "nowhere") is None
    assert store.best(adam.hash, {"B": 4, "S": 512, "H": 1024}, "local") is None
    assert store.best(h, {"B": 4, "S": 512}, "local") is None
    assert store.best(h, {"B": 4, "S": 512, "H": 1024}, "local", world=8) is None
    assert store.best(h, {"B": 4, "S": 512, "H": 1024}, "local", world=2, backend="gloo").winner.id == near


def test_best_is_the_fastest_current_winner_across_backends_and_worlds(store, adam):
    h = store.add_program(adam)
    sizes = {"N": 2**24}
    shm = win(store, h, sizes, 2e-3, backend="shm")
    gloo = win(store, h, sizes, 9e-3, backend="gloo")  # a tuning narrowed to gloo, after the shm one
    assert store.best(h, sizes, "local").winner.id == shm
    assert store.best(h, sizes, "local", backend="gloo").winner.id == gloo
    assert store.best(h, {"N": 2**23}, "local").winner.id == shm  # the nearest key: the same rule
    slower = win(store, h, sizes, 12e-3, backend="shm")  # shm tuned again: its new winner replaces the old
    assert store.best(h, sizes, "local").winner.id == gloo
    assert store.best(h, sizes, "local", backend="shm").winner.id == slower
    four = win(store, h, sizes, 5e-3, backend="shm", world=4)
    assert store.best(h, sizes, "local").winner.id == four
    assert store.best(h, sizes, "local", world=2).winner.id == gloo
    assert {r.winner.id for r in store.results(h)} == {gloo, slower, four}


def test_results_list_the_current_winner_per_key(store, adam):
    h = store.add_program(adam)
    win(store, h, {"N": 2**22}, 4e-3)
    old = win(store, h, {"N": 2**20}, 2e-3)
    new = win(store, h, {"N": 2**20}, 1e-3)
    model = win(store, h, {"N": 2**20}, 3e-3, topology="dgx", source="model", samples=[])
    results = store.results(h)
    assert [(r.winner.topology, r.sizes["N"], r.winner.id) for r in results][:3] == [
        ("dgx", 2**20, model),
        ("local", 2**20, new),
        ("local", 2**22, results[2].winner.id),
    ]
    assert old not in {r.winner.id for r in results}
    assert results[0].source == "model"
    assert [r.winner.id for r in store.results(h, topology="dgx")] == [model]
    assert store.results("nothing") == []


def test_a_prediction_never_displaces_a_measured_winner(store, adam):
    h = store.add_program(adam)
    measured = win(store, h, {"N": 2**16}, 1.9e-3)
    # an offline sweep's prediction of the same key, newer and three times faster on paper
    predicted = win(store, h, {"N": 2**16}, 0.6e-3, source="model", samples=[])
    best = store.best(h, {"N": 2**16}, "local", 2)
    assert (best.winner.id, best.source, best.exact) == (measured, "measured", True)
    assert store.best(h, {"N": 2**16}, "local").winner.id == measured  # across pairs too
    assert [r.winner.id for r in store.results(h)] == [measured]
    assert store.best(h, {"N": 2**16}, "local", source="model").winner.id == predicted
    # a pair measured on no backend but predicted on another is no rival for the measured one
    other = win(store, h, {"N": 2**16}, 0.1e-3, backend="shm", source="model", samples=[])
    assert store.best(h, {"N": 2**16}, "local").winner.id == measured
    assert store.best(h, {"N": 2**16}, "local", 2, backend="shm").winner.id == other
    # where the key has no measurement, the prediction answers, and says what it is
    only = win(store, h, {"N": 2**24}, 5e-3, source="model", samples=[])
    best = store.best(h, {"N": 2**24}, "local")
    assert (best.winner.id, best.source, best.exact) == (only, "model", True)
    # among other sizes, a measured one comes first, even if farther
    best = store.best(h, {"N": 2**23}, "local")
    assert (best.winner.id, best.exact, best.distance) == (measured, False, 7.0)
    with pytest.raises(StoreError, match="source"):
        store.best(h, {"N": 2**16}, "local", source="guess")


def reference_best(
    store: Store,
    h: str,
    sizes: dict,
    topology: str,
    world: int | None,
    backend: str | None,
    shardable: str | None = None,
):
    """Store.best's rule spelled out over every winner recorded: of those answering ``shardable``, per key and
    (world, backend) pair the newest (created_at, id) measured one, else the newest predicted one; per key the
    fastest of its pairs (of equals, the newest), of its measured pairs where it has any; then the asked key,
    else the nearest comparable one, keys with a measured winner first (then distance, then the key's text);
    (winner id, distance) or None."""
    current, measured_keys = {}, set()
    for w in sorted(store.winners(h), key=lambda w: (w.source == "measured", w.created_at, w.id)):
        if not (w.topology == topology and world in (None, w.world) and backend in (None, w.backend)):
            continue
        if w.source == "measured":
            measured_keys.add(w.sizes_key)
        if shardable is not None and not answers(
            w.shardable, shardable, sharded_by(store.measurement(w.measurement_id).schedule)
        ):
            continue
        current[(w.sizes_key, w.world, w.backend)] = w
    fastest = {}
    for (key, _, _), w in current.items():
        rank = (w.source != "measured", store.measurement(w.measurement_id).median_s, -w.created_at.timestamp(), -w.id)
        if key not in fastest or rank < fastest[key][0]:
            fastest[key] = (rank, w)
    near = sorted(
        (key not in measured_keys, d, key)
        for key, (_, w) in fastest.items()
        if (d := size_distance(sizes, w.sizes)) is not None
    )
    if any(d == 0 for _, d, _ in near):  # the asked key first, measured or not
        near = [n for n in near if n[1] == 0]
    return (fastest[near[0][2]][1].id, near[0][1]) if near else None


def test_best_follows_its_rule_on_random_stores(store, mlp):
    rng = random.Random(7)
    h = store.add_program(mlp)
    choices = dict(topology=["local", "dgx"], world=[2, 4], backend=["gloo", "shm"])
    tuned = [{"B": 2 ** rng.randrange(0, 4), "S": 2 ** rng.randrange(8, 12), "H": 1024} for _ in range(6)]
    for i in range(40):
        key = {k: rng.choice(v) for k, v in choices.items()}
        sizes = rng.choice(tuned)
        # a few equal medians among the winners, so that the rule's tie-break is exercised too
        fast = rng.choice([1e-3, 2e-3, 3e-3, 1e-3 * rng.uniform(1, 3)])
        # a third predicted, often faster than what was measured, as an offline sweep's model tends to be
        source = rng.choice(["measured", "measured", "model"])
        fast = fast / 4 if source == "model" else fast
        ids = store.add_measurements(
            [measure(h, sizes, f"s{i}-{j}", fast * (j + 1), source=source, **key) for j in range(3)]
        )
        roles = rng.choice([(None, None), (ids[1], None), (None, ids[2]), (ids[1], ids[2])])
        store.add_winner(ids[0], runner_up_id=roles[0], baseline_id=roles[1])
    asked = tuned[:3] + [{"B": 3, "S": 700, "H": 1024}, {"B": 1, "S": 1 << 14, "H": 4096}, {"B": 1, "S": 256}]
    for sizes in asked:
        for topology in ("local", "dgx", "nowhere"):
            for world in (None, 2, 4, 8):
                for backend in (None, "gloo", "shm"):
                    got = store.best(h, sizes, topology, world, backend=backend)
                    want = reference_best(store, h, sizes, topology, world, backend)
                    where = (sizes, topology, world, backend)
                    if want is None:
                        assert got is None, where
                        continue
                    assert (got.winner.id, got.distance, got.exact) == (*want, want[1] == 0), where
                    w = got.winner
                    assert w == next(x for x in store.winners(h) if x.id == w.id)
                    assert got.measurement == store.measurement(w.measurement_id)
                    for role, i in ((got.runner_up, w.runner_up_id), (got.baseline, w.baseline_id)):
                        assert role == (store.measurement(i) if i is not None else None), where


def test_best_reads_again_when_the_database_dropped_its_connection(postgres, adam):
    """best()'s pool does not ping before each use: a connection PostgreSQL closed (a restart, an idle timeout)
    fails on first use, and the read runs once more on a fresh one. (SQLite has no connections to drop.)"""
    url = postgres.new_database()
    with Store.open(url) as store:
        h = store.add_program(adam)
        wid = win(store, h, {"N": 1024}, 1e-3)
        assert store.best(h, {"N": 1024}, "local").winner.id == wid  # leaves a read connection in the pool
        other = create_engine(url, isolation_level="AUTOCOMMIT")
        try:
            with other.connect() as conn:
                dropped = conn.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                ).all()
        finally:
            other.dispose()
        assert dropped and all(ok for (ok,) in dropped)
        assert store.best(h, {"N": 1024}, "local").winner.id == wid
        assert store.best(h, {"N": 2048}, "local").distance == 1.0


# -- listings the service reads


def test_programs_are_listed(store, adam, mlp):
    assert store.programs() == []
    a, m = store.add_program(adam), store.add_program(mlp)
    listed = store.programs()
    assert [(p.hash, p.name, p.dims, p.statements) for p in listed] == [
        (a, "adam", list(adam.dims), len(to_dict(adam)["statements"])),
        (m, mlp.name, list(mlp.dims), len(to_dict(mlp)["statements"])),
    ]
    assert listed[0].created_at <= listed[1].created_at and listed[0].created_at.tzinfo is not None
    assert [p.hash for p in store.programs(newest_first=True)] == [m, a]
    assert [p.hash for p in store.programs(1)] == [a]
    assert [p.hash for p in store.programs(1, newest_first=True)] == [m]


def test_jobs_of_a_program_and_the_one_under_way(store, adam, mlp):
    a, m = store.add_program(adam), store.add_program(mlp)
    first = store.create_job(a, {"N": 1024}, "local", 2)
    other = store.create_job(m, {"B": 1, "S": 512, "H": 1024}, "local", 2)
    second = store.create_job(a, {"N": 1024}, "local", 2)
    elsewhere = store.create_job(a, {"N": 1024}, "dgx", 2)
    assert [j.id for j in store.jobs(program_hash=a)] == [first, second, elsewhere]
    assert [j.id for j in store.jobs(program_hash=a, newest_first=True, limit=2)] == [elsewhere, second]
    assert [j.id for j in store.jobs(program_hash=m)] == [other]
    assert [j.id for j in store.jobs("queued", program_hash=m)] == [other]
    assert store.jobs(program_hash="0" * 16) == []

    assert store.active_job(a, {"N": 1024}, "local", 2).id == first
    assert store.active_job(a, {"N": 1024}, "dgx", 2).id == elsewhere
    for miss in (({"N": 2048}, "local", 2), ({"N": 1024}, "local", 4), ({"N": 1024}, "gpu", 2)):
        assert store.active_job(a, *miss) is None, miss
    store.claim_job(first)
    assert store.active_job(a, {"N": 1024}, "local", 2).id == first  # running counts
    store.update_job(first, state="done")
    assert store.active_job(a, {"N": 1024}, "local", 2).id == second
    store.update_job(second, state="failed", error="x")
    assert store.active_job(a, {"N": 1024}, "local", 2) is None


def test_best_answers_a_question_on_sharding_with_a_winner_that_answers_it(store, adam):
    rng = random.Random(11)
    h = store.add_program(adam)
    # a winner shards what its schedule's as_slice names, within what its search allowed
    texts = {
        "baseline": (),
        "split(ar0)": (),
        "as_slice(m); as_slice(v)": ("m", "v"),
        "as_slice(w); as_slice(m); as_slice(v)": ("m", "v", "w"),
        "as_slice(w)": ("w",),
    }
    searches = ["*", "", "m,v", "w", "m,v,w"]
    tuned = [{"N": 2**k} for k in (10, 12, 14)]
    for i in range(60):
        text, sizes, world = rng.choice(list(texts)), rng.choice(tuned), rng.choice([2, 4])
        allowed = rng.choice([t for t in searches if t == "*" or set(texts[text]) <= set(t.split(","))])
        ids = store.add_measurements([measure(h, sizes, text, 1e-3, world=world, schedule_hash=f"h{i}")])
        store.add_winner(ids[0], shardable=allowed)
    for sizes in tuned + [{"N": 2**11}, {"N": 2**20}]:
        for world in (None, 2, 4):
            for asked in (None, *searches):
                got = store.best(h, sizes, "local", world, shardable=asked)
                want = reference_best(store, h, sizes, "local", world, None, asked)
                where = (sizes, world, asked)
                assert (None if got is None else (got.winner.id, got.distance)) == want, where
                if got is not None and asked is not None:
                    assert answers(got.winner.shardable, asked, sharded_by(got.schedule)), where


def test_a_winner_stays_within_what_its_search_allowed(store, adam):
    h = store.add_program(adam)
    mid = store.add_measurement(measure(h, {"N": 64}, "split(ar0); reorder(ag0); as_slice(w); as_slice(m)"))
    with pytest.raises(StoreError, match="leaves w sharded, which shardable 'm,v' does not allow"):
        store.add_winner(mid, shardable="m,v")
    with pytest.raises(StoreError, match="shardable 'm v' is not"):
        store.add_winner(mid, shardable="m v")
    assert store.winners(h) == []
    wid = store.add_winner(mid, shardable="m,w")
    assert [(w.id, w.shardable) for w in store.winners(h)] == [(wid, "m,w")]


def test_jobs_of_one_key_are_apart_per_shardable(store, adam):
    a = store.add_program(adam)
    default, new = store.join_job(a, {"N": 1024}, "local", 2, shardable="m,v")
    every, other = store.join_job(a, {"N": 1024}, "local", 2)
    assert new and other and default.id != every.id
    assert (default.shardable, every.shardable) == ("m,v", "*")
    assert store.join_job(a, {"N": 1024}, "local", 2, shardable="m,v") == (default, False)
    taken = store.take_job(a, {"N": 1024}, "local", 2, shardable="")
    assert taken.id not in (default.id, every.id) and taken.shardable == ""
    assert store.take_job(a, {"N": 1024}, "local", 2, shardable="m,v").id == default.id
    with pytest.raises(StoreError, match="shardable 'm;v' is not"):
        store.join_job(a, {"N": 1024}, "local", 2, shardable="m;v")


def test_requests_for_one_key_arriving_together_join_one_job(store, adam):
    a = store.add_program(adam)
    start = threading.Barrier(8)

    def join(world):
        start.wait()
        return store.join_job(a, {"N": 1024}, "local", world, budget=5, backends=["shm"])

    for _ in range(3):
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(join, [2] * 6 + [4] * 2))
        for world in (2, 4):
            mine = [(job, new) for job, new in got if job.world == world]
            assert len({job.id for job, _ in mine}) == 1 and sum(new for _, new in mine) == 1, mine
        for job in store.jobs("queued"):
            store.claim_job(job.id)
            store.update_job(job.id, state="done")
    assert len(store.jobs()) == 6  # a done job is not joined: each round made its own two
    job, new = store.join_job(a, {"N": 1024}, "local", 2)
    assert new and (job.state, job.budget) == ("queued", None)
    assert store.join_job(a, {"N": 1024}, "local", 2) == (job, False)


def test_a_tuner_takes_the_queued_job_of_its_key(store, adam):
    a = store.add_program(adam)
    queued, _ = store.join_job(a, {"N": 1024}, "local", 2, budget=5, backends=["gloo"])
    elsewhere, _ = store.join_job(a, {"N": 1024}, "local", 4)
    taken = store.take_job(a, {"N": 1024}, "local", 2, budget=9, backends=["gloo", "shm"])
    assert taken.id == queued.id and taken.state == "running" and taken.heartbeat_at is not None
    assert (taken.budget, taken.progress.total, taken.backends) == (9, 9, ["gloo", "shm"])
    assert store.claim_job().id == elsewhere.id and store.claim_job() is None  # nothing left for the workers
    # running elsewhere: left to run; this tuner gets a job of its own
    second = store.take_job(a, {"N": 1024}, "local", 2, budget=3)
    assert second.id not in (queued.id, elsewhere.id) and second.state == "running"
    assert store.join_job(a, {"N": 1024}, "local", 2)[0].id == queued.id  # the oldest active one is joined


def test_a_job_names_the_process_that_runs_it(store, adam):
    a = store.add_program(adam)
    queued, _ = store.join_job(a, {"N": 1024}, "local", 2)
    assert queued.driver is None  # nobody runs it yet
    assert store.claim_job(driver="7@worker boot/ns 123").driver == "7@worker boot/ns 123"
    assert store.job(queued.id).driver == "7@worker boot/ns 123"
    taken = store.take_job(a, {"N": 2048}, "local", 2, driver="8@laptop boot/ns 456")
    assert store.job(taken.id).driver == "8@laptop boot/ns 456"
    again, _ = store.join_job(a, {"N": 4096}, "local", 2)
    assert store.take_job(a, {"N": 4096}, "local", 2, driver="9@laptop boot/ns 789").id == again.id
    assert store.job(again.id).driver == "9@laptop boot/ns 789"


def test_a_tuner_refuses_a_key_run_by_a_live_process_in_the_same_take(store, adam):
    a = store.add_program(adam)
    running = store.take_job(a, {"N": 1024}, "local", 2, driver="7@worker boot/ns 123")
    asked = []

    def alive(job):
        asked.append(job.id)
        return False

    with pytest.raises(KeyBusy, match=f"job {running.id} of this key is running") as err:
        store.take_job(a, {"N": 1024}, "local", 2, driver="8@laptop boot/ns 456", abandoned=alive)
    assert asked == [running.id] and (err.value.running, err.value.driver) == (running.id, "7@worker boot/ns 123")
    assert [(j.id, j.state) for j in store.jobs()] == [(running.id, "running")]  # the refusal wrote nothing
    # another key, or a job nobody runs any more: taken, the left job marked interrupted in the same transaction
    other = store.take_job(a, {"N": 2048}, "local", 2, abandoned=alive)
    assert other.state == "running" and asked == [running.id]
    taken = store.take_job(a, {"N": 1024}, "local", 2, driver="8@laptop boot/ns 456", abandoned=lambda job: True)
    left = store.job(running.id)
    assert taken.id not in (running.id, other.id) and left.state == "interrupted" and "tuned again" in left.error


def test_measurement_digests_are_the_records_without_their_heavy_columns(store, adam, mlp):
    a, m = store.add_program(adam), store.add_program(mlp)
    store.add_measurements(
        [measure(a, {"N": 2 ** (10 + i % 3)}, f"s{i}", topology=("local", "dgx")[i % 2]) for i in range(7)]
        + [measure(m, {"B": 1, "S": 2, "H": 4}, "t")]
    )
    full = store.measurements(a)
    digests = store.measurement_digests(a)
    assert len(digests) == 7 and [d.id for d in digests] == [r.id for r in full]
    for d, r in zip(digests, full):
        assert d == MeasurementDigest(**{f.name: getattr(r, f.name) for f in fields(MeasurementDigest)})
        assert d.created_at.tzinfo is not None
    assert store.measurement_digests("0" * 16) == []


def test_result_counts_are_the_lengths_of_results(store, adam, mlp):
    a, m = store.add_program(adam), store.add_program(mlp)
    for i in range(7):  # six keys of a (three sizes, two backends); the seventh re-tunes the first
        win(store, a, {"N": 2 ** (10 + i % 3)}, 1e-3 * (i + 1), backend=("gloo", "shm")[i // 3 % 2])
    store.add_measurement(measure(m, {"B": 1, "S": 2, "H": 4}, "t"))  # measured, never won: no result
    assert store.result_counts() == {a: len(store.results(a))} == {a: 6}
    win(store, m, {"B": 1, "S": 2, "H": 4}, 2e-3, topology="dgx", world=4)
    assert store.result_counts() == {a: 6, m: len(store.results(m))} == {a: 6, m: 1}


def test_measurements_page_and_count(store, adam):
    h = store.add_program(adam)
    ids = store.add_measurements(
        [measure(h, {"N": 2 ** (10 + i % 3)}, f"s{i}", topology=("local", "dgx")[i % 2]) for i in range(25)]
    )
    assert store.measurement_count(h) == 25
    assert store.measurement_count(h, {"N": 1024}) == 9
    assert store.measurement_count(h, {"N": 1024}, "dgx") == 4
    assert store.measurement_count("0" * 16) == 0
    pages, after = [], 0
    while page := store.measurements(h, after=after, limit=10):
        pages.append([m.id for m in page])
        after = page[-1].id
    assert [len(p) for p in pages] == [10, 10, 5] and sum(pages, []) == ids
    local = store.measurements(h, {"N": 1024}, "local", after=ids[0], limit=3)
    assert [m.id for m in local] == [ids[6], ids[12], ids[18]]


def test_a_schedule_is_found_by_its_hash(store, adam, mlp):
    a, m = store.add_program(adam), store.add_program(mlp)
    sched = max(generate(adam, depth=1), key=lambda s: len(s.transforms))
    common = dict(topology="local", world=2, backend="gloo", samples=[1e-3], median_s=1e-3)
    loser = store.add_measurement(NewMeasurement.of(sched, sizes={"N": 1024}, **common))
    winner = store.add_measurement(NewMeasurement.of(sched, sizes={"N": 2048}, **common))
    assert store.schedule_measurement(sched.hash).id in (loser, winner)
    store.add_winner(winner)
    assert store.schedule_measurement(sched.hash).id == winner  # a winner first
    assert store.schedule_measurement(sched.hash, a).id == winner
    assert store.schedule_measurement(sched.hash, m) is None
    assert store.schedule_measurement("f" * 16) is None
    # Without the schedule's JSON there is no code to generate from it.
    store.add_measurement(measure(m, {"B": 1, "S": 512, "H": 1024}, "bare", schedule_hash="b" * 16))
    assert store.schedule_measurement("b" * 16) is None
    found = store.schedule_measurement(sched.hash)
    assert found.schedule_json == json.loads(json.dumps(sched.to_json())) and found.program_hash == a


# -- opening, migrations, neighbours


def test_migrated_schema_matches_the_models(db_url):
    from alembic import command
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from alembic.script import ScriptDirectory

    assert ScriptDirectory.from_config(alembic_config()).get_current_head() == SCHEMA_HEAD
    Store.open(db_url).close()
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"include_name": include_name, "version_table": VERSION_TABLE})
            assert ctx.get_current_revision() == SCHEMA_HEAD
            assert compare_metadata(ctx, Base.metadata) == []
        with engine.begin() as conn:
            config = alembic_config()
            config.attributes["connection"] = conn
            command.downgrade(config, "base")
        assert [t for t in inspect(engine).get_table_names() if t.startswith("coconet_")] == [VERSION_TABLE]
    finally:
        engine.dispose()
    Store.open(db_url).close()  # and up again


def _indexes(engine) -> set[str]:
    return {i["name"] for t in ("coconet_measurements", "coconet_winners") for i in inspect(engine).get_indexes(t)}


def test_a_store_at_0001_is_upgraded_when_opened(db_url, adam):
    from alembic import command

    with Store.open(db_url) as store:
        h = store.add_program(adam)
        job = store.create_job(h, {"N": 2**20}, "local", 2)
        mid = store.add_measurement(measure(h, {"N": 2**20}, "split", job_id=job, schedule_json={"text": "split"}))
        store.add_winner(mid)
        before = (store.programs(), store.jobs(), store.measurements(h), store.winners(h))
    new = {"ix_coconet_measurements_schedule_hash", "ix_coconet_winners_measurement_id"}
    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:
            config = alembic_config()
            config.attributes["connection"] = conn
            command.downgrade(config, "0001")
        with engine.connect() as conn:
            assert conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar() == "0001"
        assert not new & _indexes(engine)
        with Store.open(db_url) as store:
            assert (store.programs(), store.jobs(), store.measurements(h), store.winners(h)) == before
            assert store.schedule_measurement("h-split").id == mid
        with engine.connect() as conn:
            assert conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar() == SCHEMA_HEAD
        assert new <= _indexes(engine)
    finally:
        engine.dispose()


def test_optuna_shares_the_database(db_url, adam):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(db_url)
    study = optuna.create_study(storage=storage, study_name="adam-N=1048576-local")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    with Store.open(db_url) as store:
        h = store.add_program(adam)
        win(store, h, {"N": 2**20}, 1e-3)
        study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    with Store.open(db_url) as store:
        assert store.best(h, {"N": 2**20}, "local").exact
    assert len(optuna.load_study(study_name=study.study_name, storage=storage).trials) == 3
    tables = set(inspect(storage.engine).get_table_names())
    assert {"studies", "trials", "alembic_version", VERSION_TABLE, "coconet_winners"} <= tables
    storage.engine.dispose()


STUDIER = """
import sys, time
import optuna
from coconet.server.store import Store

url, name, start = sys.argv[1], sys.argv[2], float(sys.argv[3])
optuna.logging.set_verbosity(optuna.logging.WARNING)
with Store.open(url) as store:
    time.sleep(max(0.0, start - time.time()))  # imported and opened: now all at once
    study = optuna.create_study(storage=store.optuna_storage(), study_name=name)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=3)
    print(len(study.trials))
"""


def test_processes_making_optunas_tables_at_once_all_get_the_storage(db_url):
    # The store's own schema is made first, as `coconet tune` and the server open it; Optuna's is made at the
    # first optuna_storage(), which four processes then ask for at the same moment.
    Store.open(db_url).close()
    start = time.time() + 6
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", STUDIER, db_url, f"s{i}", str(start)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and out.split() == ["3"], err[-2000:]


WRITER = """
import json, sys
from coconet.loader import load_file
from coconet.server.store import NewMeasurement, Progress, Store

url, tag, example = sys.argv[1], sys.argv[2], sys.argv[3]
with Store.open(url) as store:
    h = store.add_program(load_file(example))
    jobs = [store.create_job(h, {"N": 2**20}, "local", 2) for _ in range(5)]
    for i in range(100):
        store.add_measurement(NewMeasurement(program_hash=h, sizes={"N": 1024}, topology="local", world=2,
                              backend="gloo", schedule=f"{tag}{i}", schedule_hash=f"{tag}{i}", median_s=1e-3))
        store.update_job(jobs[i % 5], progress=Progress(done=i))
    claimed = []
    while (job := store.claim_job()) is not None:
        claimed.append(job.id)
print(json.dumps(claimed))
"""


def test_two_processes_write_one_database(db_url):
    # Both open a fresh database at once, so they race on creating the schema too.
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, db_url, tag, str(EXAMPLES / "adam.py")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for tag in ("a", "b")
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert "locked" not in err
    claimed = [json.loads(out) for out, _ in outs]
    assert not set(claimed[0]) & set(claimed[1])
    with Store.open(db_url) as store:
        assert sorted(claimed[0] + claimed[1]) == [j.id for j in store.jobs()] == list(range(1, 11))
        assert {j.state for j in store.jobs()} == {"running"}
        assert len(store.measurements(load_file(EXAMPLES / "adam.py").hash)) == 200


def test_default_url_and_its_overrides(tmp_path, monkeypatch):
    import platformdirs

    monkeypatch.delenv(ENV_URL, raising=False)
    monkeypatch.delenv("COCONET_DATA_DIR", raising=False)  # the test run's own (tests/conftest.py)
    monkeypatch.setattr(platformdirs, "user_data_dir", lambda app: str(tmp_path / "data" / app))
    assert default_url() == f"sqlite:///{tmp_path / 'data' / 'coconet' / 'coconet.db'}"
    Store.open().close()
    assert (tmp_path / "data" / "coconet" / "coconet.db").exists()
    monkeypatch.setenv("COCONET_DATA_DIR", str(tmp_path / "mine"))  # the data dir moved: the store with it
    assert default_url() == f"sqlite:///{tmp_path / 'mine' / 'coconet.db'}"

    monkeypatch.setenv(ENV_URL, f"sqlite:///{tmp_path / 'env.db'}")
    Store.open().close()
    assert (tmp_path / "env.db").exists()
    with Store.open(f"sqlite:///{tmp_path / 'explicit' / 'x.db'}") as store:
        assert store.url.endswith("explicit/x.db") and store.dialect == "sqlite"
    assert (tmp_path / "explicit" / "x.db").exists()


def test_sqlite_pragmas(tmp_path):
    with Store.open(f"sqlite:///{tmp_path / 'p.db'}") as store, store._engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30_000


def test_a_connection_meeting_another_mid_change_to_wal_tries_again():
    import sqlite3

    from coconet.server.store.engine import _sqlite_wal

    class Cursor:  # a file another process is turning to WAL: "locked" twice, as SQLite answers without waiting
        def __init__(self, fails, error="database is locked"):
            self.fails, self.error, self.mode, self.asked = fails, error, "delete", 0

        def execute(self, sql):
            self.asked += 1
            if self.fails:
                self.fails -= 1
                raise sqlite3.OperationalError(self.error)
            if sql.endswith("= WAL"):
                self.mode = "wal"
            return self

        def fetchone(self):
            return (self.mode,)

    busy = Cursor(2)
    _sqlite_wal(busy, sqlite3.OperationalError)
    assert busy.mode == "wal" and busy.asked == 4
    done = Cursor(0)
    done.mode = "wal"
    _sqlite_wal(done, sqlite3.OperationalError)
    assert done.asked == 1  # already WAL: no change asked for
    with pytest.raises(sqlite3.OperationalError, match="disk I/O error"):
        _sqlite_wal(Cursor(1, "disk I/O error"), sqlite3.OperationalError)


def test_bad_or_unreachable_databases_are_store_errors(tmp_path):
    with pytest.raises(StoreError, match="is not a database URL"):
        Store.open("not a url")
    with pytest.raises(StoreError, match="cannot open the store at nosuchdb://"):
        Store.open("nosuchdb://host/db")
    with pytest.raises(StoreError, match="cannot open the store at postgresql\\+psycopg://postgres:\\*\\*\\*@") as err:
        Store.open(f"postgresql://postgres:secret@/x?host={tmp_path / 'nowhere'}&port=1")
    assert "secret" not in str(err.value) and "\n" not in str(err.value)
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreError, match="cannot create the directory"):
        Store.open(f"sqlite:///{tmp_path / 'file' / 'sub' / 'x.db'}")
    (tmp_path / "junk.db").write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match="not a database"):
        Store.open(f"sqlite:///{tmp_path / 'junk.db'}")


def test_lookups_use_indexes(tmp_path):
    """best, measurements and done_keys stay index lookups at a million rows: SQLite's planner says so."""
    with Store.open(f"sqlite:///{tmp_path / 'plan.db'}") as store, store._engine.connect() as conn:
        plans = {
            "measurements": "SELECT * FROM coconet_measurements "
            "WHERE program_hash='a' AND sizes_key='N=1' AND topology='t'",
            "done_keys": "SELECT DISTINCT schedule_hash FROM coconet_measurements "
            "WHERE program_hash='a' AND sizes_key='N=1'",
            "job": "SELECT * FROM coconet_measurements WHERE job_id=1",
            "nearest": "SELECT DISTINCT sizes_key FROM coconet_winners WHERE program_hash='a' AND topology='t'",
            "best": "SELECT * FROM coconet_winners WHERE program_hash='a' AND topology='t' AND sizes_key='N=1' "
            "ORDER BY created_at DESC",
            "schedule": "SELECT * FROM coconet_measurements WHERE schedule_hash='s' AND schedule_json IS NOT NULL",
            "schedule_won": "SELECT m.* FROM coconet_measurements m JOIN coconet_winners w ON w.measurement_id = m.id "
            "WHERE m.schedule_hash='s' AND m.schedule_json IS NOT NULL",
        }
        for name, sql in plans.items():
            plan = " ".join(r[-1] for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql))
            assert "USING" in plan and "SCAN" not in plan, (name, plan)


def test_the_store_s_lookups_use_indexes(tmp_path, adam):
    """The statements best and schedule_measurement send, as the store renders them, planned by SQLite."""
    with Store.open(f"sqlite:///{tmp_path / 'plan.db'}") as store:
        h = store.add_program(adam)
        sent = []
        # sqlite3 reports each statement it runs, values in place, whichever layer sent it.
        for engine in (store._engine, store._reads, store._reader):  # writes, read transactions, the hot path
            event.listen(engine, "connect", lambda dbapi_conn, _: dbapi_conn.set_trace_callback(sent.append))
            engine.dispose()
        store.best(h, {"N": 1024}, "local")  # nothing tuned: the exact lookup, then the tuned keys
        store.best(h, {"N": 1024}, "local", 2, backend="gloo")
        store.schedule_measurement("s" * 16)
        store.schedule_measurement("s" * 16, h)
        selects = [sql for sql in sent if sql.lstrip().upper().startswith("SELECT")]
        assert len(selects) == 8
        with store._engine.connect() as conn:
            for sql in selects:
                plan = " ".join(r[-1] for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql))
                assert "SCAN" not in plan, (sql, plan)


def test_a_tuner_taking_a_key_waits_for_a_worker_claiming_its_job(postgres, adam):
    """A worker's claim and a tuner's take of one queued job, at once: the take must see the claim, not pass the
    locked row over and start a second tuning of the key."""
    from sqlalchemy import select, update
    from sqlalchemy.orm import Session

    from coconet.server.models import JobRow

    url = postgres.new_database()
    with Store.open(url) as store:
        a = store.add_program(adam)
        queued, _ = store.join_job(a, {"N": 1024}, "local", 2)
        worker = create_engine(url)
        try:
            with Session(worker) as claiming, claiming.begin():
                # claim_job's statements, its transaction held open
                row = claiming.scalars(
                    select(JobRow).where(JobRow.state == "queued").with_for_update(skip_locked=True)
                ).one()
                claiming.execute(
                    update(JobRow).where(JobRow.id == row.id).values(state="running", driver="7@worker boot/ns 123")
                )
                with ThreadPoolExecutor(1) as pool:
                    took = pool.submit(
                        store.take_job,
                        a,
                        {"N": 1024},
                        "local",
                        2,
                        driver="8@laptop boot/ns 456",
                        abandoned=lambda job: False,
                    )
                    with worker.connect() as watch:
                        for _ in range(200):  # until the take waits on the row's lock (or has gone on without it)
                            waiting = watch.execute(
                                text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'")
                            ).scalar()
                            if waiting or took.done():
                                break
                            time.sleep(0.05)
                    assert not took.done(), f"the take did not wait for the claim: {took.result()}"
                    claiming.commit()
                    with pytest.raises(KeyBusy, match=f"job {queued.id} of this key is running"):
                        took.result(timeout=30)
        finally:
            worker.dispose()
        assert [(j.id, j.state, j.driver) for j in store.jobs()] == [(queued.id, "running", "7@worker boot/ns 123")]
