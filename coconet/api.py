"""coconet from Python: one function per CLI command, returning the records that command's ``--json`` prints.

::

    import coconet

    prog = coconet.load("examples/adam.py")
    coconet.schedules(prog)[:3]                          # [{"id": 0, "text": "baseline", ...}, ...]
    coconet.run(prog, {"N": 2**20}, world=2, schedules=["all"])
    coconet.tune(prog, {"N": 2**20}, world=2, budget=8)   # measured on Ray, recorded in the store
    coconet.best(prog, {"N": 2**20}, world=2)             # {"schedule": ..., "source": "measured", ...}
    coconet.sweep("configs/sweeps/paper.yaml", simulate=True)

``program`` is anything ``load`` takes: a ``.py`` file defining ``program``, a ``.json`` IR file, the IR as
JSON text or a mapping, a ``coconet.Program``. ``sizes`` is a mapping (``{"N": 1048576}``) or the CLI's text
(``"N=2^20"``; several dims ``"B=8,S=1024,H=3072"``). ``store`` is a store URL or an open ``Store``
(default ``$COCONET_DATABASE_URL``, else SQLite in the user data dir).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from coconet.codegen.backends import DEFAULT
from coconet.codegen.baselines import shardable_text
from coconet.codegen.lower import BACKENDS, KERNELS, lower
from coconet.codegen.runtime import write as write_module
from coconet.errors import CoconetError
from coconet.extras import EXTRAS, STORE, require
from coconet.loader import load
from coconet.schedules import shardable as shard
from coconet.schedules.dims import format_sizes, parse_sizes
from coconet.schedules.schedule import Schedule
from coconet.schedules.space import generate, pick
from coconet.server.records import STORED_SOURCE, answer_source, machines_of, prediction_of
from coconet.tuner.envlaunch import choose, require_one_node, run_in_job, world_of
from coconet.tuner.launch import Options, run_schedules
from coconet.tuner.runner import Protocol
from coconet.tuner.sweep import SweepConfig
from coconet.tuner.sweep import sweep as run_sweep


def schedules(program: Any, *, depth: int = 6) -> list[dict[str, Any]]:
    """The legal schedules of ``program``, as ``coconet schedules --json`` lists them."""
    space = generate(load(program), depth=depth)
    if space.refused:
        text, reason = space.refused[0]
        raise CoconetError(f"the space generator offered an illegal schedule {text!r}: {reason}")
    return space.to_json()["schedules"]


def run(
    program: Any,
    sizes: Any,
    *,
    world: int | None = None,
    schedules: Sequence[str] = ("baseline",),
    backend: str = DEFAULT,
    kernels: str = "compiled",
    stages: int | None = None,
    repeats: int = 20,
    warmup: int = 3,
    seed: int = 0,
    timeout_s: float = 120.0,
    check: bool = True,
    depth: int = 6,
    store: Any = None,
    shardable: Sequence[str] | str | None = None,
    launcher: str = "auto",
    emit: str | os.PathLike | None = None,
    standalone: bool = False,
    trace: str | os.PathLike | None = None,
    on_start: Callable[[list[Schedule], int], None] | None = None,
    on_result: Callable[[int, Any], None] | None = None,
    on_best: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """Check and time schedules on ``world`` ranks of this machine (default 2), as ``coconet run --json``: the
    baseline first, then each of ``schedules`` (a schedule's text, its id in ``schedules(program)``, ``"all"``,
    ``"baseline"``, or ``"best"``: the store's winner for these sizes on this machine and backend, of a tuning
    that let ``shardable`` stay sharded, said in ``best``). Under torchrun (``launcher``: as ``coconet run
    --launcher`` says), every rank calls it and is one rank of the run, in the process group it already formed
    or one joined from the environment; every rank gets the answer.

    ``emit``: a folder where each schedule's generated module is written too (with ``standalone``, beside a
    copy of the runtime they import); ``trace``: a folder for a Chrome trace of one more step per rank.
    For a progress display: ``on_start(schedules, world)`` hears of the schedules picked and the ranks per stage
    before the first runs, ``on_result(i, result)`` of each schedule's result (``coconet.tuner.launch.RunResult``)
    as it lands, ``on_best(found)`` of the store's answer behind ``"best"`` (``coconet.server.records.Best``)
    when it is read."""
    job = choose(launcher)
    if backend not in BACKENDS:
        raise CoconetError(f"unknown backend {backend!r} (use {', '.join(BACKENDS)})")
    if kernels not in KERNELS:
        raise CoconetError(f"unknown kernels {kernels!r} (use {' or '.join(KERNELS)})")
    if standalone and emit is None:
        raise CoconetError("standalone says how emit writes the modules: give emit (a folder) too")
    prog, source = load(program), program
    sizes = _sizes(sizes, prog)
    if job is not None:
        world = world_of(world, job, (stages or 2) if prog.is_pipeline else 1)
        require_one_node(backend, job)
    world = world or 2
    stored: list[dict[str, Any]] = []  # the store's answer behind "best", said beside the results

    def tuned() -> Schedule:
        sched, found = stored_schedule(prog, sizes, world=world, backend=backend, store=store, shardable=shardable)
        if on_best is not None:
            on_best(found)
        stored.append(_best_record(sched, found))
        return sched

    space = generate(prog, depth=depth)  # "all" and ids pick from it; each result gets its id in it
    picks = [schedules] if isinstance(schedules, str) else list(schedules)
    picked = pick(prog, picks, depth, best=tuned, space=space)
    if emit is not None and (job is None or job.rank == 0):  # one rank writes for the job
        _emit(prog.name, picked, backend, kernels, Path(emit), standalone)
    if on_start is not None:
        on_start(picked, world)
    opts = Options(
        world=world,
        sizes=sizes,
        backend=backend,
        kernels=kernels,
        stages=stages or 2,
        seed=seed,
        warmup=warmup,
        repeats=repeats,
        check=check,
        timeout_s=timeout_s,
        trace=str(Path(trace).resolve()) if trace is not None else None,
    )
    file = str(source) if isinstance(source, (str, os.PathLike)) and str(source).endswith(".py") else None
    results = (
        run_in_job(picked, opts, job, on_result=on_result)
        if job is not None
        else run_schedules(picked, opts, program_file=file, on_result=on_result)
    )
    out = {
        "program": prog.name,
        "program_hash": prog.hash,
        "world": world,
        "backend": backend,
        "stages": opts.stages if prog.is_pipeline else 1,
        "sizes": sizes,
        "results": _rows(results, space),
    }
    return {**out, "best": stored[0]} if stored else out


def stored_schedule(
    program: Any, sizes: Any, *, world: int, backend: str, store: Any = None, shardable: Sequence[str] | None = None
) -> tuple[Schedule, Any]:
    """What ``run``'s ``"best"`` runs: the store's winner for ``program`` at ``sizes`` (or the nearest tuned
    sizes') on this machine (``local``) with ``backend`` at ``world``, of a tuning that let ``shardable`` stay
    sharded; with the store's answer (``coconet.server.records.Best``: measured or predicted, exact or not)."""
    require(STORE, "the store's winner (schedule best)")
    from coconet.server.store import Store

    prog = load(program)
    sizes = _sizes(sizes, prog)
    names = [shardable] if isinstance(shardable, str) else list(shardable or ())
    allowed = shardable_text(prog, names or None)
    with _opened(store, Store, create=False) as opened:
        found = opened.best(prog.hash, sizes, "local", world, backend=backend, shardable=allowed)
        where = opened.url
    if found is None or found.measurement.schedule_json is None:
        flags = "".join(f" --shardable {n}" for n in names)
        raise CoconetError(
            f"no tuned schedule of {prog.name} on {backend} at world {world} in {where} that leaves "
            f"at most {shard.words(allowed)} sharded: run `coconet tune FILE --world {world} "
            f"--size {format_sizes(sizes)} --backend {backend}{flags}` first"
        )
    return Schedule.from_json(found.measurement.schedule_json, prog), found


def _best_record(sched: Schedule, found: Any) -> dict[str, Any]:
    """The store's answer behind ``"best"`` as ``run``'s record says it."""
    return {
        "schedule": sched.text,
        "hash": sched.hash,
        "source": answer_source(found.source),
        "exact": found.exact,
        "tuned_sizes": found.winner.sizes,
        "winner_id": found.winner.id,
        "median_s": found.measurement.median_s,
        "speedup": found.winner.speedup,
    }


def _emit(name: str, picked: list[Schedule], backend: str, kernels: str, folder: Path, standalone: bool) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for sched in picked:
        gen = lower(sched, backend, kernels)
        write_module(gen.source, backend, folder / f"{name}_{sched.hash}_{backend}.py", standalone)


def _rows(results: list, space: Any) -> list[dict[str, Any]]:
    """The results as ``run`` answers them: each with its id in ``schedules(program)`` (None where the space
    lacks it) and its speed-up over the baseline, the first."""
    base = results[0].median_s
    ids = {sched.hash: i for i, sched in enumerate(space)}
    rows = []
    for r in results:
        row = r.to_json()
        row["id"] = ids.get(r.hash)
        row["speedup"] = base / r.median_s if base and r.median_s else None
        rows.append(row)
    return rows


def tune(
    program: Any,
    sizes: Any | Iterable[Any],
    *,
    world: int = 2,
    budget: int = 32,
    topology: str = "local",
    backends: Sequence[str] = (),
    store: Any = None,
    ray_address: str | None = None,
    kernels: str = "compiled",
    depth: int = 6,
    seed: int = 0,
    timeout_s: float = 300.0,
    shardable: Sequence[str] | None = None,
    placement: str = "pack",
    on_progress: Callable[[dict[str, int], Any], None] | None = None,
    on_tuned: Callable[[Any, dict[str, Any]], None] | None = None,
) -> dict[str, Any] | list[dict[str, Any]]:
    """Tune ``program`` at ``sizes`` (one binding, or a list of them) on Ray and record the winners, as
    ``coconet tune --json``: one result for one binding, a list (smallest first) for several.
    ``on_progress(sizes, progress)`` hears of each trial as it ends (``coconet.tuner.tune.Progress``: trials,
    failed, budget, the best so far); ``on_tuned(tuned, result)`` of each binding's outcome at the end, its
    every trial with it (``coconet.tuner.tune.Tuned``), beside the result returned for it."""
    require(EXTRAS["tune"], "coconet.tune")
    from coconet.server.store import Store
    from coconet.tuner.tune import Request, check, cost_prior
    from coconet.tuner.tune import tune as run_tune

    prog, source = load(program), program
    bindings = [sizes] if isinstance(sizes, (str, Mapping)) else list(sizes)
    points = tuple(_sizes(s, prog) for s in bindings)
    file = str(source) if isinstance(source, (str, os.PathLike)) and str(source).endswith(".py") else None
    request = Request(
        prog,
        points,
        world,
        topology,
        budget,
        tuple(dict.fromkeys(backends)),
        Protocol(timeout_s=timeout_s, kernels=kernels),
        depth,
        seed=seed,
        ray_address=ray_address,
        program_file=file,
        shardable=tuple(shardable) if shardable else None,
        placement=placement,
    )
    check(request)
    with _opened(store, Store) as opened:
        results = run_tune(request, opened, on_progress=on_progress, prior=cost_prior)
    docs = [r.to_json(prog, topology, world) for r in results]
    for r, doc in zip(results, docs):
        if on_tuned is not None:
            on_tuned(r, doc)
    return docs[0] if len(docs) == 1 else docs


def best(
    program: Any,
    sizes: Any,
    *,
    topology: str = "local",
    world: int | None = None,
    backend: str | None = None,
    store: Any = None,
    server: str | None = None,
    token: str | None = None,
    shardable: Sequence[str] | str | None = None,
    source: str | None = None,
) -> dict[str, Any]:
    """The best schedule recorded for ``program`` at ``sizes`` on ``topology``, as ``GET /api/v1/best`` answers
    it: from ``server`` when given, else from ``store``. A measured winner answers before a predicted one
    (``source``: ``"measured"`` or ``"predicted"``, with the model in ``prediction``); with none at these exact
    sizes, the nearest tuned sizes' (``exact`` False). ``source`` asks for one kind only. A miss raises."""
    prog = load(program)
    sizes = _sizes(sizes, prog)
    names = [shardable] if isinstance(shardable, str) else (list(shardable) if shardable is not None else None)
    if server is not None:
        from coconet.client import Client

        with Client.open(server, token) as client:
            return client.best(
                prog.hash,
                sizes,
                topology=topology,
                world=world,
                backend=backend,
                shardable=",".join(names) if names is not None else None,
                source=source,
            )
    require(STORE, "coconet.best")
    from coconet.server.store import Store

    if source is not None and source not in STORED_SOURCE:
        raise CoconetError(f"source {source!r}: measured or predicted")
    allowed = shardable_text(prog, names)
    with _opened(store, Store, create=False) as opened:
        found = opened.best(
            prog.hash,
            sizes,
            topology,
            world,
            backend=backend,
            shardable=allowed,
            source=STORED_SOURCE.get(source) if source else None,
        )
        where = opened.url
    if found is None:
        raise CoconetError(
            f"nothing tuned for {prog.name} on {topology}"
            + (f" at world {world}" if world else "")
            + f" in {where}, at these or comparable sizes: `coconet tune` (or coconet.tune) first"
        )
    m, w = found.measurement, found.winner
    return {
        "program": prog.hash,
        "sizes": sizes,
        "tuned_sizes": w.sizes,
        "exact": found.exact,
        "distance": found.distance,
        "topology": w.topology,
        "world": w.world,
        "backend": w.backend,
        "schedule": m.schedule,
        "schedule_hash": m.schedule_hash,
        "schedule_json": m.schedule_json,
        "stats": {
            "median_s": m.median_s,
            "ci95_s": [m.ci_lo_s, m.ci_hi_s] if m.ci_lo_s is not None else None,
            "n": m.n,
        },
        "source": answer_source(w.source),
        "prediction": prediction_of(m),
        "machines": machines_of(m),
        "speedup": w.speedup,
        "order_reversed": w.order_reversed,
        "winner_id": w.id,
        "job": w.job_id,
    }


def sweep(
    config: str | os.PathLike | SweepConfig,
    *,
    simulate: bool = False,
    store: Any = None,
    ray_address: str | None = None,
    on_progress: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """An offline sweep from its YAML config, as ``coconet sweep --json`` reports it: local keys tuned (unless
    ``simulate``), the others predicted by the cost model; keys done before are skipped, measured keys are
    never predicted."""
    require(STORE if simulate else EXTRAS["tune"], "coconet.sweep")
    from coconet.server.store import Store
    from coconet.tuner.tune import Request, cost_prior
    from coconet.tuner.tune import tune as run_tune

    cfg = config if isinstance(config, SweepConfig) else SweepConfig.load(Path(config))
    with _opened(store, Store) as opened:

        def tune_key(entry: Any, sizes: dict, world: int) -> None:
            request = Request(
                entry.program,
                (sizes,),
                world,
                budget=cfg.budget,
                protocol=Protocol(),
                depth=cfg.depth,
                ray_address=ray_address,
                program_file=entry.file,
                shardable=shard.spelled(entry.shardable),
            )
            run_tune(request, opened, prior=cost_prior)

        return run_sweep(cfg, opened, simulate=simulate, on_progress=on_progress, tune_key=tune_key).to_json()


def _sizes(sizes: Any, prog: Any) -> dict[str, int]:
    if isinstance(sizes, str):
        return parse_sizes(sizes, prog.dims)
    if not isinstance(sizes, Mapping):
        raise CoconetError(f"sizes: a mapping such as {{'N': 1048576}} or text such as 'N=2^20', not {sizes!r}")
    return parse_sizes(",".join(f"{k}={v}" for k, v in sizes.items()), prog.dims)


class _opened:
    """``store`` as an open Store for a ``with`` block: one given open is used and left open; a URL (or None,
    the default store) is opened and closed here."""

    def __init__(self, store: Any, store_cls: Any, *, create: bool = True) -> None:
        self._given = store if hasattr(store, "best") else None
        self._url, self._cls, self._create = store, store_cls, create
        self._mine: Any = None

    def __enter__(self) -> Any:
        if self._given is not None:
            return self._given
        # a lookup makes the default store if it is not there yet, never a named one (a mistyped path)
        self._mine = self._cls.open(self._url, create=self._create or self._url is None)
        return self._mine

    def __exit__(self, *exc: object) -> None:
        if self._mine is not None:
            self._mine.close()
