"""A program's schedule compiled into one callable step for this rank: ``coconet.compile``.

::

    step = coconet.compile("examples/adam.py", sizes={"N": n}, group=dp_group, store="sqlite:///coconet.db")
    print(step.describe())          # which schedule, where it came from, what each input is on this rank
    step({"g": g, "w": w, "m": m, "v": v}, {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "t": it})

``schedule="best"`` takes the winner a tuning recorded in a store (``store=URL`` or a ``Store``) or on a
server (``server=URL``); any other value is a schedule's text (``"baseline"`` for the program as written).
Every rank of the group must call ``compile`` with the same arguments: rank 0 looks the schedule up and hands
it to the others, so that all run the same one.

A schedule may keep an input sliced (``as_slice(m)``: each rank holds only its rows of Adam's moments, as
ZeRO-1 does); ``step.layouts`` and ``step.inputs`` say which inputs are whole and which are this rank's rows.
Every call checks its inputs against them (names, shapes, dtypes, devices) and raises ``InputError`` naming
the input, what it was given and what the schedule expects. A tensor is checked once per identity, storage
address, shape and dtype; a step handed the same tensors again pays a dict lookup per input (2.4 us a call for
Adam's four tensors and five scalars on a 2-core x86 machine, against milliseconds for the step:
``benchmarks/step_check_cost.py``).
"""

from __future__ import annotations

import marshal
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from coconet import api
from coconet.codegen.cache import module_path
from coconet.codegen.lower import lower
from coconet.errors import CoconetError, InputError, StoreError
from coconet.extras import STORE, require
from coconet.loader import load_file, named_example
from coconet.schedules import shardable
from coconet.schedules.dims import format_sizes, parse_sizes
from coconet.schedules.ir import Program
from coconet.schedules.schedule import Schedule
from coconet.schedules.types import Local, Replicated, Sliced

BEST = "best"
LOCAL_TOPOLOGY = "local"


@dataclass(frozen=True)
class InputSpec:
    """One tensor input as this rank holds it under the schedule."""

    name: str
    layout: Any  # Local, Replicated or Sliced(dim), as the schedule has it
    shape: tuple[int, ...]  # this rank's
    global_shape: tuple[int, ...]
    dtype: str
    rows: tuple[int, int] | None = None  # Sliced: this rank's rows [lo, hi) of dim ``layout.dim``

    @property
    def sliced(self) -> bool:
        return self.rows is not None

    def __str__(self) -> str:
        shape = "[" + ", ".join(map(str, self.shape)) + "]"
        if self.rows is not None:
            lo, hi = self.rows
            n = self.global_shape[self.layout.dim]
            return f"{self.name}: {self.layout}, {self.dtype}{shape}: this rank's rows {lo}:{hi} of {n}"
        whose = "this rank's own" if isinstance(self.layout, Local) else "the same on every rank"
        return f"{self.name}: {self.layout}, {self.dtype}{shape}: whole, {whose}"


@dataclass(frozen=True)
class Origin:
    """Where a step's schedule came from: ``how`` is ``measured`` or ``model`` (a tuned winner, timed or
    predicted by the cost model) or ``given`` (the caller named it)."""

    how: str
    where: str | None = None  # the store or server it was read from
    exact: bool = True  # False: the winner of the nearest tuned sizes
    tuned_sizes: Mapping[str, int] | None = None
    median_s: float | None = None
    topology: str | None = None

    def __str__(self) -> str:
        if self.how == "given":
            return "given by the caller"
        what = "measured fastest" if self.how == "measured" else "predicted fastest by the cost model"
        at = "" if self.exact else f" at the nearest tuned sizes {format_sizes(self.tuned_sizes or {})}"
        took = f" ({self.median_s * 1e3:.3g} ms a step)" if self.median_s else ""
        return f"{what}{at} on topology {self.topology}{took}, from {self.where}"


def rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rows [lo, hi) of a dim of extent ``n`` that ``rank`` holds when it is Sliced: ceil(n / world) a rank,
    the last ones short or empty (as the generated code cuts them)."""
    chunk = -(-n // world)
    lo = min(rank * chunk, n)
    return lo, min(lo + chunk, n)


def input_specs(scheduled: Program, sizes: Mapping[str, int], world: int, rank: int) -> dict[str, InputSpec]:
    """Each tensor input of the scheduled program as ``rank`` of ``world`` holds it."""
    out = {}
    for s in scheduled.inputs:
        if s.op != "input":
            continue
        shape = tuple(d.evaluate(sizes) for d in s.type.shape)
        layout, span, mine = s.type.layout, None, shape
        if isinstance(layout, Sliced):
            span = rows(shape[layout.dim], world, rank)
            mine = shape[: layout.dim] + (span[1] - span[0],) + shape[layout.dim + 1 :]
        out[s.name] = InputSpec(s.name, layout, mine, shape, s.type.dtype, span)
    return out


class Step:
    """The generated step of one schedule, loaded once, with its inputs checked on every call. Made by
    ``coconet.compile``; call it as ``step(tensors, scalars)``: updated state is written in place, and it
    returns the program's outputs (``{"outputs": {...}, "sent": {...}}``)."""

    def __init__(
        self,
        schedule: Schedule,
        sizes: Mapping[str, int],
        *,
        group: Any,
        world: int,
        rank: int,
        backend: str,
        kernels: str,
        device_type: str,
        origin: Origin,
        custom_ops: Mapping[str, Callable] | None = None,
        stage: int = 0,
        stages: int = 1,
    ) -> None:
        self.schedule, self.program, self.sizes = schedule, schedule.program, dict(sizes)
        self.group, self.world, self.rank = group, world, rank
        self.backend, self.kernels, self.device_type, self.origin = backend, kernels, device_type, origin
        self.inputs = input_specs(schedule.scheduled, self.sizes, world, rank)
        self.scalars = tuple(s.name for s in schedule.scheduled.inputs if s.op == "scalar")
        self.generated = lower(schedule, backend, kernels)
        self._fn = _load(self.generated)
        self._kwargs = dict(
            group=group, stage=stage, stages=stages, sizes=dict(self.sizes), custom_ops=dict(custom_ops or {})
        )
        self._names, self._scalar_names = frozenset(self.inputs), frozenset(self.scalars)
        self._seen: dict[str, tuple] = {}  # input name -> the key of the tensor last checked for it

    @property
    def layouts(self) -> dict[str, Any]:
        """Each tensor input's layout under the schedule: Local and Replicated are passed whole, Sliced as this
        rank's rows (``inputs[name].rows``)."""
        return {n: s.layout for n, s in self.inputs.items()}

    @property
    def sliced(self) -> tuple[str, ...]:
        """The inputs this rank passes as its rows only."""
        return tuple(n for n, s in self.inputs.items() if s.sliced)

    @property
    def source(self) -> str:
        """The generated module: readable Python that needs torch and the runtime, ``coconet.kernels``."""
        return self.generated.source

    def describe(self) -> str:
        head = (
            f"{self.program.name} (hash {self.program.hash}) at {format_sizes(self.sizes)}, rank {self.rank} "
            f"of {self.world}, on {self.backend} with {self.kernels} kernels"
        )
        lines = [
            head,
            f"schedule: {self.schedule.text}",
            f"  {self.schedule.describe()}",
            f"  {self.origin}",
            "inputs on this rank:",
        ]
        lines += [f"  {spec}" for spec in self.inputs.values()]
        lines.append(f"scalars: {', '.join(self.scalars) or 'none'}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<coconet step {self.program.name} {self.schedule.text!r} on {self.backend}, rank {self.rank}>"

    def __call__(self, tensors: Mapping[str, Any], scalars: Mapping[str, Any]) -> dict:
        self.check(tensors, scalars)
        return self._fn(tensors, scalars, **self._kwargs)

    def check(self, tensors: Mapping[str, Any], scalars: Mapping[str, Any]) -> None:
        """Raises InputError unless ``tensors`` and ``scalars`` fit the schedule on this rank."""
        if tensors.keys() != self._names or scalars.keys() != self._scalar_names:
            self._check_names(tensors, scalars)
        seen = self._seen
        for name, t in tensors.items():
            # what the check reads (shape, dtype, device) cannot change under one key: another device or a new
            # storage moves data_ptr, and a view of the same memory as another dtype changes dtype; strides
            # are not checked (the generated code takes any)
            try:
                key = (id(t), t.data_ptr(), t.shape, t.dtype)
            except AttributeError:
                raise InputError(
                    f"input {name}: given a {type(t).__name__}, not a torch.Tensor",
                    input=name,
                    given=type(t).__name__,
                    expected=self._expected(self.inputs[name]),
                ) from None
            if seen.get(name) != key:
                self._check_tensor(self.inputs[name], t)
                seen[name] = key

    def _check_names(self, tensors: Mapping[str, Any], scalars: Mapping[str, Any]) -> None:
        for kind, given, want in (("tensor", tensors, self._names), ("scalar", scalars, self._scalar_names)):
            missing, extra = sorted(want - set(given)), sorted(set(given) - want)
            if missing or extra:
                said = ([f"missing {', '.join(missing)}"] if missing else []) + (
                    [f"unknown {', '.join(extra)}"] if extra else []
                )
                raise InputError(
                    f"{kind} inputs: {'; '.join(said)} ({self.program.name}'s {kind}s: "
                    f"{', '.join(sorted(want)) or 'none'})",
                    input=(missing or extra)[0],
                    given=", ".join(sorted(given)),
                    expected=", ".join(sorted(want)),
                )

    def _expected(self, spec: InputSpec) -> str:
        shape = f"{spec.dtype} {list(spec.shape)} on {self.device_type}"
        if spec.rows is None:
            return shape + " (whole)"
        return shape + f" (this rank's rows {spec.rows[0]}:{spec.rows[1]} of {spec.global_shape[spec.layout.dim]})"

    def _check_tensor(self, spec: InputSpec, t: Any) -> None:
        shape, dtype, device = tuple(t.shape), str(t.dtype).removeprefix("torch."), t.device.type
        if shape == spec.shape and dtype == spec.dtype and device == self.device_type:
            return
        given = f"{dtype} {list(shape)} on {device}"
        why = ""
        if shape != spec.shape and spec.rows is not None and shape == spec.global_shape:
            why = (
                f": the schedule keeps {spec.name} sliced ({self.schedule.text}), so each rank passes its "
                "rows only; a whole tensor (as a whole-state schedule's checkpoint holds) must be cut first"
            )
        elif shape != spec.shape and isinstance(spec.layout, (Local, Replicated)) and self.world > 1:
            why = f": the schedule keeps {spec.name} whole on every rank"
        raise InputError(
            f"input {spec.name}: given {given}, the schedule expects {self._expected(spec)}{why}",
            input=spec.name,
            given=given,
            expected=self._expected(spec),
        )


def _load(gen: Any) -> Callable:
    """The module's ``step``, its code compiled under its cached file's name (tracebacks show its lines)."""
    module_path(gen)
    ns: dict[str, Any] = {"__name__": f"coconet_step_{gen.key}"}
    exec(marshal.loads(gen.code), ns)
    return ns["step"]


def load_program(program: Any) -> Program:
    """A program from a file's path, a DSL ``coconet.Program`` or the IR."""
    if isinstance(program, (str, os.PathLike)):
        return load_file(program)
    if isinstance(program, Program):
        return program
    ir = getattr(program, "ir", None)
    if isinstance(ir, Program):
        return ir
    raise CoconetError(f"program: a file's path, a coconet.Program or its IR, not a {type(program).__name__}")


def _sizes(sizes: Any, prog: Program) -> dict[str, int]:
    if isinstance(sizes, str):
        return parse_sizes(sizes, prog.dims)
    if not isinstance(sizes, Mapping):
        raise CoconetError(f"sizes: a mapping like {{'N': 1024}} or text like 'N=2^20', not {sizes!r}")
    return parse_sizes(",".join(f"{k}={int(v)}" for k, v in sizes.items()), prog.dims)


def _place(group: Any, world: int | None, rank: int | None, backend: str | None) -> tuple[int, int, str, bool]:
    """(world, rank, device type, whether a process group is up) for ``group``, or as the caller gave them
    where no group is initialised (a step compiled only to be read)."""
    import torch.distributed as dist

    up = dist.is_available() and dist.is_initialized()
    if up:
        world = dist.get_world_size(group) if world is None else world
        rank = dist.get_rank(group) if rank is None else rank
    elif world is None:
        raise CoconetError(
            "no process group is initialised: call torch.distributed.init_process_group first, "
            "or pass world= and rank= to compile a step you will only read"
        )
    nccl = backend == "nccl" or (backend is None and up and dist.get_backend(group) == "nccl")
    return world, rank or 0, "cuda" if nccl else "cpu", up


def compile(
    program: Any,
    sizes: Any,
    *,
    schedule: Any = BEST,
    group: Any = None,
    backend: str | None = None,
    kernels: str = "compiled",
    store: Any = None,
    server: str | None = None,
    token: str | None = None,
    topology: str = LOCAL_TOPOLOGY,
    shardable: Any = None,
    tune_on_miss: bool = False,
    budget: int = 32,
    world: int | None = None,
    rank: int | None = None,
    custom_ops: Mapping[str, Callable] | None = None,
    stage: int = 0,
    stages: int = 1,
) -> Step:
    """The step of ``program`` (a file's path, a ``coconet.Program`` or its IR) at ``sizes`` for this rank of
    ``group`` (the default group when None), lowered and loaded once.

    ``schedule``: ``"best"`` reads the winner tuned for (program, sizes, topology, world) from ``store`` (a URL
    or an open ``Store``; ``$COCONET_DATABASE_URL`` or the default store when neither is given) or from
    ``server`` (a URL; ``token`` when it wants one), falling back to the winner of the nearest tuned sizes
    (``describe()`` says so); otherwise a schedule's text, ``"baseline"`` or a ``Schedule``. ``shardable``:
    with ``"best"``, only a winner that leaves at most these states sharded (names or ``"all"``; a winner
    slicing the weights a model reads whole would not do). ``backend``: gloo, shm or nccl; with ``"best"``
    the winner's unless given, else nccl on a NCCL group and gloo otherwise.

    ``tune_on_miss``: with ``"best"``, where the key has no measured winner at exactly these sizes (none at all,
    only the nearest sizes', or only a prediction), rank 0 tunes it first (``budget`` trials) while the other
    ranks wait: into ``store`` on this machine's local Ray, or as a job on ``server`` (``token`` needed),
    followed until it ends. Tuning takes minutes; it is said on stderr when it starts."""
    if budget < 1:
        raise CoconetError(f"budget: at least 1 trial, not {budget}")
    program = named_example(program)
    prog = load_program(program)
    sizes = _sizes(sizes, prog)
    world, rank, device_type, up = _place(group, world, rank, backend)
    if isinstance(schedule, Schedule):
        if schedule.program.hash != prog.hash:
            raise CoconetError(f"the schedule is for program {schedule.program.hash}, not {prog.hash}")
        chosen, origin = schedule, Origin("given")
    elif schedule == BEST:
        look = _Lookup(
            prog,
            sizes,
            world,
            topology,
            backend,
            device_type,
            store,
            server,
            token,
            shardable,
            Tuning(program, budget, kernels) if tune_on_miss else None,
        )
        text, knobs, backend, origin = _agreed(look, group, rank if up else 0, world if up else 1)
        chosen = Schedule.parse(text, prog)
        if knobs:
            chosen = chosen.with_knobs(**knobs)
    elif isinstance(schedule, str):
        chosen, origin = Schedule.parse(schedule, prog), Origin("given")
    else:
        raise CoconetError(f"schedule: 'best', a schedule's text or a Schedule, not {schedule!r}")
    if backend is None:
        backend = "nccl" if device_type == "cuda" else "gloo"
    prog.require_world(world)
    return Step(
        chosen,
        sizes,
        group=group,
        world=world,
        rank=rank,
        backend=backend,
        kernels=kernels,
        device_type=device_type,
        origin=origin,
        custom_ops=custom_ops or prog.custom_ops,
        stage=stage,
        stages=stages,
    )


@dataclass(frozen=True)
class Tuning:
    """What ``compile(tune_on_miss=True)`` tunes with: the program as the caller named it (a file keeps its
    custom ops), the trials, and the kernels the step will run."""

    program: Any
    budget: int
    kernels: str


@dataclass
class _Lookup:
    """The question "best schedule for (program, sizes, topology, world)", asked of a store or a server."""

    prog: Program
    sizes: dict[str, int]
    world: int
    topology: str
    backend: str | None
    device_type: str
    store: Any
    server: str | None
    token: str | None
    shardable: Any
    tuning: Tuning | None = None

    def shardable_text(self) -> str | None:
        names = self._shardable_names()
        return None if names is None else shardable.to_text(self.prog, shardable.resolve(self.prog, names))

    def answer(self) -> tuple[str, dict[str, int], str, Origin]:
        """(schedule text, knobs, backend, origin); raises CoconetError on a miss. With ``tuning``, a key
        without a measured winner at these exact sizes is tuned first."""
        try:
            got = self._read()
        except CoconetError as e:
            if self.tuning is None or not getattr(e, "not_tuned", False):
                raise
            got = None
        if self.tuning is None or (got is not None and got[3].how == "measured" and got[3].exact):
            return got  # type: ignore[return-value]  # None only with tuning
        where = f"server {self.server}" if self.server is not None else "this machine's Ray"
        print(
            f"coconet.compile: {self.prog.name} has no measured winner for {format_sizes(self.sizes)}, world "
            f"{self.world}, topology {self.topology}: tuning it on {where} ({self.tuning.budget} trials)",
            file=sys.stderr,
            flush=True,
        )
        if self.server is not None:
            self._tune_on_server(self.tuning)
        else:
            self._tune_here(self.tuning)
        got = self._read()
        if got[3].how != "measured" or not got[3].exact:
            raise CoconetError(
                f"the tuning of {self.prog.name} at {format_sizes(self.sizes)} ended without a "
                f"measured winner at these sizes"
            )
        return got

    def _read(self) -> tuple[str, dict[str, int], str, Origin]:
        return self._from_server() if self.server is not None else self._from_store()

    def _tune_backends(self) -> tuple[str, ...]:
        if self.backend is not None:
            return (self.backend,)
        return ("nccl",) if self.device_type == "cuda" else ()

    def _shardable_names(self) -> list[str] | None:
        if self.shardable is None:
            return None
        return [self.shardable] if isinstance(self.shardable, str) else list(self.shardable)

    def _tune_here(self, tuning: Tuning) -> None:
        doc = api.tune(
            tuning.program,
            self.sizes,
            world=self.world,
            budget=tuning.budget,
            topology=self.topology,
            backends=self._tune_backends(),
            store=self.store,
            kernels=tuning.kernels,
            shardable=self._shardable_names(),
        )
        assert isinstance(doc, dict)  # one binding, one result
        if doc["best"] is None:
            why = "; ".join(f"{f['count']} {f['status']}: {f['error']}" for f in doc["failures"]) or "no trial ran"
            raise CoconetError(
                f"the tuning of {self.prog.name} at {format_sizes(self.sizes)} found no schedule that ran ({why})"
            )

    def _tune_on_server(self, tuning: Tuning) -> None:
        from coconet.client import Client, follow

        assert self.server is not None  # only a step that names a server tunes there
        with Client.open(self.server, self.token) as client:
            client.send_program(self.prog)  # the server tunes what it holds, as `coconet submit` sends it
            backends = self._tune_backends()
            _, started = client.best_or_tune(
                self.prog.hash,
                self.sizes,
                topology=self.topology,
                world=self.world,
                backend=backends[0] if backends else None,
                budget=tuning.budget,
                shardable=self._shardable_names(),
            )
            if started is None:
                return  # tuned meanwhile
            job = follow(client, [started["job"]])[started["job"]]
        if job["state"] != "done":
            raise CoconetError(
                f"server {self.server}: tuning job {started['job']} {job['state']}: "
                f"{job.get('error') or 'no reason given'}"
            )

    def _wanted_backends(self) -> list[str | None]:
        if self.backend is not None:
            return [self.backend]
        return ["nccl"] if self.device_type == "cuda" else [None, "shm", "gloo"]

    def _from_store(self) -> tuple[str, dict[str, int], str, Origin]:
        require(STORE, "coconet.compile without a schedule (it reads the tuned one from the store)")
        from coconet.server.store import Store

        opened = not hasattr(self.store, "best")
        try:
            store = Store.open(self.store, create=False) if opened else self.store
        except StoreError as e:
            if self.store is not None:
                raise
            # no store named and none made yet: as good as a store without the program
            raise CoconetError(
                f"no store to read the best schedule from ({e}): run `coconet tune` first, or "
                "pass store=URL, server=URL or schedule='baseline' or a schedule's text",
                not_tuned=True,
            ) from None
        try:
            for backend in self._wanted_backends():
                best = store.best(
                    self.prog.hash,
                    self.sizes,
                    self.topology,
                    self.world,
                    backend=backend,
                    shardable=self.shardable_text(),
                )
                if best is not None and (self.device_type == "cuda") == (best.winner.backend == "nccl"):
                    m = best.measurement
                    origin = Origin(best.source, store.url, best.exact, dict(best.sizes), m.median_s, self.topology)
                    return m.schedule, dict((m.schedule_json or {}).get("knobs") or {}), best.winner.backend, origin
            raise self._miss(f"store {store.url}", "--db URL ")
        finally:
            if opened:
                store.close()

    def _from_server(self) -> tuple[str, dict[str, int], str, Origin]:
        from coconet.client import Client, ServiceError

        assert self.server is not None  # _read asks the server only when one is named
        with Client.open(self.server, self.token) as client:
            try:
                got = client.best(
                    self.prog.hash,
                    self.sizes,
                    topology=self.topology,
                    world=self.world,
                    shardable=self.shardable_text(),
                )
            except ServiceError as e:
                if getattr(e, "status", None) == 404:
                    raise self._miss(f"server {self.server}", f"--server {self.server} ") from None
                raise
        if self.backend is not None and got["backend"] != self.backend:
            raise CoconetError(
                f"server {self.server}: the winner runs on {got['backend']}, not {self.backend}; "
                "pass schedule=TEXT to run another"
            )
        how = "measured" if got.get("source") == "measured" else "model"
        origin = Origin(
            how,
            self.server,
            bool(got.get("exact", True)),
            got.get("tuned_sizes"),
            (got.get("stats") or {}).get("median_s"),
            self.topology,
        )
        knobs = dict((got.get("schedule_json") or {}).get("knobs") or {})
        return got["schedule"], knobs, got["backend"], origin

    def _miss(self, where: str, flag: str) -> CoconetError:
        sizes = format_sizes(self.sizes)
        return CoconetError(
            f"no schedule of {self.prog.name} (hash {self.prog.hash}) tuned for {sizes}, world {self.world}, "
            f"topology {self.topology} in {where}: tune it first (`coconet {'submit' if 'server' in where else 'tune'} "
            f"FILE --world {self.world} --size {sizes} {flag}`) or pass schedule='baseline' or a schedule's text",
            not_tuned=True,
        )


def _agreed(look: _Lookup, group: Any, rank: int, world: int) -> tuple[str, dict[str, int], str, Origin]:
    """Rank 0's answer to ``look``, handed to every rank of ``group``: ranks that each read the store could see
    different winners (a tuning recorded between their reads) and would run different collectives."""
    if world == 1:
        return look.answer()
    import torch.distributed as dist

    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = ("ok", look.answer())
        except CoconetError as e:
            box[0] = ("error", (str(e), bool(getattr(e, "not_tuned", False))))
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    kind, value = box[0]
    if kind == "error":
        message, not_tuned = value
        raise CoconetError(message if rank == 0 else f"rank 0: {message}", not_tuned=not_tuned)
    return value
