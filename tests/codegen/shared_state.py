"""One rank of ZeRO-1 Adam on shm, stepped with the state tensors the caller might hand it:
``python -m tests.codegen.shared_state RANK WORLD PORT KERNELS [SCHEDULE [SHARING]]`` (the fused collective by
default; without one, w's all_gather writes into the state all the same). SHARING ``private`` runs the step
where torch cannot make a buffer's memory shared in place: a flat buffer that other tensors view is shadowed.

Every rank runs the same steps, each on the seeded inputs put back into whatever w this rank passes,
and compares its w with the reference interpreter's: the state moved into shared memory by the first
step, the same tensor again, a new tensor on one rank only, a flat buffer that other tensors view (it
cannot move: its memory is made shared where it is, and the views see the step), a view into a larger buffer
and a strided column (neither can move: a shadow segment takes the peers' rows). Prints ``ok`` and exits 0, or
raises naming the step.
"""

import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from coconet.codegen.lower import lower
from coconet.kernels import segments
from coconet.schedules import interp
from coconet.schedules.schedule import Schedule
from coconet.tuner.launch import Options
from coconet.tuner.rank import inputs

SCHEDULE = "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0); fc_chunks=3"
N = 1001


def main(rank: int, world: int, port: int, kernels: str, schedule: str = SCHEDULE, sharing: str = "share") -> None:
    from coconet.loader import examples_dir, load_file

    adam = load_file(examples_dir() / "adam.py")
    sched = Schedule.parse(schedule, adam)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    ns: dict = {"__name__": "coconet_generated_shared_state"}
    exec(compile(lower(sched, "shm", kernels).source, "<shared_state>", "exec"), ns)
    # no launch watches these ranks: a rank that fails ends the others at their next barrier, not in 300 s
    ns["_Shm"].PATIENCE_S = 20.0
    if sharing == "private":
        segments._share_storage = lambda t, path: None
    opts = Options(world=world, sizes={"N": N})
    start, scalars = inputs(sched.scheduled, opts, 0, rank, torch.device("cpu"))
    want = interp.run(sched.scheduled, world, {"N": N}, seed=opts.seed).observable()["stage0.state.w"]

    buffer = torch.full((2 * N + 5,), -7.0)
    matrix = torch.full((N, 3), -7.0)
    own = start["w"].clone()
    flat = torch.empty(N)
    # it cannot move (they would stay on its old memory): its memory is made shared where it is
    params = [flat[: N // 3], flat[N // 3 :].view(-1, 1)]
    cases = [
        ("the first step", lambda: own),
        ("the same tensor again", lambda: own),
        ("a new tensor on rank 1 only", lambda: start["w"].clone() if rank == 1 else own),
        ("a flat buffer a model's parameters are views of", lambda: flat),
        ("that buffer again", lambda: flat),
        ("a view into a larger buffer", lambda: buffer[3 : 3 + N]),
        ("a strided column", lambda: matrix[:, 1]),
        ("the moved tensor after those", lambda: own),
    ]
    for what, make in cases:
        w = make()
        tensors = {k: (w if k == "w" else v.clone()) for k, v in start.items()}
        w.copy_(start["w"])
        before = w.data_ptr()
        ns["step"](tensors, scalars, group=None, sizes={"N": N})
        assert tensors["w"] is w, what
        err = float(np.max(np.abs(w.numpy() - want)) / np.max(np.abs(want)))
        assert err < 1e-5, f"rank {rank}, {what}: w differs from the reference (relative error {err:.3g})"
        if what == "a view into a larger buffer":
            assert w.data_ptr() == before and w._base is buffer, "a view must stay in its buffer"
            assert bool((buffer[:3] == -7).all() and (buffer[3 + N :] == -7).all()), "the buffer around w was written"
        if w is flat:
            assert params[0].data_ptr() == w.data_ptr(), "a buffer other tensors view must stay where they see it"
            assert torch.equal(torch.cat([params[0], params[1].flatten()]), w), "the views do not see the step"
            seg, moved = next(iter(segments._GROUPS.values())).states["w"]
            if sharing == "private":
                assert not moved and w.data_ptr() == before, f"{what}: w must be shadowed where it is"
            else:
                assert moved and seg.data_ptr() == w.data_ptr(), f"{what}: the peers do not write into w itself"
        if what == "a strided column":
            assert bool((matrix[:, 0] == -7).all() and (matrix[:, 2] == -7).all()), "the other columns were written"
    dist.barrier()
    dist.destroy_process_group()
    print("ok")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7])
