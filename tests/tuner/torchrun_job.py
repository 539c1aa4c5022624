"""A user's script under torchrun (tests/tuner/test_torchrun.py starts it): ``init_process_group("gloo")`` from the
environment, then coconet's pieces as a training job uses them. Rank 0 prints one JSON line:

- ``optim_gap``: how far a model trained 6 steps with ``coconet.optim`` (examples/optim/adamw.py) ends from its
  twin trained with DDP and ``torch.optim.AdamW`` on the same batches;
- ``compile_err``: the relative error of ``coconet.compile`` steps of SGD (the program as written, and a ZeRO-style
  schedule keeping ``buf`` sliced) against the update computed by hand from every rank's gradient;
- ``emitted_err``: the same for the module ``coconet run --emit`` wrote (argv[1], when given);
- ``run``: what ``coconet.run`` answered every rank, called in the script's own group.

    torchrun ... tests/tuner/torchrun_job.py [EMITTED_MODULE.py]
"""

import importlib.util
import json
import sys

import torch
import torch.distributed as dist

import coconet

N, LR, MOMENTUM, WD = 257, 0.1, 0.9, 0.01
SLICED = "split(ar0); reorder(ag0); as_slice(buf)"


def optim_gap() -> float:
    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))  # noqa: E731
    model, twin = make(), make()
    twin.load_state_dict(model.state_dict())
    opt = coconet.optim.from_program(
        "examples/optim/adamw.py", model.parameters(), lr=1e-2, schedule="baseline", kernels="eager"
    )
    ddp = torch.nn.parallel.DistributedDataParallel(twin)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(6):
        x = torch.randn(4, 5, generator=gen)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        ref.zero_grad()
        ddp(x).square().mean().backward()
        ref.step()
    return max(float((a - b).detach().abs().max()) for a, b in zip(model.parameters(), twin.parameters()))


def sgd_inputs():
    """Every rank's gradient (each its own) and the replicated state, as every rank can compute them."""
    grads = [torch.randn(N, generator=torch.Generator().manual_seed(100 + r)) for r in range(dist.get_world_size())]
    gen = torch.Generator().manual_seed(7)
    return grads, torch.randn(N, generator=gen), torch.randn(N, generator=gen)


def sgd_expected():
    grads, w, buf = sgd_inputs()
    buf1 = MOMENTUM * buf + (sum(grads) + WD * w)
    return w - LR * buf1, buf1


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def compile_err() -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    want_w, want_buf = sgd_expected()
    worst = 0.0
    for schedule in ("baseline", SLICED):
        step = coconet.compile("examples/sgd.py", {"N": N}, schedule=schedule, kernels="eager")
        grads, w, buf = sgd_inputs()
        lo, hi = step.inputs["buf"].rows or (0, N)
        mine = buf[lo:hi].clone()
        step({"g": grads[rank], "w": w, "buf": mine}, {"lr": LR, "momentum": MOMENTUM, "weight_decay": WD})
        worst = max(worst, rel(w, want_w), rel(mine, want_buf[lo:hi]))
    assert world == step.world
    return worst


def emitted_err(path: str) -> float:
    spec = importlib.util.spec_from_file_location("emitted", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    grads, w, buf = sgd_inputs()
    want_w, want_buf = sgd_expected()
    module.step(
        {"g": grads[dist.get_rank()], "w": w, "buf": buf},
        {"lr": LR, "momentum": MOMENTUM, "weight_decay": WD},
        group=None,
    )
    return max(rel(w, want_w), rel(buf, want_buf))


def main() -> None:
    dist.init_process_group("gloo")
    found = {"world": dist.get_world_size(), "optim_gap": optim_gap(), "compile_err": compile_err()}
    if len(sys.argv) > 1:
        found["emitted_err"] = emitted_err(sys.argv[1])
    answer = coconet.run("examples/sgd.py", "N=2^8", schedules=[SLICED], kernels="eager", repeats=2)
    found["run"] = {
        "world": answer["world"],
        "results": [(r["schedule"], r["status"], r["correct"], r["samples"]) for r in answer["results"]],
    }
    dist.barrier()  # the script's group is still there
    if dist.get_rank() == 0:
        print(json.dumps(found), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
