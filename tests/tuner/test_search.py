"""The search over a program's schedules, with a stand-in for the measurement: what it suggests,
what it reuses, what it resumes — the Ray measurement itself is tested in test_runner."""

import math
import runpy
from pathlib import Path

import pytest

from coconet.schedules.schedule import Schedule
from coconet.tuner.launch import RunResult
from coconet.tuner.search import (
    RETIME_ROUNDS,
    Candidate,
    SearchSpace,
    Trial,
    knob_variants,
    retime,
    search,
    structure_text,
    study_name,
)

ROOT = Path(__file__).parents[2]


def example(name):
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"))["program"].ir


class Fake:
    """Deterministic times per candidate, some candidates failing; counts what it measured."""

    def __init__(self, fail=(), interrupt_after=None):
        self.calls: list[str] = []
        self.fail = set(fail)
        self.interrupt_after = interrupt_after

    def time_of(self, c: Candidate) -> float:
        # a smooth landscape: more transforms and bigger fc_chunks are faster, shm a little faster
        k = c.schedule.knob_values
        return (
            1.0 / (1 + len(c.schedule.transforms))
            + 0.01 * math.log2(k.get("fc_chunks", 1))
            + (0.0 if c.backend == "shm" else 0.05)
            + 1e-3 * (int(c.schedule.hash, 16) % 97) / 97
        )

    def __call__(self, c: Candidate) -> RunResult:
        if self.interrupt_after is not None and len(self.calls) >= self.interrupt_after:
            raise KeyboardInterrupt
        self.calls.append(c.key)
        if structure_text(c.schedule) in self.fail:
            return RunResult(c.text, c.schedule.hash, "runtime_error", error="rank 1: RuntimeError: boom")
        return RunResult(c.text, c.schedule.hash, "ok", True, 0.0, [self.time_of(c)] * 8)


@pytest.fixture
def storage():
    # in memory: these tests are about the search; the RDB storage is exercised by test_tune
    import optuna

    return optuna.storages.InMemoryStorage()


def retimes(out) -> int:
    """How many measurements the final re-timing took: each of its candidates once a round."""
    return RETIME_ROUNDS * len(out.retimed)


def searched(fake: Fake, out) -> list[str]:
    """The candidates the search measured, before the final re-timing."""
    return fake.calls[: len(fake.calls) - retimes(out)]


def exhaustive_best(space: SearchSpace, fake: Fake) -> float:
    best = math.inf
    for s in space.schedules:
        for b in space.backends:
            for v in knob_variants(s):
                if structure_text(s) not in fake.fail:
                    best = min(best, fake.time_of(Candidate(v, b)))
    return best


def test_exhaustive_when_the_space_fits_the_budget(storage):
    prog = example("adam")
    space = SearchSpace.of(prog, ["gloo", "shm"])
    fake = Fake(fail={structure_text(space.schedules[1])})
    out = search(space, {"N": 1024}, storage=storage, study="s", budget=space.size, measure=fake)
    trial_calls = searched(fake, out)
    assert len(trial_calls) == len(set(trial_calls)) == space.size  # every candidate once, none twice
    assert out.winner.result.median_s == pytest.approx(exhaustive_best(space, fake))
    # then the two fastest and the baseline in turns, the order reversed in the second round
    turn = [out.winner.candidate.key, out.runner_up.candidate.key, out.baseline.candidate.key]
    assert fake.calls[len(trial_calls) :] == turn + turn[::-1]
    assert out.baseline.result.samples == out.retimed[2].result.samples and len(out.baseline.result.samples) == 16
    assert out.speedup == pytest.approx(out.baseline.result.median_s / out.winner.result.median_s)
    assert out.baseline.candidate.schedule.transforms == () and out.speedup > 1
    # the failing candidates are recorded with their reason and scored, not dropped
    assert {t.result.status for t in out.failed} == {"runtime_error"}
    assert all("boom" in t.result.error for t in out.failed)


def test_the_re_timing_is_the_one_account_of_the_winner(storage):
    """The machine slows down after the search (as a loaded machine does): every figure of the outcome is the
    re-timing's, the baseline's too, so the speed-up compares times taken together; and where the re-timing
    finds the search's runner-up faster, it wins and the outcome says the order was reversed."""
    prog = example("adam")
    space = SearchSpace.of(prog, ["gloo"], depth=1)
    first, second = sorted(
        (Candidate(v, "gloo") for s in space.schedules for v in knob_variants(s)), key=Fake().time_of
    )[:2]

    class Drifting(Fake):
        def __call__(self, c):
            res = super().__call__(c)
            if len(self.calls) > space.size:  # the re-timing: three times slower, the first two swapped
                slow = (self.time_of(second if c.key == first.key else first if c.key == second.key else c)) * 3
                res.samples = [slow] * 8
            return res

    fake = Drifting()
    out = search(space, {"N": 1024}, storage=storage, study="d", budget=space.size, measure=fake)
    assert out.search_best.candidate.key == first.key and out.winner.candidate.key == second.key
    assert out.order_reversed and out.runner_up.candidate.key == first.key
    assert out.winner.result.median_s == pytest.approx(3 * fake.time_of(first))
    assert out.baseline.result.median_s == pytest.approx(3 * fake.time_of(out.baseline.candidate))
    assert out.speedup == pytest.approx(fake.time_of(out.baseline.candidate) / fake.time_of(first))
    assert out.baseline_searched.result.median_s == pytest.approx(fake.time_of(out.baseline.candidate))


def test_a_candidate_failing_in_one_round_of_the_re_timing_fails_it():
    prog = example("adam")
    a, b = (Candidate(s, "gloo") for s in SearchSpace.of(prog, ["gloo"], depth=1).schedules[:2])
    calls = []

    def measure(c):
        calls.append(c.key)
        if c.key == b.key and len(calls) > 2:
            return RunResult(c.text, c.schedule.hash, "timeout", error="no result within 300 s")
        return RunResult(c.text, c.schedule.hash, "ok", True, 0.0, [1e-3] * 4)

    got = dict((c.key, r) for c, r in retime([a, b], measure))
    assert calls == [a.key, b.key, b.key, a.key]
    assert len(got[a.key].samples) == 8 and got[b.key].status == "timeout"


def test_tpe_within_budget_starts_from_the_baseline_and_the_prior(storage):
    prog = example("adam")
    space = SearchSpace.of(prog, ["gloo", "shm"])
    fake = Fake()
    prior = (
        [Candidate(space.schedules[-1].with_knobs(fc_chunks=8), "shm")]
        if "fc_chunks" in space.schedules[-1].knob_domains
        else [Candidate(space.schedules[-1], "shm")]
    )
    out = search(space, {"N": 1024}, storage=storage, study="t", budget=20, measure=fake, prior=prior)
    assert space.size > 20
    assert len(set(searched(fake, out))) == len(searched(fake, out)) == 20  # the budget counts candidates
    assert fake.calls[0] == Candidate(Schedule(prog), "gloo").key and fake.calls[1] == prior[0].key
    assert out.winner.result.median_s <= fake.time_of(prior[0])


def test_tpe_finds_the_exhaustive_winner_on_a_small_space(storage):
    prog = example("megatron_mlp")
    space = SearchSpace.of(prog, ["gloo"])
    fake = Fake()
    budget = space.size // 2
    out = search(space, {"B": 2, "S": 3, "H": 5}, storage=storage, study="m", budget=budget, measure=fake, seed=1)
    assert len(set(searched(fake, out))) == budget
    best = exhaustive_best(space, fake)
    assert out.winner.result.median_s <= best * 1.05


def test_a_killed_study_resumes_without_measuring_again(storage):
    prog = example("adam")
    space = SearchSpace.of(prog, ["gloo", "shm"])
    name = study_name(prog, {"N": 1024}, "local", 2)
    first = Fake(interrupt_after=7)
    with pytest.raises(KeyboardInterrupt):
        search(space, {"N": 1024}, storage=storage, study=name, budget=space.size, measure=first)
    assert len(first.calls) == 7
    second = Fake()
    out = search(space, {"N": 1024}, storage=storage, study=name, budget=space.size, measure=second)
    trial_calls = searched(second, out)
    assert not set(trial_calls) & set(first.calls)  # what finished before is reused
    assert len(set(trial_calls)) + len(first.calls) == space.size
    assert len(out.trials) == space.size
    # and once the study is complete, running it again measures only the final re-timing
    third = Fake()
    again = search(space, {"N": 1024}, storage=storage, study=name, budget=space.size, measure=third)
    assert len(third.calls) == retimes(again) == 6


def test_a_result_recorded_but_not_told_is_not_measured_again(storage):
    """Killed between recording a candidate's result in the store and telling the study: the run again
    takes that result from the store (``recorded``) instead of measuring it twice."""
    prog = example("adam")
    space = SearchSpace.of(prog, ["gloo", "shm"])
    name = study_name(prog, {"N": 1024}, "local", 2)
    stored: dict[str, Trial] = {}

    def record(c, res, role):
        stored[c.key] = Trial(c, res, len(stored) + 1, reused=True)
        if len(stored) == 5:
            raise KeyboardInterrupt  # the kill lands right after the fifth result is written
        return len(stored)

    first = Fake()
    with pytest.raises(KeyboardInterrupt):
        search(space, {"N": 1024}, storage=storage, study=name, budget=space.size, measure=first, record=record)
    assert len(first.calls) == 5
    second = Fake()
    out = search(
        space, {"N": 1024}, storage=storage, study=name, budget=space.size, measure=second, recorded=dict(stored)
    )
    assert not set(searched(second, out)) & set(first.calls)
    assert len(set(searched(second, out))) + len(first.calls) == space.size == len(out.trials)
    fifth = next(t for t in out.trials if t.candidate.key == first.calls[-1])
    assert fifth.record_id == 5 and fifth.result.median_s == first.time_of(fifth.candidate)


def test_a_candidate_killed_from_outside_is_measured_once_more_on_the_next_run(storage):
    """A rank of one candidate killed (the OOM killer, an operator): the next run of the key measures that
    candidate again, once; killed again, the failure is kept and later runs leave it alone."""
    prog = example("adam")
    space = SearchSpace.of(prog, ["gloo"], depth=1)
    name = study_name(prog, {"N": 1024}, "local", 2)
    victim = Candidate(space.schedules[1], "gloo")

    class Killing(Fake):
        def __init__(self, kill: bool):
            super().__init__()
            self.kill = kill

        def __call__(self, c):
            res = super().__call__(c)
            if self.kill and c.key == victim.key:
                return RunResult(c.text, c.schedule.hash, "killed", error="rank 1 died: killed by SIGKILL")
            return res

    def run(kill: bool):
        fake = Killing(kill)
        return fake, search(space, {"N": 1024}, storage=storage, study=name, budget=space.size, measure=fake)

    first, out = run(kill=True)
    assert victim.key in searched(first, out) and {t.result.status for t in out.failed} == {"killed"}
    second, out = run(kill=True)  # tried once more: killed again
    assert searched(second, out) == [victim.key] and out.failed[0].result.status == "killed"
    third, out = run(kill=False)  # a failure that repeats is kept: not measured a third time
    assert searched(third, out) == [] and out.failed[0].result.status == "killed"

    # killed once, then fine: the retry's result is the candidate's
    other = study_name(prog, {"N": 2048}, "local", 2)
    search(space, {"N": 2048}, storage=storage, study=other, budget=space.size, measure=Killing(True))
    fine = Killing(False)
    out = search(space, {"N": 2048}, storage=storage, study=other, budget=space.size, measure=fine)
    assert searched(fine, out) == [victim.key] and not out.failed


def _sqlite(tmp_path):
    # the CLI's storage: the RDB one holds a study to its parameters' first choices, as the in-memory one does
    return f"sqlite:///{tmp_path / 'optuna.db'}"


def _waiting(storage, prog, backend):
    import optuna

    return [
        t
        for name in optuna.get_all_study_names(storage)
        for t in optuna.load_study(study_name=name, storage=storage).get_trials(
            states=(optuna.trial.TrialState.WAITING,)
        )
        if t.params.get("backend", t.system_attrs.get("fixed_params", {}).get("backend")) == backend
    ]


def test_a_key_tuned_again_on_fewer_backends(tmp_path):
    """`coconet tune … --backend gloo` after a tuning over gloo and shm: the shm candidates the first run left
    queued are not run, its results on gloo count and are not measured again, the winner runs on gloo."""
    import optuna

    storage = _sqlite(tmp_path)
    prog = example("adam")
    name = study_name(prog, {"N": 1024}, "local", 2)
    wide = SearchSpace.of(prog, ["gloo", "shm"])
    first = Fake()
    prior = [Candidate(wide.schedules[-1], "shm"), Candidate(wide.schedules[-2], "shm")]
    before = search(wide, {"N": 1024}, storage=storage, study=name, budget=2, measure=first, prior=prior)
    assert before.winner.candidate.backend == "shm" and _waiting(storage, prog, "shm")  # left queued
    kept = {
        n: [(t.params, t.value) for t in optuna.load_study(study_name=n, storage=storage).trials]
        for n in optuna.get_all_study_names(storage)
    }
    narrow = SearchSpace.of(prog, ["gloo"])
    second = Fake()
    out = search(narrow, {"N": 1024}, storage=storage, study=name, budget=4, measure=second)
    assert len(out.trials) == 4 and {t.candidate.backend for t in out.trials} == {"gloo"}
    assert out.winner.candidate.backend == "gloo" and out.runner_up.candidate.backend == "gloo"
    assert first.calls[0] == out.baseline.candidate.key not in searched(second, out)  # searched once, on gloo
    assert len(second.calls) == 3 + retimes(out) and all(k.startswith("gloo:") for k in second.calls)
    for n, trials in kept.items():  # the first run's study as it was
        assert [(t.params, t.value) for t in optuna.load_study(study_name=n, storage=storage).trials][
            : len(trials)
        ] == trials


def test_a_key_tuned_again_at_a_smaller_depth(storage):
    prog = example("adam")
    name = study_name(prog, {"N": 1024}, "local", 2)
    deep = SearchSpace.of(prog, ["gloo", "shm"])
    first = Fake()
    deepest = max(deep.schedules, key=lambda s: len(s.transforms))
    before = search(
        deep,
        {"N": 1024},
        storage=storage,
        study=name,
        budget=2,
        measure=first,
        prior=[Candidate(deepest, "shm"), Candidate(deep.schedules[-3], "gloo")],
    )
    assert len(before.winner.candidate.schedule.transforms) > 1
    shallow = SearchSpace.of(prog, ["gloo", "shm"], depth=1)
    second = Fake()
    out = search(shallow, {"N": 1024}, storage=storage, study=name, budget=4, measure=second)
    assert len(out.trials) == 4 and all(
        structure_text(t.candidate.schedule) in shallow.by_structure for t in out.trials
    )
    assert structure_text(out.winner.candidate.schedule) in shallow.by_structure
    assert first.calls[0] not in searched(second, out) and len(second.calls) == 3 + retimes(out)


def test_a_result_outside_the_space_asked_for_is_never_its_winner(storage):
    """The fastest candidate of a wider tuning, in the study and in the store (``recorded``), stays its winner
    there and is neither counted nor the winner in a narrower one; tuned over the wide space again, it is."""
    prog = example("adam")
    name = study_name(prog, {"N": 1024}, "local", 2)
    wide = SearchSpace.of(prog, ["gloo", "shm"])
    fake = Fake()
    fastest = min(
        (Candidate(v, b) for s in wide.schedules for v in knob_variants(s) for b in wide.backends), key=fake.time_of
    )
    assert fastest.backend == "shm"
    stored: dict[str, Trial] = {}

    def record(c, res, role):
        if role == "trial":
            stored[c.key] = Trial(c, res, len(stored) + 1, reused=True)
        return len(stored)

    first = search(
        wide, {"N": 1024}, storage=storage, study=name, budget=3, measure=fake, record=record, prior=[fastest]
    )
    assert first.winner.candidate.key == fastest.key
    narrow = SearchSpace.of(prog, ["gloo"])
    second = search(
        narrow, {"N": 1024}, storage=storage, study=name, budget=4, measure=Fake(), record=record, recorded=dict(stored)
    )
    assert fastest.key not in {t.candidate.key for t in second.trials}
    assert second.winner.candidate.backend == "gloo"
    assert second.winner.result.median_s == min(t.result.median_s for t in second.trials)
    again = Fake()
    third = search(wide, {"N": 1024}, storage=storage, study=name, budget=3, measure=again, recorded=dict(stored))
    assert third.winner.candidate.key == fastest.key
    assert len(again.calls) == retimes(third)  # the gloo results of the narrower run count here too


def test_a_prior_the_space_cannot_express_is_left_out(storage):
    prog = example("adam")
    space = SearchSpace.of(prog, ["gloo"], depth=3)
    deeper = next(s for s in SearchSpace.of(prog, ["gloo"]).schedules if structure_text(s) not in space.by_structure)
    chunked = next(s for s in space.schedules if "fc_chunks" in s.knob_domains)
    fake = Fake()
    out = search(
        space,
        {"N": 1024},
        storage=storage,
        study="p",
        budget=3,
        measure=fake,
        prior=[
            Candidate(deeper, "gloo"),
            Candidate(chunked.with_knobs(fc_chunks=3), "gloo"),
            Candidate(chunked, "shm"),
        ],
    )
    assert len(out.trials) == 3 and len(set(searched(fake, out))) == 3
    assert all(
        structure_text(t.candidate.schedule) in space.by_structure and t.candidate.backend == "gloo" for t in out.trials
    )
    assert all(t.candidate.schedule.knob_values.get("fc_chunks", 1) in (1, 2, 4, 8) for t in out.trials)


def test_results_timed_with_eager_kernels_are_no_answer_for_compiled_ones(storage):
    """The same key tuned with --kernels eager, then with the compiled kernels: the second search measures
    its own candidates; the eager timings (other code) are neither reused nor its winner."""
    prog = example("adam")
    space = SearchSpace.of(prog, ["gloo"], depth=1)
    eager, compiled = Fake(), Fake()
    search(
        space,
        {"N": 1024},
        storage=storage,
        study=study_name(prog, {"N": 1024}, "local", 2, kernels="eager"),
        budget=3,
        measure=eager,
    )
    out = search(
        space, {"N": 1024}, storage=storage, study=study_name(prog, {"N": 1024}, "local", 2), budget=3, measure=compiled
    )
    assert len(eager.calls) >= 3 and set(eager.calls[:3]) <= set(compiled.calls)
    assert not any(t.reused for t in out.trials)
