"""One rank of a ``coconet run`` launch: ``python -m coconet.tuner.rank JOB RANK FD``.

The parent (``coconet.tuner.launch``) writes the job — generated sources,
scheduled programs, options — to a file and starts one such process per rank
with a pipe on file descriptor FD. The rank joins the torch.distributed group,
then for each task runs the step twice on the same inputs and reports what it
holds after each (the parent checks both against the reference interpreter) and
times warm-up and repeated steps. Messages are pickled tuples ``(kind, task, rank,
data)``: ``started``, one ``value`` per array it holds after each step (``(key,
array)``, the second step's keys ending in AGAIN), ``check`` once they are all sent,
``time`` (rank 0: the samples) and ``error``.

A rank is a fresh interpreter or a fork of the fork server's
(``coconet.tuner.forkserver``), never of the caller, nor multiprocessing-spawned:
it never re-imports the user's ``__main__``. It dies with its parent
(PR_SET_PDEATHSIG), and on SIGUSR1 dumps every thread's Python stack to
``rankN.stack`` so the parent can say where a hung rank was.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import marshal
import os
import pickle
import platform
import signal
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from coconet.codegen import backends
from coconet.codegen.baselines import BASELINES
from coconet.errors import BackendError
from coconet.loader import load_file
from coconet.schedules import interp
from coconet.tuner.bandwidth import close, kernels
from coconet.tuner.stats import summarize


def die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


# glibc gives a freed block of over 32 MiB back to the kernel and trims the heap's top, so an eager
# step's large temporaries fault every page in again on every step: more than 4x the step's time where
# page faults are dear (as in VMs and sandboxes). Ranks keep freed memory for reuse, as PyTorch's CUDA
# caching allocator does on GPUs, for every schedule and baseline alike.
ALLOCATOR = "glibc malloc keeps freed memory (M_MMAP_THRESHOLD 1 GiB, M_TRIM_THRESHOLD 2 GiB)"


def allocator_policy() -> str:
    """What the ranks' allocator does with freed memory: ALLOCATOR, unless the user set MALLOC_* variables
    of their own (they win) or the C library is not glibc."""
    if any(k.startswith("MALLOC_") for k in os.environ):
        return "glibc malloc as the MALLOC_* variables of the environment say"
    if platform.libc_ver()[0] != "glibc":
        return "the C library's own"
    return ALLOCATOR


def freeze_imports() -> None:
    """Keep what the process has imported so far out of its later garbage collections: with torch loaded, a
    full collection walked millions of objects the process will never free, a few milliseconds each time,
    triggered by whatever allocated next (a schedule's code loaded, a timed step). A fork inherits the frozen
    set (the fork server freezes before it forks its ranks)."""
    gc.collect()
    gc.freeze()


def keep_freed_memory() -> None:
    if allocator_policy() == ALLOCATOR:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, (1 << 31) - 1)  # M_TRIM_THRESHOLD


def main(argv: list[str]) -> int:
    die_with_parent()
    keep_freed_memory()
    job_path, rank, fd = argv[0], int(argv[1]), int(argv[2])
    conn = Connection(fd, readable=False)
    stack = open(Path(job_path).parent / f"rank{rank}.stack", "w")
    faulthandler.register(signal.SIGUSR1, file=stack, all_threads=True)
    with open(job_path, "rb") as f:
        sys.path[:0] = [p for p in pickle.load(f) if p not in sys.path]
        try:
            job = pickle.load(f)
        except Exception as e:  # a custom op that is not importable here
            conn.send(("error", None, rank, error_report(e, "")))
            return 1
    try:
        return _run(job, rank, conn)
    finally:
        conn.close()


def error_report(e: BaseException, module: str) -> dict[str, Any]:
    frames = [(f.filename, f.lineno) for f in traceback.extract_tb(e.__traceback__)]
    if isinstance(e, BackendError):  # coconet's own finding about the step: its words and kind, as they are
        return {"error": str(e), "frames": frames, "module": module, "kind": e.kind}
    return {"error": f"{type(e).__name__}: {e}", "frames": frames, "module": module}


def _run(job: dict[str, Any], rank: int, conn: Connection) -> int:
    import torch
    import torch.distributed as dist

    from coconet.kernels.segments import close_groups

    opts = job["options"]
    world, stages = opts.world, opts.stages
    torch.set_num_threads(job.get("threads", 1))
    try:
        custom = _custom_ops(job["custom"])
        if backends.get(opts.backend).device_type == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        dist.init_process_group(
            backends.get(opts.backend).process_group,
            init_method=f"tcp://127.0.0.1:{job['port']}",
            rank=rank,
            world_size=world * stages,
            timeout=timedelta(seconds=max(30.0, opts.timeout_s)),
        )
        groups = [dist.new_group(list(range(s * world, (s + 1) * world))) for s in range(stages)]
    except Exception as e:  # the group never formed: nothing of this launch can run
        conn.send(("error", None, rank, error_report(e, "")))
        return 1
    freeze_imports()  # a fresh interpreter's (a forked rank's were frozen by its server)
    stage = rank // world
    group = groups[stage]
    for task, code, path, prog in job["tasks"]:
        conn.send(("started", task, rank, None))
        ns: dict[str, Any] = {"__name__": f"coconet_generated_{task}"}
        try:
            if code is None:  # a hand-written baseline
                step = BASELINES[path.split(":", 1)[1]].make()
            else:
                exec(marshal.loads(code), ns)  # compiled by the caller with ``path`` as its file
                step = ns["step"]
            kwargs = dict(group=group, stage=stage, stages=stages, sizes=dict(opts.sizes), custom_ops=custom)
            if opts.check:
                tensors, scalars = inputs(prog, opts, stage, rank % world, device)
                for report in checked_steps(step, prog, tensors, scalars, kwargs, stage):
                    for key in list(report):  # a message per value: neither side holds a pickle of them all
                        conn.send(("value", task, rank, (key, report.pop(key))))
                conn.send(("check", task, rank, {}))
                del tensors  # before the timed steps' inputs are made
            samples, bandwidth = None, []
            if opts.time:
                tensors, scalars = inputs(prog, opts, stage, rank % world, device)
                samples = _time(step, tensors, scalars, kwargs, opts, device)
                del tensors
                if opts.probe and device.type == "cpu":
                    bandwidth = probe_bandwidth()
            if opts.trace:  # before the last report: the parent stops the ranks once it has every result
                tensors, scalars = inputs(prog, opts, stage, rank % world, device)
                _trace(step, tensors, scalars, kwargs, Path(opts.trace) / f"{Path(path).stem}_rank{rank}.json")
            if opts.time and rank == 0:
                conn.send(("time", task, rank, {"samples": samples, "bandwidth": bandwidth}))
        except Exception as e:
            conn.send(("error", task, rank, error_report(e, path)))
            return 1
        close_groups()  # the next task maps its own segments
    dist.destroy_process_group()
    return 0


def _custom_ops(spec) -> dict[str, Any]:
    kind, value = spec
    if kind == "callables":
        return value
    return {k: op.torch for k, op in load_file(value).custom_ops.items()}


def inputs(prog, opts, stage: int, grank: int, device):
    """This rank's pieces of the seeded inputs (the interpreter's values; its layouts decide the pieces)."""
    import torch

    values = interp.rank_inputs(prog, opts.world, opts.sizes, grank, opts.seed, stage)
    tensors, scalars = {}, {}
    for s in prog.inputs:
        if s.name not in values:
            continue
        piece = values.pop(s.name)  # let go of each float64 piece once its tensor exists
        if s.op == "scalar":
            scalars[s.name] = int(piece) if s.type.dtype == "int64" else float(piece)
            continue
        # ascontiguousarray makes a 0-d piece 1-d: the shape is the program's
        piece = np.ascontiguousarray(piece).reshape(np.shape(piece))
        tensors[s.name] = torch.tensor(piece, dtype=getattr(torch, s.type.dtype), device=device)
    return tensors, scalars


AGAIN = "@again"  # what the keys of a second step's values end in


def checked_steps(step, prog, tensors, scalars, kwargs, stage: int):
    """What the rank holds after a step on its inputs, then after a second step on the same inputs put back in
    place (keys ending in AGAIN). The second is a steady step like the timed ones: a backend that keeps
    something between steps (shm's state in shared memory) runs it otherwise than the first. Each report's
    arrays may be the tensors' own memory: use them before asking for the next."""
    import torch

    start = {k: v.clone() for k, v in tensors.items()}
    out = step(tensors, scalars, **kwargs)
    written = [k for k, v in start.items() if k not in prog.updates and not _same(tensors[k], v)]
    if written:
        raise BackendError(
            f"the step wrote into input {', '.join(written)}, which the program does not update: "
            "the caller's tensors must be left as they were",
            kind="wrong_result",
        )
    yield observe(prog, tensors, out, stage)
    with torch.no_grad():
        for k, v in start.items():
            tensors[k].copy_(v)
    del start
    yield {key + AGAIN: v for key, v in observe(prog, tensors, step(tensors, scalars, **kwargs), stage).items()}


def _same(a, b) -> bool:
    """Equal, bit for bit where it matters: NaN where the other has NaN counts as the same."""
    import torch

    if torch.equal(a, b):
        return True
    return a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all())


def observe(prog, tensors, out, stage: int) -> dict[str, np.ndarray]:
    """What the rank holds after the step, in its own dtype (the checker widens it a block at a time as it
    compares; float64 copies would double what crosses the pipe); bfloat16, which NumPy lacks, as float32."""
    import torch

    def host(v):
        v = v.detach().cpu()
        return (v.float() if v.dtype == torch.bfloat16 else v).numpy()  # pickled at once, before any other step

    obs = {}
    for name in prog.updates:
        obs[f"stage{stage}.state.{name}"] = host(tensors[name])
    for name, v in out["outputs"].items():
        obs[f"stage{stage}.output.{name}"] = host(v)
    for tag, v in out["sent"].items():
        obs[f"stage{stage}.sent.{tag}"] = host(v)
    return obs


def _trace(step, tensors, scalars, kwargs, out: Path) -> None:
    """One step under torch.profiler: collectives in flight show on the threads that carry them (gloo's
    workers, the shm communication thread) beside the compute on the main thread."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    step(tensors, scalars, **kwargs)
    dist.barrier()
    # the profiler records only the threads it was started on unless told otherwise; the shm communication
    # thread exists before it starts
    try:
        extra: dict[str, Any] = {
            "experimental_config": torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        }
    except TypeError:  # a torch without it: the shm thread stays out of the trace
        extra = {}
    with profile(activities=[ProfilerActivity.CPU], **extra) as prof:
        step(tensors, scalars, **kwargs)
    out.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out))
    dist.barrier()  # every rank's trace is written before rank 0 reports


def probe_bandwidth(nbytes: int = 2**27, repeats: int = 3) -> list[float]:
    """Bytes per second through memory while every rank of the launch runs the floor's probe kernels
    (coconet.tuner.bandwidth, ``nbytes`` each) at once, right after the timed steps, each call timed like a
    step; a sample per repeat, the faster kernel's. This machine's bandwidth comes in modes lasting minutes:
    a floor sampled elsewhere in a long run may be of another mode than the steps it is set against."""
    import torch
    import torch.distributed as dist

    probe = kernels(nbytes, torch.get_num_threads())
    out = []
    try:
        for _ in range(repeats):
            best = 0.0
            for k in probe:
                dist.barrier()
                t0 = time.perf_counter()
                k.run()
                # from the first rank's start to the last one's end, on the clock the ranks of one machine share:
                # with more ranks than cores, a rank may run only once another has finished, and its own time
                # alone would count the two calls as done at once
                span = torch.tensor([-t0, time.perf_counter()], dtype=torch.float64)
                dist.all_reduce(span, op=dist.ReduceOp.MAX)
                best = max(best, k.nbytes * dist.get_world_size() / float(span.sum()))
            out.append(best)
    finally:
        close(probe)
    return out


def _time(step, tensors, scalars, kwargs, opts, device) -> list[float]:
    return time_steps(step, tensors, scalars, kwargs, device, warmup=opts.warmup, repeats=opts.repeats)


def time_steps(
    step,
    tensors,
    scalars,
    kwargs,
    device,
    *,
    warmup: int,
    repeats: int,
    max_repeats: int | None = None,
    rel_ci: float | None = None,
    max_s: float | None = None,
) -> list[float]:
    """Each sample: barrier, one step, the slowest rank's time (the step is as slow as its slowest rank).

    ``repeats`` samples at least; with ``rel_ci``, more until the 95% CI of the median is within
    ±rel_ci of it, ``max_repeats`` samples or ``max_s`` seconds of samples. Every rank holds the same
    samples (all-reduced), so every rank takes the same decision to stop without another message.
    """
    import torch
    import torch.distributed as dist

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cap = max(repeats, max_repeats or repeats)
    samples: list[float] = []
    i = 0
    while True:
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        step(tensors, scalars, **kwargs)
        sync()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        i += 1
        if i <= warmup:
            continue
        samples.append(float(dt.item()))
        if len(samples) < repeats:
            continue
        if rel_ci is None or len(samples) >= cap or (max_s is not None and sum(samples) >= max_s):
            return samples
        if summarize(samples).rel_halfwidth <= rel_ci:
            return samples


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
