"""coconet tune end to end on Ray into a fresh store: the winner recorded and served by the store,
an interrupted tuning resumed without measuring anything twice."""

import re
import runpy
from pathlib import Path

import pytest

from coconet.codegen.lower import lower
from coconet.errors import CoconetError
from coconet.server.driver import Driver, this_process
from coconet.server.store import Store
from coconet.tuner.cluster import Node, Offer
from coconet.tuner.fingerprint import detect_local
from coconet.tuner.runner import Protocol
from coconet.tuner.search import RETIME_ROUNDS
from coconet.tuner.tune import Request, _free_keys, tune

ROOT = Path(__file__).parents[2]
FAST = Protocol(warmup=1, min_repeats=5, max_repeats=10, max_time_s=1.0, kernels="eager", timeout_s=60.0)


def example(name):
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"))["program"].ir


def trial_rows(store, prog):
    return [m for m in store.measurements(prog.hash) if m.job_id is not None]


def test_tune_records_the_winner_the_store_serves(ray_local, tmp_path):
    prog = example("adam")
    sizes = {"N": 3000}
    with Store.open(f"sqlite:///{tmp_path / 'coconet.db'}") as store:
        request = Request(prog, (sizes,), world=2, budget=5, backends=("gloo", "shm"), protocol=FAST)
        store.add_program(prog)
        # queued for the service's workers, asking what tune asks by default: Adam's moments may stay sharded
        asked, _ = store.join_job(prog.hash, sizes, "local", 2, budget=20, shardable="m,v")
        [tuned] = tune(request, store)
        assert tuned.job_id == asked.id  # taken and run here, not tuned twice
        o = tuned.outcome
        assert len(o.trials) == 5 and o.winner is not None and o.baseline is not None
        assert all(set(t.candidate.schedule.sharded) <= {"m", "v"} for t in o.trials)  # w stays whole
        assert o.baseline.candidate.schedule.transforms == ()
        assert all(t.result.status == "ok" and t.result.correct for t in o.trials)
        best = store.best(prog.hash, sizes, "local", 2)
        assert best.exact and best.winner.id == tuned.record_id and best.winner.shardable == "m,v"
        assert tuned.to_json(prog, "local", 2)["shardable"] == ["m", "v"]
        assert store.best(prog.hash, sizes, "local", 2, shardable="m,v").winner.id == tuned.record_id
        assert store.best(prog.hash, sizes, "local", 2, shardable="*") is None  # w-sharding never tried
        assert best.measurement.schedule_hash == o.winner.candidate.schedule.hash
        assert best.measurement.backend == o.winner.candidate.backend
        assert best.baseline.schedule == "baseline" and best.speedup == pytest.approx(o.speedup)
        rows = store.measurements(prog.hash, sizes, "local")
        assert len(rows) == 5 + len(o.retimed)  # every trial, then the two fastest and the baseline re-timed
        assert o.baseline.record_id in {t.record_id for t in o.retimed} and best.baseline.id == o.baseline.record_id
        assert {r.source for r in rows} == {"measured"} and all(r.versions["torch"] for r in rows)
        here = detect_local()  # the local Ray cluster is this machine: each trial says so, with its placement
        assert all(
            r.versions["fingerprint"] == here.digest
            and r.versions["machines"] == here.text()
            and r.versions["placement"] == "2 ranks on 1 node"
            for r in rows
        )
        assert tuned.to_json(prog, "local", 2)["machines"] == {
            "fingerprint": here.digest,
            "machines": here.text(),
            "placement": "2 ranks on 1 node",
        }
        job = store.job(tuned.job_id)
        assert job.state == "done" and job.result["best"]["hash"] == best.measurement.schedule_hash
        assert job.progress.done == 5
        # the same tuning again: the study is complete, nothing is measured but the final re-timing,
        # and the new winner is a new record that replaces the old one of its backend. The re-timing may crown
        # the other backend this time (at this size gloo and shm are a barrier apart): the lookup then
        # answers the faster of the two backends' current winners
        [again] = tune(request, store)
        assert len(store.measurements(prog.hash, sizes, "local")) == len(rows) + len(again.outcome.retimed)
        backend = again.outcome.winner.candidate.backend
        assert store.best(prog.hash, sizes, "local", 2, backend=backend).winner.id == again.record_id != tuned.record_id
        current = [b for b in (store.best(prog.hash, sizes, "local", 2, backend=x) for x in ("gloo", "shm")) if b]
        fastest = min(current, key=lambda b: b.measurement.median_s)
        assert store.best(prog.hash, sizes, "local", 2).winner.id == fastest.winner.id
        assert {b.winner.id for b in current} == {again.record_id} | (
            {tuned.record_id} if backend != o.winner.candidate.backend else set()
        )
        assert len(store.winners(prog.hash, sizes, "local")) == 2


def test_an_interrupted_tuning_resumes_where_it_stopped(ray_local, tmp_path):
    prog = example("adam")
    sizes = {"N": 2000}
    calls = []

    def interrupting(schedule, backend, kernels):
        calls.append((schedule.hash, backend))
        if len(calls) == 4:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the fourth trial
        return lower(schedule, backend, kernels)

    url = f"sqlite:///{tmp_path / 'coconet.db'}"
    request = Request(prog, (sizes,), world=2, budget=6, backends=("gloo",), protocol=FAST)
    with Store.open(url) as store:
        with pytest.raises(KeyboardInterrupt):
            tune(request, store, lowering=interrupting)
        first = trial_rows(store, prog)
        assert len(first) == 3
        assert store.jobs()[0].state == "interrupted"
    measured_again = []

    def counting(schedule, backend, kernels):
        measured_again.append((schedule.hash, backend))
        return lower(schedule, backend, kernels)

    with Store.open(url) as store:
        [tuned] = tune(request, store, lowering=counting)
        trials = measured_again[: len(measured_again) - RETIME_ROUNDS * len(tuned.outcome.retimed)]
        assert not {(m.schedule_hash, m.backend) for m in first} & set(trials)
        assert len(trials) == 6 - 3
        assert len(tuned.outcome.trials) == 6
        assert store.best(prog.hash, sizes, "local", 2).winner.id == tuned.record_id


def test_the_tuners_winner_is_the_exhaustive_winner_within_its_ci(ray_local, tmp_path):
    """On a small space (SGD at N=2^22: 16 candidates, 34 to 82 ms here), every candidate is measured on
    Ray; then the search `coconet tune` runs (TPE, half the budget, the cost model's top 3 first) replays
    those measurements and must pick the exhaustive winner, or one whose interval overlaps the winner's
    (the two cannot be told apart). Replayed, not measured again: two runs minutes apart on a shared
    machine differ by more than either run's interval, and that would test the machine, not the search."""
    import optuna

    from coconet.tuner.search import SearchSpace, search, study_name
    from coconet.tuner.tune import cost_prior

    prog = example("sgd")
    sizes = {"N": 2**22}
    with Store.open(f"sqlite:///{tmp_path / 'all.db'}") as store:
        [every] = tune(
            Request(
                prog, (sizes,), world=2, budget=10_000, backends=("gloo",), protocol=FAST, depth=3, shardable=("all",)
            ),
            store,
        )
    assert len(every.outcome.trials) == 16
    results = {t.candidate.key: t.result for t in every.outcome.trials}
    space = SearchSpace.of(prog, ("gloo",), 3)
    replayed: list[str] = []

    def replay(c):
        replayed.append(c.key)
        return results[c.key]

    out = search(
        space,
        sizes,
        storage=optuna.storages.InMemoryStorage(),
        study=study_name(prog, sizes, "local", 2),
        budget=8,
        measure=replay,
        prior=cost_prior(space, sizes, "local", 2)[:3],
    )
    assert len(out.trials) == 8 and out.winner is not None
    # each once, then the two fastest and the baseline again, in turns
    assert len(replayed) == 8 + RETIME_ROUNDS * len(out.retimed) and len(set(replayed[:8])) == 8
    ok = [r for r in results.values() if r.status == "ok"]
    best = min(ok, key=lambda r: r.median_s)
    mine = results[out.winner.candidate.key]
    assert mine is best or mine.ci95_s[0] <= best.ci95_s[1], (mine.schedule, mine.ci95_s, best.schedule, best.ci95_s)


def test_the_tuned_json_says_which_state_the_winner_leaves_sharded():
    from coconet.schedules.schedule import Schedule
    from coconet.tuner.launch import RunResult
    from coconet.tuner.search import Candidate, Outcome, Trial
    from coconet.tuner.tune import Tuned

    prog = example("adam")

    def trial(text):
        s = Schedule.parse(text, prog) if text else Schedule(prog)
        return Trial(Candidate(s, "shm"), RunResult(s.text, s.hash, "ok", True, 0.0, [0.01, 0.011, 0.012]))

    zero1 = trial("split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0)")
    weights = trial("split(ar0); reorder(ag0); as_slice(w); as_slice(m); as_slice(v); fuse_collective(rs0)")
    base = trial(None)
    outcome = Outcome("s", {"N": 8}, [zero1, weights], weights, zero1, base)
    doc = Tuned({"N": 8}, outcome, 1, 2).to_json(prog, "local", 2)
    # sorted, as REST gives them
    assert doc["best"]["sharded"] == ["m", "v", "w"] and doc["runner_up"]["sharded"] == ["m", "v"]
    assert doc["baseline"]["sharded"] == []


def test_the_tuned_json_says_why_its_trials_failed():
    from coconet.schedules.schedule import Schedule
    from coconet.tuner.launch import RunResult
    from coconet.tuner.search import Candidate, Outcome, Trial
    from coconet.tuner.tune import Tuned

    prog = example("adam")
    texts = ["split(ar0)", "split(ar0); reorder(ag0)", "split(ar0); reorder(ag0); fuse_collective(rs0)"]

    def trial(text, status="ok", error=None, backend="shm"):
        s = Schedule.parse(text, prog)
        return Trial(
            Candidate(s, backend),
            RunResult(s.text, s.hash, status, error=error, samples=[0.01] * 3 if status == "ok" else []),
        )

    oom = "rank 0: MemoryError: Unable to allocate 8.00 TiB"
    trials = [
        trial(texts[0], "timeout", "rank 1 did not answer within 60 s"),
        trial(texts[1], "runtime_error", oom),
        trial(texts[2], "runtime_error", oom, backend="gloo"),
        trial(texts[2]),
    ]
    doc = Tuned({"N": 8}, Outcome("s", {"N": 8}, trials, trials[3], None, None), 1, 2).to_json(prog, "local", 2)
    assert doc["failed"] == 3
    assert doc["failures"] == [  # the commonest first, each with one of its candidates
        {"status": "runtime_error", "error": oom, "count": 2, "schedule": texts[1], "backend": "shm"},
        {
            "status": "timeout",
            "error": "rank 1 did not answer within 60 s",
            "count": 1,
            "schedule": texts[0],
            "backend": "shm",
        },
    ]


def test_tune_refuses_sizes_whose_inputs_cannot_fit_this_machine():
    from coconet.errors import SizeError
    from coconet.tuner.tune import check

    prog = example("adam")
    huge = Request(prog, ({"N": 2**20}, {"N": 2**40}), world=2, backends=("gloo",))
    with pytest.raises(SizeError, match=r"N=1099511627776 the inputs of adam on 2 rank\(s\) take at least 32.0 TiB"):
        check(huge)
    # a cluster's nodes are not this machine: their memory is theirs to run out of
    assert check(Request(prog, huge.sizes, world=2, backends=("gloo",), ray_address="10.0.0.1:6379")) == ("gloo",)


def test_tune_leaves_a_key_another_tuner_is_running(tmp_path):
    prog = example("adam")
    me = this_process()
    with Store.open(f"sqlite:///{tmp_path / 'coconet.db'}") as store:
        store.add_program(prog)
        other = store.take_job(prog.hash, {"N": 3000}, "local", 2, budget=5, shardable="m,v", driver=me.text)
        request = Request(prog, ({"N": 2000}, {"N": 3000}), world=2, budget=5, backends=("gloo",), protocol=FAST)
        # refused before Ray starts or anything is recorded, naming the size, the job and its process
        with pytest.raises(
            CoconetError,
            match=rf"adam at N=3000 \(job {other.id}, pid {me.pid} on {me.host}\) on "
            rf"local, world 2 is being tuned",
        ):
            tune(request, store)
        assert [j.id for j in store.jobs()] == [other.id] and store.job(other.id).state == "running"
        # another choice of shardable state is another key
        _free_keys(store, prog, [{"N": 3000}], request, "*")
        assert store.job(other.id).state == "running"


def test_tune_refuses_a_key_another_tuner_took_after_the_check(tmp_path, monkeypatch):
    # A multi-size tune checks its keys when it starts and takes each when it gets to it, minutes later
    # perhaps: a key a worker claimed meanwhile is refused as it is taken, not tuned twice.
    from coconet.tuner import tune as tune_module

    prog = example("adam")
    me = this_process()
    request = Request(prog, ({"N": 3000},), world=2, budget=5, backends=("gloo",), protocol=FAST)
    with Store.open(f"sqlite:///{tmp_path / 'coconet.db'}") as store:
        store.add_program(prog)

        def late(store, prog, *args, **kwargs):
            _free_keys(store, prog, *args, **kwargs)  # the key is free at the check...
            late.job = store.take_job(prog.hash, {"N": 3000}, "local", 2, shardable="m,v", driver=me.text)

        monkeypatch.setattr(tune_module, "_free_keys", late)
        monkeypatch.setattr(tune_module, "connect", lambda *a, **k: None)  # refused before any rank is needed
        monkeypatch.setattr(tune_module, "offer", lambda: Offer((Node("n0", "127.0.0.1", 8.0, 0.0),)))
        with pytest.raises(
            CoconetError,
            match=rf"N=3000 \(job \d+, pid {me.pid} on {me.host}\) on local, world 2 "
            rf"is being tuned",
        ):
            tune(request, store)
        assert [(j.id, j.state) for j in store.jobs()] == [(late.job.id, "running")]


def test_tune_takes_a_key_whose_tuner_is_gone(tmp_path):
    prog = example("adam")
    me = this_process()
    dead = Driver(me.host, me.machine, 2**22 + 1, "1")  # no such process on this machine
    request = Request(prog, ({"N": 3000},), world=2, budget=5, backends=("gloo",), protocol=FAST)
    with Store.open(f"sqlite:///{tmp_path / 'coconet.db'}") as store:
        store.add_program(prog)
        killed = store.take_job(prog.hash, {"N": 3000}, "local", 2, shardable="m,v", driver=dead.text)
        _free_keys(store, prog, [{"N": 3000}], request, "m,v")  # its heartbeat is fresh, its process gone
        job = store.job(killed.id)
        assert job.state == "interrupted" and "left by the process that ran it" in job.error
        # a process elsewhere that stopped beating holds nothing either
        elsewhere = store.take_job(
            prog.hash,
            {"N": 3000},
            "local",
            2,
            shardable="m,v",
            driver=Driver("another-host", me.machine, me.pid, me.start).text,
        )
        with pytest.raises(CoconetError, match="is being tuned"):
            _free_keys(store, prog, [{"N": 3000}], request, "m,v")
        _free_keys(store, prog, [{"N": 3000}], request, "m,v", stale_s=0)
        assert store.job(elsewhere.id).state == "interrupted"


def test_a_killed_result_in_the_store_is_measured_again_once(tmp_path):
    """What a tuner killed before telling the study left in the store: a candidate killed once is left out (to
    be measured again), one killed twice keeps its failure, and one that lived on its retry is taken."""
    from coconet.server.records import NewMeasurement
    from coconet.tuner.search import Candidate, SearchSpace
    from coconet.tuner.tune import _recorded

    prog = example("adam")
    sizes = {"N": 4096}
    space = SearchSpace.of(prog, ("gloo",), 1)
    once, twice, lived = space.schedules[:3]
    request = Request(prog, (sizes,), world=2, backends=("gloo",), protocol=FAST)
    with Store.open(f"sqlite:///{tmp_path / 'c.db'}") as store:
        store.add_program(prog)
        job = store.create_job(prog.hash, sizes, "local", 2, budget=3)
        common = dict(
            sizes=sizes, topology="local", world=2, backend="gloo", job_id=job, versions={"kernels": FAST.kernels}
        )
        killed = dict(status="killed", error="rank 1 died", **common)
        store.add_measurements(
            [
                NewMeasurement.of(once, **killed),
                NewMeasurement.of(twice, **killed),
                NewMeasurement.of(twice, **killed),
                NewMeasurement.of(lived, **killed),
                NewMeasurement.of(lived, median_s=1e-3, samples=[1e-3] * 3, **common),
            ]
        )
        got = _recorded(store, space, prog, sizes, request)
    assert Candidate(once, "gloo").key not in got
    assert got[Candidate(twice, "gloo").key].result.status == "killed"
    assert got[Candidate(lived, "gloo").key].result.status == "ok"


def test_a_candidate_killed_from_outside_is_tried_again_on_the_next_run(ray_local, tmp_path):
    """Rank 1 of the baseline is SIGKILLed mid-check, as the OOM killer or an operator would: recorded as
    ``killed``, the tuning goes on; the next run of the key measures the baseline again (the kill was not the
    schedule's doing) and records its result, reusing the others' trials."""
    from tests.tuner.test_runner import wrapped

    marker = tmp_path / "killed-once"
    killing = wrapped(
        "",
        f"    if rank == 1 and not os.path.exists({str(marker)!r}):\n"
        f"        open({str(marker)!r}, 'w').close()\n"
        "        os.kill(os.getpid(), 9)\n"
        "    out = _generated(tensors, scalars, **kw)",
    )

    def lowering(schedule, backend, kernels):
        return (killing if schedule.transforms == () else lower)(schedule, backend, kernels)

    prog = example("adam")
    sizes = {"N": 1500}
    request = Request(prog, (sizes,), world=2, budget=3, backends=("gloo",), protocol=FAST, depth=1)
    with Store.open(f"sqlite:///{tmp_path / 'c.db'}") as store:
        [first] = tune(request, store, lowering=lowering)
        assert [t.result.status for t in first.outcome.failed] == ["killed"] and marker.exists()
        assert re.match(r"rank 1 \(node \w+ at [^)]+\) died", first.outcome.failed[0].result.error)
        [second] = tune(request, store, lowering=lowering)
        assert not second.outcome.failed and second.outcome.baseline.result.status == "ok"
        rows = [m for m in store.measurements(prog.hash, sizes, "local") if m.schedule == "baseline"]
        assert [m.status for m in rows][:2] == ["killed", "ok"] and rows[1].job_id == second.job_id
        # the other two trials were not measured again: their only rows are the first run's (and re-timings)
        searched = [
            m for m in store.measurements(prog.hash, sizes, "local", job_id=second.job_id) if m.schedule != "baseline"
        ]
        assert len(searched) == len(second.outcome.retimed) - 1
