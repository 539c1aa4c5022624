"""gloo: CPU tensors, torch.distributed's collectives over gloo (TCP, or loopback on one node)."""

from coconet.codegen.backends.base import Backend

GLOO = Backend(
    name="gloo",
    doc="torch.distributed (gloo)",
    device="torch.device('cpu')",
    device_type="cpu",
    process_group="gloo",
    one_node=False,
    summary="CPU tensors",
    flattens_buckets=True,
    # gloo runs rings, broadcasts from the root to each peer, and runs reduce_scatter_tensor as an allreduce
    # of the whole buffer of which each rank keeps its rows (a profile of a gloo reduce_scatter shows one
    # gloo:all_reduce)
    algorithms={
        "allreduce": ("ring",),
        "reduce_scatter": ("allreduce",),
        "all_gather": ("ring",),
        "broadcast": ("direct",),
        "send": ("direct",),
    },
)
