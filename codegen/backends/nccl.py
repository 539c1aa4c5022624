"""nccl: CUDA tensors, torch.distributed's collectives over NCCL."""

from coconet.codegen.backends.base import Backend


def nccl_version() -> str:
    """The NCCL torch runs, as ``2.21.5``."""
    import torch  # seconds: only a measurement on CUDA asks

    return ".".join(map(str, torch.cuda.nccl.version()))


NCCL = Backend(
    name="nccl",
    doc="torch.distributed (nccl)",
    device="torch.device('cuda', torch.cuda.current_device())",
    device_type="cuda",
    process_group="nccl",
    one_node=False,
    summary="CUDA tensors",
    version=nccl_version,
    per_element_dropout=True,
    # NCCL picks the faster of ring and tree for an allreduce (its tuner models both)
    algorithms={
        "allreduce": ("ring", "tree"),
        "reduce_scatter": ("ring",),
        "all_gather": ("ring",),
        "broadcast": ("ring",),
        "send": ("direct",),
    },
)
