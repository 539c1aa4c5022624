"""What the generated code's kernel wrapper (``coconet.kernels.compiled.kernel``) costs a step, between revisions.

    python benchmarks/kernel_wrapper.py --rev 723ddd1 --rev HEAD --rev . [--device cuda]
                                        [--size N=2^10 --size N=2^22 --size N=2^24] [--chunks 4] [--scalars host]
                                        [--out benchmarks/results/kernel_wrapper_cuda_h200.json]

Each ``--rev`` is a git revision whose ``kernels/compiled.py`` (``codegen/prelude.py`` before the runtime was
``coconet.kernels``) is loaded as a module of its own (``.``: the working tree's). Its wrapper wraps one fused
Adam chunk (the shape of the NCCL fused collective's:
m, v and w written in place from the reduced gradient's rows), and a step calls it on ``--chunks`` chunks,
as the generated step does. Per size and revision: the best of 7 means of 30 steps, once synchronised after
every step and once pipelined, revisions taking turns; one step each first, which compiles and must write
the state eager torch writes (``same_results``). The kernels are
the same Inductor code whichever the revision: what differs is the host's work around each call.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def wrapper_at(rev: str, scratch: Path):
    """The kernel wrapper of revision ``rev``: where the runtime was pasted, ``_kernel`` of codegen/prelude.py."""
    for file, name in (("kernels/compiled.py", "kernel"), ("codegen/prelude.py", "_kernel")):
        if rev == ".":
            path = ROOT / file
            if not path.exists():
                continue
        else:
            shown = subprocess.run(["git", "show", f"{rev}:{file}"], cwd=ROOT, capture_output=True, text=True)
            if shown.returncode:
                continue
            path = scratch / f"{Path(file).stem}_{rev.replace('/', '_')}.py"
            path.write_text(shown.stdout)
        spec = importlib.util.spec_from_file_location(f"wrapper_at_{len(sys.modules)}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return getattr(module, name)
    sys.exit(f"kernel_wrapper: {rev!r} has neither kernels/compiled.py nor codegen/prelude.py")


def adam_chunk(m_k, v_k, w_k, beta1, beta2, sub0, rs0, sub1, sub2, sub3, lr, eps):
    add0 = beta1 * m_k + sub0 * rs0
    add1 = beta2 * v_k + sub1 * rs0 * rs0
    sub4 = w_k - lr * (add0 / sub2) / ((add1 / sub3).sqrt() + eps)
    m_k.copy_(add0)
    v_k.copy_(add1)
    w_k.copy_(sub4)


def main(argv: list[str] | None = None) -> dict:
    import torch

    from coconet.schedules.dims import parse_sizes

    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", action="append", required=True)
    ap.add_argument("--size", action="append", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument(
        "--scalars",
        choices=("host", "device"),
        default="host",
        help="where the 0-d scalars live (the generated step keeps them on the host)",
    )
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    with tempfile.TemporaryDirectory() as scratch:
        wrappers = {rev: wrapper_at(rev, Path(scratch)) for rev in args.rev}
    points = []
    for n in [parse_sizes(s, ("N",))["N"] for s in args.size or ["N=2^10", "N=2^22", "N=2^24"]]:
        gen = torch.Generator(device=args.device).manual_seed(n)
        m, v, w, g = (torch.rand(n, device=args.device, generator=gen) for _ in range(4))
        on = args.device if args.scalars == "device" else "cpu"
        scalars = [torch.tensor(x, device=on) for x in (0.9, 0.999, 0.1, 0.001, 0.1, 0.001, 1e-3, 1e-8)]
        beta1, beta2, sub0, sub1, sub2, sub3, lr, eps = scalars
        k = -(-n // args.chunks)
        rows = [slice(i * k, min((i + 1) * k, n)) for i in range(args.chunks)]
        kernels = {rev: wrap(adam_chunk) for rev, wrap in wrappers.items()}

        def step(kernel):
            for s in rows:
                kernel(m[s], v[s], w[s], beta1, beta2, sub0, g[s], sub1, sub2, sub3, lr, eps)

        same = {}
        for rev, kernel in kernels.items():  # the first step compiles; it must write what eager torch writes
            state = [t.clone() for t in (m, v, w)]
            for s in rows:
                adam_chunk(*(t[s] for t in state), beta1, beta2, sub0, g[s], sub1, sub2, sub3, lr, eps)
            step(kernel)
            same[rev] = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(state, (m, v, w)))
            for t, want in zip((m, v, w), state):
                t.copy_(want)
        sync()
        best = {rev: {"sync_us": float("inf"), "pipelined_us": float("inf")} for rev in kernels}
        for _ in range(7):
            for rev, kernel in kernels.items():
                t = time.perf_counter()
                for _ in range(args.steps):
                    step(kernel)
                    sync()
                best[rev]["sync_us"] = min(best[rev]["sync_us"], (time.perf_counter() - t) / args.steps * 1e6)
                t = time.perf_counter()
                for _ in range(args.steps):
                    step(kernel)
                sync()
                best[rev]["pipelined_us"] = min(best[rev]["pipelined_us"], (time.perf_counter() - t) / args.steps * 1e6)
        points.append({"n": n, "same_results": same, "step_us": best})
        print(
            f"n={n:>9}  "
            + "  ".join(
                f"{rev}: {b['sync_us']:8.1f} us synced, {b['pipelined_us']:8.1f} pipelined" for rev, b in best.items()
            ),
            flush=True,
        )
    report = {
        "machine": platform.processor() or platform.machine(),
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "torch": torch.__version__,
        "chunks": args.chunks,
        "scalars": args.scalars,
        "steps": args.steps,
        "revs": args.rev,
        "points": points,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
