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
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from coconet.codegen.backends import REGISTRY
from coconet.codegen.backends import get as backend_of
from coconet.codegen.cache import module_path
from coconet.codegen.lower import lower
from coconet.errors import CoconetError, InputError
from coconet.loader import load_file, named_example
from coconet.lookup import Lookup, Origin, Tuning, agreed
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
    if backend is not None:
        device_type = backend_of(backend).device_type
    else:  # the device of the backends that form such a group: nccl's, cuda
        device_type = REGISTRY.device_of_group(dist.get_backend(group)) if up else "cpu"
    return world, rank or 0, device_type, up


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
        look = Lookup(
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
        text, knobs, backend, origin = agreed(look, group, rank if up else 0, world if up else 1)
        chosen = Schedule.parse(text, prog)
        if knobs:
            chosen = chosen.with_knobs(**knobs)
    elif isinstance(schedule, str):
        chosen, origin = Schedule.parse(schedule, prog), Origin("given")
    else:
        raise CoconetError(f"schedule: 'best', a schedule's text or a Schedule, not {schedule!r}")
    if backend is None:
        backend = REGISTRY.default(device_type)
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
