"""What an engineer would write without coconet: hand-written PyTorch steps for the paper's workloads,
and for any other program, its statements as eager PyTorch.

Each baseline has the calling convention of a generated ``step`` (same inputs, same state updated in
place), so a launch checks and times it beside the schedules. ``Baseline.checked`` says whether its
results can be compared with the reference interpreter: eager dropout draws torch's own mask, so the
Megatron layer's output cannot be.

A hand-written step stands for the example program it was written for, recognised by its structural
hash, not by its name: a user's "adam" that computes something else gets the eager baseline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from coconet.loader import examples_dir, load_file
from coconet.schedules import shardable as shard
from coconet.schedules.ir import Program
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
            opt.state[param] = {
                "step": torch.zeros((), dtype=torch.float32, device=w.device),
                "exp_avg": m,
                "exp_avg_sq": v,
            }
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


class GptLayerSPStep:
    """Megatron-LM's sequence-parallel epilogue as eager PyTorch: matmul, ``dist.reduce_scatter_tensor`` along
    the sequence, ``F.dropout(y + b) + r`` and ``F.layer_norm`` on the slice, ``dist.all_gather_into_tensor``.
    Megatron-LM requires the sequence to divide among the ranks; here an uneven one is padded, as the
    collectives want equal parts."""

    def __init__(self, p: float = 0.1) -> None:
        self.p = p  # the example's dropout probability

    def __call__(self, tensors, scalars, *, group=None, **_):
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        world, rank = dist.get_world_size(group), dist.get_rank(group)
        y = torch.matmul(tensors["x"], tensors["w"])
        n = y.shape[0]
        chunk = -(-n // world)
        if n != chunk * world:
            y = torch.cat([y, y.new_zeros((chunk * world - n,) + tuple(y.shape[1:]))])
        part = y.new_empty((chunk,) + tuple(y.shape[1:]))
        dist.reduce_scatter_tensor(part, y.contiguous(), group=group)
        lo = min(rank * chunk, n)
        part = part[: min(lo + chunk, n) - lo]
        h = F.dropout(part + tensors["b"], p=self.p, training=True) + tensors["r"]
        normed = F.layer_norm(h, h.shape[-1:], tensors["gamma"], tensors["beta"], eps=1e-5)
        sent = torch.cat([normed, normed.new_zeros((chunk - normed.shape[0],) + tuple(normed.shape[1:]))])
        whole = sent.new_empty((chunk * world,) + tuple(sent.shape[1:]))
        dist.all_gather_into_tensor(whole, sent.contiguous(), group=group)
        return {"outputs": {"residual": h, "out": whole[:n]}, "sent": {}}


class ConvBlockStep:
    """The channel-parallel convolution as eager PyTorch: ``F.conv2d`` of this rank's channels, ``dist.all_reduce``,
    ``F.relu(y + b + r)``. Channel parallelism splits the channels evenly; where the ranks outnumber them, a rank
    without channels contributes zeros (``F.conv2d`` would give it a result without channels). On CUDA in float32
    as the generated code convolves, not cuDNN's default TF32: its result is checked, and both do the same work."""

    def __call__(self, tensors, scalars, *, group=None, **_):
        import torch.distributed as dist
        import torch.nn.functional as F

        from coconet.kernels.ops import ieee_float32

        x, w = tensors["x"], tensors["w"]
        if x.shape[1]:
            with ieee_float32(x):
                y = F.conv2d(x, w, padding=1)
        else:
            y = x.new_zeros((x.shape[0], w.shape[0]) + tuple(x.shape[2:]))
        dist.all_reduce(y, group=group)
        return {"outputs": {"out": F.relu(y + tensors["b"] + tensors["r"])}, "sent": {}}


class AttentionOutStep:
    """Megatron-LM's tensor-parallel attention on this rank's heads as eager PyTorch (its ``CoreAttention`` and
    ``RowParallelLinear``): ``torch.matmul(q, k.transpose(1, 2)) * scale``, ``torch.softmax``, ``F.dropout``,
    ``torch.matmul(probs, v)``, the context laid out ``[s, heads * head dim]`` (a permute and a copy) times the
    weight's rows as one GEMM, ``dist.all_reduce``, ``F.dropout(y + b) + r``. A rank without heads contributes
    zeros (a product over no columns)."""

    def __init__(self, p: float = 0.1) -> None:
        self.p = p  # the example's dropout probability, both dropouts'

    def __call__(self, tensors, scalars, *, group=None, **_):
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        q, k, v, w = tensors["q"], tensors["k"], tensors["v"], tensors["w"]
        scores = torch.matmul(q, k.transpose(1, 2)) * float(scalars["scale"])
        probs = F.dropout(torch.softmax(scores, -1), p=self.p, training=True)
        ctx = torch.matmul(probs, v)
        heads, s, d = ctx.shape
        y = torch.matmul(ctx.permute(1, 0, 2).reshape(s, heads * d), w.reshape(heads * d, w.shape[-1]))
        dist.all_reduce(y, group=group)
        return {"outputs": {"out": F.dropout(y + tensors["b"], p=self.p, training=True) + tensors["r"]}, "sent": {}}


@dataclass(frozen=True)
class Baseline:
    name: str
    program: str  # the program (its name) this baseline computes
    make: Callable[[], Callable[..., Any]] | None  # None: the program lowered as eager PyTorch
    checked: bool
    doc: str
    program_hash: str | None = None  # None: the example program named ``program``
    # state the baseline's caller never reads, which a schedule may leave sharded (Schedule.sharded)
    shardable: tuple[str, ...] = ()

    def computes(self, prog: Program) -> bool:
        if self.program_hash is not None:
            return prog.hash == self.program_hash
        return prog.name == self.program and _example_hash(self.program) == prog.hash


BASELINES = {
    # torch.optim keeps the moments to itself; the model reads w whole
    "adam": Baseline(
        "adam", "adam", AdamStep, True, "dist.all_reduce + torch.optim.Adam(fused=True)", shardable=("m", "v")
    ),
    "megatron_mlp": Baseline(
        "megatron_mlp",
        "megatron_mlp",
        MegatronStep,
        False,
        "eager PyTorch: matmul, dist.all_reduce, F.dropout(y + b) + r",
    ),
    "gpt_layer_sp": Baseline(
        "gpt_layer_sp",
        "gpt_layer_sp",
        GptLayerSPStep,
        False,
        "eager PyTorch as Megatron-LM's sequence parallelism: matmul, "
        "dist.reduce_scatter_tensor, F.dropout(y + b) + r, F.layer_norm, "
        "dist.all_gather_into_tensor",
    ),
    "conv_block": Baseline(
        "conv_block", "conv_block", ConvBlockStep, True, "eager PyTorch: F.conv2d, dist.all_reduce, F.relu(y + b + r)"
    ),
    "attention_out": Baseline(
        "attention_out",
        "attention_out",
        AttentionOutStep,
        False,
        "eager PyTorch as Megatron-LM's tensor-parallel attention: matmul, softmax, F.dropout, matmul, "
        "the context's [s, h] GEMM, dist.all_reduce, F.dropout(y + b) + r",
    ),
}


def eager(prog: Program) -> Baseline:
    """The program as an engineer would write it in eager PyTorch: a torch op per statement,
    torch.distributed collectives, ``F.dropout``; the state written back in place at the end."""
    dropout = any(s.op == "dropout" for s in prog.stmts)
    return Baseline(
        "eager",
        prog.name,
        None,
        not dropout,
        "eager PyTorch: a torch op per statement, torch.distributed collectives" + (", F.dropout" if dropout else ""),
        program_hash=prog.hash,
    )


def baseline_for(prog: Program) -> Baseline:
    """The hand-written step of the example ``prog`` is, else ``prog`` as eager PyTorch."""
    hand = BASELINES.get(prog.name)
    return hand if hand is not None and hand.computes(prog) else eager(prog)


def default_shardable(prog: Program) -> frozenset[str]:
    """The state a schedule of ``prog`` may leave sharded unless the caller says otherwise: what its baseline's
    caller never reads (Adam: m, v), else nothing, so that a schedule hands back all the program computes."""
    return frozenset(baseline_for(prog).shardable)


def shardable_text(prog: Program, names: Sequence[str] | None = None) -> str:
    """The text (``coconet.schedules.shardable``) of what a tuning question lets stay sharded: the names a user
    gave (``all`` for every one; refused if not the program's state), else the program's default."""
    return shard.to_text(prog, default_shardable(prog) if names is None else shard.resolve(prog, names))


def _example_hash(name: str) -> str | None:
    path = examples_dir() / f"{name}.py"
    return load_file(path).hash if path.is_file() else None


@dataclass(frozen=True)
class TorchTask:
    """A baseline as a launch task: it stands where a Generated module would. A hand-written step is
    made on the rank (``source`` None); the eager baseline is a generated module like any schedule's."""

    baseline: Baseline
    schedule: Schedule  # the program's own (untransformed) schedule: inputs and reference come from it
    source: str | None = None
    path: str | None = None
    line_map: dict | None = None
    code: bytes | None = None  # the eager module compiled (``Generated.code``), for the ranks to load

    @property
    def key(self) -> str:
        return f"torch_{self.baseline.name}"

    @property
    def text(self) -> str:
        return f"torch: {self.baseline.doc}"

    def statement_at(self, line: int) -> str | None:
        return (self.line_map or {}).get(line)
