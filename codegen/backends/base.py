"""What a backend is to the lowering, the cost model and the tuner (``Backend``): where a step's tensors live,
which runtime its collectives come from, which of the lowering's placements it can make, how its collectives
are priced, and what it needs of the machine (``Machine``). A new backend is one module of this package with
one ``Backend`` and a line in the registry (``coconet.codegen.backends``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping


@dataclass(frozen=True)
class Machine:
    """What a backend asks of the machine it would run on: its architecture (``platform.machine()``) and its
    CUDA devices. The tuner reads them off this machine; a test may describe any other."""

    architecture: str
    gpus: int = 0


@dataclass(frozen=True)
class Backend:
    name: str
    # --- where it runs, and what it needs of the machine ---
    doc: str  # what a module's header says it runs on
    device: str  # the device of the step's tensors, as generated code spells it
    device_type: str  # "cpu" or "cuda": the device a rank must have
    process_group: str  # the torch.distributed backend the ranks' group is made with
    one_node: bool  # its ranks must share one node's memory
    notes: tuple[str, ...] = ()  # what a module's header adds about running it
    summary: str = ""  # the CLI's word on it after its name: "CPU tensors"
    # the architectures (platform.machine()) it runs on; empty: any
    architectures: frozenset[str] = frozenset()
    # the version of the library its collectives run in, recorded with a measurement made on its device;
    # a function, so that only a measurement imports what reads it (torch)
    version: Callable[[], str] | None = None
    # --- how its collectives are lowered ---
    runtime: str = "torch"  # which of coconet.kernels' tables its modules import (coconet.codegen.runtime)
    # collectives computed by the ranks of one node in shared segments the step maps (_Shm.of): a fused
    # collective's reduction reads the peers' rows out of them, its gathers end at one barrier for all
    shared_memory: bool = False
    # --- what it can place ---
    gathers_into_state: bool = False  # an all_gather writes this rank's rows into every rank's copy of a state
    reads_in_place: bool = False  # a fused collective reads its input, or a held buffer, where it lies on every rank
    sums_in_kernel: bool = False  # a compiled chunk kernel reduces every rank's rows as it reads them
    writes_slots: bool = False  # a compiled chunk kernel writes a gathered value into this rank's slot
    native_chunks: bool = False  # a chunk kernel given in C, streaming its stores into the peers' copies
    # --- how it is priced ---
    per_element_dropout: bool = False  # a Philox call per element (CUDA), not per block of four (CPU)
    flattens_buckets: bool = False  # a bucket's coalesced collectives copy its buffers into one and back
    transfers: str = ""  # the backend that carries send/recv between pipeline stages: its own where empty
    # per collective, the algorithms it runs where a topology does not say (coconet.tuner.topology.ALGORITHMS
    # names them): a property of the library, which the cost model prices; a topology file may override them
    algorithms: Mapping[str, tuple[str, ...]] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        # read-only: a backend is a value every lowering and prediction shares
        object.__setattr__(self, "algorithms", MappingProxyType({op: tuple(a) for op, a in self.algorithms.items()}))

    @property
    def transport(self) -> str:
        """The backend whose point-to-point transfers this one's pipeline stages use."""
        return self.transfers or self.name

    def runs_on(self, machine: Machine, world: int) -> bool:
        """Whether ``machine`` can run ``world`` of its ranks: its architecture, and a CUDA device per rank
        where its tensors live on one."""
        if self.architectures and machine.architecture not in self.architectures:
            return False
        return self.device_type != "cuda" or machine.gpus >= world
