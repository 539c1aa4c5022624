"""What a compiled kernel's call costs on the host: the generated code's ``torch.compile`` against the same
graph handed to Inductor without Dynamo (``torch._inductor.standalone_compile``), on a fused Adam chunk of
the shape the shm backend's fused collective runs (two ranks' gradient rows summed, m, v and w written in
place, w's new rows stored into a peer's copy too).

    python benchmarks/kernel_call.py [--size N=2^10 --size N=2^18 --size N=2^22] [--device cpu|cuda]
                                     [--scalars device|host] [--out benchmarks/results/kernel_call_cpu.json]

Per size: the best of 5 means of ``--calls`` calls each way (on CUDA synchronised after each batch),
after one call that compiles, and whether the standalone kernel's in-place results match the compiled
one's (to float32 rounding: the two may fuse the arithmetic differently). At small sizes the difference
is the host's work per call (Dynamo's guards and frame, the AOT wrappers); at large ones, the kernels'.
The standalone kernel has no guards: a caller must key it by its inputs' shapes, strides and dtypes.
``--scalars host`` hands the four scalars over as 0-d tensors on the host, as the generated step does on
CUDA; a graph Inductor will not compile standalone that way is reported (``standalone_error``), not timed.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def adam_chunk(peer, m, v, w, g0, g1, beta1, beta2, lr, eps):
    g = g0 + g1
    m1 = beta1 * m + (1 - beta1) * g
    v1 = beta2 * v + (1 - beta2) * g * g
    w1 = w - lr * m1 / (v1.sqrt() + eps)
    m.copy_(m1)
    v.copy_(v1)
    w.copy_(w1)
    peer.copy_(w1)


def main(argv: list[str] | None = None) -> dict:
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from coconet.schedules.dims import parse_sizes

    ap = argparse.ArgumentParser()
    ap.add_argument("--size", action="append", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--scalars", choices=["device", "host"], default="device")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU (one rank's share)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    points = []
    for n in [parse_sizes(s, ("N",))["N"] for s in args.size or ["N=2^10", "N=2^18", "N=2^22"]]:
        gen = torch.Generator(device=args.device).manual_seed(n)
        state = [torch.rand(n, device=args.device, generator=gen) for _ in range(6)]
        scalars = [
            torch.tensor(x, device=args.device if args.scalars == "device" else "cpu") for x in (0.9, 0.999, 1e-3, 1e-8)
        ]

        def inputs():
            return [t.clone() for t in state] + scalars

        dynamo = torch.compile(adam_chunk, dynamic=False, fullgraph=True)
        t0 = time.perf_counter()
        dynamo(*inputs())
        sync()
        dynamo_compile = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            standalone = torch._inductor.standalone_compile(
                make_fx(adam_chunk)(*inputs()), inputs(), dynamic_shapes="from_example_inputs"
            )
            standalone(*inputs())
        except Exception as exc:  # reported with the point: the other sizes still run
            points.append({"n": n, "standalone_error": f"{type(exc).__name__}: {exc}"[:2000]})
            print(f"n={n:>9}  standalone failed: {points[-1]['standalone_error'][:300]}")
            continue
        sync()
        standalone_compile = time.perf_counter() - t0
        a, b = inputs(), inputs()
        dynamo(*a)
        standalone(*b)
        sync()
        same = all(torch.allclose(x, y, rtol=1e-6, atol=1e-7) for x, y in zip(a[:6], b[:6]))
        moved = not torch.equal(b[3], state[3])

        def per_call(fn, args_):
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(args.calls):
                    fn(*args_)
                sync()
                best = min(best, (time.perf_counter() - t) / args.calls)
            return best

        xs = inputs()
        d, s = per_call(dynamo, xs), per_call(standalone, xs)
        points.append(
            {
                "n": n,
                "torch_compile_s": d,
                "standalone_s": s,
                "ratio": d / s,
                "compile_s": {"torch_compile": dynamo_compile, "standalone": standalone_compile},
                "same_results": same,
                "wrote_in_place": moved,
            }
        )
        print(
            f"n={n:>9}  torch.compile {d * 1e6:9.1f} us  standalone {s * 1e6:9.1f} us  {d / s:5.2f}x  "
            f"same results: {same}  in place: {moved}"
        )
    report = {
        "machine": platform.processor() or platform.machine(),
        "device": args.device,
        "torch": torch.__version__,
        "threads": args.threads if args.device == "cpu" else None,
        "scalars": args.scalars,
        "calls": args.calls,
        "points": points,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
