"""What a backend is to the lowering and the cost model (``Backend``): where a step's tensors live, which
runtime its collectives come from, which of the lowering's placements it can make, how its collectives
are priced, and what it needs of the machine. A new backend is one module of this package with one
``Backend`` and a line in its registry (``coconet.codegen.backends``)."""

from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def transport(self) -> str:
        """The backend whose point-to-point transfers this one's pipeline stages use."""
        return self.transfers or self.name
