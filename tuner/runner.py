"""Measuring candidates on a real world of ranks: one Ray actor per rank, a torch.distributed group
among them.

The driver lowers each schedule (a lowering error is a ``compile_error``), has every rank run the
generated step once on small inputs and checks what they hold against the reference interpreter
(``wrong_result``), then times it at the real sizes: warm-up, then repeats until the 95% CI of the
median is within ±3% or a cap, each sample the slowest rank's time after a barrier. A rank that
raises gives ``runtime_error`` — or ``compile_error`` when what raised was the kernel compiler —, a rank
whose process ends without a word gives ``killed``, and a group that does not answer within the timeout
gives ``timeout``. After either the actors are
killed and the next candidate runs on a fresh group: a rank left inside a collective would take
every later candidate down with it. Failures are results; nothing here raises for a bad candidate.

Workers compile and time; they never see the database.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import shutil
import signal
import stat
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from coconet.codegen import backends
from coconet.codegen.backends import DEFAULT
from coconet.codegen.lower import BACKENDS, Generated, lower
from coconet.errors import BackendError, ClusterError, CoconetError
from coconet.schedules.equivalence import Reference
from coconet.schedules.ir import Program
from coconet.schedules.schedule import Schedule
from coconet.tuner.check import compare
from coconet.tuner.cluster import ONE_NODE, PLACEMENTS, Need, describe, offer, plan
from coconet.tuner.launch import (
    HANG_DUMP_S,
    PORT_TRIES,
    Options,
    RunResult,
    custom_payload,
    describe_error,
    free_port,
    port_taken,
    remove_leftover_segments,
    strip_program,
    stuck_at,
)
from coconet.tuner.rank import (
    _custom_ops,
    checked_steps,
    error_report,
    freeze_imports,
    inputs,
    keep_freed_memory,
    time_steps,
)

Lowering = Callable[[Schedule, str, str], Generated]
PLACEMENT_POLL_S = 5.0  # how often a placement under way looks at the cluster again
DEATH_NOTICE_S = 5.0  # how long Ray may take to report a dead actor after its peers saw the connection drop


@dataclass(frozen=True)
class Protocol:
    """How one candidate is checked and timed (docs/architecture.md, "Data flow", step 4)."""

    warmup: int = 3
    min_repeats: int = 10
    max_repeats: int = 100
    rel_ci: float = 0.03  # stop once the 95% CI of the median is within ±3% of it
    max_time_s: float = 20.0  # or once the samples add up to this
    check: bool = True
    check_size: int = 97  # every dim at most this in the check: small, and prime so nothing divides evenly
    timeout_s: float = 300.0  # per call to the ranks (one check, or one timing)
    kernels: str = "compiled"
    seed: int = 0


def check_sizes(sizes: Mapping[str, int], cap: int) -> dict[str, int]:
    return {k: min(v, cap) for k, v in sizes.items()}


class _Rank:
    """A rank: joins the group once, then runs tasks the driver sends (wrapped by ray.remote)."""

    def __init__(self, rank: int, world: int, stages: int, backend: str, threads: int, custom, run_dir: str) -> None:
        import torch

        keep_freed_memory()
        self.rank, self.world, self.stages, self.backend = rank, world, stages, backend
        torch.set_num_threads(threads)
        # on SIGUSR1 (a timeout), every thread's stack goes here so the driver can say where this rank was
        self.stack_path = Path(run_dir) / f"rank{rank}-{os.getpid()}.stack"
        self._stack = private_file(self.stack_path)
        faulthandler.register(signal.SIGUSR1, file=self._stack, all_threads=True)
        self.custom = _custom_ops(custom)
        self.group = None
        freeze_imports()

    def where(self) -> tuple[str, int, int, str, str]:
        import ray

        return (
            ray.util.get_node_ip_address(),
            free_port(),
            os.getpid(),
            str(self.stack_path),
            ray.get_runtime_context().get_node_id(),
        )

    def join(self, addr: str, port: int, timeout_s: float) -> None:
        import torch
        import torch.distributed as dist

        if backends.get(self.backend).device_type == "cuda":
            torch.cuda.set_device(0)  # Ray gives each actor its own GPU as device 0
        dist.init_process_group(
            backends.get(self.backend).process_group,
            init_method=f"tcp://{addr}:{port}",
            rank=self.rank,
            world_size=self.world * self.stages,
            timeout=timedelta(seconds=max(30.0, timeout_s)),
        )
        groups = [dist.new_group(list(range(s * self.world, (s + 1) * self.world))) for s in range(self.stages)]
        self.group = groups[self.rank // self.world]

    def run(self, source: str, filename: str, prog: Program, sizes: dict, seed: int, protocol: Protocol | None):
        """Check (``protocol`` None) or time the step; returns what the driver needs, or the error."""
        import torch

        from coconet.kernels.segments import close_groups

        device = torch.device("cuda", 0) if backends.get(self.backend).device_type == "cuda" else torch.device("cpu")
        stage = self.rank // self.world
        opts = Options(world=self.world, sizes=sizes, seed=seed)
        ns: dict[str, Any] = {"__name__": "coconet_generated"}
        try:
            try:
                exec(compile(source, filename, "exec"), ns)
            except SyntaxError as e:
                return {"error": _error(e, filename), "kind": "compile_error"}
            step = ns["step"]
            kwargs = dict(group=self.group, stage=stage, stages=self.stages, sizes=dict(sizes), custom_ops=self.custom)
            tensors, scalars = inputs(prog, opts, stage, self.rank % self.world, device)
            if protocol is None:
                held: dict[str, Any] = {}
                for report in checked_steps(step, prog, tensors, scalars, kwargs, stage):
                    held.update((k, np.array(v)) for k, v in report.items())  # a copy: the next step writes on
                return {"check": held}
            samples = time_steps(
                step,
                tensors,
                scalars,
                kwargs,
                device,
                warmup=protocol.warmup,
                repeats=protocol.min_repeats,
                max_repeats=protocol.max_repeats,
                rel_ci=protocol.rel_ci,
                max_s=protocol.max_time_s,
            )
            return {"samples": samples}
        except Exception as e:
            return {"error": _error(e, filename), "kind": _kind(e)}
        finally:
            close_groups()


def _error(e: BaseException, filename: str) -> dict[str, Any]:
    report = error_report(e, filename)
    return dict(report, error=report["error"].strip()[:2000])  # it travels back through Ray and into the store


def _kind(e: BaseException) -> str:
    if isinstance(e, BackendError):
        return e.kind
    # Inductor compiles a fused kernel on its first call: its failures are the kernel's, not the step's
    for cls in type(e).__mro__:
        mod = cls.__module__ or ""
        if mod.startswith(("torch._inductor", "torch._dynamo.exc")) or cls.__name__ == "BackendCompilerFailed":
            return "compile_error"
    return "runtime_error"


def private_file(path: Path) -> Any:
    """``path`` opened for writing, made new in a folder only this user can enter (made so where missing, as on
    another node): never a file or link someone else put there first."""
    folder = path.parent
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise CoconetError(
            f"{folder} is not a private folder of this user (a link, another owner, or open to "
            "others): refusing to write rank diagnostics there"
        )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    return os.fdopen(fd, "w")


class Runner:
    """Candidates of one program, measured at one size on ``world`` ranks (per pipeline stage) over
    Ray. ``lowering`` turns a schedule into code (``coconet.codegen.lower.lower``; tests inject
    faulty code through it). Use as a context manager, or call ``close``."""

    def __init__(
        self,
        program: Program,
        *,
        world: int,
        sizes: Mapping[str, int],
        backend: str = DEFAULT,
        protocol: Protocol = Protocol(),
        stages: int = 2,
        program_file: str | None = None,
        lowering: Lowering = lower,
        placement: str = "pack",
    ) -> None:
        if backend not in BACKENDS:
            raise BackendError(f"unknown backend {backend!r} (use {', '.join(BACKENDS)})", kind="compile_error")
        if world < 1:
            raise CoconetError(f"world must be a positive number of ranks, got {world}")
        if placement not in PLACEMENTS:
            raise CoconetError(f"unknown placement {placement!r} (use {' or '.join(PLACEMENTS)})")
        self.placement = placement
        self.program, self.world, self.backend, self.protocol = program, world, backend, protocol
        self.sizes = dict(sizes)
        self.stages = stages if program.is_pipeline else 1
        self.lowering = lowering
        self._custom = custom_payload(program, program_file)
        self._check_sizes = check_sizes(self.sizes, protocol.check_size)
        self._reference = None
        self._actors: list = []
        self._pg = None
        self._stacks: list[tuple[str, int, str]] = []
        self._nodes: list[str] = []  # each rank's Ray node id, as last placed
        self._run_dir: Path | None = None

    @property
    def placed(self) -> str | None:
        """Where the ranks ran last, in words (``2 ranks on 1 node``); None before they were placed."""
        return describe(self._nodes) if self._nodes else None

    @property
    def nodes(self) -> tuple[str, ...]:
        """Each rank's Ray node id, as last placed; empty before they were placed."""
        return tuple(self._nodes)

    @property
    def run_dir(self) -> Path | None:
        """The private folder (0700) of the ranks' diagnostics while they run; removed by ``close``."""
        return self._run_dir

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def nranks(self) -> int:
        return self.world * self.stages

    def measure(self, schedule: Schedule) -> RunResult:
        if schedule.program.hash != self.program.hash:
            raise CoconetError(f"schedule of {schedule.program.name}, runner of {self.program.name}")
        try:
            gen = self.lowering(schedule, self.backend, self.protocol.kernels)
        except CoconetError as e:
            return RunResult(schedule.text, schedule.hash, getattr(e, "kind", "compile_error"), error=str(e))
        prog = strip_program(gen.schedule.scheduled)
        filename = f"<coconet {schedule.hash} {self.backend}>"
        res = RunResult(schedule.text, schedule.hash, "ok")
        if self.protocol.check:
            got = self._call(gen, filename, prog, self._check_sizes, None)
            if isinstance(got, RunResult):
                return got
            opts = Options(world=self.world, sizes=self._check_sizes, stages=self.stages)
            res.max_rel_err, bad = compare(
                prog, {r: g["check"] for r, g in enumerate(got)}, opts, self._ref(), again=True
            )
            res.correct = bad is None
            if bad is not None:
                res.status, res.error = "wrong_result", bad
                return res
        got = self._call(gen, filename, prog, self.sizes, self.protocol)
        if isinstance(got, RunResult):
            return dataclasses.replace(got, correct=res.correct, max_rel_err=res.max_rel_err)
        res.samples = list(got[0]["samples"])
        return res

    def _ref(self):
        if self._reference is None:
            self._reference = Reference(
                self.program, self.world, self._check_sizes, seed=self.protocol.seed, stages=self.stages
            )
        return self._reference

    def _call(self, gen: Generated, filename: str, prog, sizes, protocol) -> list[dict] | RunResult:
        """Every rank runs the step; their answers in rank order, or the failure as a result."""
        import ray

        def failed(status: str, error: str) -> RunResult:
            self._reset()  # a rank may be stuck in a collective: the next candidate gets a fresh group
            return RunResult(gen.schedule.text, gen.schedule.hash, status, error=error)

        try:
            actors = self._group()
        except ClusterError:
            raise  # the cluster, not this candidate: the study stops
        except CoconetError as e:
            return failed("runtime_error", str(e))
        refs = [a.run.remote(gen.source, filename, prog, sizes, self.protocol.seed, protocol) for a in actors]
        rank_of = {ref: r for r, ref in enumerate(refs)}
        answers: dict[int, dict] = {}
        deadline = time.monotonic() + self.protocol.timeout_s
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = sorted(rank_of[r] for r in pending)
                return failed(
                    "timeout",
                    f"no result within {self.protocol.timeout_s:g} s from rank"
                    f"{'s' if len(late) > 1 else ''} {', '.join(map(str, late))}"
                    + self._hang_report(late, gen, filename),
                )
            rank = rank_of[ready[0]]
            try:
                answer = ray.get(ready[0])
            except ray.exceptions.RayError as e:
                return failed("killed", _death(self._rank_text(rank), e))
            if "error" in answer:
                # a peer that died makes the others' collectives fail at once; the death is the cause
                dead = _dead_rank(pending, rank_of, self._rank_text)
                if dead is not None:
                    return failed("killed", dead)
                return failed(answer["kind"], describe_error(rank, answer["error"], gen))
            answers[rank] = answer
        return [answers[r] for r in range(len(refs))]

    def _hang_report(self, ranks: list[int], gen: Generated, filename: str) -> str:
        """Where the ranks on this node are stuck: SIGUSR1 has each dump its stacks (faulthandler)."""
        import ray

        here = ray.util.get_node_ip_address()
        asked = []
        for r in ranks:
            ip, pid, path = self._stacks[r]
            if ip == here:
                try:
                    os.kill(pid, signal.SIGUSR1)
                    asked.append((r, Path(path)))
                except ProcessLookupError:
                    pass
        time.sleep(HANG_DUMP_S if asked else 0)
        found = []
        for r, dump in asked:
            where = stuck_at(dump.read_text(errors="replace") if dump.exists() else "", gen, filename)
            if where:
                found.append(f"rank {r} {where}")
        return f": {'; '.join(found)}" if found else ""

    def _group(self) -> list:
        if self._actors:
            return self._actors
        tries = PORT_TRIES
        while True:
            try:
                return self._form_group()
            except _PortTaken:
                tries -= 1
                if not tries:
                    raise

    def _await_placement(self, pg: Any, need: Need) -> None:
        """Until the group is placed, the cluster is looked at again every few seconds: one that can no longer
        hold it (a node lost since the study began) stops the study then, where waiting for the placement
        would take the whole timeout for this candidate and for each one after it."""
        import ray

        deadline = time.monotonic() + self.protocol.timeout_s
        while True:
            plan(need, (self.backend,), offer(), asked=True, placement=self.placement)
            left = deadline - time.monotonic()
            ready, _ = ray.wait([pg.ready()], timeout=max(0.0, min(PLACEMENT_POLL_S, left)))
            if ready:
                return
            if left <= PLACEMENT_POLL_S:
                raise CoconetError(
                    f"the Ray cluster cannot place {need.text()} within "
                    f"{self.protocol.timeout_s:g} s (its CPUs are busy with other work)"
                )

    def _rank_text(self, rank: int) -> str:
        if rank < len(self._nodes):
            return f"rank {rank} (node {self._nodes[rank][:12]} at {self._stacks[rank][0]})"
        return f"rank {rank}"

    def _form_group(self) -> list:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = backends.get(self.backend).device_type == "cuda"
        bundle = {"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}
        # shm ranks must share one node's memory; the others go where the placement asks
        strategy = "STRICT_PACK" if self.backend in ONE_NODE else {"pack": "PACK", "spread": "SPREAD"}[self.placement]
        pg = placement_group([bundle] * self.nranks, strategy=strategy)
        try:
            self._await_placement(pg, Need(self.nranks, gpu))
        except BaseException:
            ray.util.remove_placement_group(pg)
            raise
        self._pg = pg
        threads = max(1, (os.cpu_count() or 1) // self.nranks)
        if self._run_dir is None:
            self._run_dir = Path(tempfile.mkdtemp(prefix="coconet-ranks-"))  # mode 0700, a name no one can guess
        cls = ray.remote(_Rank)
        self._actors = [
            cls.options(
                num_cpus=1,
                num_gpus=1 if gpu else 0,
                max_concurrency=1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r),
            ).remote(r, self.world, self.stages, self.backend, threads, self._custom, str(self._run_dir))
            for r in range(self.nranks)
        ]
        try:
            where = ray.get([a.where.remote() for a in self._actors], timeout=self.protocol.timeout_s)
            self._stacks = [(ip, pid, path) for ip, _, pid, path, _ in where]
            self._nodes = [node for *_, node in where]
            addr, port, *_ = where[0]
            ray.get(
                [a.join.remote(addr, port, self.protocol.timeout_s) for a in self._actors],
                timeout=self.protocol.timeout_s + 30,
            )
        except Exception as e:
            self._reset()
            error = _PortTaken if port_taken(str(e)) else CoconetError
            raise error(f"the ranks did not form a group: {_first_line(e)}") from None
        return self._actors

    def _reset(self) -> None:
        import ray

        for a in self._actors:
            ray.kill(a, no_restart=True)
        if self._pg is not None:
            ray.util.remove_placement_group(self._pg)
        for _, pid, stack in self._stacks:
            remove_leftover_segments(pid)
            Path(stack).unlink(missing_ok=True)
        self._actors, self._pg, self._stacks = [], None, []

    def close(self) -> None:
        if self._actors or self._pg is not None:
            self._reset()
        if self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
            self._run_dir = None


class _PortTaken(CoconetError):
    """Rank 0's port, free when it chose it, was taken before it listened: the group is formed again."""


def _dead_rank(pending: list, rank_of: dict, name: Callable[[int], str], wait_s: float = DEATH_NOTICE_S) -> str | None:
    import ray

    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
    for ref in ready:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as e:
            return _death(name(rank_of[ref]), e)
        except ray.exceptions.RayError:
            continue
    return None


def _death(rank: str, e: BaseException) -> str:
    # Ray cannot tell a signal from outside (the OOM killer, an operator, a node lost) from the step crashing
    # the process: either is ``killed``, which the next tuning of the key tries once more (a failure that
    # repeats stays)
    return (
        f"{rank} died, its process ended without reporting an error (killed by a signal, its node lost, "
        f"or a crash): {_first_line(e)}"
    )


def _first_line(e: BaseException) -> str:
    cause = getattr(e, "cause", None)  # a Ray task's error: its first line is Ray's, naming the task
    if isinstance(cause, BaseException):
        e = cause
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
