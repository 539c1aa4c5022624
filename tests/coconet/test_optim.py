"""coconet.optim: an optimizer made from a DSL program, in a torch.optim training loop on ranks of a gloo group.

Each test runs its ranks once (tests/coconet/ranks.py); a rank trains a small model with coconet's optimizer
beside a twin trained with DDP and torch.optim (or torch.optim on gradients averaged by ``dist.all_reduce``,
what DDP computes), on batches of its own, and reports how far they end apart."""

import pytest

from tests.coconet.ranks import run

ZERO1 = "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0)"
WHOLE = "split(ar0); reorder(ag0); fuse_collective(rs0)"


def _models(seed=0):
    import torch

    torch.manual_seed(seed)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))  # noqa: E731
    model, twin = make(), make()
    twin.load_state_dict(model.state_dict())
    return model, twin


def _twin_step(twin, opt, world):
    import torch.distributed as dist

    for p in twin.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()


def _gap(model, twin):
    return max(float((a - b).abs().max()) for a, b in zip(model.parameters(), twin.parameters()))


def _train_beside_torch(rank, world, schedule, backend, zeroing):
    """8 AdamW steps of coconet's optimizer and torch's, the gradients zeroed as ``zeroing`` says."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import coconet

    model, twin = _models()
    opt = coconet.optim.from_program(
        "examples/optim/adamw.py",
        model.parameters(),
        lr=1e-2,
        betas=(0.8, 0.99),
        schedule=schedule,
        backend=backend,
        kernels="eager",
        foreach=True,
    )
    ddp = DistributedDataParallel(twin)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, betas=(0.8, 0.99), foreach=True)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(8):
        x = torch.randn(4, 5, generator=gen)
        if zeroing == "optimizer":
            opt.zero_grad()
        elif zeroing == "model":
            model.zero_grad()
        else:
            opt.zero_grad(set_to_none=False)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(float(loss))
        ref.zero_grad()
        ddp(x).square().mean().backward()
        ref.step()
    return _gap(model, twin), losses, opt.describe()


@pytest.mark.parametrize(
    "world, schedule, backend, zeroing",
    [(2, ZERO1, "gloo", "optimizer"), (3, ZERO1, "shm", "model"), (3, "baseline", "gloo", "in place")],
)
def test_trains_as_torch_adamw_on_averaged_gradients(world, schedule, backend, zeroing):
    """The weights follow DDP + torch.optim.AdamW's to float32 rounding after 8 steps, however the gradients were
    zeroed (set to None by the optimizer or the model, or zeroed in place): a .grad autograd made anew is
    copied in, so the loss keeps moving."""
    for gap, losses, described in run(_train_beside_torch, world, schedule, backend, zeroing):  # noqa: B007 (read after)
        assert gap < 2e-6, gap
        assert losses[-1] < losses[0]
    if schedule == ZERO1:
        assert "m: Sliced(0)" in described and "this rank's rows" in described


def _checkpoint(rank, world, schedule, steps, saved, first):
    """Train steps [first, steps) on a global batch of 12 split among the ranks (so every world computes the
    same averaged gradient), from ``saved`` (model and optimizer state) when given; return the state after
    step 3 and the weights at the end."""
    import torch

    import coconet

    model, _ = _models()
    opt = coconet.optim.from_program(
        "examples/optim/adam.py", model.parameters(), lr=1e-2, schedule=schedule, kernels="eager"
    )
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
    gen = torch.Generator().manual_seed(5)
    xs = torch.randn(steps, 12, 5, generator=gen)
    per = 12 // world
    state = None
    for t in range(first, steps):
        opt.zero_grad()
        model(xs[t, rank * per : (rank + 1) * per]).square().mean().backward()
        opt.step()
        if t == 2:
            state = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optim": opt.state_dict()}
    return state, [p.detach().clone() for p in model.parameters()], opt.state_dict()


def test_checkpoint_moves_between_schedules_and_world_sizes():
    """A checkpoint saved under world 2 with ZeRO-1 (moments sliced) and restored under world 3 with the moments
    whole continues as the run that was not stopped; and the other way round. The saved state is whole and in
    torch's form: exp_avg-like tensors per parameter, shaped like it."""
    a = run(_checkpoint, 2, ZERO1, 6, None, 0)
    b = run(_checkpoint, 3, WHOLE, 6, None, 0)
    saved_a, saved_b = a[0][0], b[0][0]
    for entry in saved_a["optim"]["state"].values():
        assert set(entry) == {"m", "v", "step"} and float(entry["step"]) == 3
    for p, entry in zip(a[0][1], saved_a["optim"]["state"].values()):
        assert entry["m"].shape == p.shape
    # a's uninterrupted run, and b's: the same training (to rounding) whatever the world and the schedule
    assert max(float((x - y).abs().max()) for x, y in zip(a[0][1], b[0][1])) < 1e-5
    resumed_b = run(_checkpoint, 3, WHOLE, 6, saved_a, 3)
    resumed_a = run(_checkpoint, 2, ZERO1, 6, saved_b, 3)
    for resumed, uninterrupted in ((resumed_b, b), (resumed_a, a)):
        for rank in resumed:
            assert max(float((x - y).abs().max()) for x, y in zip(rank[1], uninterrupted[0][1])) < 1e-5
        for name in ("m", "v"):
            for k, entry in uninterrupted[0][2]["state"].items():
                assert float((resumed[0][2]["state"][k][name] - entry[name]).abs().max()) < 1e-5


def _groups_and_scheduler(rank, world):
    """Two param groups (weight decay on the matrices only) and a StepLR halving lr every 2 steps."""
    import torch

    import coconet

    model, twin = _models()

    def split(m):
        return [
            {"params": [p for p in m.parameters() if p.dim() > 1]},
            {"params": [p for p in m.parameters() if p.dim() == 1], "weight_decay": 0.0},
        ]

    opt = coconet.optim.from_program(
        "examples/optim/adamw.py", split(model), lr=1e-2, weight_decay=0.1, schedule=ZERO1, kernels="eager"
    )
    ref = torch.optim.AdamW(split(twin), lr=1e-2, weight_decay=0.1)
    sched, ref_sched = (torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in (opt, ref))
    gen = torch.Generator().manual_seed(rank)
    for _ in range(6):
        x = torch.randn(4, 5, generator=gen)
        for m, o, s in ((model, opt, sched), (twin, ref, ref_sched)):
            o.zero_grad()
            m(x).square().mean().backward()
            if o is ref:
                _twin_step(twin, ref, world)
            else:
                o.step()
            s.step()
    return _gap(model, twin), [g["lr"] for g in opt.param_groups], len(opt._buckets)


def test_param_groups_and_an_lr_scheduler_act_as_on_torch_optim():
    for gap, lrs, groups in run(_groups_and_scheduler, 2):
        assert gap < 2e-6 and lrs == [1e-2 / 8, 1e-2 / 8] and groups == 2


def test_a_program_that_is_not_an_optimizer_or_lacks_hyperparameters_is_refused():
    import torch

    import coconet
    from coconet.errors import CoconetError

    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(CoconetError, match="needs lr"):
        coconet.optim.from_program("examples/adam.py", params, beta1=0.9, beta2=0.999, eps=1e-8)
    with pytest.raises(CoconetError, match="momentum_: not scalars of sgd"):
        coconet.optim.from_program("examples/sgd.py", params, lr=0.1, momentum_=0.9)
    with pytest.raises(CoconetError, match="dims M, K"):
        coconet.optim.from_program("benchmarks/programs/adafactor.py", params)
    with pytest.raises(CoconetError, match="no scalars beta1 and beta2"):
        coconet.optim.from_program("examples/sgd.py", params, lr=0.1, betas=(0.9, 0.99))


def _moved_memory(rank, world):
    """The flat buffer's memory swapped for shared memory (what the shm backend does to a buffer that views
    hold), between two steps: the parameters follow, and the optimizer keeps stepping them."""
    import torch

    import coconet

    model, _ = _models()
    opt = coconet.optim.from_program(
        "examples/optim/adam.py", model.parameters(), lr=1e-2, schedule="baseline", kernels="eager"
    )
    x = torch.randn(4, 5)
    before = []
    for t in range(3):
        if t == 1:
            storage = opt._buckets[0][0].w.untyped_storage()
            address = storage.data_ptr()
            storage._share_filename_cpu_()
            assert storage.data_ptr() != address
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        before.append(float(model(x).square().mean()))
    return before


def test_the_flat_buffer_may_move_under_its_views():
    losses = run(_moved_memory, 1)[0]
    assert losses[0] > losses[1] > losses[2]
