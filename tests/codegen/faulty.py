"""Custom ops whose torch code misbehaves on one rank: the failures a launch must report.

They live in an importable module so that the rank processes can unpickle them.
``COCONET_TEST_ONCE`` names a file: while it does not exist the op misbehaves
(and creates it), so only the first launch that reaches the op fails.
"""

import gc
import os
import time

import numpy as np
import torch.distributed as dist

import coconet as cc


def _misbehaves() -> bool:
    if dist.get_rank() != 1:
        return False
    marker = os.environ.get("COCONET_TEST_ONCE")
    if marker is None:
        return True
    if os.path.exists(marker):
        return False
    open(marker, "w").close()
    return True


def _raise(x):
    if _misbehaves():
        raise RuntimeError("boom on purpose")
    return x * 2


def _hang(x):
    if _misbehaves():
        time.sleep(3600)
    return x * 2


def _die(x):
    if _misbehaves():
        os._exit(3)
    return x * 2


def _tell_frozen(x):
    if dist.get_rank() == 1:
        raise RuntimeError(f"{gc.get_freeze_count()} objects frozen")
    return x * 2


def _double(x):
    return x * 2


boom = cc.custom_op("boom", reference=_double, torch=_raise)
hang = cc.custom_op("hang", reference=_double, torch=_hang)
die = cc.custom_op("die", reference=_double, torch=_die)
frozen = cc.custom_op("frozen", reference=_double, torch=_tell_frozen)  # how many objects GC leaves alone


def program(op):
    """An allreduce, then ``op`` on the slices, then the update of replicated state."""
    p = cc.Program("faulty", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    w = p.tensor("w", ("N",), layout=cc.Replicated)
    p.update(w, w - op(cc.allreduce(g)))
    return p.ir


def reference_only():
    p = cc.Program("ref_only", dims=("N",))
    g = p.tensor("g", ("N",), layout=cc.Local)
    twice = cc.custom_op("twice", reference=lambda x: np.asarray(x) * 2)
    p.output("y", twice(cc.allreduce(g)))
    return p.ir
