"""One rank of Adam after gradient accumulation (benchmarks/programs/adam_accumulate.py) in its fused
collective on shm, stepped several times: ``python -m tests.codegen.held_input RANK WORLD PORT KERNELS``.
The collective reduces ``acc + g``, which the step computes into the buffer it keeps for it (``_Shm.held``):
the first step moves that buffer into a segment of its own and from then on the peers read it there, so no
step publishes it into a slot (counted at ``_publish``). Each step's w and acc are the reference
interpreter's for that step's gradients. Prints ``ok`` and exits 0, or raises naming the step.
"""

import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from coconet.codegen.launch import Options
from coconet.codegen.rank import inputs
from coconet.loader import load_file
from coconet.schedules import interp
from coconet.schedules.schedule import Schedule
from tests.codegen.shared_input import counting_rank

SCHEDULE = "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0); fc_chunks=3"
PROGRAM = Path(__file__).parents[2] / "benchmarks" / "programs" / "adam_accumulate.py"
N = 1001


def main(rank: int, world: int, port: int, kernels: str) -> None:
    sched = Schedule.parse(SCHEDULE, load_file(PROGRAM))
    ns, published = counting_rank(sched, kernels, rank, world, port)
    opts = Options(world=world, sizes={"N": N})
    start, scalars = inputs(sched.scheduled, opts, 0, rank, torch.device("cpu"))
    every = interp.make_inputs(sched.scheduled, world, {"N": N})  # every rank's g and acc, (world, N)
    tensors = {k: v.clone() for k, v in start.items()}
    w_type = sched.scheduled["w"].type
    held = None
    for k in range(4):
        scale = 0.5 + 0.25 * k
        for name in start:  # the same state each step; g and acc this step's
            tensors[name].copy_(start[name])
        tensors["g"].copy_(torch.from_numpy(every["g"][rank] * scale).float())
        tensors["acc"].copy_(torch.from_numpy(every["acc"][rank] * (1 + scale)).float())
        published.clear()
        ns["step"](tensors, scalars, group=None, sizes={"N": N})
        want = interp.run(sched.scheduled, world, {"N": N},
                          inputs={"g": every["g"] * scale, "acc": every["acc"] * (1 + scale)}).observable()
        w = interp.distribute(w_type, want["stage0.state.w"], want["stage0.state.w"].shape, world)[rank]
        err = float(np.max(np.abs(tensors["w"].numpy() - w)) / np.max(np.abs(w)))
        assert err < 1e-5, f"rank {rank}, step {k}: w differs from the reference (relative error {err:.3g})"
        assert not tensors["acc"].any(), f"rank {rank}, step {k}: acc was not cleared"
        assert not published, f"rank {rank}, step {k}: acc + g was published into a slot"
        shm = next(iter(ns["_GROUPS"].values()))
        held = held if held is not None else shm.kept["add0"]
        assert shm.kept["add0"] is held, f"rank {rank}, step {k}: acc + g went into a new buffer"
        assert held.data_ptr() == shm.inputs["add0"][0].data_ptr(), f"rank {rank}, step {k}: not in its segment"
    dist.barrier()
    dist.destroy_process_group()
    print("ok")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])
