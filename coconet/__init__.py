"""coconet: distributed ML programs whose computation and communication are optimised together.

The public DSL (DESIGN §3)::

    from coconet import Program, Local, Replicated, Sliced, allreduce, sqrt
"""

from coconet.errors import (
    CoconetError,
    IllegalTransform,
    ProgramError,
    ScheduleError,
    SizeError,
)
from coconet.schedules.custom import CustomOp, OpRegistry, custom_op
from coconet.schedules.dsl import (
    Expr,
    Program,
    abs,
    all_gather,
    allreduce,
    broadcast,
    cast,
    dropout,
    exp,
    log,
    matmul,
    maximum,
    minimum,
    norm,
    recv,
    reduce_scatter,
    rsqrt,
    send,
    sqrt,
    sum,
    where,
)
from coconet.schedules.ir import NEXT_STAGE, PREV_STAGE
from coconet.schedules.serialize import export, load
from coconet.schedules.types import Local, Replicated, Sliced

__version__ = "0.1.0"

__all__ = [
    "CoconetError", "CustomOp", "Expr", "IllegalTransform", "Local", "NEXT_STAGE", "OpRegistry", "PREV_STAGE",
    "Program", "ProgramError", "Replicated", "ScheduleError", "SizeError", "Sliced", "abs", "all_gather",
    "allreduce", "broadcast", "cast", "custom_op", "dropout", "exp", "export", "load", "log", "matmul",
    "maximum", "minimum", "norm", "recv", "reduce_scatter", "rsqrt", "send", "sqrt", "sum", "where",
]
