"""``coconet tune``: the study of one program at one or more sizes, measured on Ray, recorded in the
store. Only this driver writes the database; the ranks measure.

Per size, one Optuna study (in the store's database) over the backends this topology allows, the
schedules and their knobs. The baseline goes first, then the winners of the sizes already tuned —
in this call (smallest sizes first) or earlier ones (the store's nearest) — then the cost model's
top-k. Every trial's measurement is recorded as it finishes, so a killed tuner loses at most the
trial it was in; the two fastest and the baseline are timed again in turns, and the fastest of that
re-timing is recorded as the winner, with the runner-up and the baseline beside it, all as re-timed.
"""

from __future__ import annotations

import math
import os
import platform
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import coconet
from coconet.codegen.backends import REGISTRY, Machine, Registry
from coconet.codegen.backends import get as backend_of
from coconet.codegen.baselines import shardable_text
from coconet.codegen.footprint import require_fits
from coconet.codegen.lower import Generated, lower
from coconet.errors import CoconetError, KeyBusy, StoreError
from coconet.schedules import shardable as shard
from coconet.schedules.dims import format_sizes
from coconet.schedules.ir import Program
from coconet.schedules.schedule import Schedule
from coconet.server.driver import describe, this_process
from coconet.server.keys import sizes_key
from coconet.server.leases import STALE_S, abandoned, heartbeat
from coconet.server.records import MACHINE_KEYS, NewMeasurement
from coconet.server.records import Progress as JobProgress
from coconet.server.store import RETAKEN
from coconet.tuner.calibrate import local_topology
from coconet.tuner.cluster import PLACEMENTS, Need, connect, offer, plan
from coconet.tuner.cost import predict
from coconet.tuner.fingerprint import Fingerprint, check_topology, cpu_model, detect_cluster, of_nodes
from coconet.tuner.launch import MAX_RANKS, RunResult
from coconet.tuner.runner import Protocol, Runner
from coconet.tuner.search import KILLED_TRIES, Candidate, Outcome, Progress, SearchSpace, Trial, search, study_name
from coconet.tuner.stats import summarize
from coconet.tuner.topology import LOCAL, load_topology, topology_path


@dataclass(frozen=True)
class Request:
    program: Program
    sizes: tuple[Mapping[str, int], ...]
    world: int
    topology: str = LOCAL
    budget: int = 32
    backends: tuple[str, ...] = ()  # empty: every backend the topology allows
    protocol: Protocol = Protocol()
    depth: int = 6
    top_k: int = 3
    seed: int = 0
    ray_address: str | None = None
    program_file: str | None = None
    # state a schedule may leave sharded (names, or `all`); None: the program's default (``default_shardable``)
    shardable: tuple[str, ...] | None = None
    placement: str = "pack"  # where a candidate's ranks go on the cluster: few nodes (pack) or many (spread)


@dataclass
class Tuned:
    """One size's outcome, as recorded."""

    sizes: dict[str, int]
    outcome: Outcome
    job_id: int
    record_id: int | None  # the winner's record
    shardable: str = shard.EVERY  # what the search let stay sharded (coconet.schedules.shardable's text)
    measurement_ids: dict[str, Any] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)  # backends the cluster cannot run, and why
    machines: dict[str, str] | None = None  # the winner's: fingerprint, machines (its text), placement

    def to_json(self, program: Program, topology: str, world: int) -> dict[str, Any]:
        o = self.outcome
        allowed = shard.names(self.shardable)

        def stats(t) -> dict[str, Any] | None:
            if t is None or not t.result.samples:
                return None
            s = summarize(t.result.samples)
            # the space holds schedules that leave replicated state sharded: the caller must see that
            return {
                "schedule": t.candidate.text,
                "backend": t.candidate.backend,
                "median_s": s.median,
                "ci95_s": list(s.ci95),
                "n": s.n,
                "hash": t.candidate.schedule.hash,
                "sharded": sorted(t.candidate.schedule.sharded),
            }

        return {
            "program_hash": program.hash,
            "program": program.name,
            "sizes": self.sizes,
            "topology": topology,
            "world": world,
            "shardable": sorted(allowed if allowed is not None else shard.candidates(program)),
            "best": stats(o.winner),
            "runner_up": stats(o.runner_up),
            "baseline": stats(o.baseline),
            "speedup": o.speedup,
            # the search's own fastest and its figure; best, runner_up, baseline and speedup are the re-timing's
            "search_best": stats(o.search_best),
            "order_reversed": o.order_reversed,
            "trials": len(o.trials),
            "failed": len(o.failed),
            "failures": failures(o.failed),
            "record_id": self.record_id,
            "job_id": self.job_id,
            "study": o.study,
            "backends_left_out": self.left_out,
            "machines": self.machines,
        }


def failures(failed: Sequence[Trial], most: int = 5) -> list[dict[str, Any]]:
    """The distinct reasons trials failed, the commonest first, with how many and one of each's candidates: a
    tune in which nothing ran must say why without a trip to the store."""
    seen: dict[tuple[str, str], dict[str, Any]] = {}
    for t in failed:
        key = (t.result.status, t.result.error or "")
        if key not in seen:
            seen[key] = {
                "status": key[0],
                "error": key[1][:1000],
                "count": 0,
                "schedule": t.candidate.text,
                "backend": t.candidate.backend,
            }
        seen[key]["count"] += 1
    return sorted(seen.values(), key=lambda f: -f["count"])[:most]


def this_machine() -> Machine:
    """This machine as the backends ask about it: its architecture and CUDA devices."""
    import torch

    return Machine(platform.machine(), torch.cuda.device_count() if torch.cuda.is_available() else 0)


def local_backends(world: int, machine: Machine | None = None, among: Registry = REGISTRY) -> tuple[str, ...]:
    """What this machine (or ``machine``) can run ``world`` ranks on (``Registry.runnable``): NCCL with a GPU
    per rank, else gloo, and shm on x86-64 (its barriers rely on the x86 memory order)."""
    return among.runnable(machine or this_machine(), world)


def versions(
    backend: str, kernels: str = "compiled", placed: str | None = None, machines: Fingerprint | None = None
) -> dict[str, str]:
    import torch

    out = {
        "coconet": coconet.__version__,
        "torch": torch.__version__,
        "backend": backend,
        "python": platform.python_version(),
        "kernels": kernels,
    }
    if placed:  # where the ranks ran: "2 ranks on 1 node"
        out["placement"] = placed
    if machines is not None:  # what they ran on: coconet.tuner.fingerprint
        out |= machines.versions()
    on = backend_of(backend)
    if on.device_type == "cuda" and torch.cuda.is_available():
        if on.version is not None:  # its library's: "nccl": "2.21.5"
            out[on.name] = on.version()
        out["driver"] = f"cuda {torch.version.cuda}; {torch.cuda.get_device_name(0)}"
    else:
        out["driver"] = platform.processor() or platform.machine()
    return out


def fingerprint() -> dict[str, Any]:
    """What makes this machine this topology: a store keeps results of one fingerprint per name."""
    import torch

    cpu = cpu_model()
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    return {"machine": platform.machine(), "cpu": cpu, "cpus": os.cpu_count(), "gpus": gpus}


def check(request: Request) -> tuple[str, ...]:
    """Refuse a request that cannot run here, before anything is started or written; its backends."""
    if request.topology != LOCAL and not request.ray_address:
        raise CoconetError(
            f"coconet tune measures: topology {request.topology!r} needs its cluster "
            "(--ray-address); for a prediction use coconet sweep"
        )
    if request.placement not in PLACEMENTS:
        raise CoconetError(f"unknown placement {request.placement!r} (use {' or '.join(PLACEMENTS)})")
    if request.budget < 1:
        raise CoconetError(f"budget must be at least 1 trial, got {request.budget}")
    if request.shardable is not None:
        shardable_text(request.program, request.shardable)  # names that are not the program's state: refused
    request.program.require_world(request.world)
    if not request.ray_address and request.world > MAX_RANKS:  # a Ray actor per rank, all on this machine
        raise CoconetError(
            f"world {request.world}: the local Ray cluster runs at most {MAX_RANKS} ranks per stage "
            "on this machine (--ray-address joins a cluster for more)"
        )
    if not request.ray_address:  # the local cluster's ranks share this machine's memory; a cluster's, their nodes'
        for sizes in request.sizes:
            require_fits(request.program, sizes, request.world, check=False)
    # last: asking torch for the GPUs imports it, seconds that a refusal above need not wait
    if request.topology == LOCAL:
        allowed = local_backends(request.world)
    else:  # a cluster that is this topology: its backends, shm only where every rank shares one node
        topo = load_topology(request.topology)
        allowed = tuple(b for b in topo.backends if not backend_of(b).one_node or topo.nodes == 1)
    backends = tuple(request.backends) or allowed
    unusable = [b for b in backends if b not in allowed]
    if unusable:
        raise CoconetError(
            f"backend {', '.join(unusable)} cannot run on {request.topology} (it runs {', '.join(allowed)})"
        )
    return backends


def tune(
    request: Request,
    store,
    *,
    on_progress: Callable[[dict, Progress], None] | None = None,
    lowering: Callable[[Schedule, str, str], Generated] = lower,
    prior: Callable[[SearchSpace, Mapping[str, int], str, int], Sequence[Candidate]] | None = None,
    job_id: int | None = None,
) -> list[Tuned]:
    """Tune every size of ``request`` into ``store``; ``prior`` gives the cost model's top-k. ``job_id``: a job
    the caller created and claimed (the service's worker) to run instead of a new one; one size only."""
    if job_id is not None and len(request.sizes) != 1:
        check(request)
        raise CoconetError(f"job {job_id} tunes one size; the request has {len(request.sizes)}")
    study = _Study.open(request, store, on_progress, lowering, prior, free_keys=job_id is None)
    done: list[Tuned] = []
    for sizes in sorted(request.sizes, key=lambda s: math.prod(s.values())):
        sizes = dict(sizes)
        job, beating = (job_id, nullcontext()) if job_id is not None else study.take(sizes)
        with beating:
            done.append(_Key(study, sizes, job).tune(done))
    return done


@dataclass
class _Study:
    """What every size of a request shares: the program, backends and shardable state asked, the cluster and
    how candidates fit it, the schedule space, the store and its Optuna storage, and the caller's hooks."""

    request: Request
    store: Any
    backends: tuple[str, ...]
    allowed_text: str
    cluster: Any
    fit: Any
    space: SearchSpace
    storage: Any
    on_progress: Callable[[dict, Progress], None] | None
    lowering: Callable[[Schedule, str, str], Generated]
    prior: Callable[[SearchSpace, Mapping[str, int], str, int], Sequence[Candidate]] | None

    @classmethod
    def open(cls, request: Request, store, on_progress, lowering, prior, *, free_keys: bool) -> _Study:
        """Checks the request, the keys, the cluster and the topology before any trial; records the program."""
        prog = request.program
        backends = check(request)
        allowed_text = shardable_text(prog, request.shardable)
        topo = local_topology() if request.topology == LOCAL else load_topology(request.topology)
        if free_keys:
            _free_keys(store, prog, request.sizes, request, allowed_text)
        stages = 2 if prog.is_pipeline else 1
        connect(request.ray_address, ranks=request.world * stages * len(backends))
        cluster = detect_cluster()
        # before any trial: results under a topology's name are of its machines. `local` is this machine's kind,
        # which a cluster joined by --ray-address may have several of (each measurement records how many it used)
        check_topology(topo, of_nodes(cluster), per_node=request.topology == LOCAL)
        fit = plan(
            Need(request.world * stages, gpu=any(backend_of(b).device_type == "cuda" for b in backends)),
            backends,
            offer(),
            asked=bool(request.backends),
            placement=request.placement,
        )
        space = SearchSpace.of(prog, fit.backends, request.depth, shard.names(allowed_text))
        store.add_program(prog)
        if request.topology == LOCAL:
            store.add_topology(LOCAL, fingerprint(), source="measured")
        return cls(
            request,
            store,
            backends,
            allowed_text,
            cluster,
            fit,
            space,
            store.optuna_storage(),
            on_progress,
            lowering,
            prior,
        )

    def take(self, sizes: dict[str, int]) -> tuple[int, AbstractContextManager[None]]:
        """A job for the key, taken now, and the heartbeat that holds it while its tuning runs."""
        request, prog = self.request, self.request.program
        me = this_process()
        try:  # the key looked at again as it is taken: another tuner may have started it since the check
            job = self.store.take_job(
                prog.hash,
                sizes,
                request.topology,
                request.world,
                budget=request.budget,
                backends=list(self.backends),
                shardable=self.allowed_text,
                driver=me.text if me else None,
                abandoned=abandoned,
            ).id
        except KeyBusy as err:
            raise _busy(prog, request, [_busy_text(sizes, err.running, err.driver)]) from None
        return job, heartbeat(self.store, job)  # the service sees the key taken while this runs, and free if it dies


class _Key:
    """One size's tuning: a runner per backend (made on its first candidate), and how a trial is measured,
    recorded and reported."""

    def __init__(self, study: _Study, sizes: dict[str, int], job: int) -> None:
        self.study, self.sizes, self.job = study, sizes, job
        self.runners: dict[str, Runner] = {}

    def measure(self, c: Candidate) -> RunResult:
        study, request = self.study, self.study.request
        if not study.fit.shared:  # the cluster holds one backend's ranks at a time: the others let theirs go
            for other, runner in self.runners.items():
                if other != c.backend:
                    runner.close()
        if c.backend not in self.runners:
            self.runners[c.backend] = Runner(
                request.program,
                world=request.world,
                sizes=self.sizes,
                backend=c.backend,
                protocol=request.protocol,
                program_file=request.program_file,
                lowering=study.lowering,
                placement=request.placement,
            )
        return self.runners[c.backend].measure(c.schedule)

    def record(self, c: Candidate, res: RunResult, role: str) -> int:
        request = self.study.request
        s = summarize(res.samples) if res.samples else None
        err = res.max_rel_err if res.max_rel_err is not None and math.isfinite(res.max_rel_err) else None
        return self.study.store.add_measurement(
            NewMeasurement.of(
                c.schedule,
                sizes=self.sizes,
                topology=request.topology,
                world=request.world,
                backend=c.backend,
                status=res.status,
                error=res.error,
                samples=list(res.samples),
                n=len(res.samples),
                median_s=s.median if s else None,
                ci_lo_s=s.ci95[0] if s else None,
                ci_hi_s=s.ci95[1] if s else None,
                max_rel_err=err,
                source="measured",
                versions=versions(c.backend, request.protocol.kernels, self.placed(c.backend), self.ran_on(c.backend)),
                job_id=self.job,
            )
        )

    def placed(self, backend: str) -> str | None:
        runner = self.runners.get(backend)
        return runner.placed if runner is not None else None

    def ran_on(self, backend: str) -> Fingerprint:
        runner = self.runners.get(backend)  # not placed yet (a group that never formed): the whole cluster
        return of_nodes(self.study.cluster, runner.nodes if runner is not None and runner.nodes else None)

    def progress(self, p: Progress) -> None:
        self.study.store.update_job(
            self.job,
            progress=JobProgress(done=p.trials, total=p.budget, failed=p.failed, best_s=p.best[1] if p.best else None),
        )
        if self.study.on_progress:
            self.study.on_progress(self.sizes, p)

    def tune(self, done: list[Tuned]) -> Tuned:
        """The search (seeded by the sizes tuned before and the cost model), its winner recorded, the job ended."""
        study, request, store, sizes = self.study, self.study.request, self.study.store, self.sizes
        prog = request.program
        seeds = _neighbours(store, study.space, prog, sizes, request, done, study.allowed_text)
        if study.prior is not None:
            seeds += list(study.prior(study.space, sizes, request.topology, request.world))[: request.top_k]
        try:
            outcome = search(
                study.space,
                sizes,
                storage=study.storage,
                study=study_name(
                    prog, sizes, request.topology, request.world, study.allowed_text, request.protocol.kernels
                ),
                budget=request.budget,
                measure=self.measure,
                record=self.record,
                prior=seeds,
                seed=request.seed,
                on_progress=self.progress,
                recorded=_recorded(store, study.space, prog, sizes, request),
            )
        except BaseException as e:
            store.update_job(
                self.job,
                state="interrupted" if isinstance(e, KeyboardInterrupt) else "failed",
                error=f"{type(e).__name__}: {e}"[:2000],
            )
            raise
        finally:
            for r in self.runners.values():
                r.close()
        winner_id = None
        if outcome.winner is not None:
            base_id = _record_id(outcome.baseline, self.record)  # recorded first, where it is not yet
            winner_id = store.add_winner(
                _record_id(outcome.winner, self.record),
                runner_up_id=_record_id(outcome.runner_up, self.record),
                baseline_id=base_id,
                job_id=self.job,
                shardable=study.allowed_text,
                order_reversed=outcome.order_reversed,
            )
        tuned = Tuned(
            sizes,
            outcome,
            self.job,
            winner_id,
            shardable=study.allowed_text,
            left_out=dict(study.fit.left_out),
            machines=_machines(store, outcome.winner, self.record),
        )
        store.update_job(self.job, state="done", result=tuned.to_json(prog, request.topology, request.world))
        return tuned


def _free_keys(
    store: Any,
    prog: Program,
    sizes: Sequence[Mapping[str, int]],
    request: Request,
    allowed_text: str,
    stale_s: float | None = None,
) -> None:
    """Refuses a key another tuner (the service's worker, another ``coconet tune``) is running right now: both
    would time their candidates on the same cores at once, each skewing the other's numbers, for one study.
    A running job nobody runs any more (its process gone, or its heartbeat stale) is marked interrupted
    instead, so that no server queues it again beside this run; its finished trials stay in the study."""
    keys = {sizes_key(sz) for sz in sizes}
    busy = []
    for job in store.jobs("running", program_hash=prog.hash):
        if job.sizes_key not in keys or (job.topology, job.world, job.shardable) != (
            request.topology,
            request.world,
            allowed_text,
        ):
            continue
        if abandoned(job, STALE_S if stale_s is None else stale_s):
            try:
                store.update_job(job.id, state="interrupted", error=RETAKEN)
            except StoreError:  # moved on meanwhile (a server queued it again): take_job finds it queued
                pass
            continue
        busy.append(_busy_text(job.sizes, job.id, job.driver))
    if busy:
        raise _busy(prog, request, busy)


def _busy_text(sizes: Mapping[str, int], job: int, driver: str | None) -> str:
    by = describe(driver)
    return f"{format_sizes(sizes)} (job {job}{', ' + by if by else ''})"


def _busy(prog: Program, request: Request, busy: list[str]) -> CoconetError:
    return CoconetError(
        f"{prog.name} at {'; '.join(busy)} on {request.topology}, world {request.world} is being "
        f"tuned by another tuner sharing this store right now: its winner will be recorded here "
        f"(coconet run --schedule best, GET /api/v1/jobs/ID); tuning it here too would run a second "
        f"search of the same study beside it, on one machine timing both on the same cores"
    )


def cost_prior(space: SearchSpace, sizes: Mapping[str, int], topology: str, world: int) -> list[Candidate]:
    """The cost model's favourites, best first: tried right after the baseline. None where the
    topology has no description (an uncalibrated `local`: `coconet calibrate` writes it)."""
    if topology_path(topology) is None:
        return []
    topo = load_topology(topology)
    stages = 2 if space.program.is_pipeline else 1  # the model's world counts every stage's ranks
    ranked = [
        (predict(s, sizes, topo, b, world=world * stages, stages=stages).seconds, i, Candidate(s, b))
        for b in space.backends
        if b in topo.backends
        for i, s in enumerate(space.schedules)
    ]
    return [c for *_, c in sorted(ranked, key=lambda x: x[:2])]


def _machines(store, winner: Trial | None, record) -> dict[str, str] | None:
    """Where the winner's recorded measurement ran, as its record says (a trial reused from an earlier run
    ran where that run placed it)."""
    mid = _record_id(winner, record)
    found = store.measurement(mid) if mid is not None else None
    if found is None:
        return None
    return {k: v for k, v in (found.versions or {}).items() if k in MACHINE_KEYS} or None


def _record_id(trial, record) -> int | None:
    """The store id of a trial's measurement; a trial reused from a study whose records are gone
    (an Optuna study kept in another database) is recorded again from the study's values."""
    if trial is None:
        return None
    if trial.record_id is not None:
        return int(trial.record_id)
    return record(trial.candidate, trial.result, "trial")


def _recorded(store, space: SearchSpace, prog: Program, sizes, request: Request) -> dict[str, Trial]:
    """This key's measured results already in the store, the oldest per candidate: what a tuner killed
    between recording a result and telling the study left behind. A candidate whose only result is one
    ``killed`` is left out, to be measured again (as ``search`` does with its study's trials); killed
    ``KILLED_TRIES`` times, it stays."""
    found: dict[str, list[Trial]] = {}
    for m in store.measurements(prog.hash, sizes, request.topology, world=request.world, source="measured"):
        if m.job_id is None or m.schedule_json is None or m.backend not in space.backends:
            continue
        if (m.versions or {}).get("kernels", "compiled") != request.protocol.kernels:  # timed with other kernels
            continue
        try:
            c = Candidate(Schedule.from_json(m.schedule_json, prog), m.backend)
        except CoconetError:
            continue  # a schedule this coconet no longer offers: nothing to reuse
        res = RunResult(
            m.schedule,
            m.schedule_hash,
            m.status,
            correct=m.status != "wrong_result",
            max_rel_err=m.max_rel_err,
            samples=list(m.samples),
            error=m.error,
        )
        found.setdefault(c.key, []).append(Trial(c, res, m.id, reused=True))
    out: dict[str, Trial] = {}
    for key, results in found.items():
        lived = [t for t in results if t.result.status != "killed"]
        if lived or len(results) >= KILLED_TRIES:
            out[key] = (lived or results)[0]
    return out


def _neighbours(
    store, space: SearchSpace, prog: Program, sizes, request: Request, done: list[Tuned], shardable: str
) -> list[Candidate]:
    """Winners worth trying first: those of the sizes tuned in this call, then the store's nearest that answers
    this tuning's ``shardable``."""
    out: list[Candidate] = []
    for t in reversed(done):
        for trial in (t.outcome.winner, t.outcome.runner_up):
            if trial is not None:
                out.append(trial.candidate)
    only = space.backends[0] if len(space.backends) == 1 else None  # else the fastest of any may be one not searched
    best = store.best(prog.hash, sizes, request.topology, request.world, backend=only, shardable=shardable)
    if best is not None and best.measurement.schedule_json is not None and best.measurement.backend in space.backends:
        try:
            sched = Schedule.from_json(best.measurement.schedule_json, prog)
            out.append(Candidate(sched, best.measurement.backend))
        except CoconetError:
            pass  # a schedule of an older coconet that this one no longer offers: nothing to seed
    return out
