"""Running schedules in a job whose launcher started the ranks: torchrun (also as Slurm's srun starts it), or
any launcher that sets torch.distributed's ``env://`` variables (``coconet run`` under torchrun).

Each process is one rank. It joins the group from the environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), lowers the schedules itself (every rank loaded the same program file), and runs each as a rank
of ``coconet run`` does (``coconet.tuner.rank``): two checked steps on the seeded inputs, then warm-up and
timed steps. Where the local launcher's ranks report to a parent over pipes, here rank 0 is the parent: every
rank's values are gathered to it over a gloo group of their own, and it checks them against the reference
interpreter. Every rank ends with the same results (rank 0 hands them out), so that every rank exits alike.

A rank that fails does not leave the others waiting forever: the step's group has the run's timeout, so the
others' collectives give up, and every rank then meets at the next exchange, where the failure is told.
The remaining schedules run on a fresh group, as the local launcher's do. A rank that dies outright ends the
job: torchrun stops the other ranks.
"""

from __future__ import annotations

import dataclasses
import marshal
import os
import re
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence

from coconet.codegen import backends
from coconet.codegen.lower import lower
from coconet.errors import BackendError, CoconetError
from coconet.schedules.dims import format_sizes
from coconet.schedules.equivalence import Reference
from coconet.schedules.schedule import Schedule
from coconet.tuner.check import Check
from coconet.tuner.launch import Options, RunResult, describe_error
from coconet.tuner.rank import checked_steps, error_report, inputs, time_steps

VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LAUNCHERS = ("auto", "local", "env")
# the exchanges between steps wait for the slowest rank's step to give up (the run's timeout) and more
EXCHANGE_MARGIN_S = 60.0
MIN_TIMEOUT_S = 10.0  # a collective waits at least this long for its peers


@dataclass(frozen=True)
class JobEnv:
    """Where this process stands in the job, as its launcher said it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None  # None: the launcher did not say (then the hosts are compared)
    master: str


def job_env(environ: Mapping[str, str] | None = None) -> JobEnv | None:
    """The job's variables, or None when the launcher's four are not all set."""
    env = os.environ if environ is None else environ
    if not all(env.get(k) for k in VARIABLES):
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", "0"))
        local_world = int(env["LOCAL_WORLD_SIZE"]) if env.get("LOCAL_WORLD_SIZE") else None
    except ValueError:
        found = ", ".join(f"{k}={env.get(k)!r}" for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
        raise CoconetError(f"the launcher's variables must be integers: {found}") from None
    if world < 1 or not 0 <= rank < world:
        raise CoconetError(f"RANK={rank} is not a rank of WORLD_SIZE={world}")
    return JobEnv(rank, world, local_rank, local_world, f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}")


def choose(launcher: str, environ: Mapping[str, str] | None = None) -> JobEnv | None:
    """The job this process is a rank of, or None to start the ranks here. ``auto``: a job when its launcher's
    variables are set (torchrun sets them for every rank it starts); ``env``: they must be; ``local``: never."""
    if launcher not in LAUNCHERS:
        raise CoconetError(f"unknown launcher {launcher!r} (use {', '.join(LAUNCHERS)})")
    if launcher == "local":
        return None
    found = job_env(environ)
    if found is None and launcher == "env":
        env = os.environ if environ is None else environ
        missing = [k for k in VARIABLES if not env.get(k)]
        raise CoconetError(
            f"--launcher env: {', '.join(missing)} not set; start coconet with torchrun (or set "
            f"{', '.join(VARIABLES)} as torch.distributed's env:// asks)"
        )
    return found


def world_of(asked: int | None, env: JobEnv, stages: int) -> int:
    """Ranks per stage: WORLD_SIZE / stages, which ``--world`` must match when given."""
    if env.world_size % stages:
        raise CoconetError(
            f"the job has WORLD_SIZE={env.world_size} ranks, not a multiple of the program's {stages} pipeline stages"
        )
    world = env.world_size // stages
    if asked is not None and asked != world:
        per = f" ({stages} stages of {world})" if stages > 1 else ""
        raise CoconetError(
            f"--world {asked} disagrees with the job's WORLD_SIZE={env.world_size}{per}: leave "
            "--world out under torchrun, or start as many ranks as it says"
        )
    return world


def require_one_node(backend: str, env: JobEnv) -> None:
    """shm's ranks share memory, so they must all run on one node (known before the group forms when the
    launcher says how many ranks this node runs)."""
    if backends.get(backend).one_node and env.local_world_size is not None and env.local_world_size != env.world_size:
        raise BackendError(
            f"the {backend} backend shares memory between ranks on one node, and this job runs "
            f"{env.local_world_size} of its {env.world_size} ranks per node "
            f"(LOCAL_WORLD_SIZE={env.local_world_size}): use gloo or nccl across nodes"
        )


def run_in_job(
    schedules: Sequence[Schedule], opts: Options, env: JobEnv, on_result: Callable[[int, RunResult], None] | None = None
) -> list[RunResult]:
    """Check and time ``schedules`` with this process as rank ``env.rank`` of the job; every rank returns the
    same results, ``on_result`` hears of each on rank 0 as it is known."""
    import torch.distributed as dist

    if not schedules:
        return []
    program = schedules[0].program
    if any(s.program.hash != program.hash for s in schedules):
        raise CoconetError("schedules of one run must share their program")
    stages = opts.stages if program.is_pipeline else 1
    opts = dataclasses.replace(opts, stages=stages, sizes=dict(opts.sizes))
    if opts.world * stages != env.world_size:
        raise CoconetError(f"{opts.world} ranks x {stages} stages is not the job's WORLD_SIZE={env.world_size}")
    if opts.trace or opts.probe:
        raise CoconetError("tracing and bandwidth probes run under the local launcher only")
    program.require_world(opts.world)
    require_one_node(opts.backend, env)
    job = _Job(opts, env, program)
    joined = dist.is_initialized()  # a script's own group (coconet.run in a training job) is used, and kept
    try:
        job.join()
        job.agree(schedules)
        return job.run(schedules, on_result)
    finally:
        if dist.is_initialized() and not joined:
            dist.destroy_process_group()


class _Job:
    """This rank's share of the run: its groups, its device, and (rank 0) the checking."""

    def __init__(self, opts: Options, env: JobEnv, program) -> None:
        self.opts, self.env, self.program = opts, env, program
        self.custom = {k: op.torch for k, op in program.custom_ops.items() if op.torch is not None}
        self.step_timeout = timedelta(seconds=max(MIN_TIMEOUT_S, opts.timeout_s))
        self.exchange_timeout = timedelta(seconds=2 * self.step_timeout.total_seconds() + EXCHANGE_MARGIN_S)

    def join(self) -> None:
        import torch
        import torch.distributed as dist

        if backends.get(self.opts.backend).device_type == "cuda":
            if not torch.cuda.is_available():
                raise BackendError("the nccl backend runs on CUDA tensors and this node has no CUDA device")
            torch.cuda.set_device(self.env.local_rank % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group(
                backends.get(self.opts.backend).process_group, init_method="env://", timeout=self.step_timeout
            )
        elif (dist.get_rank(), dist.get_world_size()) != (self.env.rank, self.env.world_size):
            raise CoconetError(
                f"the process group already formed here has rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, and the launcher says RANK={self.env.rank} of "
                f"WORLD_SIZE={self.env.world_size}"
            )
        # values and verdicts travel here, apart from the steps' group, which a failed step may leave unusable; a
        # torch.distributed gloo group whatever the step's backend: what travels are Python objects on the CPU
        self.exchange = dist.new_group(backend="gloo", timeout=self.exchange_timeout)
        if backends.get(self.opts.backend).one_node and self.env.local_world_size is None:
            hosts: list[Any] = [None] * self.env.world_size
            dist.all_gather_object(hosts, socket.gethostname(), group=self.exchange)
            if len(set(hosts)) > 1:
                raise BackendError(
                    f"the shm backend shares memory between ranks on one node, and this job's ranks "
                    f"run on {len(set(hosts))} hosts ({', '.join(sorted(set(hosts)))}): use gloo or "
                    "nccl across nodes"
                )
        self.groups = self._step_groups()

    def agree(self, schedules: Sequence[Schedule]) -> None:
        """Every rank must run the same thing: a program file edited on one node, other sizes or schedules on
        another, would have the ranks wait in collectives that never match."""
        import torch.distributed as dist

        opts = self.opts
        mine = {
            "program": f"{self.program.name} (hash {self.program.hash})",
            "sizes": format_sizes(opts.sizes),
            "backend": opts.backend,
            "kernels": opts.kernels,
            "seed": opts.seed,
            "schedules": ", ".join(s.text for s in schedules),
        }
        every: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(every, mine, group=self.exchange)
        for rank, theirs in enumerate(every):
            differ = [k for k in mine if theirs[k] != every[0][k]]
            if differ:
                k = differ[0]
                raise CoconetError(
                    f"rank {rank} runs {k} {theirs[k]} where rank 0 runs {every[0][k]}: start every "
                    "rank with the same command and program file"
                )

    def _step_groups(self) -> list:
        import torch.distributed as dist

        w = self.opts.world
        return [
            dist.new_group(list(range(s * w, (s + 1) * w)), timeout=self.step_timeout) for s in range(self.opts.stages)
        ]

    def run(self, schedules: Sequence[Schedule], on_result) -> list[RunResult]:
        import torch.distributed as dist

        opts = self.opts
        reference = (
            Reference(self.program, opts.world, opts.sizes, seed=opts.seed, stages=opts.stages)
            if opts.check and self.env.rank == 0
            else {}
        )
        # the others wait here, not in a step's collective whose timeout the reference may outlast
        dist.barrier(group=self.exchange)
        results: list[RunResult] = []
        for i, sched in enumerate(schedules):
            try:
                gen = lower(sched, opts.backend, opts.kernels)
                code = gen.code
            except CoconetError as e:  # the same on every rank: lowering is deterministic
                results.append(RunResult(sched.text, sched.hash, getattr(e, "kind", "compile_error"), error=str(e)))
            else:
                try:
                    results.append(self._task(gen, code, reference))
                except CoconetError:
                    raise
                except Exception as e:  # an exchange failed: a rank is gone, so no result can be gathered
                    raise CoconetError(
                        f"rank {self.env.rank}: the job lost a rank while running schedule "
                        f"{sched.text!r} ({_first_line(e)}); the other ranks' output says which "
                        "and why"
                    ) from e
                if results[-1].status != "ok":
                    self.groups = self._step_groups()  # a failed step may have left messages in flight
            if self.env.rank == 0 and on_result is not None:
                on_result(i, results[-1])
        shared = [results]
        dist.broadcast_object_list(shared, src=0, group=self.exchange)
        return shared[0]

    def _task(self, gen, code: bytes, reference) -> RunResult:
        """One schedule on every rank: checked steps, their values gathered to rank 0 and judged there, then
        (if every rank got through) timed steps. Every rank takes part in both exchanges whatever happened."""
        import torch.distributed as dist

        opts, rank = self.opts, self.env.rank
        stage, grank = rank // opts.world, rank % opts.world
        ns: dict[str, Any] = {"__name__": f"coconet_generated_{gen.schedule.hash}"}
        kwargs = dict(
            group=self.groups[stage], stage=stage, stages=opts.stages, sizes=dict(opts.sizes), custom_ops=self.custom
        )
        error, report = None, {}
        try:
            exec(marshal.loads(code), ns)
            if opts.check:
                tensors, scalars = inputs(gen.schedule.scheduled, opts, stage, grank, self.device)
                for values in checked_steps(ns["step"], gen.schedule.scheduled, tensors, scalars, kwargs, stage):
                    report.update({k: v.copy() for k, v in values.items()})
                del tensors
        except Exception as e:
            error = error_report(e, gen.path)
        verdict, raised = self._judge(gen, error, report, reference)
        samples: list[float] = []
        if not raised and opts.time:  # a wrong result is timed too, as the local launcher's ranks time it
            error = None
            try:
                tensors, scalars = inputs(gen.schedule.scheduled, opts, stage, grank, self.device)
                samples = time_steps(
                    ns["step"], tensors, scalars, kwargs, self.device, warmup=opts.warmup, repeats=opts.repeats
                )
                del tensors
            except Exception as e:
                error = error_report(e, gen.path)
            errors: list[Any] = [None] * self.env.world_size
            dist.all_gather_object(errors, error, group=self.exchange)
            failed = _first_failure(errors)
            if failed is not None:
                verdict = _failure(gen, *failed)
            else:
                verdict.samples = samples
        for shm in list(ns.get("_GROUPS", {}).values()):  # the next schedule maps its own segments
            shm.close()
        return verdict

    def _judge(self, gen, error, report, reference) -> tuple[RunResult, bool]:
        """Every rank's error or values gathered to rank 0, checked there; its verdict handed to every rank, with
        whether a rank raised."""
        import torch.distributed as dist

        rank = self.env.rank
        gathered: list[Any] | None = [None] * self.env.world_size if rank == 0 else None
        dist.gather_object((error, report), gathered, dst=0, group=self.exchange)
        verdict: list[Any] = [None]
        if rank == 0:
            assert gathered is not None
            failed = _first_failure([e for e, _ in gathered])
            verdict[0] = (_failure(gen, *failed), True) if failed else (self._check(gen, gathered, reference), False)
        dist.broadcast_object_list(verdict, src=0, group=self.exchange)
        return verdict[0]

    def _check(self, gen, gathered: list, reference) -> RunResult:
        res = RunResult(gen.schedule.text, gen.schedule.hash, "ok")
        if self.opts.check:
            check = Check(gen.schedule.scheduled, self.opts, reference, again=True)
            for r, (_, values) in enumerate(gathered):
                check.add(r, values)
            res.max_rel_err, bad = check.result()
            res.correct = bad is None
            if bad is not None:
                res.status, res.error = "wrong_result", bad
        return res


def _first_failure(errors: Sequence[Any]) -> tuple[int, dict] | None:
    """The rank whose error tells what went wrong: one that raised, before those whose collectives then gave up
    waiting for it."""
    failed = [(_timed_out(e), r, e) for r, e in enumerate(errors) if e is not None]
    return min(failed, key=lambda f: f[:2])[1:] if failed else None


def _first_line(e: BaseException) -> str:
    """An error of torch.distributed's in a line: its first sentence, without the source location it starts with."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    text = re.sub(r"^\[[^\]]*\] ", "", text)
    return text.split(". ")[0]


def _timed_out(data: dict) -> bool:
    return "timed out" in data["error"].lower() or "timeout" in data["error"].lower()


def _failure(gen, rank: int, data: dict) -> RunResult:
    """A rank's error as the local launcher tells it; a collective that gave up waiting is a ``timeout``."""
    kind = data.get("kind") or ("timeout" if _timed_out(data) else "runtime_error")
    return RunResult(gen.schedule.text, gen.schedule.hash, kind, error=describe_error(rank, data, gen))
