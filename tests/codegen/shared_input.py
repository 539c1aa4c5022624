"""One rank of Adam's fused collective on shm, stepped with the gradient tensors a caller might hand it:
``python -m tests.codegen.shared_input RANK WORLD PORT KERNELS [SCHEDULE [SHARING]]``. The schedule is ZeRO-1's
(``zero1``: w gathered at the collective's end) or one that leaves w sliced too (``sliced``: nothing gathered,
the collective ends with a barrier of its own).

Every step starts from the same seeded state with a gradient of its own on every rank (the seeded one,
scaled per step), and each rank compares its w with the reference interpreter's for those gradients. What
the cases check beside the values: whether this rank published its gradient into its slot (counted at
``_publish``) or its peers read it where it lay, in the segment it moved into. SHARING ``private`` runs the
step where torch cannot make a buffer's memory shared in place: a flat buffer that other tensors view is
published. Prints ``ok`` and exits 0,
or raises naming the step.
"""

import gc
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from coconet.codegen.lower import lower
from coconet.kernels import segments
from coconet.kernels import shm as shm_kernels
from coconet.schedules import interp
from coconet.schedules.schedule import Schedule
from coconet.tuner.launch import Options
from coconet.tuner.rank import inputs

SCHEDULES = {
    "zero1": "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0); fc_chunks=3",
    "sliced": "split(ar0); reorder(ag0); as_slice(w); as_slice(m); as_slice(v); fuse_collective(rs0); fc_chunks=3",
}
N = 1001


def counting_rank(sched, kernels: str, rank: int, world: int, port: int) -> tuple[dict, list]:
    """This rank in its gloo group, and the schedule's shm module run in a namespace of its own, with the
    runtime's ``_publish`` appending to the list returned with it."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    ns: dict = {"__name__": "coconet_generated_counting"}
    exec(compile(lower(sched, "shm", kernels).source, "<counting_rank>", "exec"), ns)
    ns["_Shm"].PATIENCE_S = 20.0  # no launch watches these ranks: a failed rank ends the others soon
    published: list = []
    publish = shm_kernels._publish
    shm_kernels._publish = lambda *a: published.append(1) or publish(*a)
    return ns, published


def main(rank: int, world: int, port: int, kernels: str, schedule: str = "zero1", sharing: str = "share") -> None:
    from coconet.loader import examples_dir, load_file

    sched = Schedule.parse(SCHEDULES[schedule], load_file(examples_dir() / "adam.py"))
    ns, published = counting_rank(sched, kernels, rank, world, port)
    private = sharing == "private"
    if private:
        segments._share_storage = lambda t, path: None
    opts = Options(world=world, sizes={"N": N})
    start, scalars = inputs(sched.scheduled, opts, 0, rank, torch.device("cpu"))
    grads = interp.make_inputs(sched.scheduled, world, {"N": N})["g"]  # every rank's, (world, N)
    w = start["w"].clone()
    w_type = sched.scheduled["w"].type
    buffer = torch.full((2 * N + 5,), -7.0)
    held = {"A": start["g"].clone()}
    flat = torch.empty(N)
    views = [flat[: N // 3], flat[N // 3 :].view(-1, 1)]

    def fresh(name):
        held[name] = torch.empty(N)
        return held[name]

    def forget(*names):
        for name in names:
            held.pop(name, None)
        gc.collect()

    # (what, the tensor this rank passes, whether this rank publishes it, whether every rank holds a segment
    # for its gradient after the step, mapped by every peer)
    cases = [
        ("the first step (g moves into a segment)", lambda: held["A"], False, True),
        ("a new gradient written into the same tensor", lambda: held["A"], False, True),
        ("a new tensor on rank 1 only", lambda: fresh("B") if rank == 1 else held["A"], rank == 1, True),
        ("a view into a larger buffer (cannot move)", lambda: buffer[3 : 3 + N], True, True),
        ("the moved tensor again", lambda: held["A"], False, True),
        ("a new tensor once the moved one is gone", lambda: forget("A", "B") or fresh("C"), False, True),
        ("that tensor again", lambda: held["C"], False, True),
        ("a new tensor each step, first", lambda: forget("C") or fresh("D"), False, True),
        # D served one step: the caller sets .grad to None every step, and the segments go
        ("a new tensor each step, second", lambda: forget("D") or fresh("E"), True, False),
        ("a new tensor each step, third", lambda: forget("E") or fresh("F"), True, False),
        ("that tensor again (it moves into a segment anew)", lambda: held["F"], False, True),
        ("that tensor once more", lambda: held["F"], False, True),
        # a flat gradient buffer whose views are the parameters' .grad, which backward writes through: were it
        # to move into F's segment, the next step's gradient would land in its old memory and go unread; its
        # memory is made shared where it is instead
        (
            "a flat buffer that .grad views write into, once the moved one is gone",
            lambda: forget("F") or flat,
            private,
            True,
        ),
        ("that buffer again, written through its views", lambda: flat, private, True),
    ]
    for k, (what, make, publishes, segment) in enumerate(cases):
        scale = 0.5 + 0.25 * k
        g = make()
        given = torch.from_numpy(grads[rank] * scale).float()
        if what.endswith("through its views"):
            views[0].copy_(given[: N // 3])
            views[1].copy_(given[N // 3 :].view(-1, 1))
        else:
            g.copy_(given)
        sent = g.clone()
        tensors = {"g": g, "w": w, "m": start["m"].clone(), "v": start["v"].clone()}
        w.copy_(start["w"])
        published.clear()
        ns["step"](tensors, scalars, group=None, sizes={"N": N})
        want = interp.run(sched.scheduled, world, {"N": N}, inputs={"g": grads * scale}).observable()["stage0.state.w"]
        want = interp.distribute(w_type, want, want.shape, world)[rank]  # sliced: this rank's rows
        err = float(np.max(np.abs(w.numpy() - want)) / np.max(np.abs(want)))
        assert err < 1e-5, f"rank {rank}, {what}: w differs from the reference (relative error {err:.3g})"
        assert torch.equal(g, sent), f"rank {rank}, {what}: the step changed the gradient"
        assert bool(published) == publishes, (
            f"rank {rank}, {what}: {'published' if published else 'did not publish'} its gradient"
        )
        shm = next(iter(segments._GROUPS.values()))
        seg = shm.inputs["g"][0]
        assert (seg is not None) == segment, f"rank {rank}, {what}: {'no' if segment else 'a'} segment held for g"
        mapped = [r for r, peer in enumerate(shm.peer_states["g"]) if r != rank and (peer is not None) != segment]
        assert not mapped, f"rank {rank}, {what}: the segments of ranks {mapped} {'not ' if segment else ''}mapped"
        here = seg is not None and g.data_ptr() == seg.data_ptr()
        assert here == (not publishes), f"rank {rank}, {what}: g is not where it was read"
        if g is flat:
            assert views[0].data_ptr() == g.data_ptr(), "a buffer other tensors view must stay where they see it"
        if what.startswith("a view"):
            assert g._base is buffer, "a view must stay in its buffer"
            assert bool((buffer[:3] == -7).all() and (buffer[3 + N :] == -7).all()), "the buffer around g was written"
        del g, tensors  # what the next case forgets must be gone
    dist.barrier()
    dist.destroy_process_group()
    print("ok")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])
