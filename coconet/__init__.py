"""coconet: distributed ML programs whose computation and communication are optimised together.

The public DSL (docs/dsl.md)::

    from coconet import Program, Local, Replicated, Sliced, allreduce, sqrt

and, for a training loop (imported on first use: ``import coconet`` does not import torch)::

    step = coconet.compile("examples/adam.py", sizes={"N": n}, group=dp_group)   # a tuned step
    opt = coconet.optim.from_program("examples/adam.py", model.parameters(), lr=1e-3, group=dp_group)
"""

import importlib

from coconet.errors import CoconetError, IllegalTransform, ProgramError, ScheduleError, SizeError
from coconet.loader import load
from coconet.schedules.custom import CustomOp, OpRegistry, custom_op
from coconet.schedules.dsl import (
    Expr,
    Program,
    abs,
    all_gather,
    allreduce,
    broadcast,
    cast,
    conv1d,
    conv2d,
    dropout,
    exp,
    layer_norm,
    log,
    log_softmax,
    matmul,
    max,
    maximum,
    mean,
    min,
    minimum,
    norm,
    recv,
    reduce_scatter,
    rms_norm,
    rsqrt,
    send,
    softmax,
    sqrt,
    sum,
    tensordot,
    transpose,
    where,
)
from coconet.schedules.ir import NEXT_STAGE, PREV_STAGE
from coconet.schedules.serialize import export
from coconet.schedules.types import Local, Replicated, Sliced

__version__ = "0.1.0"

_LAZY = {
    "compile": ("coconet.step", "compile"),
    "Step": ("coconet.step", "Step"),
    "optim": ("coconet.optim", None),
    **{name: ("coconet.api", name) for name in ("run", "tune", "best", "sweep")},
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'coconet' has no attribute {name!r}")

    module, attr = _LAZY[name]
    loaded = importlib.import_module(module)
    return loaded if attr is None else getattr(loaded, attr)


__all__ = [
    "CoconetError",
    "CustomOp",
    "Expr",
    "IllegalTransform",
    "Local",
    "NEXT_STAGE",
    "OpRegistry",
    "PREV_STAGE",
    "Program",
    "ProgramError",
    "Replicated",
    "ScheduleError",
    "SizeError",
    "Sliced",
    "Step",
    "abs",
    "all_gather",
    "allreduce",
    "best",
    "broadcast",
    "cast",
    "compile",
    "conv1d",
    "conv2d",
    "custom_op",
    "dropout",
    "exp",
    "export",
    "layer_norm",
    "load",
    "log",
    "log_softmax",
    "matmul",
    "max",
    "maximum",
    "mean",
    "min",
    "minimum",
    "norm",
    "optim",
    "recv",
    "reduce_scatter",
    "rms_norm",
    "rsqrt",
    "run",
    "schedules",
    "send",
    "softmax",
    "sqrt",
    "sum",
    "sweep",
    "tensordot",
    "transpose",
    "tune",
    "where",
]
