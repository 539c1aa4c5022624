"""One rank of Adam after gradient accumulation (benchmarks/programs/adam_accumulate.py) in its fused
collective on shm, stepped several times: ``python -m tests.codegen.held_input RANK WORLD PORT KERNELS``.
The collective reduces ``acc + g``. Compiled, its chunk kernel adds every rank's rows of acc and g as it reads
them where they lie, each moved into a segment of its own on the first step, so nothing is published, but
for a tensor that cannot move (a view into a larger buffer), which goes into its place in the slot. Eager,
the step computes ``acc + g`` into the buffer it keeps for it (``_Shm.held``), which moves into a segment
once and is read there from then on, whatever tensors the caller passes. Publishing is counted at
``_publish``. Each step's w and acc are the reference interpreter's for that step's gradients. Prints ``ok``
and exits 0, or raises naming the step.
"""

import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from coconet.kernels import segments
from coconet.loader import load_file
from coconet.schedules import interp
from coconet.schedules.schedule import Schedule
from coconet.tuner.launch import Options
from coconet.tuner.rank import inputs
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
    moved = {"g": tensors["g"], "acc": tensors["acc"]}
    buffer = torch.full((3 * N + 7,), -7.0)
    views = {"acc": buffer[2 : 2 + N], "g": buffer[N + 5 : 2 * N + 5]}
    compiled = kernels == "compiled"
    # (what, the tensors passed as acc and g, how many this rank publishes compiled)
    cases = [
        ("the first step", ("acc", "g"), 0),
        ("the same tensors again", ("acc", "g"), 0),
        ("acc a view that cannot move", ("acc",), 1),
        ("both views", (), 2),
        ("g a view on rank 1 only", ("acc",) if rank == 1 else ("acc", "g"), int(rank == 1)),
        ("the moved tensors once more", ("acc", "g"), 0),
    ]
    held = None
    for k, (what, kept, publishes) in enumerate(cases):
        scale = 0.5 + 0.25 * k
        for name in start:  # the same state each step; g and acc this step's
            if name not in moved:
                tensors[name].copy_(start[name])
        for name in moved:
            tensors[name] = moved[name] if name in kept else views[name]
        tensors["g"].copy_(torch.from_numpy(every["g"][rank] * scale).float())
        tensors["acc"].copy_(torch.from_numpy(every["acc"][rank] * (1 + scale)).float())
        g = tensors["g"].clone()
        published.clear()
        ns["step"](tensors, scalars, group=None, sizes={"N": N})
        want = interp.run(
            sched.scheduled, world, {"N": N}, inputs={"g": every["g"] * scale, "acc": every["acc"] * (1 + scale)}
        ).observable()
        w = interp.distribute(sched.scheduled["w"].type, want["stage0.state.w"], want["stage0.state.w"].shape, world)[
            rank
        ]
        err = float(np.max(np.abs(tensors["w"].numpy() - w)) / np.max(np.abs(w)))
        assert err < 1e-5, f"rank {rank}, {what}: w differs from the reference (relative error {err:.3g})"
        assert not tensors["acc"].any(), f"rank {rank}, {what}: acc was not cleared"
        assert torch.equal(tensors["g"], g), f"rank {rank}, {what}: the step changed the gradient"
        around = torch.cat([buffer[:2], buffer[2 + N : N + 5], buffer[2 * N + 5 :]])
        assert bool((around == -7).all()), f"rank {rank}, {what}: the buffer around the views was written"
        shm = next(iter(segments._GROUPS.values()))
        if compiled:
            assert len(published) == publishes, (
                f"rank {rank}, {what}: published {len(published)} of acc and g, not {publishes}"
            )
            for name in kept:
                assert tensors[name].data_ptr() == shm.inputs[name][0].data_ptr(), (
                    f"rank {rank}, {what}: {name} is not in its segment"
                )
            assert "add0" not in shm.kept, f"rank {rank}, {what}: acc + g was computed whole"
        else:
            assert not published, f"rank {rank}, {what}: acc + g was published into a slot"
            held = held if held is not None else shm.kept["add0"]
            assert shm.kept["add0"] is held, f"rank {rank}, {what}: acc + g went into a new buffer"
            assert held.data_ptr() == shm.inputs["add0"][0].data_ptr(), f"rank {rank}, {what}: not in its segment"
    dist.barrier()
    dist.destroy_process_group()
    print("ok")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])
