"""Where a world-1 Adam step's time goes on the host: the generated ``fuse(...)`` step and its parts, timed in
one process, against ``dist.all_reduce`` + ``torch.optim.Adam(fused=True)``.

    python benchmarks/step_host_time.py [N] [--out benchmarks/results/host_profile.json]

NCCL on the first CUDA device where there is one, else gloo on the CPU. Each part is timed two ways: one call
between two synchronisations (what a step pays: the host's launches and the device's work), and as many calls
back to back (the host's launches hidden behind the device's work where they can be). Then a cProfile and a
torch.profiler table of the step, printed.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import runpy
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist

from coconet.codegen.lower import lower
from coconet.schedules.space import generate
from coconet.tuner.launch import free_port

ROOT = Path(__file__).parents[1]
SCALARS = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "t": 3}


def timed(fn, sync, n: int = 300) -> dict:
    for _ in range(10):
        fn()
    once = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        once.append(time.perf_counter() - t0)
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return {"sync_us": statistics.median(once) * 1e6, "pipelined_us": (time.perf_counter() - t0) / n * 1e6}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("n", nargs="?", type=int, default=2**22)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        prog = runpy.run_path(str(ROOT / "examples" / "adam.py"))["program"].ir
        sched = next(s for s in generate(prog) if s.text.startswith("fuse("))
        # Dynamo finds a compiled function's globals through its module: it must be importable
        mod = types.ModuleType("coconet_step_host_time")
        sys.modules[mod.__name__] = mod
        exec(compile(lower(sched, backend=backend).source, mod.__name__, "exec"), mod.__dict__)
        T = {k: torch.rand(args.n, device=dev) for k in "gwmv"}
        out = {
            "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "N": args.n,
            "torch": torch.__version__,
            "schedule": sched.text,
        }
        out["step"] = timed(lambda: mod.step(T, SCALARS), sync)

        def scalars():
            lr, b1, b2, eps, t = (
                torch.tensor(float(SCALARS[k]), dtype=torch.float32) for k in ("lr", "beta1", "beta2", "eps", "t")
            )
            return lr, b1, b2, eps, 1 - b1, 1 - b2, 1 - b1**t, 1 - b2**t

        c = mod._Ctx(None, dev)
        lr, b1, b2, eps, sub0, sub1, sub2, sub3 = scalars()
        ar = mod._allreduced(c, T["g"], "sum")
        kernel_args = (c, b1, T["m"], sub0, ar, b2, T["v"], sub1, sub2, sub3, lr, eps, T["w"])
        out["kernel_call"] = timed(lambda: mod._fuse0(*kernel_args), sync)
        out["allreduced"] = timed(lambda: mod._allreduced(c, T["g"], "sum"), sync)
        out["clone"] = timed(lambda: T["g"].clone(), sync)
        out["all_reduce"] = timed(lambda: dist.all_reduce(T["g"]), sync)
        out["scalars"] = timed(scalars, sync)
        out["ctx"] = timed(lambda: mod._Ctx(None, dev), sync)
        p = torch.nn.Parameter(T["w"].clone())
        p.grad = T["g"].clone()
        opt = torch.optim.Adam([p], fused=True)
        out["torch_fused_adam_step"] = timed(opt.step, sync)
        out["torch_baseline"] = timed(lambda: (dist.all_reduce(p.grad), opt.step()), sync)
        print(json.dumps(out, indent=1))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            mod.step(T, SCALARS)
        sync()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        print(text.getvalue())
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as tp:
            for _ in range(50):
                mod.step(T, SCALARS)
            sync()
        print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        return out
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
