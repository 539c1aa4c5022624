"""shm: CPU tensors, the collectives computed by the ranks of one node in shared memory
(``coconet.kernels.shm``); a gloo group bootstraps it and carries send/recv."""

from coconet.codegen.backends.base import Backend

SHM = Backend(
    name="shm",
    doc="the shm backend (collectives in shared memory; a gloo group bootstraps it and carries send/recv)",
    device="torch.device('cpu')",
    device_type="cpu",
    process_group="gloo",
    one_node=True,
    notes=(
        "The group's ranks must share this node's memory: its first step maps their segments",
        "of /dev/shm (the files are gone once mapped). Its large copies compile a few lines of C",
        "with the system's C compiler when there is one.",
    ),
    summary="CPU tensors, collectives in shared memory",
    # its barriers rely on the x86 memory order (coconet.kernels.segments)
    architectures=frozenset({"x86_64", "AMD64"}),
    runtime="shm",
    shared_memory=True,
    gathers_into_state=True,
    reads_in_place=True,
    sums_in_kernel=True,
    writes_slots=True,
    native_chunks=True,
    transfers="gloo",
    # every rank reads and writes the segments itself: no rings, no trees
    algorithms={
        "allreduce": ("direct",),
        "reduce_scatter": ("direct",),
        "all_gather": ("direct",),
        "broadcast": ("direct",),
        "send": ("direct",),
    },
)
