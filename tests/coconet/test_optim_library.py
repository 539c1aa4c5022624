"""examples/optim/: each optimizer, on every schedule that leaves the weights whole, against torch.optim (or, for
LAMB and Lion, which torch lacks, their papers' update written in torch) over 8 steps at worlds 2 and 3.

Eight steps take RAdam past its rectification's start (about the sixth step) and SGD's momentum past its first
step. Every schedule of every optimizer runs in one launch of ranks per world; each rank sets gradients of its
own and the reference steps on their average (what DDP hands torch.optim)."""

import pytest

from tests.coconet.ranks import run

STEPS = 8
# name: (program file, torch.optim class or None, hyperparameters, one vector parameter only)
OPTIMIZERS = {
    "adam": ("adam", "Adam", dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1), False),
    "adamw": ("adamw", "AdamW", dict(lr=1e-2, weight_decay=0.1), False),
    "nadam": ("nadam", "NAdam", dict(lr=1e-2, weight_decay=0.1, momentum_decay=4e-3), False),
    "radam": ("radam", "RAdam", dict(lr=1e-2, weight_decay=0.1), False),
    "adamax": ("adamax", "Adamax", dict(lr=1e-2, weight_decay=0.1), False),
    "adagrad": (
        "adagrad",
        "Adagrad",
        dict(lr=1e-1, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.5),
        False,
    ),
    "rmsprop": ("rmsprop", "RMSprop", dict(lr=1e-2, momentum=0.9, weight_decay=0.1), False),
    "rmsprop_centered": ("rmsprop_centered", "RMSprop", dict(lr=1e-2, momentum=0.9, weight_decay=0.1), False),
    "sgd": ("sgd", "SGD", dict(lr=1e-1, momentum=0.9, dampening=0.5, weight_decay=0.1), False),
    "sgd_nesterov": ("sgd", "SGD", dict(lr=1e-1, momentum=0.9, nesterov=True), False),
    "adafactor": ("adafactor", "Adafactor", dict(lr=1e-2, weight_decay=0.1), True),
    "lamb": ("lamb", None, dict(lr=1e-2, weight_decay=0.1), False),
    "lion": ("lion", None, dict(lr=1e-3, weight_decay=0.1), False),
}
# what torch.optim is told beside the shared hyperparameters: the program is the switch's one branch
TORCH_SWITCHES = {"rmsprop_centered": {"centered": True}}


class _Paper:
    """LAMB and Lion as their papers write them, on the flat buffer of the parameters (one trust ratio)."""

    def __init__(self, name, params, lr, weight_decay):
        import torch

        self.name, self.params, self.lr, self.wd, self.t = name, list(params), lr, weight_decay, 0
        n = sum(p.numel() for p in self.params)
        self.m, self.v = torch.zeros(n), torch.zeros(n)

    def step(self):
        import torch

        self.t += 1
        w = torch.cat([p.detach().reshape(-1) for p in self.params])
        g = torch.cat([p.grad.reshape(-1) for p in self.params])
        if self.name == "lion":
            c = 0.9 * self.m + 0.1 * g
            w = w * (1 - self.lr * self.wd) - self.lr * torch.sign(c)
            self.m = 0.99 * self.m + 0.01 * g
        else:
            self.m = 0.9 * self.m + 0.1 * g
            self.v = 0.999 * self.v + 0.001 * g * g
            u = (self.m / (1 - 0.9**self.t)) / ((self.v / (1 - 0.999**self.t)).sqrt() + 1e-6) + self.wd * w
            w = w - self.lr * (w.norm() / u.norm()) * u
        at = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(w[at : at + p.numel()].view_as(p))
                at += p.numel()


def _params(vector):
    import torch

    gen = torch.Generator().manual_seed(3)
    shapes = [(23,)] if vector else [(4, 5), (3,)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _one(name, schedule, rank, world):
    """The largest difference of the weights from the reference's after STEPS steps, over their largest value."""
    import torch
    import torch.distributed as dist

    import coconet

    path, cls, hyper, vector = OPTIMIZERS[name]
    params, twin = _params(vector), _params(vector)
    opt = coconet.optim.from_program(f"examples/optim/{path}.py", params, schedule=schedule, kernels="eager", **hyper)
    switches = TORCH_SWITCHES.get(name, {})
    ref = getattr(torch.optim, cls)(twin, **hyper, **switches) if cls else _Paper(name, twin, **hyper)
    gen = torch.Generator().manual_seed(100 + rank)
    for t in range(STEPS):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for p, q, gr in zip(params, twin, grads):
            if t % 2:
                p.grad = gr.clone()  # a tensor of its own, as autograd makes after zero_grad()
            else:
                p.grad.copy_(gr)  # into the optimizer's view
            avg = gr.clone()
            dist.all_reduce(avg)
            q.grad = avg / world
        opt.step()
        ref.step()
    scale = max(float(q.detach().abs().max()) for q in twin)
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(params, twin)) / scale


def _library(rank, world):
    from coconet.loader import load_file
    from coconet.schedules.space import generate
    from coconet.schedules.types import Sliced

    gaps = {}
    for name, (path, *_) in OPTIMIZERS.items():
        prog = load_file(f"examples/optim/{path}.py")
        for sched in generate(prog):
            if not isinstance(sched.scheduled["w"].type.layout, Sliced):
                gaps[(name, sched.text)] = _one(name, sched.text, rank, world)
    return gaps


@pytest.mark.parametrize("world", [2, 3])
def test_every_optimizer_on_every_schedule_matches_torch(world):
    gaps = run(_library, world, timeout_s=300)[world - 1]
    assert {name for name, _ in gaps} == set(OPTIMIZERS)
    assert len(gaps) > 200
    wrong = {k: v for k, v in gaps.items() if not v < 1e-5}
    assert not wrong, wrong
