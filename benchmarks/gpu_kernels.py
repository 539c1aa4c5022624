"""Fused pointwise kernels of generated code on one GPU, against PyTorch's own, in one run.

    python benchmarks/gpu_kernels.py [--out benchmarks/results/gpu_kernels.json]

- Adam: the kernel coconet generates for ``fuse(...)`` of examples/adam.py (Inductor → Triton,
  state written in place) against ``torch.optim.Adam(fused=True)``, N = 2^22 … 2^27. Both move
  7 float32 streams (read g, w, m, v; write w, m, v); the bandwidth is those bytes over the time,
  as a fraction of a device-to-device copy measured in the same run and of the memory's peak
  (clock × bus width, as the driver reports them).
- Megatron epilogue: the generated ``fuse(add0, drop0, add1)`` kernel (bias + dropout with the
  counter-based RNG + residual) against eager PyTorch (``F.dropout(x + b) + r``) at B=8, S=1024,
  H=3072, and the same statements uncompiled.

Each is timed three ways: one call between two CUDA events (what a step pays, the host's launch
included), 20 calls back to back between two events (the host's launches hidden behind the GPU's
work where they can be), and the GPU kernels alone (the profiler's kernel intervals of 20 calls).
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


def timings(fn, calls=20) -> dict:
    """Seconds per call: one call alone, ``calls`` back to back, and the kernels' own GPU time."""
    from torch.profiler import ProfilerActivity, profile

    single = cuda_time(fn)
    pipelined = cuda_time(lambda: [fn() for _ in range(calls)], repeats=10, warmup=1) / calls
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.time_range.elapsed_us() for e in kernels)
    return {
        "single_call_s": single,
        "pipelined_s": pipelined,
        "kernels_s": busy_us / 1e6 / calls,
        "kernels_per_call": len(kernels) / calls,
    }


def memory_peak_Bps() -> tuple[float | None, str]:
    """The memory's peak (double data rate × bus width) from the device's properties or NVML."""
    props = torch.cuda.get_device_properties(0)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", None), getattr(props, "memory_bus_width", None)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8, "torch device properties"
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
        bits = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
        return 2 * mhz * 1e6 * bits / 8, "NVML max memory clock and bus width"
    except Exception as exc:  # an unknown peak is reported as such, the copy rate still stands
        return None, f"unknown ({type(exc).__name__}: {exc})"


def rates(moved: int, t: dict, copy_Bps: float, peak_Bps: float | None) -> dict:
    out = {}
    for how in ("single_call", "pipelined", "kernels"):
        secs = t[f"{how}_s"]
        out[f"{how}_GBps"] = moved / secs / 1e9
        out[f"{how}_fraction_of_copy"] = moved / secs / copy_Bps
        out[f"{how}_fraction_of_peak"] = moved / secs / peak_Bps if peak_Bps else None
    return out


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
    peak, peak_source = memory_peak_Bps()
    out: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "memory_peak_GBps": peak / 1e9 if peak else None,
        "memory_peak_source": peak_source,
        "adam": [],
        "epilogue": {},
    }

    adam = runpy.run_path(str(ROOT / "examples/adam.py"))["program"].ir
    from coconet.schedules.space import generate

    fuse_text = next(s.text for s in generate(adam) if s.text.startswith("fuse("))
    ns = kernel_of("adam", fuse_text, "compiled")
    ctx = ns["_Ctx"](None, dev)
    for log2n in (22, 23, 24, 25, 26, 27):
        n = 2**log2n
        g, w, m, v = (torch.rand(n, device=dev) for _ in range(4))
        # 0-d host tensors, as the generated step hands its scalars to the kernel
        s = {k: torch.tensor(val) for k, val in dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, t=3.0).items()}
        sub0, sub1 = 1 - s["beta1"], 1 - s["beta2"]
        sub2, sub3 = 1 - s["beta1"] ** s["t"], 1 - s["beta2"] ** s["t"]

        def ours_step():
            ns["_fuse0"](ctx, s["beta1"], m, sub0, g, s["beta2"], v, sub1, sub2, sub3, s["lr"], s["eps"], w)

        # one step against the update in float64, before the timed calls move the state on
        m64, v64, w64, g64 = (x.double() for x in (m, v, w, g))
        ours_step()
        b1, b2, lr, eps, t = (float(s[k]) for k in ("beta1", "beta2", "lr", "eps", "t"))
        m64 = b1 * m64 + (1 - b1) * g64
        v64 = b2 * v64 + (1 - b2) * g64 * g64
        w64 -= lr * (m64 / (1 - b1**t)) / ((v64 / (1 - b2**t)).sqrt() + eps)
        err = max(float((x.double() - ref).norm() / ref.norm()) for x, ref in ((m, m64), (v, v64), (w, w64)))
        ours = timings(ours_step)
        p = torch.nn.Parameter(torch.rand(n, device=dev))
        p.grad = torch.rand(n, device=dev)
        opt = torch.optim.Adam([p], lr=1e-3, fused=True)
        theirs = timings(opt.step)
        a, b = torch.empty(n * 8, device=dev), torch.empty(n * 8, device=dev)
        copy = 2 * a.numel() * 4 / cuda_time(lambda: b.copy_(a))
        moved = 7 * n * 4
        row = {
            "n": n,
            "bytes_moved": moved,
            "copy_GBps": copy / 1e9,
            "rel_err_vs_float64": err,
            "coconet": dict(ours, **rates(moved, ours, copy, peak)),
            "torch_adam_fused": dict(theirs, **rates(moved, theirs, copy, peak)),
        }
        row["speedup_vs_torch_adam_fused"] = {
            how: theirs[f"{how}_s"] / ours[f"{how}_s"] for how in ("single_call", "pipelined", "kernels")
        }
        out["adam"].append(row)
        print(json.dumps(row), flush=True)

    B, S, H = 8, 1024, 3072
    ar0, r = torch.randn(B, S, H, device=dev), torch.randn(B, S, H, device=dev)
    bias = torch.randn(H, device=dev)
    compiled = kernel_of("megatron_mlp", "fuse(add0, drop0, add1)", "compiled")
    eager = kernel_of("megatron_mlp", "fuse(add0, drop0, add1)", "eager")
    seed = torch.tensor(1234, dtype=torch.int64)
    t_comp = timings(lambda: compiled["_fuse0"](ctx, B, S, H, ar0, bias, seed, r))
    t_eager_ours = timings(lambda: eager["_fuse0"](ctx, B, S, H, ar0, bias, 1234, r))
    t_torch = timings(lambda: torch.nn.functional.dropout(ar0 + bias, p=0.1) + r)
    a, b = torch.empty(B * S * H * 2, device=dev), torch.empty(B * S * H * 2, device=dev)
    copy = 2 * a.numel() * 4 / cuda_time(lambda: b.copy_(a))
    moved = 3 * B * S * H * 4  # read x and r, write the result
    out["epilogue"] = {
        "B": B,
        "S": S,
        "H": H,
        "bytes_moved": moved,
        "copy_GBps": copy / 1e9,
        "coconet_compiled": dict(t_comp, **rates(moved, t_comp, copy, peak)),
        "coconet_eager": t_eager_ours,
        "torch_eager": dict(t_torch, **rates(moved, t_torch, copy, peak)),
        "speedup_vs_torch_eager": {
            how: t_torch[f"{how}_s"] / t_comp[f"{how}_s"] for how in ("single_call", "pipelined", "kernels")
        },
    }
    print(json.dumps(out["epilogue"]), flush=True)
    # same mask as the reference: the compiled kernel against its uncompiled statements
    x1 = compiled["_fuse0"](ctx, B, S, H, ar0, bias, seed, r)[0]
    x2 = eager["_fuse0"](ctx, B, S, H, ar0, bias, 1234, r)[0]
    out["epilogue"]["compiled_equals_eager_mask"] = bool(torch.equal((x1 - r) == 0, (x2 - r) == 0))
    out["epilogue"]["compiled_vs_eager_max_abs_diff"] = float((x1 - x2).abs().max())
    out["epilogue"]["kept_fraction"] = float(((x1 - r) != 0).double().mean())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
