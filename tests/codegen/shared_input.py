"""One rank of ZeRO-1 Adam on shm, stepped with the gradient tensors a caller might hand it:
``python -m tests.codegen.shared_input RANK WORLD PORT KERNELS``.

Every step starts from the same seeded state with a gradient of its own on every rank (the seeded one,
scaled per step), and each rank compares its w with the reference interpreter's for those gradients. What
the cases check beside the values: whether this rank published its gradient into its slot (counted at
``_publish``) or its peers read it where it lay, in the segment it moved into. Prints ``ok`` and exits 0,
or raises naming the step.
"""

import gc
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from coconet.codegen.launch import Options
from coconet.codegen.lower import lower
from coconet.codegen.rank import inputs
from coconet.schedules import interp
from coconet.schedules.schedule import Schedule

SCHEDULE = "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0); fc_chunks=3"
N = 1001


def main(rank: int, world: int, port: int, kernels: str) -> None:
    from coconet.loader import examples_dir, load_file

    sched = Schedule.parse(SCHEDULE, load_file(examples_dir() / "adam.py"))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    ns: dict = {"__name__": "coconet_generated_shared_input"}
    exec(compile(lower(sched, "shm", kernels).source, "<shared_input>", "exec"), ns)
    ns["_Shm"].PATIENCE_S = 20.0  # no launch watches these ranks: a failed rank ends the others soon
    published = []
    publish = ns["_publish"]
    ns["_publish"] = lambda *a: published.append(1) or publish(*a)
    opts = Options(world=world, sizes={"N": N})
    start, scalars = inputs(sched.scheduled, opts, 0, rank, torch.device("cpu"))
    grads = interp.make_inputs(sched.scheduled, world, {"N": N})["g"]  # every rank's, (world, N)
    w = start["w"].clone()
    buffer = torch.full((2 * N + 5,), -7.0)
    held = {"A": start["g"].clone()}

    def fresh(name):
        held[name] = torch.empty(N)
        return held[name]

    def forget(*names):
        for name in names:
            held.pop(name, None)
        gc.collect()

    # (what, the tensor this rank passes, whether this rank publishes it)
    cases = [
        ("the first step (g moves into a segment)", lambda: held["A"], False),
        ("a new gradient written into the same tensor", lambda: held["A"], False),
        ("a new tensor on rank 1 only", lambda: fresh("B") if rank == 1 else held["A"], rank == 1),
        ("a view into a larger buffer (cannot move)", lambda: buffer[3:3 + N], True),
        ("the moved tensor again", lambda: held["A"], False),
        ("a new tensor once the moved one is gone", lambda: forget("A", "B") or fresh("C"), False),
        ("that tensor again", lambda: held["C"], False),
        ("a new tensor each step, first", lambda: forget("C") or fresh("D"), False),
        ("a new tensor each step, second", lambda: forget("D") or fresh("E"), True),
        ("a new tensor each step, third", lambda: forget("E") or fresh("F"), True),
    ]
    for k, (what, make, publishes) in enumerate(cases):
        scale = 0.5 + 0.25 * k
        g = make()
        g.copy_(torch.from_numpy(grads[rank] * scale).float())
        sent = g.clone()
        tensors = {"g": g, "w": w, "m": start["m"].clone(), "v": start["v"].clone()}
        w.copy_(start["w"])
        published.clear()
        ns["step"](tensors, scalars, group=None, sizes={"N": N})
        want = interp.run(sched.scheduled, world, {"N": N}, inputs={"g": grads * scale}).observable()["stage0.state.w"]
        err = float(np.max(np.abs(w.numpy() - want)) / np.max(np.abs(want)))
        assert err < 1e-5, f"rank {rank}, {what}: w differs from the reference (relative error {err:.3g})"
        assert torch.equal(g, sent), f"rank {rank}, {what}: the step changed the gradient"
        assert bool(published) == publishes, (
            f"rank {rank}, {what}: {'published' if published else 'did not publish'} its gradient")
        seg = next(iter(ns["_GROUPS"].values())).inputs["g"][0]
        assert (g.data_ptr() == seg.data_ptr()) == (not publishes), f"rank {rank}, {what}: g is not where it was read"
        if what.startswith("a view"):
            assert g._base is buffer, "a view must stay in its buffer"
            assert bool((buffer[:3] == -7).all() and (buffer[3 + N:] == -7).all()), "the buffer around g was written"
        del g, tensors  # what the next case forgets must be gone
    dist.barrier()
    dist.destroy_process_group()
    print("ok")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
