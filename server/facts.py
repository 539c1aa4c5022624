"""What the API's requests need to know of a program, read from the store once, and the checks of the sizes a
request gives against it."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from fastapi import HTTPException

from coconet.codegen.baselines import shardable_text
from coconet.errors import CoconetError, SizeError
from coconet.schedules.dims import parse_sizes
from coconet.schedules.ir import Program
from coconet.schedules.serialize import load
from coconet.server.schemas import MAX_DIMS, MAX_SIZE
from coconet.server.store import Store


@dataclass(frozen=True)
class Facts:
    """What requests about a program need to know of it."""

    program: Program
    default_shardable: str

    @property
    def name(self) -> str:
        return self.program.name

    @property
    def dims(self) -> tuple[str, ...]:
        return tuple(self.program.dims)

    def shardable(self, names: list[str] | None) -> str:
        """The text of what a request lets stay sharded: its names (``all`` for every one), else the default."""
        if names is None:
            return self.default_shardable
        try:
            return shardable_text(self.program, names)
        except CoconetError as e:
            raise HTTPException(422, str(e)) from None


class ProgramFacts:
    """Each program's facts by hash, read from the store once: a program's record never changes (its hash is its
    content), so nothing kept here goes stale. At most ``size`` programs, the oldest dropped first."""

    def __init__(self, store: Store, size: int = 4096) -> None:
        self._store, self._size = store, size
        self._known: dict[str, Facts] = {}
        self._lock = threading.Lock()

    def get(self, program_hash: str) -> Facts | None:
        found = self._known.get(program_hash)
        if found is None:
            record = self._store.program(program_hash)
            if record is None:
                return None
            prog = load(record.ir)
            found = Facts(prog, shardable_text(prog))
            with self._lock:
                if len(self._known) >= self._size:
                    self._known.pop(next(iter(self._known)))
                self._known[program_hash] = found
        return found


def request_sizes(spec: str) -> dict[str, int]:
    sizes = parse_sizes(spec)
    if len(sizes) > MAX_DIMS:
        raise SizeError(f"{len(sizes)} sizes given; at most {MAX_DIMS} dims are accepted")
    return sizes


def check_dims(name: str, dims: tuple[str, ...], sizes: dict[str, int]) -> None:
    extra = sorted(set(sizes) - set(dims))
    missing = [d for d in dims if d not in sizes]
    if extra or missing:
        why = [f"no size for {', '.join(missing)}"] if missing else []
        why += [f"{', '.join(extra)} {'is' if len(extra) == 1 else 'are'} not among them"] if extra else []
        raise SizeError(f"program {name} has dims {', '.join(dims) or 'none'}: {'; '.join(why)}")
    for k, v in sizes.items():
        if not 1 <= v <= MAX_SIZE:
            raise SizeError(f"size {k}={v} is outside 1..2^40")
