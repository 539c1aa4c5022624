"""Running generated schedules on R ranks of this machine: check, then time.

The parent lowers every schedule, writes a job file and starts ``stages ×
world`` rank processes (``coconet.tuner.rank``, forked by a fork server that
has imported torch once, ``coconet.tuner.forkserver``: never the caller, so
its ``__main__`` is never re-imported; CUDA ranks are fresh interpreters)
joined by a torch.distributed group on a free loopback port; each reports over
its own pipe. Each rank builds its
pieces of the seeded inputs (the interpreter's ``make_inputs``: no data crosses
processes), runs the step once and reports the values it holds — the parent
checks each report against the reference interpreter as it comes — then times
warm-up and repeated steps, each sample being the max over ranks after a
barrier.

A rank that raises reports the statement it was in; a rank that dies closes
its pipe; a task that overruns its deadline has every rank dump its Python
stack (SIGUSR1, faulthandler) so the error names where each one was. Either way
the whole group is killed (its own process group) and the remaining schedules
run on a fresh one. Ranks die with the parent (PR_SET_PDEATHSIG), so neither
Ctrl-C nor a crash leaves a process behind.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, cast

from coconet.codegen import backends
from coconet.codegen.baselines import Baseline, TorchTask
from coconet.codegen.cache import module_path
from coconet.codegen.footprint import require_fits
from coconet.codegen.lower import Generated, lower
from coconet.errors import BackendError, CoconetError
from coconet.schedules.equivalence import Reference
from coconet.schedules.schedule import Schedule
from coconet.tuner.check import Check
from coconet.tuner.forkserver import kill_group, prestart, start_rank
from coconet.tuner.stats import summarize

MAX_RANKS = 64  # ranks of one machine a launch starts (per stage): one process each, beside the reference
STARTUP_S = 60.0  # interpreter start, torch import and group formation, on a loaded machine
HANG_DUMP_S = 1.0


@dataclass
class RunResult:
    schedule: str
    hash: str
    status: str  # ok | wrong_result | runtime_error | compile_error | timeout | killed
    correct: bool | None = None
    max_rel_err: float | None = None
    samples: list[float] = field(default_factory=list)
    error: str | None = None
    bandwidth: list[float] = field(default_factory=list)  # bytes/s, probed by the ranks after timing (Options.probe)

    def __post_init__(self) -> None:
        if self.status == "wrong_result" and self.correct is None:  # found wrong before any value was compared
            self.correct = False

    @property
    def median_s(self) -> float | None:
        return summarize(self.samples).median if self.samples else None

    @property
    def ci95_s(self) -> tuple[float, float] | None:
        return summarize(self.samples).ci95 if self.samples else None

    def to_json(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule,
            "hash": self.hash,
            "status": self.status,
            "correct": self.correct,
            "max_rel_err": self.max_rel_err
            if self.max_rel_err is not None and math.isfinite(self.max_rel_err)
            else None,
            "median_s": self.median_s,
            "ci95_s": list(self.ci95_s) if self.ci95_s else None,
            "samples": len(self.samples),
            "error": self.error,
            **({"bandwidth_GBps": max(self.bandwidth) / 1e9} if self.bandwidth else {}),
        }


@dataclass(frozen=True)
class Options:
    world: int
    sizes: Mapping[str, int]
    backend: str = backends.DEFAULT
    kernels: str = "compiled"  # or "eager": see coconet.codegen.lower.lower
    stages: int = 1
    seed: int = 0
    warmup: int = 3
    repeats: int = 20
    check: bool = True
    time: bool = True
    timeout_s: float = 120.0
    trace: str | None = None  # a directory: each rank profiles one more step there (Chrome trace JSON)
    probe: bool = False  # after the timed steps, the ranks measure the memory bandwidth together (CPU)


# A port free when chosen may be taken by the time rank 0 listens on it (an outgoing connection of any other
# process can get it): the launch is made again on another port, this many times in all.
PORT_TRIES = 3


def port_taken(error: str) -> bool:
    """Whether a group failed to form because its port was taken (torch's store names the errno)."""
    return "EADDRINUSE" in error


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_schedules(
    schedules: Sequence[Schedule],
    opts: Options,
    program_file: str | None = None,
    baselines: Sequence[Baseline] = (),
    on_result: Callable[[int, RunResult], None] | None = None,
) -> list[RunResult]:
    """Check and time ``schedules`` (of one program) on ``opts.world`` ranks per stage, in one launch
    unless a schedule fails (the rest then run on a fresh group). ``program_file`` is where the
    program's custom ops can be re-loaded by the ranks if their code does not pickle. Hand-written
    ``baselines`` of the same program run first, their results first. ``on_result(i, result)`` hears of
    each result as it is known (``i``: its place in the list returned), so that a caller stopped before
    the last keeps the others."""
    if not schedules:
        return []
    program = schedules[0].program
    for b in baselines:
        if not b.computes(program):
            raise CoconetError(
                f"baseline {b.name} computes {b.program}"
                + (
                    f", not {program.name}"
                    if b.program != program.name
                    else f", not this program of that name (hash {program.hash})"
                )
            )
    if any(s.program.hash != program.hash for s in schedules):
        raise CoconetError("schedules of one run must share their program")
    if opts.world < 1 or opts.stages < 1:
        raise CoconetError(f"world and stages must be positive, got world={opts.world}, stages={opts.stages}")
    stages = opts.stages if program.is_pipeline else 1
    target = backends.get(opts.backend)
    if target.device_type == "cuda":
        require_cuda(opts.world * stages)
    opts = dataclasses.replace(opts, stages=stages, sizes=dict(opts.sizes))
    program.require_world(opts.world)
    require_fits(program, opts.sizes, opts.world, check=opts.check)
    if target.device_type != "cuda":
        prestart(compiled=opts.kernels == "compiled")  # the ranks' imports, beside the lowering's
    custom = custom_payload(program, program_file)
    results = _Results(on_result)
    tasks: list[tuple[int, Any]] = [(i, _baseline_task(b, program, opts)) for i, b in enumerate(baselines)]
    for i, sched in enumerate(schedules, start=len(baselines)):
        try:
            gen = lower(sched, opts.backend, opts.kernels)
        except CoconetError as e:
            results[i] = RunResult(sched.text, sched.hash, getattr(e, "kind", "compile_error"), error=str(e))
            continue
        tasks.append((i, gen))
    reference = Reference(program, opts.world, opts.sizes, seed=opts.seed, stages=stages) if opts.check else {}
    tries = PORT_TRIES
    while tasks:
        done = _launch(tasks, opts, reference, results, custom, retry_port=tries > 1)
        if done is None:  # the group's port was taken before rank 0 listened on it
            tries -= 1
            continue
        tasks = [t for t in tasks if t[0] not in done]
    return [results[i] for i in range(len(baselines) + len(schedules))]


class _Results(dict):
    """Results by task id, each handed on as it is set: a task's result is set once."""

    def __init__(self, on_result: Callable[[int, RunResult], None] | None) -> None:
        super().__init__()
        self.on_result = on_result

    def __setitem__(self, i: int, result: RunResult) -> None:
        super().__setitem__(i, result)
        if self.on_result is not None:
            self.on_result(i, result)


def _baseline_task(b: Baseline, program, opts: Options) -> TorchTask:
    if b.make is not None:
        return TorchTask(b, Schedule(program))
    # torch.distributed collectives: the shm backend's ranks form a gloo group too
    gen = lower(Schedule(program), backends.get(opts.backend).process_group, "eager", dropout="torch")
    return TorchTask(b, Schedule(program), gen.source, str(module_path(gen)), gen.line_map, gen.code)


def custom_payload(program, program_file: str | None):
    ops = {k: op.torch for k, op in program.custom_ops.items() if op.torch is not None}
    try:
        pickle.dumps(ops)
        return ("callables", ops)
    except Exception as e:
        if program_file:
            return ("file", os.path.abspath(program_file))
        raise BackendError(
            f"custom ops {', '.join(ops)}: their torch code cannot be sent to the ranks ({e}); "
            "define them in an importable module",
            kind="compile_error",
        ) from None


def _launch(tasks, opts: Options, reference, results, custom, retry_port: bool = False) -> set[int] | None:
    """One group of ranks runs the tasks in order until one fails; returns the task ids finished. None, where
    ``retry_port``, if the group never formed because its port was taken: nothing ran, launch again."""
    nranks = opts.world * opts.stages
    workdir = _write_job(tasks, opts, custom, nranks)
    procs: list = []
    conns: dict[Connection, int] = {}
    by_id = dict(tasks)
    done: set[int] = set()
    current = tasks[0][0]
    try:
        _start_ranks(workdir, nranks, opts, procs, conns)
        pending: dict[int, dict] = {}
        started: dict[int, set] = {}
        # the first task also pays for starting the interpreters and the group
        deadline = time.monotonic() + opts.timeout_s + STARTUP_S
        while len(done) < len(tasks):
            if not conns:
                results[current] = _result(by_id[current], "runtime_error", "every rank exited before reporting")
                done.add(current)
                return done
            # wait hands back the connections it was given
            ready = cast(list[Connection], wait(list(conns), timeout=max(0.0, deadline - time.monotonic())))
            if not ready:
                gen = by_id[current]
                results[current] = _result(
                    gen, "timeout", f"no result within {opts.timeout_s:g} s" + _hang_report(procs, workdir, gen)
                )
                done.add(current)
                return done
            for conn in ready:
                rank = conns[conn]
                try:
                    kind, task, _, data = conn.recv()
                except (EOFError, OSError):
                    del conns[conn]
                    code = procs[rank].wait(timeout=10)
                    if code == 0:  # it finished every task; the others may still be on theirs
                        continue
                    gen = by_id[current]
                    # ended by a signal (from outside, or its own crash) is ``killed``, as the tuner's ranks say it
                    results[current] = _result(
                        gen,
                        "killed" if code < 0 else "runtime_error",
                        f"rank {rank} {_died(code)}" + _log_tail(workdir, rank),
                    )
                    done.add(current)
                    return done
                if kind == "error":
                    if task is None and retry_port and port_taken(data.get("error", "")):
                        return None
                    if task is None:  # the group never formed: every task fails alike
                        for i, gen in tasks:
                            results[i] = _result(gen, "runtime_error", f"rank {rank}: {data['error']}")
                        return {i for i, _ in tasks}
                    results[task] = _result(
                        by_id[task], data.get("kind", "runtime_error"), describe_error(rank, data, by_id[task])
                    )
                    done.add(task)
                    return done
                if kind == "started":
                    started.setdefault(task, set()).add(rank)
                    if len(started[task]) == 1:
                        current = task
                        deadline = time.monotonic() + opts.timeout_s
                    continue
                slot = pending.setdefault(task, {"check": _check_of(by_id[task], opts, reference), "time": None})
                _take(slot, kind, rank, data)
                checked = not opts.check or len(slot["check"].ranks) == nranks
                if checked and (not opts.time or slot["time"] is not None):
                    results[task] = _finish(by_id[task], slot, opts)
                    del pending[task]  # the pieces of sharded state: at large sizes, GBs per task
                    done.add(task)
        return done
    finally:
        _stop(procs)
        for conn in conns:
            conn.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _take(slot: dict, kind: str, rank: int, data) -> None:
    """A rank's report on a task into its slot: a value or a check for the reference, or the step's times."""
    if kind == "value":
        slot["check"].take(rank, *data)
    elif kind == "check":
        slot["check"].add(rank, data)
    elif kind == "time":
        slot["time"] = data


def _write_job(tasks, opts: Options, custom, nranks: int) -> Path:
    """A folder for one group's launch: the job every rank reads (the caller's path, the options, a free port,
    the tasks' code), and later the ranks' logs."""
    workdir = Path(tempfile.mkdtemp(prefix="coconet-run-"))
    with open(workdir / "job.pkl", "wb") as f:
        pickle.dump(list(sys.path), f)
        pickle.dump(
            {
                "options": opts,
                "port": free_port(),
                "custom": custom,
                "threads": max(1, (os.cpu_count() or 1) // nranks),
                "tasks": [(i, gen.code, _task_path(gen), strip_program(gen.schedule.scheduled)) for i, gen in tasks],
            },
            f,
        )
    return workdir


def _start_ranks(workdir: Path, nranks: int, opts: Options, procs: list, conns: dict) -> None:
    """Starts the ranks, each logging into ``workdir`` and reporting through a pipe: into ``procs`` and ``conns``
    as they start, so that the caller stops those that did if a later one cannot."""
    for r in range(nranks):
        rfd, wfd = os.pipe()
        log = open(workdir / f"rank{r}.log", "wb")
        # in a group of their own: Ctrl-C reaches the parent only; it stops the ranks
        fresh = backends.get(opts.backend).device_type == "cuda"
        procs.append(start_rank(str(workdir / "job.pkl"), r, log.fileno(), wfd, fresh=fresh))
        os.close(wfd)
        log.close()
        conns[Connection(rfd, writable=False)] = r


def _task_path(task) -> str:
    """Where a rank finds the task's code: a generated module's file, or ``torch:NAME`` for a baseline."""
    if isinstance(task, TorchTask):
        return task.path or f"torch:{task.baseline.name}"
    return str(module_path(task))


def strip_program(prog):
    """The program as ranks need it: custom ops travel separately (their code may not pickle)."""
    return dataclasses.replace(prog, custom_ops={}, locations={})


def _text(task) -> str:
    return task.text if isinstance(task, TorchTask) else task.schedule.text


def _result(gen: Generated, status: str, error: str) -> RunResult:
    return RunResult(_text(gen), gen.schedule.hash, status, error=error)


def _stop(procs) -> None:
    for p in procs:
        kill_group(p)
    for p in procs:
        p.wait()
        remove_leftover_segments(p.pid)


def remove_leftover_segments(pid: int) -> None:
    """shm segments are unlinked once every rank has mapped them; a rank killed in between leaves its
    file behind (named by its pid: coconet.kernels.shm)."""
    for leftover in Path("/dev/shm").glob(f"coconet-{pid}-*"):
        leftover.unlink(missing_ok=True)


def _check_of(gen, opts: Options, reference) -> Check:
    """What checks a task's reports; a baseline that cannot be checked (torch's own dropout masks) is only
    counted in."""
    unchecked = isinstance(gen, TorchTask) and not gen.baseline.checked
    return Check(gen.schedule.scheduled, opts, reference, score=not unchecked, again=True)


def _finish(gen: Generated, slot, opts: Options) -> RunResult:
    res = RunResult(_text(gen), gen.schedule.hash, "ok")
    if opts.check and slot["check"].score:
        res.max_rel_err, bad = slot["check"].result()
        res.correct = bad is None
        if bad is not None:
            res.status, res.error = "wrong_result", bad
    if opts.time and slot["time"] is not None:
        res.samples = list(slot["time"]["samples"])
        res.bandwidth = list(slot["time"]["bandwidth"])
    return res


def require_cuda(ranks: int) -> None:
    """NCCL runs one rank per CUDA device: refused up front, not found out by the ranks."""
    import torch

    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices == 0:
        raise BackendError(
            "the nccl backend runs on CUDA tensors and this machine has no CUDA device (gloo and shm run on CPU)"
        )
    if ranks > devices:
        raise BackendError(
            f"the nccl backend needs a CUDA device per rank: {ranks} ranks, {devices} device"
            f"{'s' if devices > 1 else ''} here"
        )


def _died(code: int) -> str:
    if code >= 0:
        return f"died (exit code {code})"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    causes: dict[int, str] = {
        signal.SIGKILL: " (the kernel's OOM killer sends it when memory runs out: see dmesg)",
        signal.SIGBUS: " (a store into shared memory past what /dev/shm can hold is the usual cause: see df /dev/shm)",
    }
    return f"was killed by {name}{causes.get(-code, '')}"


def describe_error(rank: int, data: dict, gen: Generated) -> str:
    stmt = None
    for fname, line in reversed(data["frames"]):
        if fname == data["module"]:
            stmt = gen.statement_at(line)
            if stmt:
                break
    known = stmt and stmt in gen.schedule.scheduled
    where = f" in statement {stmt} ({gen.schedule.scheduled[stmt].op})" if known else ""
    return f"rank {rank}{where}: {data['error']}"


def _hang_report(procs, workdir: Path, gen: Generated) -> str:
    """Where each live rank is: SIGUSR1 makes it dump its Python stacks (faulthandler)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGUSR1)
    time.sleep(HANG_DUMP_S)
    found = []
    for r in range(len(procs)):
        path = workdir / f"rank{r}.stack"
        where = stuck_at(path.read_text(errors="replace") if path.exists() else "", gen, f"coconet_{gen.key}.py")
        if where:
            found.append(f"rank {r} {where}")
    return f": {'; '.join(found)}" if found else ""


def stuck_at(stacks: str, gen: Generated, module: str) -> str | None:
    """Where in the generated module a faulthandler dump (innermost frame first) says a rank was."""
    line = None
    for m in re.finditer(r'File "([^"]+)", line (\d+)', stacks):
        if m.group(1).endswith(module):
            stmt = gen.statement_at(int(m.group(2)))
            if stmt and stmt in gen.schedule.scheduled:
                return f"in statement {stmt} ({gen.schedule.scheduled[stmt].op})"
            line = line or int(m.group(2))
    return f"at line {line} of the generated module" if line else None


def _log_tail(workdir: Path, rank: int, lines: int = 5) -> str:
    path = workdir / f"rank{rank}.log"
    text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return (": " + " | ".join(text[-lines:])) if text else ""
