"""Whether the shm backend could skip publishing: a reduce_scatter read straight out of the peers' private
memory (``process_vm_readv``, the single copy of MPI's shared-memory transports) against the publish it
does today, on two processes of this machine.

    python benchmarks/single_copy.py [--size N=2^24] [--chunk 2^16 --chunk 2^18] [--repeats 15] [--rounds 3]
                                     [--out benchmarks/results/single_copy_w2.json]

Each of two processes holds a gradient of N floats in its private memory and reduces its half of the two:

- ``local``: both halves in its own memory (what no cross-process step can beat: the floor's bytes);
- ``publish``: the shm backend's reduce_scatter. Each process streams the half its peer reduces into its
  shared segment (non-temporal stores, as ``coconet.kernels.shm`` copies), the two meet at a barrier, and
  each adds the peer's segment to its own half;
- ``single copy``: each process reads the peer's half out of the peer's private memory in chunks of
  ``--chunk`` floats into a buffer that stays in its cache, and adds it to its own half: the gradient crosses
  memory once, but the kernel copies it and pins the peer's pages per call.

Both processes run each variant at once; a sample is the slower process's time for one reduce between two
barriers, the median of ``--repeats`` per round; the variants take turns in every round. Where the system
refuses ``process_vm_readv`` (a container's seccomp profile, ptrace rules) the report says so.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import platform
import queue
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _readv():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.process_vm_readv
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    fn.restype = ctypes.c_ssize_t
    return fn


def _rank(rank: int, n: int, chunks: list[int], repeats: int, rounds: int, segments: list[str], barrier, pipe, out):
    import torch

    from coconet.kernels.copier import stream_copier as _stream_copier
    from coconet.kernels.segments import segment as _segment

    torch.set_num_threads(1)
    torch.manual_seed(rank)
    half = n // 2
    g = torch.rand(n)
    mine = slice(rank * half, (rank + 1) * half)
    theirs = slice((1 - rank) * half, (2 - rank) * half)
    peer_local = torch.rand(half)  # the 'local' variant's stand-in for the peer's half
    result = torch.empty(half)
    segs = [_segment(p, half * 4).view(torch.float32) for p in segments]
    stream = _stream_copier()
    pipe.send((os.getpid(), g.data_ptr() + theirs.start * 4))  # the rows the peer reduces
    peer_pid, peer_addr = pipe.recv()  # and where the peer holds the rows this rank reduces
    readv = _readv()

    def local():
        torch.add(g[mine], peer_local, out=result)

    def publish():
        src = g[theirs]
        if stream:
            stream(segs[rank].data_ptr(), src.data_ptr(), half * 4)
        else:
            segs[rank].copy_(src)
        barrier.wait()
        torch.add(g[mine], segs[1 - rank], out=result)

    def single_copy(chunk):
        buf = torch.empty(chunk)
        here, there = _IoVec(buf.data_ptr(), 0), _IoVec(0, 0)

        def run():
            own = g[mine]
            for a in range(0, half, chunk):
                b = min(a + chunk, half)
                here.len = there.len = (b - a) * 4
                there.base = peer_addr + a * 4
                got = readv(peer_pid, ctypes.byref(here), 1, ctypes.byref(there), 1, 0)
                if got != (b - a) * 4:
                    raise OSError(ctypes.get_errno(), f"process_vm_readv: {os.strerror(ctypes.get_errno())}")
                torch.add(own[a:b], buf[: b - a], out=result[a:b])

        return run

    variants = {"local": local, "publish": publish}
    variants.update({f"single copy, chunks of {c}": single_copy(c) for c in chunks})
    checks, refused = {}, None
    times: dict[str, list[list[float]]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            samples = []
            for i in range(repeats + 1):
                barrier.wait()
                t0 = time.perf_counter()
                try:
                    fn()
                except OSError as e:
                    refused = str(e)
                barrier.wait()
                if i:
                    samples.append(time.perf_counter() - t0)
            times[name].append(samples)
            checks[name] = float(result.sum())
    out.put((rank, times, checks, refused))


def main(argv: list[str] | None = None) -> dict:
    from coconet.schedules.dims import parse_sizes

    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="N=2^24")
    ap.add_argument("--chunk", action="append", default=None, help="floats per process_vm_readv (repeatable)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/single_copy_w2.json")
    args = ap.parse_args(argv)
    n = parse_sizes(args.size, ("N",))["N"]
    chunks = [parse_sizes(f"chunk={c}")["chunk"] for c in args.chunk or ["2^16", "2^18"]]
    if str(Path(__file__).parent) not in sys.path:  # spawned processes import this module by its name
        sys.path.insert(0, str(Path(__file__).parent))
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    a, b = ctx.Pipe()
    tag = f"/dev/shm/coconet-single-copy-{os.getpid()}"
    segments = [f"{tag}-0", f"{tag}-1"]
    for p in segments:
        with open(p, "wb") as f:
            f.truncate(n // 2 * 4)
    try:
        procs = [
            ctx.Process(target=_rank, args=(r, n, chunks, args.repeats, args.rounds, segments, barrier, pipe, out))
            for r, pipe in ((0, a), (1, b))
        ]
        for p in procs:
            p.start()
        got = []
        while len(got) < len(procs):
            try:
                got.append(out.get(timeout=5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:  # the other waits at a barrier that will not break by itself
                    for p in procs:
                        p.kill()
                    raise SystemExit(f"process {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
        got.sort(key=lambda x: x[0])
        for p in procs:
            p.join()
    finally:
        for p in segments:
            if os.path.exists(p):
                os.unlink(p)
    (_, t0, c0, r0), (_, t1, c1, r1) = got
    refused = r0 or r1
    variants = {}
    for name in t0:
        # a sample is the slower rank's; a round's figure its median; the variant's the median of its rounds
        rounds = [statistics.median(max(x, y) for x, y in zip(s0, s1)) for s0, s1 in zip(t0[name], t1[name])]
        variants[name] = {
            "round_medians_s": rounds,
            "median_s": statistics.median(rounds),
            "checksum": [c0[name], c1[name]],
        }
    ref = variants["publish"]["median_s"]
    for name, v in variants.items():
        v["vs_publish"] = ref / v["median_s"]
        if name.startswith("single copy"):  # the same rows reduced: the same sums, to the bit
            v["same_result_as_publish"] = v["checksum"] == variants["publish"]["checksum"]
    # the bytes each variant moves through memory, both processes: the floor's reads and writes, and the publish's
    bytes_local = 2 * (3 * n // 2 * 4)
    report = {
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "N": n,
        "processes": 2,
        "threads_per_process": 1,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "process_vm_readv": "refused: " + refused if refused else "allowed",
        "bytes_floor": bytes_local,
        "bytes_publish": bytes_local + 2 * (2 * n // 2 * 4),
        "variants": variants,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, v in variants.items():
        print(
            f"{name:28s} {v['median_s'] * 1e3:8.2f} ms  rounds {[round(x * 1e3, 2) for x in v['round_medians_s']]}"
            f"  {v['vs_publish']:.2f}x publish"
        )
    if refused:
        print(f"process_vm_readv refused: {refused}")
    return report


if __name__ == "__main__":
    main()
