"""The CoCoNet transformations, one module each (docs/architecture.md, "Packages and modules")."""

from coconet.schedules.transforms.as_slice import AsSlice
from coconet.schedules.transforms.base import Transform
from coconet.schedules.transforms.bucket import Bucket
from coconet.schedules.transforms.fuse import Fuse
from coconet.schedules.transforms.fuse_collective import FuseCollective
from coconet.schedules.transforms.overlap import Overlap
from coconet.schedules.transforms.reorder import Reorder
from coconet.schedules.transforms.slice_reduce import SliceReduce
from coconet.schedules.transforms.slice_send import SliceSend
from coconet.schedules.transforms.split import Split

# Rewrites first, then groupings: the order the space generator tries them in.
TRANSFORMS: tuple[type[Transform], ...] = (
    Split,
    Reorder,
    AsSlice,
    SliceSend,
    SliceReduce,
    Fuse,
    FuseCollective,
    Overlap,
    Bucket,
)
BY_NAME: dict[str, type[Transform]] = {t.name: t for t in TRANSFORMS}

__all__ = [
    "AsSlice",
    "BY_NAME",
    "Bucket",
    "Fuse",
    "FuseCollective",
    "Overlap",
    "Reorder",
    "SliceReduce",
    "SliceSend",
    "Split",
    "TRANSFORMS",
    "Transform",
]
