"""The runtime that generated modules carry, under public names for code that runs it outside a generated
module: the tuner's calibration, roofline and bandwidth probes time the very helpers a generated step calls.

In ``prelude`` (torch.distributed) and ``shm`` (the shm backend) the helpers keep their ``_`` names: their text
is pasted into every generated module (``runtime_text``), where a leading ``_`` keeps them apart from the
program's own names (docs/architecture.md, "Known debts").
"""

from __future__ import annotations

from coconet.codegen import prelude, shm

Ctx = prelude._Ctx  # where a rank stands: group, rank, world, device (and the shm segments, on shm)
all_gather_into_tensor = prelude._AG  # torch.distributed's, under whichever name this torch gives it
reduce_scatter_tensor = prelude._RS
matmul = prelude._matmul
dropout_words = prelude._words  # the counter-based RNG's words for a slice of a dropout mask
dropped = prelude._dropped  # a value with the mask those words draw applied

Shm = shm._Shm  # a group's shared-memory segments
shm_allreduce = shm._allreduce
shm_reduce_scatter = shm._reduce_scatter
shm_all_gather = shm._all_gather
native_library = shm._native_library  # C compiled once per machine into coconet's cache, and loaded
