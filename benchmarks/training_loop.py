"""A model trained with coconet's generated Adam step in its loop, against DDP and torch.optim.Adam.

    python benchmarks/training_loop.py [--world 2] [--dims 1024,4096,4096,10] [--batch 32] [--steps 30]
                                       [--rounds 2] [--backend shm] [--kernels compiled]
                                       [--schedule TEXT] [--out benchmarks/results/training_loop_w2.json]

Every rank builds the same MLP from one seed and trains it on batches of its own, three ways, from the same
start, each for ``--steps`` steps:

- ``coconet``: the loop as torch.optim's, with ``coconet.optim.from_program("examples/optim/adam.py", ...)``
  as its optimizer: Adam as torch computes it, the gradients averaged over the ranks, lowered for
  ``--schedule`` (ZeRO-1's fused collective by default: each rank keeps its rows of Adam's moments) on
  ``--backend``. The optimizer makes the parameters views of one flat buffer ``w`` and their ``.grad`` views
  of one flat buffer ``g``, as DDP's buckets and ZeRO's flat partitions keep them, so backward writes where
  the step reads;
- ``ddp``: ``DistributedDataParallel`` (gloo, ``gradient_as_bucket_view``) and ``torch.optim.Adam(fused=True)``,
  whose gradient allreduce overlaps backward;
- ``allreduce``: the flat buffers as coconet's, ``dist.all_reduce`` of g after backward, then
  ``torch.optim.Adam(fused=True)``: ``coconet bench``'s baseline for the step, in the loop.

The report gives each way's losses (the mean over ranks, step by step) and how far they and the final weights
end from DDP's, beside how far the program's update written in eager torch on DDP's gradients ends from
Adam(fused) (the same arithmetic in another association: what rounding alone does to this model over the
steps); and each way's step time, from the step's start to the end of its optimizer step, the slowest
rank's, and the part of it after backward (the reduction left to do, and the update): the median over the
steps after the first two (which compile and move buffers into shared memory), per round, the ways taking
turns to go first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from coconet.tuner.plots import COLOURS, can_write, figure, write_figure

ZERO1 = "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0)"
# Adam as torch.optim.Adam computes it, the gradients averaged over the ranks as DDP averages them
PROGRAM = Path(__file__).resolve().parents[1] / "examples" / "optim" / "adam.py"
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
WARMUP = 2


def _model(dims: list[int]):
    import torch

    torch.manual_seed(0)
    layers = []
    for a, b in zip(dims, dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _batches(dims: list[int], batch: int, steps: int, rank: int):
    """This rank's batches: inputs, and the classes a fixed random teacher assigns them."""
    import torch

    gen = torch.Generator().manual_seed(1000 + rank)
    teacher = torch.randn(dims[0], dims[-1], generator=torch.Generator().manual_seed(7))
    xs = torch.randn(steps, batch, dims[0], generator=gen)
    return xs, (xs @ teacher).argmax(-1)


def _schedule(text: str):
    """PROGRAM under the schedule ``text``, which must leave w whole: the model holds its weights so."""
    from coconet import Sliced
    from coconet.loader import load_file
    from coconet.schedules.schedule import Schedule

    sched = Schedule.parse(text, load_file(PROGRAM))
    if isinstance(sched.scheduled["w"].type.layout, Sliced):
        raise SystemExit(f"--schedule {text!r} leaves w sliced; the model in this loop holds its weights whole")
    return sched


def _train_coconet(args, xs, ys):
    """The torch.optim loop with coconet's optimizer: the optimizer's line and nothing else changed."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import coconet

    model = _model(args.dims)
    opt = coconet.optim.from_program(
        PROGRAM,
        model.parameters(),
        lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        schedule=args.schedule,
        backend=args.backend,
        kernels=args.kernels,
    )
    losses, times = [], []
    for t in range(len(xs)):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(xs[t]), ys[t])
        loss.backward()
        tb = time.perf_counter()
        opt.step()
        end = time.perf_counter()
        times.append((end - t0, end - tb))
        losses.append(float(loss.detach()))
    return losses, times, torch.cat([p.detach().flatten() for p in model.parameters()])


def _flat_model(dims: list[int]):
    """The model with every parameter a view of one flat buffer w and its .grad a view of one flat buffer g."""
    import torch

    model = _model(dims)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    w, g = torch.empty(n), torch.zeros(n)
    at = 0
    for p in params:
        k = p.numel()
        w[at : at + k].copy_(p.detach().flatten())
        p.data = w[at : at + k].view_as(p)
        p.grad = g[at : at + k].view_as(p)
        at += k
    return model, w, g


def _train_flat(args, world, xs, ys, update):
    """Steps of the model on its flat buffers: backward of the loss over the world (the gradients are summed
    over ranks), then ``update(t)``, which ``update`` gets from the model and the buffers first."""
    import torch.distributed as dist
    import torch.nn.functional as F

    model, w, g = _flat_model(args.dims)
    update = update(model, w, g)
    losses, times = [], []
    for t in range(len(xs)):
        dist.barrier()
        t0 = time.perf_counter()
        g.zero_()
        loss = F.cross_entropy(model(xs[t]), ys[t])
        (loss / world).backward()  # all_reduce sums the gradients
        tb = time.perf_counter()
        update(t + 1)
        end = time.perf_counter()
        times.append((end - t0, end - tb))
        losses.append(float(loss.detach()))
    return losses, times, w


def _allreduce_adam(model, w, g):
    """``dist.all_reduce`` of g, then Adam(fused=True): coconet bench's hand-written baseline for the step."""
    import torch
    import torch.distributed as dist

    opt = torch.optim.Adam(
        model.parameters(), lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"], fused=True
    )

    def update(t):
        dist.all_reduce(g)
        opt.step()

    return update


def _train_ddp(args, rank, world, xs, ys, formula=False):
    """DDP and Adam(fused=True); or, with ``formula``, DDP and examples/adam.py's update written in eager torch
    (the same arithmetic as the program, in another association than torch's Adam), the reference for how far
    two correct Adams drift apart on this model from rounding alone."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    model = _model(args.dims)
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"], fused=True)
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params] if formula else []
    b1, b2 = torch.tensor(HYPER["beta1"]), torch.tensor(HYPER["beta2"])
    losses, times = [], []
    for t in range(len(xs)):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss = F.cross_entropy(ddp(xs[t]), ys[t])
        loss.backward()
        tb = time.perf_counter()
        if not formula:
            opt.step()
        else:
            with torch.no_grad():
                tt = torch.tensor(float(t + 1))
                for p, (m, v) in zip(params, moments):
                    m.copy_(b1 * m + (1 - b1) * p.grad)
                    v.copy_(b2 * v + (1 - b2) * p.grad * p.grad)
                    p.copy_(p - HYPER["lr"] * (m / (1 - b1**tt)) / (torch.sqrt(v / (1 - b2**tt)) + HYPER["eps"]))
        end = time.perf_counter()
        times.append((end - t0, end - tb))
        losses.append(float(loss.detach()))
    return losses, times, torch.cat([p.detach().flatten() for p in params])


def _rank(rank: int, world: int, port: int, args, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    xs, ys = _batches(args.dims, args.batch, args.steps, rank)
    ways = ("coconet", "ddp", "allreduce")
    report, first = {way: [] for way in ways}, {}
    for r in range(args.rounds):
        for way in ways[r % 3 :] + ways[: r % 3]:  # each way first in a round of its own
            if way == "coconet":
                losses, times, weights = _train_coconet(args, xs, ys)
            elif way == "ddp":
                losses, times, weights = _train_ddp(args, rank, world, xs, ys)
            else:
                losses, times, weights = _train_flat(args, world, xs, ys, _allreduce_adam)
            slowest = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            mean_loss = torch.tensor(losses, dtype=torch.float64)
            dist.all_reduce(mean_loss)
            report[way].append(
                {
                    "losses": (mean_loss / world).tolist(),
                    "times_s": slowest[:, 0].tolist(),
                    "after_backward_s": slowest[:, 1].tolist(),
                }
            )
            first.setdefault(way, weights.clone())
    reference, _, first["formula"] = _train_ddp(args, rank, world, xs, ys, formula=True)
    mean_loss = torch.tensor(reference, dtype=torch.float64)
    dist.all_reduce(mean_loss)
    report["formula"] = [{"losses": (mean_loss / world).tolist()}]
    # rank 0's weights after each way's first round (every rank holds them whole), compared here: a tensor
    # put on the queue would need this process alive until it is read
    gap = {
        k: float((first[k] - first["ddp"]).abs().max() / first["ddp"].abs().max())
        for k in ("coconet", "formula", "allreduce")
    }
    report.update(weights_rel_gap=gap, parameters=first["ddp"].numel())
    if rank == 0:
        out.put(report)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    import torch.multiprocessing as mp

    from coconet.tuner.launch import free_port

    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dims", default="1024,4096,4096,10", help="the MLP's widths, input to classes")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--backend", default="shm")
    ap.add_argument("--kernels", default="compiled")
    ap.add_argument("--schedule", default=ZERO1)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="the losses step by step, the step times per round: .html a page, .png an image",
    )
    args = ap.parse_args(argv)
    if args.plot is not None:
        can_write(args.plot)  # before the training whose figure it is
    args.dims = [int(d) for d in args.dims.split(",")]
    if args.steps <= WARMUP:
        ap.error(f"--steps must exceed the {WARMUP} steps left out of the times")
    _schedule(args.schedule)  # a schedule that does not fit the loop is refused before any rank starts
    if str(Path(__file__).parent) not in sys.path:  # spawned processes import this module by its name
        sys.path.insert(0, str(Path(__file__).parent))
    from interleaved import run_processes

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args, out)) for r in range(args.world)]
    got = run_processes(procs, out)
    return _report(args, got)


def _report(args, got: dict) -> dict:
    coconet, ddp, formula = got["coconet"][0], got["ddp"][0], got["formula"][0]

    def loss_gap(way):
        return max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(way["losses"], ddp["losses"]))

    weights_gap = got["weights_rel_gap"]
    rounds = []
    for c, d, a in zip(got["coconet"], got["ddp"], got["allreduce"]):
        tc, td, ta = (statistics.median(x["times_s"][WARMUP:]) for x in (c, d, a))
        bc, bd, ba = (statistics.median(x["after_backward_s"][WARMUP:]) for x in (c, d, a))
        rounds.append(
            {
                "coconet_step_s": tc,
                "ddp_step_s": td,
                "allreduce_adam_step_s": ta,
                "speedup": td / tc,
                "speedup_over_allreduce_adam": ta / tc,
                # from the end of backward to the end of the optimizer step: the gradients' reduction
                # that is left (all of it but DDP's) and the update
                "after_backward_s": {"coconet": bc, "ddp": bd, "allreduce": ba},
            }
        )
    report = {
        "command": "python benchmarks/training_loop.py "
        + " ".join(
            f"--{k} {','.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items()
            if k not in ("out", "plot")
        ),
        "world": args.world,
        "dims": args.dims,
        "parameters": got["parameters"],
        "batch": args.batch,
        "steps": args.steps,
        "schedule": args.schedule,
        "backend": args.backend,
        "kernels": args.kernels,
        "baseline": "DistributedDataParallel (gloo, gradient_as_bucket_view) + torch.optim.Adam(fused=True)",
        "second_baseline": "the same flat buffers, dist.all_reduce of g, torch.optim.Adam(fused=True)",
        "losses": {"coconet": coconet["losses"], "ddp": ddp["losses"], "formula": formula["losses"]},
        # against DDP + Adam(fused); "formula": the program's update in eager torch on DDP's gradients
        "loss_rel_gap": {"coconet": loss_gap(coconet), "formula": loss_gap(formula)},
        "weights_rel_gap": weights_gap,
        "rounds": rounds,
        "speedup": statistics.median(r["speedup"] for r in rounds),
        "speedup_over_allreduce_adam": statistics.median(r["speedup_over_allreduce_adam"] for r in rounds),
    }
    for k, r in enumerate(rounds):
        print(
            f"round {k}: coconet {r['coconet_step_s'] * 1e3:.1f} ms a step, DDP + Adam(fused) "
            f"{r['ddp_step_s'] * 1e3:.1f} ms ({r['speedup']:.2f}x), all_reduce + Adam(fused) "
            f"{r['allreduce_adam_step_s'] * 1e3:.1f} ms ({r['speedup_over_allreduce_adam']:.2f}x); after "
            "backward: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r["after_backward_s"].items())
        )
    print(
        f"{report['parameters']} parameters; losses {coconet['losses'][0]:.4f} -> {coconet['losses'][-1]:.4f} "
        f"(DDP {ddp['losses'][-1]:.4f}); largest relative gap to DDP: losses {loss_gap(coconet):.2g}, weights "
        f"{weights_gap['coconet']:.2g}; the program's update in eager torch: {loss_gap(formula):.2g}, "
        f"{weights_gap['formula']:.2g}"
    )
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    if args.plot is not None:
        plot(report, args.plot)
    return report


def plot(report: dict, path: Path) -> None:
    import plotly.graph_objects as go  # plotly: only when plotting

    fig = figure(1, 2)
    for i, (way, label, dash) in enumerate(
        (
            ("ddp", "DDP + Adam(fused)", "solid"),
            ("coconet", "coconet step", "dash"),
            ("formula", "the program's update in eager torch", "dot"),
        )
    ):
        losses = report["losses"][way]
        fig.add_trace(
            go.Scatter(
                x=list(range(1, len(losses) + 1)),
                y=losses,
                mode="lines",
                name=label,
                line={"color": COLOURS[i], "dash": dash},
            ),
            row=1,
            col=1,
        )
    rounds = report["rounds"]
    labels = [f"round {i}: {r['speedup']:.2f}x" for i, r in enumerate(rounds)]
    for i, (key, label) in enumerate(
        (
            ("ddp_step_s", "DDP + Adam(fused)"),
            ("allreduce_adam_step_s", "all_reduce + Adam(fused)"),
            ("coconet_step_s", "coconet step"),
        )
    ):
        fig.add_trace(
            go.Bar(x=labels, y=[r[key] * 1e3 for r in rounds], name=label, marker_color=COLOURS[(i + 3) % 8]),
            row=1,
            col=2,
        )
    fig.update_xaxes(title_text="step", row=1, col=1)
    fig.update_yaxes(title_text="loss, mean over ranks", row=1, col=1)
    fig.update_yaxes(title_text="training step (ms), median, slowest rank", row=1, col=2)
    fig.update_layout(
        barmode="group",
        title=f"{report['parameters'] / 1e6:.1f}M-parameter MLP, world {report['world']}, "
        f"{report['backend']}, batch {report['batch']} per rank",
    )
    write_figure(fig, path, width=1200, height=450)


if __name__ == "__main__":
    main(sys.argv[1:])
