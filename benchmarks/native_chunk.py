"""One rank's chunk of ZeRO-1 Adam on the shm backend, three ways, in one process: the generated module's C
kernel (coconet.kernels.native: the peers' rows streamed past the cache), the same C kernel storing them
plainly, and Inductor's kernel of the same Python function (what ran before the C kernel).

    python benchmarks/native_chunk.py [--world 4] [--size N=2^24] [--calls 20]
                                      [--out benchmarks/results/native_chunk.json]

The chunk is the rank's 1/world of the rows: world gradient parts summed, m, v and w written in place, w's
new rows stored into world - 1 peers' copies. Each call of each kind in turn (this machine's bandwidth drifts
from one minute to the next), the median time of each and the median of the paired ratios to Inductor's;
and whether every kind wrote the same bits.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEDULE = "split(ar0); reorder(ag0); as_slice(m); as_slice(v); fuse_collective(rs0)"


def main(argv: list[str] | None = None) -> dict:
    import torch

    from coconet.codegen.lower import lower
    from coconet.loader import load_file
    from coconet.schedules.dims import parse_sizes
    from coconet.schedules.schedule import Schedule

    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--size", default="N=2^24")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # as one rank of the shm backend runs

    n = parse_sizes([args.size])["N"] // args.world
    source = lower(Schedule.parse(SCHEDULE, load_file(str(ROOT / "examples" / "adam.py"))), "shm").source
    ns: dict = {"__name__": "coconet_native_chunk"}
    exec(compile(source, "adam_zero1_shm", "exec"), ns)
    native = ns["_chunk0"]
    plain_source = source.replace("if (nt) stream_line(", "if (0) stream_line(")
    plain_ns: dict = {"__name__": "coconet_native_chunk_plain"}
    exec(compile(plain_source, "adam_zero1_shm_plain", "exec"), plain_ns)
    plain = plain_ns["_chunk0"]
    # Inductor's kernel of the same function: the module's _kernel around the Python kernel, undone by _native
    python_fn = {}
    exec(
        compile(
            source.replace("_chunk0 = _native(_kernel(_chunk0),", "_chunk0 = (lambda f, *_: f)(_kernel(_chunk0),"),
            "adam_zero1_shm_inductor",
            "exec",
        ),
        python_fn,
    )
    inductor = python_fn["_chunk0"]

    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(n, generator=gen) for _ in range(args.world)]
    start = {k: torch.rand(n, generator=gen) for k in ("m", "v", "w")}
    scalars = [torch.tensor(x) for x in (0.9, 0.999, 0.1, 0.001, 0.5, 0.6, 1e-3, 1e-8)]
    kinds = {"inductor": inductor, "c_streamed": native, "c_plain": plain}
    state = {
        k: ({s: t.clone() for s, t in start.items()}, [torch.zeros(n) for _ in range(args.world - 1)]) for k in kinds
    }

    def call(kind):
        st, peers = state[kind]
        kinds[kind](peers, st["m"], st["v"], st["w"], parts, *scalars)

    for kind in kinds:  # compiles; and one step each from the same state, to compare the bits
        call(kind)
    same = {
        k: all(torch.equal(state[k][0][s], state["inductor"][0][s]) for s in start)
        and all(torch.equal(a, b) for a, b in zip(state[k][1], state["inductor"][1]))
        for k in kinds
    }
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.calls):
        for kind in kinds:
            t0 = time.perf_counter()
            call(kind)
            times[kind].append(time.perf_counter() - t0)
    words = args.world + 6 + (args.world - 1)  # parts, m v w read and written, the peers' rows
    report = {
        "world": args.world,
        "rows": n,
        "calls": args.calls,
        "machine": platform.processor() or platform.machine(),
        "kinds": {
            k: {
                "median_ms": statistics.median(ts) * 1e3,
                "ratio_to_inductor": statistics.median(a / b for a, b in zip(ts, times["inductor"])),
                "GBps_at_needed_bytes": words * 4 * n / statistics.median(ts) / 1e9,
                "same_bits_as_inductor": same[k],
            }
            for k, ts in times.items()
        },
    }
    for k, r in report["kinds"].items():
        print(
            f"{k:>11}: {r['median_ms']:.2f} ms, {r['ratio_to_inductor']:.3f}x Inductor's, "
            f"{r['GBps_at_needed_bytes']:.1f} GB/s of the bytes it must move, "
            f"same bits: {r['same_bits_as_inductor']}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
