"""The backends a schedule is lowered for, as objects (``Backend``), and the registry that names them
(``Registry``). ``REGISTRY`` holds the backends coconet ships, one module each (``gloo``, ``nccl``, ``shm``);
``get(name)``, ``BACKENDS`` (their names) and ``DEFAULT`` read it. Code that chooses among backends asks the
registry for their facts (device, one node, the machine they need) and never compares names; a function
that chooses takes a ``Registry`` (``REGISTRY`` unless given), so that one built with another backend
(``REGISTRY.adding(...)``) is chosen from with no other change."""

from __future__ import annotations

from dataclasses import dataclass

from coconet.codegen.backends.base import Backend, Machine
from coconet.codegen.backends.gloo import GLOO
from coconet.codegen.backends.nccl import NCCL
from coconet.codegen.backends.shm import SHM
from coconet.errors import BackendError

__all__ = ["BACKENDS", "DEFAULT", "REGISTRY", "Backend", "Machine", "Registry", "get"]


@dataclass(frozen=True)
class Registry:
    """Backends by name, in the order they are listed to users and tried."""

    backends: tuple[Backend, ...]

    def __post_init__(self) -> None:
        names = [b.name for b in self.backends]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise BackendError(f"backend {', '.join(twice)} registered twice", kind="compile_error")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.backends)

    def get(self, name: str) -> Backend:
        """The backend called ``name``; a BackendError naming the known ones for any other."""
        for b in self.backends:
            if b.name == name:
                return b
        raise BackendError(f"unknown backend {name!r} (use {', '.join(self.names)})", kind="compile_error")

    def adding(self, *more: Backend) -> Registry:
        """This registry and ``more`` after its own."""
        return Registry(self.backends + more)

    def on(self, device_type: str) -> tuple[str, ...]:
        """The backends whose tensors live on ``device_type`` ("cpu", "cuda")."""
        return tuple(b.name for b in self.backends if b.device_type == device_type)

    def default(self, device_type: str) -> str:
        """The backend a step on ``device_type`` runs where none is named: the first on it."""
        found = self.on(device_type)
        if not found:
            raise BackendError(f"no backend runs on {device_type} tensors", kind="compile_error")
        return found[0]

    def device_of_group(self, process_group: str) -> str:
        """The device type of the backends that form a torch.distributed group of ``process_group`` (``"gloo"``:
        cpu); cpu for a group none of them forms."""
        devices = {b.device_type for b in self.backends if b.process_group == process_group}
        return devices.pop() if len(devices) == 1 else "cpu"

    def runnable(self, machine: Machine, world: int) -> tuple[str, ...]:
        """The backends ``machine`` runs ``world`` ranks on: those on CUDA tensors where it has a device per rank
        (CPU tensors would leave them idle), else those on CPU tensors that run on its architecture."""
        fits = [b for b in self.backends if b.runs_on(machine, world)]
        gpu = [b.name for b in fits if b.device_type == "cuda"]
        return tuple(gpu) if gpu else tuple(b.name for b in fits if b.device_type == "cpu")


REGISTRY = Registry((GLOO, NCCL, SHM))
BACKENDS = REGISTRY.names
DEFAULT = GLOO.name  # the backend where none is named: any CPU, one node or several


def get(name: str) -> Backend:
    """The backend called ``name`` in ``REGISTRY``; a BackendError naming the known ones for any other."""
    return REGISTRY.get(name)
