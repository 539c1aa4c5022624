"""Optimizers coconet has no hand-written baseline for, against torch.optim written by hand, in one run.

    python benchmarks/unseen_optimizers.py [--world 2] [--size N=2^22 --size N=2^24] [--rounds 2]

For a program that is not one of the paper's workloads, ``coconet bench`` compares with the program run
as eager PyTorch. That baseline is coconet's own reading of the program; this script puts the best
schedule beside the baseline a user would write instead: ``dist.all_reduce`` on the gradient in place,
then torch.optim's own step, ``fused=True`` where torch has it (Adam with amsgrad, AdamW, Adagrad) and
``foreach=True`` where it does not (RMSprop); AdamW's step comes after ``clip_grad_norm_``, whose global norm
the program computes too. The DSL programs are in ``benchmarks/programs/``. torch.optim keeps its state
(Adam's moments, RMSprop's square average, …) to itself, so the schedules may leave that state sharded, as
ZeRO-1 does (``--whole-state``: only schedules that leave it whole on every rank); w stays whole.

First, on small inputs, torch.optim's step is checked against coconet's reference interpreter running
the program: the two compute the same update. Then per size and round, one after the other: the
torch.optim ranks (each sample the slowest rank's step after a barrier; the gradient is put back
untimed between steps, so the baseline pays no copy) and ``coconet bench`` on shm, which also runs the
program as eager PyTorch. Each rank has ``cpus // world`` threads on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from coconet.tuner.plots import COLOURS, figure, write_figure

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ROOT / "benchmarks" / "programs"

# the optimizer and its hyper-parameters, the program's scalars of the same values, the state it keeps
# (program name -> torch's), and the max_norm the gradient is clipped to before the step (None: not clipped)
OPTIMIZERS = {
    "rmsprop": (
        "RMSprop",
        dict(lr=1e-3, alpha=0.99, eps=1e-8, momentum=0.9, weight_decay=1e-4, foreach=True),
        dict(lr=1e-3, alpha=0.99, eps=1e-8, momentum=0.9, weight_decay=1e-4),
        {"sq": "square_avg", "buf": "momentum_buffer"},
        None,
    ),
    "amsgrad": (
        "Adam",
        dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, amsgrad=True, fused=True),
        dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, t=1.0),
        {"m": "exp_avg", "v": "exp_avg_sq", "vmax": "max_exp_avg_sq"},
        None,
    ),
    "adamw_clip": (
        "AdamW",
        dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True),
        dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, t=1.0, max_norm=1.0),
        {"m": "exp_avg", "v": "exp_avg_sq"},
        1.0,
    ),
    "adagrad": ("Adagrad", dict(lr=1e-2, eps=1e-10, fused=True), dict(lr=1e-2, eps=1e-10), {"s": "sum"}, None),
}


def _optimizer(name, w, state_values):
    """torch.optim's optimizer for ``w`` with its state set to ``state_values`` (program name -> tensor)."""
    import torch

    cls, kwargs, _, names, _ = OPTIMIZERS[name]
    opt = getattr(torch.optim, cls)([w], **kwargs)
    if state_values is None:
        return opt
    w.grad = torch.zeros_like(w)
    before = w.detach().clone()
    opt.step()  # makes the state; with weight decay it moves w too, put back below with the state's values
    with torch.no_grad():
        w.copy_(before)
        st = opt.state[w]
        for prog_name, torch_name in names.items():
            st[torch_name].copy_(state_values[prog_name])
        st["step"].zero_()
    return opt


def _clip(name, w):
    import torch

    max_norm = OPTIMIZERS[name][4]
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_([w], max_norm, foreach=True)


def check_semantics(name: str, world: int = 2, n: int = 1000) -> float:
    """The largest relative difference between torch.optim's step and the reference's, over w and the state."""
    import numpy as np
    import torch

    from coconet.loader import load_file
    from coconet.schedules import interp

    prog = load_file(PROGRAMS / f"{name}.py")
    values = interp.make_inputs(prog, world, {"N": n}, seed=3)
    values.update({k: np.float64(v) for k, v in OPTIMIZERS[name][2].items()})
    ref = interp.run(prog, world, {"N": n}, inputs=dict(values))
    w = torch.nn.Parameter(torch.tensor(values["w"], dtype=torch.float32))
    state = {k: torch.tensor(values[k], dtype=torch.float32) for k in OPTIMIZERS[name][3]}
    opt = _optimizer(name, w, state)
    w.grad = torch.tensor(values["g"].sum(axis=0), dtype=torch.float32)
    _clip(name, w)
    opt.step()
    worst = 0.0
    for prog_name, got in [("w", w.detach())] + [(k, opt.state[w][v]) for k, v in OPTIMIZERS[name][3].items()]:
        want = ref.state(prog_name)
        worst = max(worst, float(np.max(np.abs(got.double().numpy() - want) / np.maximum(np.abs(want), 1e-6))))
    return worst


def _rank(name: str, rank: int, world: int, port: int, n: int, repeats: int, warmup: int, out: str) -> None:
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(rank)
    g = torch.rand(n, generator=gen)
    w = torch.nn.Parameter(torch.rand(n, generator=gen))
    opt = _optimizer(name, w, None)
    w.grad = g.clone()
    samples = []
    for i in range(warmup + repeats):
        with torch.no_grad():
            w.grad.copy_(g)  # the gradient back as backward would leave it: not timed
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(w.grad)
        _clip(name, w)
        opt.step()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i >= warmup:
            samples.append(float(dt))
    if rank == 0:
        Path(out).write_text(json.dumps(samples))
    dist.destroy_process_group()


def time_torch_optim(name: str, world: int, n: int, repeats: int, warmup: int = 3) -> list[float]:
    from coconet.tuner.launch import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "samples.json")
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--rank",
                    name,
                    str(r),
                    str(world),
                    str(port),
                    str(n),
                    str(repeats),
                    str(warmup),
                    out,
                ]
            )
            for r in range(world)
        ]
        codes = [p.wait(timeout=1800) for p in procs]
        if any(codes):
            raise RuntimeError(f"torch.optim {name} ranks exited with {codes}")
        return json.loads(Path(out).read_text())


def time_coconet(name: str, world: int, size: str, repeats: int, shardable: tuple[str, ...] = ()) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        shard = ["--shardable", ",".join(shardable)] if shardable else []
        subprocess.run(
            [
                sys.executable,
                "-m",
                "coconet",
                "bench",
                str(PROGRAMS / f"{name}.py"),
                "--world",
                str(world),
                "--size",
                size,
                "--backend",
                "shm",
                "--repeats",
                str(repeats),
                "-o",
                str(out),
                "--json",
                *shard,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        point = json.loads(out.read_text())["points"][0]
    best = point["best"]
    return {
        "best_schedule": best["schedule"],
        "best_s": best["median_s"],
        "eager_program_s": point["torch"]["median_s"],
    }


def plot(report: dict, path: Path) -> None:
    import plotly.graph_objects as go  # plotly: only when plotting

    rows = report["rows"]
    labels = [f"{r['program']}<br>{r['sizes']}" for r in rows]
    fig = figure()
    for key, name, colour in (
        ("speedup_over_torch_optim", "over torch.optim", COLOURS[0]),
        ("speedup_over_eager_program", "over the program, eager", COLOURS[1]),
    ):
        fig.add_trace(go.Bar(x=labels, y=[r[key] for r in rows], name=name, marker_color=colour))
    fig.add_hline(y=1.0, line={"color": "black", "width": 1})
    fig.update_layout(
        barmode="group",
        title=f"optimizers without a hand-written baseline, world {report['world']} ({report['cpus']} cores)",
        yaxis_title="speed-up of coconet's best schedule",
    )
    write_figure(fig, path, width=int(150 * len(rows) + 200), height=400)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        name, rank, world, port, n, repeats, warmup, out = sys.argv[2:]
        return _rank(name, int(rank), int(world), int(port), int(n), int(repeats), int(warmup), out)
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--size", action="append", default=None)
    ap.add_argument("--program", action="append", default=None, choices=sorted(OPTIMIZERS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/unseen_optimizers_w2.json")
    # torch.optim keeps its state to itself, as ZeRO-1 does: by default the schedules may leave it sharded
    ap.add_argument(
        "--whole-state",
        action="store_true",
        help="compare only schedules that leave the optimizer's state whole on every rank",
    )
    args = ap.parse_args()
    from coconet.schedules.dims import parse_sizes

    report = {
        "world": args.world,
        "cpus": os.cpu_count(),
        "rounds": args.rounds,
        "semantics_max_rel_diff": {},
        "rows": [],
    }
    for name in args.program or sorted(OPTIMIZERS):
        report["semantics_max_rel_diff"][name] = diff = check_semantics(name)
        if diff > 1e-4:
            raise SystemExit(f"{name}: torch.optim and the program differ by {diff:.2e}: not the same update")
        for size in args.size or ["N=2^22", "N=2^24"]:
            n = parse_sizes([size], ("N",))["N"]
            optim_rounds, coconet_rounds = [], []
            shardable = () if args.whole_state else tuple(sorted(OPTIMIZERS[name][3]))
            for _ in range(args.rounds):
                optim_rounds.append(statistics.median(time_torch_optim(name, args.world, n, args.repeats)))
                coconet_rounds.append(time_coconet(name, args.world, size, args.repeats, shardable))
            optim = statistics.median(optim_rounds)
            best = statistics.median(r["best_s"] for r in coconet_rounds)
            eager = statistics.median(r["eager_program_s"] for r in coconet_rounds)
            row = {
                "program": name,
                "sizes": size,
                "torch_optim": OPTIMIZERS[name][0],
                "torch_optim_kwargs": {k: v for k, v in OPTIMIZERS[name][1].items() if k != "betas"},
                "shardable": list(shardable),
                "torch_optim_s": optim,
                "torch_optim_rounds_s": optim_rounds,
                "best_s": best,
                "best_rounds": coconet_rounds,
                "eager_program_s": eager,
                "speedup_over_torch_optim": optim / best,
                "speedup_over_eager_program": eager / best,
                "speedup_over_torch_optim_rounds": [o / c["best_s"] for o, c in zip(optim_rounds, coconet_rounds)],
            }
            report["rows"].append(row)
            print(
                json.dumps(
                    {
                        k: row[k]
                        for k in (
                            "program",
                            "sizes",
                            "torch_optim_s",
                            "best_s",
                            "eager_program_s",
                            "speedup_over_torch_optim",
                        )
                    }
                ),
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
