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
from coconet.codegen.lower import BACKENDS, KERNELS
from coconet.errors import CoconetError
from coconet.extras import EXTRAS, STORE, require
from coconet.loader import load
from coconet.schedules import shardable as shard
from coconet.schedules.dims import parse_sizes
from coconet.schedules.schedule import Schedule
from coconet.schedules.space import generate
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
    launcher: str = "auto",
) -> dict[str, Any]:
    """Check and time schedules on ``world`` ranks of this machine (default 2), as ``coconet run --json``: the
    baseline first, then each of ``schedules`` (a schedule's text, its id in ``schedules(program)``, ``"all"``,
    ``"baseline"``, or ``"best"``: the store's winner for these sizes, said in ``best``). Under torchrun
    (``launcher``: as ``coconet run --launcher`` says), every rank calls it and is one rank of the run, in the
    process group it already formed or one joined from the environment; every rank gets the answer."""
    job = choose(launcher)
    if backend not in BACKENDS:
        raise CoconetError(f"unknown backend {backend!r} (use {', '.join(BACKENDS)})")
    if kernels not in KERNELS:
        raise CoconetError(f"unknown kernels {kernels!r} (use {' or '.join(KERNELS)})")
    if isinstance(schedules, str):
        schedules = [schedules]
    prog, source = load(program), program
    sizes = _sizes(sizes, prog)
    if job is not None:
        world = world_of(world, job, (stages or 2) if prog.is_pipeline else 1)
        require_one_node(backend, job)
    world = world or 2
    chosen: dict[str, Any] = {}
    stored: dict[str, Any] | None = None
    space = None
    for pick in ["baseline", *schedules]:
        if pick == "best":
            found = best(prog, sizes, world=world, backend=backend, store=store)
            stored = found
            picked = [Schedule.from_json(found["schedule_json"], prog)]
        elif pick == "all" or str(pick).isdigit():
            space = space if space is not None else generate(prog, depth=depth)
            if pick != "all" and int(pick) >= len(space):
                raise CoconetError(f"there is no schedule {pick}; the space has {len(space)} (0-{len(space) - 1})")
            picked = list(space) if pick == "all" else [space[int(pick)]]
        else:
            picked = [Schedule(prog) if pick == "baseline" else Schedule.parse(pick, prog)]
        for s in picked:
            chosen.setdefault(s.hash, s)
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
    )
    file = str(source) if isinstance(source, (str, os.PathLike)) and str(source).endswith(".py") else None
    results = (
        run_in_job(list(chosen.values()), opts, job)
        if job is not None
        else run_schedules(list(chosen.values()), opts, program_file=file)
    )
    base = results[0].median_s
    rows = [dict(r.to_json(), speedup=base / r.median_s if base and r.median_s else None) for r in results]
    out = {
        "program": prog.name,
        "program_hash": prog.hash,
        "world": world,
        "backend": backend,
        "stages": opts.stages if prog.is_pipeline else 1,
        "sizes": sizes,
        "results": rows,
    }
    return {**out, "best": stored} if stored is not None else out


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
) -> dict[str, Any] | list[dict[str, Any]]:
    """Tune ``program`` at ``sizes`` (one binding, or a list of them) on Ray and record the winners, as
    ``coconet tune --json``: one result for one binding, a list (smallest first) for several."""
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
        results = run_tune(request, opened, prior=cost_prior)
    docs = [r.to_json(prog, topology, world) for r in results]
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
