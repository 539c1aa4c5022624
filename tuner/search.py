"""Search over a program's schedules with Optuna: one study per (program, sizes, topology, world) and space.

The parameters are the backend, the schedule (categorical, by its transforms) and the knobs of
that schedule (categorical over each knob's domain, asked only when the schedule has it). Where
the whole space fits the budget the study is exhaustive (BruteForceSampler); otherwise TPE. The
baseline and any prior candidates (the cost model's top-k, the neighbouring sizes' winners) are
enqueued first. A candidate measured once in a study is never measured again: a repeated
suggestion, or a study resumed after the tuner was killed, reuses the trial that has it. A failed
candidate scores infinity and carries its reason. At the end the two fastest and the baseline are timed
again in turns, and the fastest of that re-timing wins: the winner's time, the runner-up's and the
speed-up over the baseline all come from one stretch of the machine's time.

Optuna fixes a parameter's choices for the life of a study, so a key searched over another space (other
backends, another depth, other knobs) gets a study of its own, named by the space's digest. It starts
from the key's other studies' results that its space can express; theirs stay as they were.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from coconet.errors import CoconetError
from coconet.schedules.dims import format_sizes
from coconet.schedules.ir import Program
from coconet.schedules.schedule import BASELINE, Schedule
from coconet.schedules.shardable import EVERY
from coconet.schedules.space import generate
from coconet.tuner.launch import RunResult

SUGGESTIONS_PER_CANDIDATE = 10
RETIME_ROUNDS = 2
KILLED_TRIES = 2  # a candidate whose rank was killed is measured once more before its failure is kept


@dataclass(frozen=True)
class Candidate:
    schedule: Schedule
    backend: str

    @property
    def key(self) -> str:
        return f"{self.backend}:{self.schedule.hash}"

    @property
    def text(self) -> str:
        return self.schedule.text


def structure_text(s: Schedule) -> str:
    """A schedule's transforms without its knob values: the categorical the study chooses from."""
    return "; ".join(t.text() for t in s.transforms) if s.transforms else BASELINE


def knob_variants(s: Schedule) -> list[Schedule]:
    """``s`` with every combination of its knobs' values (``s`` itself when it has none)."""
    doms = s.knob_domains
    names = sorted(doms)
    if not names:
        return [s]
    return [s.with_knobs(**dict(zip(names, values))) for values in itertools.product(*(doms[k][1] for k in names))]


@dataclass(frozen=True)
class SearchSpace:
    """Every (backend, schedule, knob values) of a program the study may suggest."""

    program: Program
    backends: tuple[str, ...]
    schedules: tuple[Schedule, ...]

    @classmethod
    def of(
        cls, program: Program, backends: Sequence[str], depth: int = 6, shardable: Iterable[str] | None = None
    ) -> "SearchSpace":
        """``shardable``: the state a schedule may leave sharded (None: any), the others left out."""
        if not backends:
            raise CoconetError("no backend to tune on")
        schedules = generate(program, depth).schedules
        if shardable is not None:
            allowed = set(shardable)
            schedules = tuple(s for s in schedules if set(s.sharded) <= allowed)
        return cls(program, tuple(dict.fromkeys(backends)), schedules)

    @property
    def by_structure(self) -> dict[str, Schedule]:
        return {structure_text(s): s for s in self.schedules}

    @property
    def knob_domains(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for s in self.schedules:
            for k, (_, dom) in s.knob_domains.items():
                if out.setdefault(k, tuple(dom)) != tuple(dom):
                    raise CoconetError(f"knob {k} has domains {out[k]} and {tuple(dom)} in one space")
        return out

    @property
    def size(self) -> int:
        return len(self.backends) * sum(math.prod(len(d) for _, d in s.knob_domains.values()) for s in self.schedules)

    @property
    def choices(self) -> dict[str, tuple]:
        """Every parameter's choices, in the order ``suggest`` asks them: what Optuna holds the study to."""
        return {"backend": self.backends, "schedule": tuple(self.by_structure), **self.knob_domains}

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(sorted((k, list(v)) for k, v in self.choices.items())).encode()).hexdigest()[
            :12
        ]

    def params(self, c: Candidate) -> dict[str, Any]:
        return {"backend": c.backend, "schedule": structure_text(c.schedule), **c.schedule.knob_values}

    def fits(self, params: Mapping[str, Any]) -> bool:
        """Whether ``suggest`` can give exactly these parameters: a value out of its choices makes Optuna
        raise, and a knob missing or extra names another candidate than the one meant."""
        base = self.by_structure.get(params.get("schedule"))
        if base is None or params.get("backend") not in self.backends:
            return False
        doms = base.knob_domains
        knobs = {k: v for k, v in params.items() if k not in ("backend", "schedule")}
        return set(knobs) == set(doms) and all(v in doms[k][1] for k, v in knobs.items())

    def contains(self, c: Candidate) -> bool:
        return self.fits(self.params(c))

    def suggest(self, trial) -> Candidate:
        backend = trial.suggest_categorical("backend", list(self.backends))
        base = self.by_structure[trial.suggest_categorical("schedule", list(self.by_structure))]
        domains = self.knob_domains
        knobs = {k: trial.suggest_categorical(k, list(domains[k])) for k in sorted(base.knob_domains)}
        return Candidate(base.with_knobs(**knobs), backend)


@dataclass
class Progress:
    """What a study has done so far; handed to the progress callback after every trial."""

    trials: int = 0
    budget: int = 0
    measured: int = 0
    reused: int = 0
    failed: int = 0
    best: tuple[str, float] | None = None  # (candidate key, median s)
    last: str = ""


@dataclass(frozen=True)
class Trial:
    candidate: Candidate
    result: RunResult
    record_id: Any = None
    reused: bool = False


@dataclass
class Outcome:
    study: str
    sizes: dict[str, int]
    trials: list[Trial]
    winner: Trial | None
    runner_up: Trial | None
    baseline: Trial | None
    retimed: list[Trial] = field(default_factory=list)  # winner, runner-up and baseline, timed again in turns
    search_best: Trial | None = None  # the search's fastest, by the search's own figure
    order_reversed: bool = False  # the re-timing's fastest is not the search's

    @property
    def speedup(self) -> float | None:
        if not (self.winner and self.baseline and self.baseline.result.median_s and self.winner.result.median_s):
            return None
        return self.baseline.result.median_s / self.winner.result.median_s

    @property
    def baseline_searched(self) -> Trial | None:
        """The baseline's trial in the search, whose figure the search's ratios are taken against."""
        key = self.baseline.candidate.key if self.baseline is not None else None
        return next((t for t in self.trials if t.candidate.key == key), None)

    @property
    def failed(self) -> list[Trial]:
        return [t for t in self.trials if t.result.status != "ok"]


Measure = Callable[[Candidate], RunResult]
Record = Callable[[Candidate, RunResult, str], Any]  # (candidate, result, role) -> record id


def study_name(
    program: Program,
    sizes: Mapping[str, int],
    topology: str,
    world: int,
    shardable: str = EVERY,
    kernels: str = "compiled",
) -> str:
    # the family of the studies of a key, one per space (``search`` adds the space's digest); a shardable set
    # other than ``*`` has a family of its own, named as when it was how a key's studies were told apart
    name = f"coconet:{program.hash}:{format_sizes(sizes)}:{topology}:w{world}"
    name = name if shardable == EVERY else f"{name}:shard[{shardable}]"
    # eager kernels time other code: their results are no answer for the compiled kernels' search, nor back
    return name if kernels == "compiled" else f"{name}:kernels[{kernels}]"


def search(
    space: SearchSpace,
    sizes: Mapping[str, int],
    *,
    storage,
    study: str,
    budget: int,
    measure: Measure,
    record: Record | None = None,
    prior: Iterable[Candidate] = (),
    seed: int = 0,
    on_progress: Callable[[Progress], None] | None = None,
    sampler: str | None = None,
    recorded: Mapping[str, Trial] | None = None,
) -> Outcome:
    """Run (or resume) the study of ``space`` in the family ``study`` (``study_name``), in Optuna ``storage``,
    until ``budget`` candidates have results or the space is exhausted; ``measure`` times a candidate,
    ``record`` stores each new result.
    ``recorded``: results already in the store by candidate key, used instead of measuring again (a tuner
    killed after recording a result but before the study heard of it).
    ``sampler`` (``brute``, ``tpe``, ``random``) overrides the choice by budget (for benchmarks)."""
    st = _open(space, study, storage, sampler or ("brute" if space.size <= budget else "tpe"), seed)
    trials, base = _resume(st, space, prior)
    progress = Progress(
        trials=len(trials), budget=min(budget, space.size), failed=sum(t.result.status != "ok" for t in trials.values())
    )
    _update_best(progress, trials.values())

    def objective(trial) -> float:
        c = space.suggest(trial)
        trial.set_user_attr("candidate", c.key)
        trial.set_user_attr("schedule", c.text)
        if c.key not in trials and recorded and c.key in recorded:
            trials[c.key] = recorded[c.key]
        if c.key in trials:  # suggested again, measured before a restart, or in the store: never twice
            t = trials[c.key]
            progress.reused += 1
            _attrs(trial, t.result)
            trial.set_user_attr("reused", True)
            if t.record_id is not None:
                trial.set_user_attr("record_id", t.record_id)
            return _value(t.result)
        res = measure(c)
        rid = record(c, res, "trial") if record else None
        trials[c.key] = Trial(c, res, rid)
        _attrs(trial, res)
        if rid is not None:
            trial.set_user_attr("record_id", rid)
        progress.measured += 1
        progress.failed += res.status != "ok"
        return _value(res)

    # The budget counts candidates, not suggestions: TPE repeats itself in a small categorical
    # space, and a repeat costs nothing. The cap on suggestions keeps it from circling forever.
    goal = min(budget, space.size)
    cap = len(st.get_trials(deepcopy=False)) + SUGGESTIONS_PER_CANDIDATE * goal

    def after(study, frozen) -> None:
        progress.trials = len(trials)
        progress.last = frozen.user_attrs.get("schedule", "")
        _update_best(progress, trials.values())
        if on_progress:
            on_progress(progress)
        if len(trials) >= goal or frozen.number + 1 >= cap:
            study.stop()

    if on_progress:
        on_progress(progress)
    if len(trials) < goal:
        st.optimize(objective, callbacks=[after], gc_after_trial=False)
    return _finish(st.study_name, dict(sizes), list(trials.values()), base, measure, record)


def _open(space: SearchSpace, study: str, storage, kind: str, seed: int):
    """The Optuna study of ``space`` in the family ``study``, created or loaded, its orphaned trials failed and
    an earlier space's trials adopted."""
    import optuna

    # ERROR: a trial cut by Ctrl-C or a coconet bug is reported once, by the caller; Optuna would also log its traceback
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    with warnings.catch_warnings():  # BruteForceSampler is "experimental" since Optuna 3.1
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        samplers = {
            "brute": optuna.samplers.BruteForceSampler,
            "tpe": optuna.samplers.TPESampler,
            "random": optuna.samplers.RandomSampler,
        }
        if kind not in samplers:
            raise CoconetError(f"unknown sampler {kind!r} (use {', '.join(samplers)})")
        chosen = samplers[kind](seed=seed)
    st = optuna.create_study(
        study_name=f"{study}:space[{space.digest}]",
        storage=storage,
        sampler=chosen,
        direction="minimize",
        load_if_exists=True,
    )
    _fail_orphans(st)
    _adopt(st, space, study, storage)
    return st


def _resume(st, space: SearchSpace, prior: Iterable[Candidate]) -> tuple[dict[str, Trial], Candidate]:
    """The results the study has (each candidate's latest), and the queue: the baseline, ``prior``, and the
    candidates a killed or cut trial left without a result, unless measured or queued already."""
    import optuna

    complete = [
        t
        for t in st.get_trials(deepcopy=False)
        if t.state == optuna.trial.TrialState.COMPLETE and "candidate" in t.user_attrs
    ]
    done = {t.user_attrs["candidate"]: t for t in complete}  # each candidate's latest
    kills = Counter(t.user_attrs["candidate"] for t in complete if t.user_attrs.get("status") == "killed")
    # killed once (a signal from outside, perhaps): measured again in this run; killed twice, it stays
    again = [k for k, t in done.items() if t.user_attrs.get("status") == "killed" and kills[k] < KILLED_TRIES]
    trials: dict[str, Trial] = {k: _trial_from(space, t) for k, t in done.items() if k not in again}
    queued = {
        t.user_attrs.get("candidate") for t in st.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
    }
    # A trial cut short (the tuner killed or interrupted in it) finished as FAIL without a result:
    # the exhaustive sampler counts it as visited, so its candidate goes back in the queue.
    cut = [
        _trial_from(space, t).candidate
        for t in st.get_trials(deepcopy=False)
        if t.state == optuna.trial.TrialState.FAIL and "schedule" in t.params
    ]
    cut += [_trial_from(space, done[k]).candidate for k in again]
    base = Candidate(Schedule(space.program), space.backends[0])
    for c in [base, *prior, *cut]:
        # a prior from another space (a neighbour's winner, the store's) may have no place in this one
        if space.contains(c) and c.key not in trials and c.key not in queued:
            st.enqueue_trial(space.params(c), user_attrs={"candidate": c.key})
            queued.add(c.key)
    return trials, base


def _finish(
    study: str, sizes, trials: list[Trial], base: Candidate, measure: Measure, record: Record | None
) -> Outcome:
    """The search's two fastest and the baseline timed again in turns (``retime``); the fastest of that
    re-timing wins, and every figure of the outcome (winner, runner-up, baseline, speed-up) is the re-timing's,
    all taken on the same machine state."""
    ok = sorted((t for t in trials if t.result.status == "ok" and t.result.median_s), key=lambda t: t.result.median_s)
    baseline = next((t for t in trials if t.candidate.key == base.key), None)
    contenders = [t.candidate for t in ok[:2]]
    if baseline is not None and baseline.result.status == "ok" and base.key not in {c.key for c in contenders}:
        contenders.append(base)
    retimed = [Trial(c, res, record(c, res, "retime") if record else None) for c, res in retime(contenders, measure)]
    good = sorted(
        (t for t in retimed if t.result.status == "ok" and t.result.median_s), key=lambda t: t.result.median_s
    )
    winner = good[0] if good else (ok[0] if ok else None)
    runner_up = good[1] if len(good) > 1 else None
    baseline = next((t for t in retimed if t.candidate.key == base.key), baseline)
    reversed_ = bool(good) and bool(ok) and good[0].candidate.key != ok[0].candidate.key
    return Outcome(study, sizes, trials, winner, runner_up, baseline, retimed, ok[0] if ok else None, reversed_)


def retime(
    candidates: list[Candidate], measure: Measure, rounds: int = RETIME_ROUNDS
) -> list[tuple[Candidate, RunResult]]:
    """Each candidate measured ``rounds`` times in turns, the order reversed every other round (A B C, C B A: a
    drift of the machine over the re-timing weighs on each alike); per candidate, its rounds' samples together,
    or the first failure of its rounds."""
    merged: dict[str, RunResult] = {}
    for r in range(rounds):
        for c in candidates if r % 2 == 0 else candidates[::-1]:
            res = measure(c)
            had = merged.get(c.key)
            if had is None:
                merged[c.key] = res
            elif had.status == "ok" and res.status == "ok":
                merged[c.key] = dataclasses.replace(had, samples=[*had.samples, *res.samples])
            elif had.status == "ok":
                merged[c.key] = res
    return [(c, merged[c.key]) for c in candidates if c.key in merged]


def _value(res: RunResult) -> float:
    return res.median_s if res.status == "ok" and res.median_s else math.inf


def _attrs(trial, res: RunResult) -> None:
    trial.set_user_attr("status", res.status)
    trial.set_user_attr("samples", list(res.samples))
    if res.max_rel_err is not None and math.isfinite(res.max_rel_err):
        trial.set_user_attr("max_rel_err", res.max_rel_err)
    if res.error:
        trial.set_user_attr("error", res.error[:4000])


def _trial_from(space: SearchSpace, t) -> Trial:
    """A finished trial of an earlier run of the study, as this run's record of it."""
    p = dict(t.params)
    base = space.by_structure[p.pop("schedule")]
    backend = p.pop("backend")
    sched = base.with_knobs(**{k: v for k, v in p.items() if k in base.knob_domains})
    a = t.user_attrs
    res = RunResult(
        sched.text,
        sched.hash,
        a.get("status", "ok"),
        correct=a.get("status") != "wrong_result",
        max_rel_err=a.get("max_rel_err"),
        samples=list(a.get("samples", [])),
        error=a.get("error"),
    )
    return Trial(Candidate(sched, backend), res, a.get("record_id"), reused=True)


def _adopt(st, space: SearchSpace, family: str, storage) -> None:
    """Adds to ``st`` the results of ``family``'s other studies (the key searched over other spaces, or its one
    study from before studies were per space) that ``space`` can express, each candidate once: they count
    for this search and are not measured again. The others stay in their studies, out of this one's reach."""
    import optuna
    from optuna.distributions import CategoricalDistribution

    complete = (optuna.trial.TrialState.COMPLETE,)
    have = {t.user_attrs.get("candidate") for t in st.get_trials(deepcopy=False, states=complete)}
    choices = space.choices
    for name in optuna.get_all_study_names(storage):
        if name == st.study_name or not (name == family or name.startswith(f"{family}:space[")):
            continue
        for t in optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False, states=complete):
            key = t.user_attrs.get("candidate")
            if key is None or key in have or not space.fits(t.params):
                continue
            st.add_trial(
                optuna.trial.create_trial(
                    params=t.params,
                    distributions={k: CategoricalDistribution(choices[k]) for k in t.params},
                    value=t.value,
                    user_attrs={**t.user_attrs, "adopted_from": name},
                )
            )
            have.add(key)


def _update_best(progress: Progress, trials: Iterable[Trial]) -> None:
    ok = [t for t in trials if t.result.status == "ok" and t.result.median_s]
    if ok:
        b = min(ok, key=lambda t: t.result.median_s)
        progress.best = (f"{b.candidate.backend}: {b.candidate.text}", b.result.median_s)


def _fail_orphans(study) -> None:
    """Trials left RUNNING by a tuner that was killed: failed, so that their candidates are suggested
    again. One tuner per study at a time (the service runs one job per key): a second one started
    beside a live one would fail the first one's running trial."""
    import optuna

    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        study.tell(t.number, state=optuna.trial.TrialState.FAIL)
