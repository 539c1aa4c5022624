"""The search over a program's schedules, with a stand-in for the measurement: what it suggests,
what it reuses, what it resumes — the Ray measurement itself is tested in test_runner."""

import math
import runpy
from pathlib import Path

import pytest

from coconet.codegen.launch import RunResult
from coconet.schedules.schedule import Schedule
from coconet.tuner.search import Candidate, SearchSpace, Trial, knob_variants, search, structure_text, study_name

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
        return (1.0 / (1 + len(c.schedule.transforms)) + 0.01 * math.log2(k.get("fc_chunks", 1))
                + (0.0 if c.backend == "shm" else 0.05) + 1e-3 * (int(c.schedule.hash, 16) % 97) / 97)

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
    trial_calls = fake.calls[:-2]  # the last two: the two fastest timed again
    assert len(trial_calls) == len(set(trial_calls)) == space.size  # every candidate once, none twice
    assert out.winner.result.median_s == pytest.approx(exhaustive_best(space, fake))
    assert fake.calls[-2:] == [out.winner.candidate.key, out.runner_up.candidate.key]
    assert out.baseline.candidate.schedule.transforms == () and out.speedup > 1
    # the failing candidates are recorded with their reason and scored, not dropped
    assert {t.result.status for t in out.failed} == {"runtime_error"}
    assert all("boom" in t.result.error for t in out.failed)


def test_tpe_within_budget_starts_from_the_baseline_and_the_prior(storage):
    prog = example("adam")
    space = SearchSpace.of(prog, ["gloo", "shm"])
    fake = Fake()
    prior = [Candidate(space.schedules[-1].with_knobs(fc_chunks=8), "shm")] \
        if "fc_chunks" in space.schedules[-1].knob_domains else [Candidate(space.schedules[-1], "shm")]
    out = search(space, {"N": 1024}, storage=storage, study="t", budget=20, measure=fake, prior=prior)
    assert space.size > 20
    assert len(set(fake.calls[:-2])) == len(fake.calls[:-2]) == 20  # the budget counts candidates
    assert fake.calls[0] == Candidate(Schedule(prog), "gloo").key and fake.calls[1] == prior[0].key
    assert out.winner.result.median_s <= fake.time_of(prior[0])


def test_tpe_finds_the_exhaustive_winner_on_a_small_space(storage):
    prog = example("megatron_mlp")
    space = SearchSpace.of(prog, ["gloo"])
    fake = Fake()
    budget = space.size // 2
    out = search(space, {"B": 2, "S": 3, "H": 5}, storage=storage, study="m", budget=budget, measure=fake, seed=1)
    assert len(set(fake.calls[:-2])) == budget
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
    trial_calls = second.calls[:-2]
    assert not set(trial_calls) & set(first.calls)  # what finished before is reused
    assert len(set(trial_calls)) + len(first.calls) == space.size
    assert len(out.trials) == space.size
    # and once the study is complete, running it again measures only the final re-timing
    third = Fake()
    search(space, {"N": 1024}, storage=storage, study=name, budget=space.size, measure=third)
    assert len(third.calls) == 2


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
    out = search(space, {"N": 1024}, storage=storage, study=name, budget=space.size, measure=second,
                 recorded=dict(stored))
    assert not set(second.calls[:-2]) & set(first.calls)
    assert len(set(second.calls[:-2])) + len(first.calls) == space.size == len(out.trials)
    fifth = next(t for t in out.trials if t.candidate.key == first.calls[-1])
    assert fifth.record_id == 5 and fifth.result.median_s == first.time_of(fifth.candidate)
