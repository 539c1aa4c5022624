"""An optimizer made from a DSL program, used as any ``torch.optim`` optimizer is.

::

    opt = coconet.optim.from_program("examples/adam.py", model.parameters(), lr=1e-3, group=dp_group)
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()                      # the program's step: the gradients' collective and the update

The program names its weights ``w`` (Replicated; or ``param``, ``p``, ``weight``, ``theta``; ``weights=`` for
another name), the gradient ``g`` (its one Local tensor: each rank's own, the program reduces it) and its
state (the other tensors it updates: Adam's ``m`` and ``v``), all of one shape ``(N,)``; its scalars are the
hyperparameters, and ``t`` (or ``step``), when it has one, is the step counter the optimizer keeps (1 on the
first step). torch's ``foreach``, ``fused``, ``capturable`` and ``differentiable`` are accepted and ignored.
The parameters of each param group and dtype become views of one flat buffer (``w``), their ``.grad`` views of
another (``g``): backward writes the gradients where the step reads them. A ``.grad`` that is not the
optimizer's view — ``None`` after ``zero_grad()`` (set-to-None, torch's default, for the optimizer's or the
model's), or a new tensor autograd made — counts as zero or is copied in before the step.

The schedule is the store's winner for each buffer's size (``schedule="best"``; the program as written, with a
warning, where nothing was tuned) or the text given. State a schedule keeps sliced (``as_slice(m)``, ZeRO-1)
is held as this rank's rows; ``state_dict()`` gathers it whole (a collective: every rank calls it) and
``load_state_dict`` cuts this rank's rows again, so a checkpoint moves between schedules and world sizes.

A program file may also define ``defaults`` (hyperparameters' default values) and ``host_scalars(hyper, t,
numel)``, which returns scalars computed on the host each step from the hyperparameters, the step counter and
the flat buffer's length (RAdam's rectification); hyperparameters the program does not read are the host's.
Hyperparameters may be spelled as torch does: ``betas=(b1, b2)`` for ``beta1``/``beta2``, ``weight_decay``
for ``wd``.
"""

from __future__ import annotations

import re
import runpy
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch

from coconet.errors import CoconetError
from coconet.loader import named_example
from coconet.schedules.ir import Program
from coconet.schedules.types import Local
from coconet.step import BEST, Step, compile, load_program

COUNTERS = ("t", "step")  # a scalar of either name is the step counter the optimizer keeps
ALIASES = {"weight_decay": ("wd",), "lr": ("eta",)}  # torch's name -> a program's other spellings
# torch.optim's switches between its own implementations of one update: nothing to do with a program's
IMPLEMENTATION = frozenset({"foreach", "fused", "capturable", "differentiable"})
# compile's arguments that only the lookup of a tuned schedule reads
LOOKUP_ONLY = ("store", "server", "token", "topology", "tune_on_miss", "budget")
WEIGHT_NAMES = ("w", "param", "params", "p", "weight", "weights", "theta", "x")


def from_program(
    program: Any,
    params: Iterable[Any],
    *,
    group: Any = None,
    schedule: Any = BEST,
    store: Any = None,
    server: str | None = None,
    token: str | None = None,
    backend: str | None = None,
    kernels: str = "compiled",
    topology: str = "local",
    weights: str = "w",
    grad: str = "g",
    host_scalars: Callable[[dict, int, int], Mapping[str, float]] | None = None,
    tune_on_miss: bool = False,
    budget: int = 32,
    **hyper: Any,
) -> "Optimizer":
    """A ``torch.optim.Optimizer`` stepping ``params`` with ``program`` (a file's path, the name of one of
    ``examples/optim`` such as ``"adamw"``, a ``coconet.Program`` or its IR) over the process group ``group``.
    ``hyper``: the program's scalars (``lr=1e-3``), beside the file's ``defaults``. See ``compile``
    for ``schedule``, ``store``, ``server``, ``backend``, ``kernels``, ``tune_on_miss`` and ``budget``; without
    ``tune_on_miss`` a size never tuned runs the program as written, with a warning."""
    prog, file_defaults, file_host, initial = _program_file(program)
    return Optimizer(
        params,
        prog,
        dict(file_defaults, **_torch_names(prog, hyper)),
        group=group,
        schedule=schedule,
        store=store,
        server=server,
        token=token,
        backend=backend,
        kernels=kernels,
        topology=topology,
        weights=weights,
        grad=grad,
        host_scalars=host_scalars or file_host,
        tune_on_miss=tune_on_miss,
        budget=budget,
        initial_state=initial,
    )


def _program_file(program: Any) -> tuple[Program, dict, Callable | None, dict[str, str]]:
    """The program, and what its file adds for an optimizer: ``defaults``, ``host_scalars`` and
    ``initial_state`` (a state's name -> the hyperparameter its buffer starts at, as Adagrad's
    ``initial_accumulator_value``; zero otherwise)."""
    program = named_example(program, "optim")
    prog = load_program(program)
    if not isinstance(program, (str, Path)) or Path(program).suffix != ".py":
        return prog, {}, None, {}
    text = Path(program).read_text()
    if not re.search(r"^(defaults|host_scalars|initial_state)\b|^def host_scalars\b", text, re.M):
        return prog, {}, None, {}
    namespace = runpy.run_path(str(program), run_name="__coconet_program__")  # loaded once already: it runs
    return (
        prog,
        dict(namespace.get("defaults") or {}),
        namespace.get("host_scalars"),
        dict(namespace.get("initial_state") or {}),
    )


def _torch_names(prog: Program, hyper: Mapping[str, Any]) -> dict[str, Any]:
    """``hyper`` with torch's spellings turned into the program's where the program spells them otherwise."""
    scalars = {s.name for s in prog.inputs if s.op == "scalar"}
    out = {}
    for key, value in hyper.items():
        if key in IMPLEMENTATION and key not in scalars:
            continue
        if key == "maximize" and key not in scalars:
            if value:
                raise CoconetError(f"maximize=True: {prog.name} descends; negate the loss, or the update")
            continue
        if key == "betas" and "betas" not in scalars:
            names = [n for n in (("beta1", "beta2"), ("b1", "b2")) if set(n) <= scalars]
            if not names:
                raise CoconetError(f"betas=: {prog.name} has no scalars beta1 and beta2")
            first, second = names[0]
            if len(value) != 2:
                raise CoconetError(f"betas={value!r}: two values, as torch's (beta1, beta2)")
            out[first], out[second] = float(value[0]), float(value[1])
            continue
        other = [a for a in ALIASES.get(key, ()) if a in scalars and key not in scalars]
        out[other[0] if other else key] = value
    return out


class _Bucket:
    """The parameters of one param group and dtype and device as views of flat buffers, with the state the
    program keeps for them and the step compiled for their count."""

    def __init__(
        self,
        params: list,
        step: Step,
        weights: str,
        grad: str,
        state: list[str],
        starts: Mapping[str, float] | None = None,
    ) -> None:
        self.params, self.step, self.weights_name, self.grad_name = params, step, weights, grad
        self.numel = sum(p.numel() for p in params)
        first = params[0]
        self.w = torch.empty(self.numel, dtype=first.dtype, device=first.device)
        self.g = torch.zeros(self.numel, dtype=first.dtype, device=first.device)
        self.spans, self.grads, at = [], [], 0
        with torch.no_grad():
            for p in params:
                k = p.numel()
                self.w[at : at + k].copy_(p.detach().reshape(-1))
                p.data = self.w[at : at + k].view_as(p)
                view = self.g[at : at + k].view_as(p)
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                self.grads.append(view)
                self.spans.append((at, at + k))
                at += k
        # where each parameter lies in w, in bytes: w's memory may move (the shm backend makes it shared memory
        # in place of the process's own, the views following), the parameters' places in it may not
        self.offsets = [lo * self.w.element_size() for lo, _ in self.spans]
        self.state = {}
        for name in state:
            spec = step.inputs[name]
            self.state[name] = torch.full(
                spec.shape, (starts or {}).get(name, 0.0), dtype=getattr(torch, spec.dtype), device=first.device
            )
        self.tensors = {grad: self.g, weights: self.w, **self.state}

    def collect_grads(self) -> None:
        """Makes ``g`` hold every parameter's ``.grad``: the views hold them already unless the grad was set to
        None (zero) or replaced by a tensor of its own (copied in, then the view put back in its place)."""
        base = self.w.data_ptr()
        for p, view, offset in zip(self.params, self.grads, self.offsets):
            if p.data_ptr() != base + offset:
                raise CoconetError(
                    f"a parameter of shape {tuple(p.shape)} is no longer a view of the optimizer's "
                    "flat buffer (its .data was replaced, or the model moved with .to()): build "
                    "the optimizer after moving the model"
                )
            got = p.grad
            if got is view:
                continue
            if got is None:
                view.zero_()
                continue
            view.copy_(got)
            p.grad = view

    def sliced(self, name: str) -> tuple[int, int] | None:
        return self.step.inputs[name].rows

    def whole(self, name: str) -> torch.Tensor:
        """State ``name`` whole: this rank's rows gathered from every rank where the schedule slices it."""
        part, span = self.state[name], self.sliced(name)
        if span is None:
            return part
        import torch.distributed as dist

        world = self.step.world
        chunk = -(-self.numel // world)
        padded = part.new_zeros(chunk)
        padded[: part.numel()].copy_(part)
        pieces = [part.new_empty(chunk) for _ in range(world)]
        dist.all_gather(pieces, padded, group=self.step.group)
        return torch.cat(pieces)[: self.numel]

    def load(self, name: str, whole: torch.Tensor) -> None:
        span = self.sliced(name)
        rows = whole if span is None else whole[span[0] : span[1]]
        self.state[name].copy_(rows)


class Optimizer(torch.optim.Optimizer):
    """A DSL program's step as a ``torch.optim.Optimizer``; made by ``from_program``.

    ``param_groups`` hold the hyperparameters by the program's names (an LR scheduler's changes to ``lr`` are
    read at each step); ``describe()`` says which schedule each flat buffer runs and what it keeps sliced."""

    def __init__(
        self,
        params: Iterable[Any],
        program: Program,
        defaults: Mapping[str, Any],
        *,
        group: Any = None,
        schedule: Any = BEST,
        store: Any = None,
        server: str | None = None,
        token: str | None = None,
        backend: str | None = None,
        kernels: str = "compiled",
        topology: str = "local",
        weights: str = "w",
        grad: str = "g",
        host_scalars: Callable[[dict, int, int], Mapping[str, float]] | None = None,
        tune_on_miss: bool = False,
        budget: int = 32,
        initial_state: Mapping[str, str] | None = None,
    ) -> None:
        self.program, self.group, self.host_scalars = program, group, host_scalars
        self._layout = _roles(program, weights, grad)
        self._initial = dict(initial_state or {})
        unknown = sorted(set(self._initial) - set(self._layout[2]))
        if unknown:
            raise CoconetError(
                f"initial_state names {', '.join(unknown)}: not state {program.name} updates "
                f"(its state: {', '.join(self._layout[2]) or 'none'})"
            )
        self._hyper = self._hyper_names(host_scalars, defaults)
        self._lookup = dict(
            schedule=schedule,
            store=store,
            server=server,
            token=token,
            backend=backend,
            kernels=kernels,
            topology=topology,
            tune_on_miss=tune_on_miss,
            budget=budget,
        )
        self._buckets: list[list[_Bucket]] = []
        self._counts: list[int] = []
        super().__init__(params, dict(defaults))  # its add_param_group builds each group's buffers

    def _hyper_names(self, host: Callable | None, defaults: Mapping[str, Any]) -> tuple[str, ...]:
        """The hyperparameters a param group holds: the program's scalars but the counter and those the host
        computes, and, with a ``host_scalars``, what else the defaults name (the host's own, as SGD's
        ``nesterov``)."""
        self._program_scalars = frozenset(s.name for s in self.program.inputs if s.op == "scalar")
        self._counter = next((n for n in COUNTERS if n in self._program_scalars), None)
        scalars = [s.name for s in self.program.inputs if s.op == "scalar" and s.name != self._counter]
        self._from_host = frozenset(host(dict(defaults), 1, 1)) if host is not None else frozenset()
        extra = [n for n in defaults if n not in scalars]
        unknown = [n for n in extra if n not in self._initial.values()]
        if unknown and host is None:
            raise CoconetError(
                f"{', '.join(unknown)}: not scalars of {self.program.name} (its hyperparameters: {', '.join(scalars)})"
            )
        return tuple(n for n in scalars if n not in self._from_host) + tuple(extra)

    def add_param_group(self, param_group: dict) -> None:
        params = param_group.pop("params")
        param_group = {**_torch_names(self.program, param_group), "params": params}
        super().add_param_group(param_group)
        self._build(len(self.param_groups) - 1)

    def _build(self, index: int) -> None:
        group = self.param_groups[index]
        missing = [n for n in self._hyper if n not in group]
        if missing:
            raise CoconetError(
                f"{self.program.name} needs {', '.join(missing)}: pass them to from_program "
                f"({missing[0]}=...) or in the param group"
            )
        weights, grad, state = self._layout
        by_kind: dict[tuple, list] = {}
        for p in group["params"]:
            by_kind.setdefault((p.dtype, p.device), []).append(p)
        starts = {name: float(group[hyper]) for name, hyper in self._initial.items()}
        buckets = []
        for params in by_kind.values():
            step = self._compile(sum(p.numel() for p in params), state)
            buckets.append(_Bucket(params, step, weights, grad, state, starts))
        self._buckets.append(buckets)
        self._counts.append(0)

    def _compile(self, n: int, state: list[str]) -> Step:
        dim = self.program.dims[0]
        kw = dict(self._lookup)
        schedule = kw.pop("schedule")
        if schedule == BEST:
            try:
                step = compile(self.program, {dim: n}, schedule=BEST, group=self.group, shardable=state, **kw)
            except CoconetError as e:
                if not getattr(e, "not_tuned", False):
                    raise
                warnings.warn(f"coconet.optim: {e}; running {self.program.name} as written (baseline)", stacklevel=4)
                for name in LOOKUP_ONLY:
                    kw.pop(name)
                step = compile(self.program, {dim: n}, schedule="baseline", group=self.group, **kw)
        else:
            for name in LOOKUP_ONLY:
                kw.pop(name)
            step = compile(self.program, {dim: n}, schedule=schedule, group=self.group, **kw)
        if step.inputs[self._layout[0]].sliced:
            raise CoconetError(
                f"schedule {step.schedule.text!r} keeps the weights {self._layout[0]} sliced; the "
                "model reads them whole: use a schedule that slices state only"
            )
        return step

    def _scalars(self, index: int, t: int, numel: int) -> dict[str, float]:
        group = self.param_groups[index]
        values = {n: group[n] for n in self._hyper}
        if any(isinstance(v, torch.Tensor) for v in values.values()):
            values = {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in values.items()}
        if self.host_scalars is not None:
            values.update(self.host_scalars(dict(values), t, numel))
        out = {k: v for k, v in values.items() if k in self._program_scalars}
        if self._counter is not None:
            out[self._counter] = t
        return out

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, buckets in enumerate(self._buckets):
            self._counts[index] += 1
            for b in buckets:
                b.collect_grads()
                b.step(b.tensors, self._scalars(index, self._counts[index], b.numel))
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients set to None (torch's default: the next step counts them zero) or the flat gradient buffers
        zeroed in one pass, every ``.grad`` the optimizer's view again."""
        for buckets in self._buckets:
            for b in buckets:
                if set_to_none:
                    for p in b.params:
                        p.grad = None
                else:
                    b.g.zero_()
                    for p, view in zip(b.params, b.grads):
                        if p.grad is not view:
                            p.grad = view

    def describe(self) -> str:
        parts = []
        for index, buckets in enumerate(self._buckets):
            for b in buckets:
                sliced = [n for n in b.state if b.sliced(n)]
                head = (
                    f"param group {index}: {len(b.params)} parameters, {b.numel} {str(b.w.dtype)[6:]} on "
                    f"{b.w.device}; state {', '.join(b.state) or 'none'}"
                    + (f" ({', '.join(sliced)} this rank's rows)" if sliced else "")
                )
                parts.append(head + "\n" + "\n".join("  " + line for line in b.step.describe().splitlines()))
        return "\n".join(parts)

    def state_dict(self) -> dict[str, Any]:
        """torch's form: ``state`` by parameter index, each the parameter's whole state (sliced state gathered
        from every rank: all ranks call this) and its ``step``; ``param_groups`` with the hyperparameters."""
        state: dict[int, dict[str, Any]] = {}
        groups, at = [], 0
        for index, (group, buckets) in enumerate(zip(self.param_groups, self._buckets)):
            place = _places(group)
            for b in buckets:
                wholes = {name: b.whole(name) for name in b.state}
                for p, (lo, hi) in zip(b.params, b.spans):
                    entry = {name: whole[lo:hi].view_as(p).clone() for name, whole in wholes.items()}
                    entry["step"] = torch.tensor(float(self._counts[index]))
                    state[place[id(p)] + at] = entry
            groups.append(
                {
                    **{k: v for k, v in group.items() if k != "params"},
                    "params": list(range(at, at + len(group["params"]))),
                }
            )
            at += len(group["params"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores hyperparameters, step counters and state saved by ``state_dict`` (under any schedule and
        world size): each rank keeps its rows of what its schedule slices."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved, self.param_groups)
        ):
            raise CoconetError(
                "the state_dict's param groups do not match this optimizer's (their count or their parameters' count)"
            )
        state = {int(k): v for k, v in state_dict["state"].items()}
        for index, (group, old, buckets) in enumerate(zip(self.param_groups, saved, self._buckets)):
            group.update({k: v for k, v in old.items() if k != "params"})
            first, place = old["params"], _places(group)
            for b in buckets:
                for name in b.state:
                    pieces = []
                    for p in b.params:
                        entry = state.get(first[place[id(p)]], {})
                        if name not in entry:
                            raise CoconetError(
                                f"the state_dict holds no {name!r} for a parameter of shape {tuple(p.shape)}"
                            )
                        pieces.append(entry[name].reshape(-1).to(b.w.device, b.state[name].dtype))
                    b.load(name, torch.cat(pieces))
            steps = [state[i]["step"] for i in first if i in state and "step" in state[i]]
            self._counts[index] = int(float(steps[0])) if steps else 0


def _places(group: dict) -> dict[int, int]:
    """Each parameter's place in its param group, by identity."""
    return {id(p): i for i, p in enumerate(group["params"])}


def _roles(program: Program, weights: str, grad: str) -> tuple[str, str, list[str]]:
    """(weights, gradient, state): the program's tensors as an optimizer uses them, checked."""
    if len(program.dims) != 1:
        raise CoconetError(
            f"{program.name} has dims {', '.join(program.dims)}: an optimizer steps a flat buffer, "
            "a program over one dim N whose tensors are all (N,)"
        )
    tensors = {s.name: s for s in program.inputs if s.op == "input"}
    local = [n for n, s in tensors.items() if isinstance(s.type.layout, Local)]
    if grad not in tensors and len(local) == 1:
        grad = local[0]
    if weights not in tensors:
        weights = next((n for n in WEIGHT_NAMES if n in tensors and n in program.updates), weights)
    for role, name in (("weights", weights), ("gradient", grad)):
        if name not in tensors:
            raise CoconetError(
                f"{program.name} has no tensor {name!r} for the {role} (pass "
                f"{'weights' if role == 'weights' else 'grad'}=NAME; its tensors: {', '.join(tensors)})"
            )
    if weights not in program.updates:
        raise CoconetError(f"{program.name} does not update {weights}: it is not an optimizer's step")
    if not isinstance(tensors[grad].type.layout, Local):
        raise CoconetError(
            f"{program.name}'s gradient {grad} is {tensors[grad].type.layout}: each rank's own "
            "gradient is Local, and the program reduces it"
        )
    for s in tensors.values():
        if [str(d) for d in s.type.shape] != [program.dims[0]]:
            raise CoconetError(
                f"{program.name}'s tensor {s.name} is shaped ({', '.join(map(str, s.type.shape))}): "
                f"an optimizer's tensors are all ({program.dims[0]},)"
            )
    state = [n for n in tensors if n not in (weights, grad)]
    constant = [n for n in state if n not in program.updates]
    if constant:
        raise CoconetError(
            f"{program.name} reads {', '.join(constant)}, which it does not update: an optimizer's "
            "program reads weights, gradient, state and scalars only"
        )
    return weights, grad, state
