"""nccl: CUDA tensors, torch.distributed's collectives over NCCL."""

from coconet.codegen.backends.base import Backend

NCCL = Backend(
    name="nccl",
    doc="torch.distributed (nccl)",
    device="torch.device('cuda', torch.cuda.current_device())",
    device_type="cuda",
    process_group="nccl",
    one_node=False,
    per_element_dropout=True,
)
