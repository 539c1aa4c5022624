"""gloo: CPU tensors, torch.distributed's collectives over gloo (TCP, or loopback on one node)."""

from coconet.codegen.backends.base import Backend

GLOO = Backend(
    name="gloo",
    doc="torch.distributed (gloo)",
    device="torch.device('cpu')",
    device_type="cpu",
    process_group="gloo",
    one_node=False,
    flattens_buckets=True,
)
