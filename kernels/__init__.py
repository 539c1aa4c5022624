"""The runtime: what runs inside a rank when a generated step runs.

A module that ``coconet.codegen`` generates holds its program alone (its header, ``step`` and its kernels)
and imports what it calls from here, each name bound as ``_<name>`` so that it stays apart from the
program's own names:

- ``context``: where a rank stands (``Ctx``) and a chunk of its rows (``Chunk``);
- ``collectives``: torch.distributed collectives with uneven slices, their chunked and bucketed forms;
- ``shm``: the same collectives for the shm backend, in shared memory, with the fused collectives' parts;
  ``segments`` holds its shared segments and barrier, ``copier`` the native copies and C chunk kernels;
- ``compiled``: the wrapper that compiles a fused pointwise kernel with Inductor;
- ``dropout`` and ``philox``: dropout with the counter-based mask the reference interpreter draws;
- ``ops``: the matrix product, the L2 norm and the small helpers a step calls;
- ``cache``: the folder where what is built once per machine is kept.

These modules import torch and the standard library only, and each other by relative imports, so that a
copy of them next to a generated module (``coconet run --emit DIR --standalone``) runs with torch alone.
``native`` (C for a fused collective's chunk) and ``rng`` (masks for checks) serve the lowering and tests.
"""
