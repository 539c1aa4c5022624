"""Where ``coconet.compile`` finds its schedule when the caller names none: the question "best schedule for
(program, sizes, topology, world)" asked of a store or a server, tuned there on a miss where asked
(``Tuning``), and agreed on by every rank of the group; ``Origin`` says where the answer came from."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Mapping

from coconet import api
from coconet.codegen.backends import REGISTRY
from coconet.errors import CoconetError, StoreError
from coconet.extras import STORE, require
from coconet.schedules import shardable
from coconet.schedules.dims import format_sizes
from coconet.schedules.ir import Program


@dataclass(frozen=True)
class Origin:
    """Where a step's schedule came from: ``how`` is ``measured`` or ``model`` (a tuned winner, timed or
    predicted by the cost model) or ``given`` (the caller named it)."""

    how: str
    where: str | None = None  # the store or server it was read from
    exact: bool = True  # False: the winner of the nearest tuned sizes
    tuned_sizes: Mapping[str, int] | None = None
    median_s: float | None = None
    topology: str | None = None

    def __str__(self) -> str:
        if self.how == "given":
            return "given by the caller"
        what = "measured fastest" if self.how == "measured" else "predicted fastest by the cost model"
        at = "" if self.exact else f" at the nearest tuned sizes {format_sizes(self.tuned_sizes or {})}"
        took = f" ({self.median_s * 1e3:.3g} ms a step)" if self.median_s else ""
        return f"{what}{at} on topology {self.topology}{took}, from {self.where}"


@dataclass(frozen=True)
class Tuning:
    """What ``compile(tune_on_miss=True)`` tunes with: the program as the caller named it (a file keeps its
    custom ops), the trials, and the kernels the step will run."""

    program: Any
    budget: int
    kernels: str


@dataclass
class Lookup:
    """The question "best schedule for (program, sizes, topology, world)", asked of a store or a server."""

    prog: Program
    sizes: dict[str, int]
    world: int
    topology: str
    backend: str | None
    device_type: str
    store: Any
    server: str | None
    token: str | None
    shardable: Any
    tuning: Tuning | None = None

    def shardable_text(self) -> str | None:
        names = self._shardable_names()
        return None if names is None else shardable.to_text(self.prog, shardable.resolve(self.prog, names))

    def answer(self) -> tuple[str, dict[str, int], str, Origin]:
        """(schedule text, knobs, backend, origin); raises CoconetError on a miss. With ``tuning``, a key
        without a measured winner at these exact sizes is tuned first."""
        try:
            got = self._read()
        except CoconetError as e:
            if self.tuning is None or not getattr(e, "not_tuned", False):
                raise
            got = None
        if self.tuning is None or (got is not None and got[3].how == "measured" and got[3].exact):
            return got  # type: ignore[return-value]  # None only with tuning
        where = f"server {self.server}" if self.server is not None else "this machine's Ray"
        print(
            f"coconet.compile: {self.prog.name} has no measured winner for {format_sizes(self.sizes)}, world "
            f"{self.world}, topology {self.topology}: tuning it on {where} ({self.tuning.budget} trials)",
            file=sys.stderr,
            flush=True,
        )
        if self.server is not None:
            self._tune_on_server(self.tuning)
        else:
            self._tune_here(self.tuning)
        got = self._read()
        if got[3].how != "measured" or not got[3].exact:
            raise CoconetError(
                f"the tuning of {self.prog.name} at {format_sizes(self.sizes)} ended without a "
                f"measured winner at these sizes"
            )
        return got

    def _read(self) -> tuple[str, dict[str, int], str, Origin]:
        return self._from_server() if self.server is not None else self._from_store()

    def _tune_backends(self) -> tuple[str, ...]:
        if self.backend is not None:
            return (self.backend,)
        # a step on CUDA tensors needs a winner on them: left to itself, a tuning on a machine with fewer GPUs
        # than ranks would try the CPU backends
        return REGISTRY.on(self.device_type) if self.device_type == "cuda" else ()

    def _shardable_names(self) -> list[str] | None:
        if self.shardable is None:
            return None
        return [self.shardable] if isinstance(self.shardable, str) else list(self.shardable)

    def _tune_here(self, tuning: Tuning) -> None:
        doc = api.tune(
            tuning.program,
            self.sizes,
            world=self.world,
            budget=tuning.budget,
            topology=self.topology,
            backends=self._tune_backends(),
            store=self.store,
            kernels=tuning.kernels,
            shardable=self._shardable_names(),
        )
        assert isinstance(doc, dict)  # one binding, one result
        if doc["best"] is None:
            why = "; ".join(f"{f['count']} {f['status']}: {f['error']}" for f in doc["failures"]) or "no trial ran"
            raise CoconetError(
                f"the tuning of {self.prog.name} at {format_sizes(self.sizes)} found no schedule that ran ({why})"
            )

    def _tune_on_server(self, tuning: Tuning) -> None:
        from coconet.client import Client, follow

        assert self.server is not None  # only a step that names a server tunes there
        with Client.open(self.server, self.token) as client:
            client.send_program(self.prog)  # the server tunes what it holds, as `coconet submit` sends it
            backends = self._tune_backends()
            _, started = client.best_or_tune(
                self.prog.hash,
                self.sizes,
                topology=self.topology,
                world=self.world,
                backend=backends[0] if backends else None,
                budget=tuning.budget,
                shardable=self._shardable_names(),
            )
            if started is None:
                return  # tuned meanwhile
            job = follow(client, [started["job"]])[started["job"]]
        if job["state"] != "done":
            raise CoconetError(
                f"server {self.server}: tuning job {started['job']} {job['state']}: "
                f"{job.get('error') or 'no reason given'}"
            )

    def _wanted_backends(self) -> list[str | None]:
        if self.backend is not None:
            return [self.backend]
        if self.device_type == "cuda":
            return list(REGISTRY.on(self.device_type))
        # any backend first: the store answers with the fastest; where that runs on another device, each of ours
        return [None, *REGISTRY.on(self.device_type)]

    def _from_store(self) -> tuple[str, dict[str, int], str, Origin]:
        require(STORE, "coconet.compile without a schedule (it reads the tuned one from the store)")
        from coconet.server.store import Store

        opened = not hasattr(self.store, "best")
        try:
            store = Store.open(self.store, create=False) if opened else self.store
        except StoreError as e:
            if self.store is not None:
                raise
            # no store named and none made yet: as good as a store without the program
            raise CoconetError(
                f"no store to read the best schedule from ({e}): run `coconet tune` first, or "
                "pass store=URL, server=URL or schedule='baseline' or a schedule's text",
                not_tuned=True,
            ) from None
        try:
            for backend in self._wanted_backends():
                best = store.best(
                    self.prog.hash,
                    self.sizes,
                    self.topology,
                    self.world,
                    backend=backend,
                    shardable=self.shardable_text(),
                )
                if best is not None and best.winner.backend in REGISTRY.on(self.device_type):
                    m = best.measurement
                    origin = Origin(best.source, store.url, best.exact, dict(best.sizes), m.median_s, self.topology)
                    return m.schedule, dict((m.schedule_json or {}).get("knobs") or {}), best.winner.backend, origin
            raise self._miss(f"store {store.url}", "--db URL ")
        finally:
            if opened:
                store.close()

    def _from_server(self) -> tuple[str, dict[str, int], str, Origin]:
        from coconet.client import Client, ServiceError

        assert self.server is not None  # _read asks the server only when one is named
        with Client.open(self.server, self.token) as client:
            try:
                got = client.best(
                    self.prog.hash,
                    self.sizes,
                    topology=self.topology,
                    world=self.world,
                    shardable=self.shardable_text(),
                )
            except ServiceError as e:
                if getattr(e, "status", None) == 404:
                    raise self._miss(f"server {self.server}", f"--server {self.server} ") from None
                raise
        if self.backend is not None and got["backend"] != self.backend:
            raise CoconetError(
                f"server {self.server}: the winner runs on {got['backend']}, not {self.backend}; "
                "pass schedule=TEXT to run another"
            )
        how = "measured" if got.get("source") == "measured" else "model"
        origin = Origin(
            how,
            self.server,
            bool(got.get("exact", True)),
            got.get("tuned_sizes"),
            (got.get("stats") or {}).get("median_s"),
            self.topology,
        )
        knobs = dict((got.get("schedule_json") or {}).get("knobs") or {})
        return got["schedule"], knobs, got["backend"], origin

    def _miss(self, where: str, flag: str) -> CoconetError:
        sizes = format_sizes(self.sizes)
        return CoconetError(
            f"no schedule of {self.prog.name} (hash {self.prog.hash}) tuned for {sizes}, world {self.world}, "
            f"topology {self.topology} in {where}: tune it first (`coconet {'submit' if 'server' in where else 'tune'} "
            f"FILE --world {self.world} --size {sizes} {flag}`) or pass schedule='baseline' or a schedule's text",
            not_tuned=True,
        )


def agreed(look: Lookup, group: Any, rank: int, world: int) -> tuple[str, dict[str, int], str, Origin]:
    """Rank 0's answer to ``look``, handed to every rank of ``group``: ranks that each read the store could see
    different winners (a tuning recorded between their reads) and would run different collectives."""
    if world == 1:
        return look.answer()
    import torch.distributed as dist

    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = ("ok", look.answer())
        except CoconetError as e:
            box[0] = ("error", (str(e), bool(getattr(e, "not_tuned", False))))
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    kind, value = box[0]
    if kind == "error":
        message, not_tuned = value
        raise CoconetError(message if rank == 0 else f"rank 0: {message}", not_tuned=not_tuned)
    return value
