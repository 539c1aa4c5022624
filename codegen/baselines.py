"""What an engineer would write without coconet: hand-written PyTorch steps for the paper's workloads.

Each baseline has the calling convention of a generated ``step`` (same inputs, same state updated in
place), so a launch checks and times it beside the schedules. ``Baseline.checked`` says whether its
results can be compared with the reference interpreter: eager dropout draws torch's own mask, so the
Megatron layer's output cannot be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from coconet.schedules.schedule import Schedule


class AdamStep:
    """DDP-style data-parallel Adam: the gradient copied into a bucket and ``dist.all_reduce``d (sum, as
    the program says), then ``torch.optim.Adam(fused=True)`` on w with m and v as its state."""

    def __init__(self) -> None:
        self.ready: dict[str, Any] | None = None

    def __call__(self, tensors, scalars, *, group=None, **_):
        import torch
        import torch.distributed as dist

        w, m, v = tensors["w"], tensors["m"], tensors["v"]
        if self.ready is None or self.ready["w"] is not w:
            param = torch.nn.Parameter(w, requires_grad=True)  # shares w's storage
            param.grad = torch.empty_like(w)
            opt = torch.optim.Adam([param], fused=True)
            opt.state[param] = {"step": torch.zeros((), dtype=torch.float32, device=w.device),
                                "exp_avg": m, "exp_avg_sq": v}
            self.ready = {"w": w, "param": param, "opt": opt}
        param, opt = self.ready["param"], self.ready["opt"]
        group_ = opt.param_groups[0]
        group_["lr"], group_["eps"] = float(scalars["lr"]), float(scalars["eps"])
        group_["betas"] = (float(scalars["beta1"]), float(scalars["beta2"]))
        opt.state[param]["step"].fill_(float(scalars["t"]) - 1)  # Adam counts the step it takes
        param.grad.copy_(tensors["g"])
        dist.all_reduce(param.grad, group=group)
        with torch.no_grad():
            opt.step()
        return {"outputs": {}, "sent": {}}


class MegatronStep:
    """The Megatron layer as eager PyTorch: matmul, ``dist.all_reduce``, ``F.dropout(y + b) + r``."""

    def __call__(self, tensors, scalars, *, group=None, **_):
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        y = torch.matmul(tensors["x"], tensors["w"])
        dist.all_reduce(y, group=group)
        return {"outputs": {"out": F.dropout(y + tensors["b"], p=0.1, training=True) + tensors["r"]}, "sent": {}}


@dataclass(frozen=True)
class Baseline:
    name: str
    program: str  # the program (its name) this baseline computes
    make: Callable[[], Callable[..., Any]]
    checked: bool
    doc: str


BASELINES = {
    "adam": Baseline("adam", "adam", AdamStep, True, "dist.all_reduce + torch.optim.Adam(fused=True)"),
    "megatron_mlp": Baseline("megatron_mlp", "megatron_mlp", MegatronStep, False,
                             "eager PyTorch: matmul, dist.all_reduce, F.dropout(y + b) + r"),
}


@dataclass(frozen=True)
class TorchTask:
    """A baseline as a launch task: it stands where a Generated module would."""

    baseline: Baseline
    schedule: Schedule  # the program's own (untransformed) schedule: inputs and reference come from it
    source: None = None
    line_map: dict | None = None

    @property
    def key(self) -> str:
        return f"torch_{self.baseline.name}"

    @property
    def text(self) -> str:
        return f"torch: {self.baseline.doc}"

    def statement_at(self, line: int) -> None:
        return None
