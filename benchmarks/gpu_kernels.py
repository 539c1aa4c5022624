"""Fused pointwise kernels of generated code on one GPU, against PyTorch's own, in one run.

    python benchmarks/gpu_kernels.py [--out benchmarks/results/gpu_kernels.json]

- Adam: the kernel coconet generates for ``fuse(...)`` of examples/adam.py (Inductor → Triton,
  state written in place) against ``torch.optim.Adam(fused=True)``, N = 2^22 … 2^26. Both move
  7 float32 streams (read g, w, m, v; write w, m, v); the bandwidth is those bytes over the time,
  as a fraction of a device-to-device copy measured in the same run.
- Megatron epilogue: the generated ``fuse(add0, drop0, add1)`` kernel (bias + dropout with the
  counter-based RNG + residual) against eager PyTorch (``F.dropout(x + b) + r``) at B=8, S=1024,
  H=3072, and the same statements uncompiled.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from coconet.codegen.lower import lower
from coconet.schedules.schedule import Schedule

ROOT = Path(__file__).parents[1]


def cuda_time(fn, repeats=50, warmup=5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def kernel_of(example: str, text: str, kernels: str):
    prog = runpy.run_path(str(ROOT / "examples" / f"{example}.py"))["program"].ir
    gen = lower(Schedule.parse(text, prog), "nccl", kernels)
    path = Path(tempfile.mkdtemp()) / f"coconet_{gen.key}.py"
    path.write_text(gen.source)
    ns: dict = {"__name__": path.stem}
    exec(compile(gen.source, str(path), "exec"), ns)
    return ns


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/gpu_kernels.json")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29655")
    dist.init_process_group("nccl", rank=0, world_size=1)
    dev = torch.device("cuda", 0)
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "adam": [], "epilogue": {}}

    adam = runpy.run_path(str(ROOT / "examples/adam.py"))["program"].ir
    from coconet.schedules.space import generate

    fuse_text = next(s.text for s in generate(adam) if s.text.startswith("fuse("))
    ns = kernel_of("adam", fuse_text, "compiled")
    ctx = ns["_Ctx"](None, dev)
    for log2n in (22, 23, 24, 25, 26):
        n = 2**log2n
        g, w, m, v = (torch.rand(n, device=dev) for _ in range(4))
        s = {k: torch.tensor(val, device=dev) for k, val in
             dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, t=3.0).items()}
        sub0, sub1 = 1 - s["beta1"], 1 - s["beta2"]
        sub2, sub3 = 1 - s["beta1"] ** s["t"], 1 - s["beta2"] ** s["t"]
        ours = cuda_time(lambda: ns["_fuse0"](ctx, s["beta1"], m, sub0, g, s["beta2"], v, sub1, sub2, sub3,
                                               s["lr"], s["eps"], w))
        p = torch.nn.Parameter(torch.rand(n, device=dev))
        p.grad = torch.rand(n, device=dev)
        opt = torch.optim.Adam([p], lr=1e-3, fused=True)
        theirs = cuda_time(opt.step)
        a, b = torch.empty(n * 8, device=dev), torch.empty(n * 8, device=dev)
        copy = cuda_time(lambda: b.copy_(a))
        peak = 2 * a.numel() * 4 / copy
        moved = 7 * n * 4
        out["adam"].append({"n": n, "coconet_s": ours, "torch_adam_fused_s": theirs, "copy_GBps": peak / 1e9,
                            "coconet_GBps": moved / ours / 1e9, "torch_adam_fused_GBps": moved / theirs / 1e9,
                            "coconet_fraction_of_copy": moved / ours / peak,
                            "torch_adam_fused_fraction_of_copy": moved / theirs / peak,
                            "speedup_vs_torch_adam_fused": theirs / ours})
        print(out["adam"][-1], flush=True)

    B, S, H = 8, 1024, 3072
    ar0, r = torch.randn(B, S, H, device=dev), torch.randn(B, S, H, device=dev)
    bias = torch.randn(H, device=dev)
    compiled = kernel_of("megatron_mlp", "fuse(add0, drop0, add1)", "compiled")
    eager = kernel_of("megatron_mlp", "fuse(add0, drop0, add1)", "eager")
    seed = torch.tensor(1234, dtype=torch.int64, device=dev)
    t_comp = cuda_time(lambda: compiled["_fuse0"](ctx, B, S, H, ar0, bias, seed, r))
    t_eager_ours = cuda_time(lambda: eager["_fuse0"](ctx, B, S, H, ar0, bias, 1234, r))
    t_torch = cuda_time(lambda: torch.nn.functional.dropout(ar0 + bias, p=0.1) + r)
    a, b = torch.empty(B * S * H * 2, device=dev), torch.empty(B * S * H * 2, device=dev)
    peak = 2 * a.numel() * 4 / cuda_time(lambda: b.copy_(a))
    moved = 3 * B * S * H * 4  # read x and r, write the result
    out["epilogue"] = {"B": B, "S": S, "H": H, "coconet_compiled_s": t_comp, "coconet_eager_s": t_eager_ours,
                       "torch_eager_s": t_torch, "speedup_vs_torch_eager": t_torch / t_comp,
                       "coconet_fraction_of_copy": moved / t_comp / peak, "copy_GBps": peak / 1e9}
    print(out["epilogue"], flush=True)
    # same mask as the reference: the compiled kernel against its uncompiled statements
    x1 = compiled["_fuse0"](ctx, B, S, H, ar0, bias, seed, r)[0]
    x2 = eager["_fuse0"](ctx, B, S, H, ar0, bias, 1234, r)[0]
    out["epilogue"]["compiled_equals_eager_mask"] = bool(torch.equal((x1 - r) == 0, (x2 - r) == 0))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
