"""Inference rules of the products beyond a matrix by a matrix, and of ``transpose``: a batch of products
(``matmul`` of (..., M, K) by (..., K, N)), a contraction over any dims (``tensordot``), a swap of two dims.
The table of docs/dsl.md, "Layouts"; each rule returns the result type or raises ``ProgramError`` naming it.

Attention under Megatron-LM's tensor parallelism slices the heads: ``q @ k^T`` and ``probs @ v`` are batches
of products sliced along the batch, and the row-parallel output projection contracts each rank's heads (and
the head dim) with its rows of the weight, a partial sum.
"""

from __future__ import annotations

from typing import Sequence

from coconet.errors import ProgramError
from coconet.schedules.infer import dim_index, need_numbers, operands_text
from coconet.schedules.types import Layout, Local, Replicated, Sliced, TensorType, promote

BATCHED_RULES = "R×R→R, L×R→L, S(i)×S(i)→S(i) for a batch dim i, S(M)×R→S(M), R×S(N)→S(N), S(K)×S(K)→L"
TENSORDOT_RULES = (
    "R×R→R, L×R→L, R×L→L, S(a free dim)×R and R×S(a free dim)→S(its place in the result), "
    "S(c)×S(c') for a contracted pair (c, c')→L"
)


def batched_matmul(a: TensorType, b: TensorType, names: Sequence[str]) -> TensorType:
    """a (..., M, K) by b (..., K, N), both with the same batch dims (b has 3 dims or more; a matrix b is
    ``infer.matmul``'s). Layouts: R×R→R · L×R→L · S(i)×S(i)→S(i) for a batch dim i · S(M)×R→S(M) ·
    R×S(N)→S(N) · S(K)×S(K)→L. The builder writes S(i)×R and R×S(i) along a batch dim as the whole operand's
    rows along i (a slice) by the sliced one, and R×S(K) as a's columns (a slice) by b's rows and an
    allreduce, so those never arrive here."""
    rule = "matmul shapes (..., M, K) x (..., K, N), equal batch dims"
    if a.ndim != b.ndim:
        raise ProgramError(
            f"matmul({operands_text(names, (a, b))}): a batch of products needs a and b with the same dims; b has "
            f"{b.ndim}, a {a.ndim} (a matrix b (K, N) multiplies any a)",
            rule=rule,
        )
    if a.shape[:-2] != b.shape[:-2]:
        raise ProgramError(
            f"batch dims differ: {names[0]}{a.shape_text()} and {names[1]}{b.shape_text()} (no broadcasting)", rule=rule
        )
    if a.shape[-1] != b.shape[-2]:
        raise ProgramError(
            f"contracted dims differ: {names[0]}{a.shape_text()} and {names[1]}{b.shape_text()}", rule=rule
        )
    need_numbers("matmul", (a, b), names)
    n = a.ndim
    la, lb = a.layout, b.layout
    layout: Layout | None = None
    if isinstance(la, (Replicated, Local)) and isinstance(lb, Replicated):
        layout = la
    elif isinstance(la, Sliced) and la == lb and la.dim < n - 2:
        layout = la
    elif isinstance(la, Sliced) and la.dim == n - 2 and isinstance(lb, Replicated):
        layout = la
    elif isinstance(la, Replicated) and lb == Sliced(n - 1):
        layout = lb
    elif la == Sliced(n - 1) and lb == Sliced(n - 2):
        layout = Local()
    if layout is None:
        raise ProgramError(
            f"no batched matmul rule for {la} x {lb} ({operands_text(names, (a, b))}); allowed: {BATCHED_RULES}, and "
            "S(i)×R, R×S(i) for a batch dim i and R×S(K) (the builder slices the whole operand)",
            rule="matmul layouts (batched)",
        )
    shape = a.shape[:-1] + (b.shape[-1],)
    return TensorType(shape, promote([(a, None), (b, None)]), layout)


def transpose(x: TensorType, dim0: int, dim1: int) -> TensorType:
    """``x`` with dims ``dim0`` and ``dim1`` (counted from the front) swapped; a Sliced dim moves with them."""
    shape = list(x.shape)
    shape[dim0], shape[dim1] = shape[dim1], shape[dim0]
    layout = x.layout
    if isinstance(layout, Sliced):
        layout = Sliced({dim0: dim1, dim1: dim0}.get(layout.dim, layout.dim))
    return TensorType(tuple(shape), x.dtype, layout)


def tensordot(a: TensorType, b: TensorType, dims: tuple[tuple[int, ...], tuple[int, ...]], names: Sequence[str]):
    """a and b contracted over the pairs of ``dims`` (a's, b's; counted from the front); the result's dims are
    a's free dims then b's. Layouts: R×R→R · L×R→L · R×L→L · S(i)×R→S(i's place) for a free dim i of a ·
    R×S(j)→S(len(a's free) + j's place) for a free dim j of b · S(c)×S(c')→L for a contracted pair (c, c'),
    each rank's share of the sum. The builder writes S(c)×R (and R×S(c')) as the whole operand's rows along
    the pair's other dim (a slice), the partial sums and an allreduce, so those never arrive here."""
    da, db = dims
    rule = "tensordot(a, b, dims): dims pair equal extents"
    for ds, n in ((da, names[0]), (db, names[1])):
        if len(set(ds)) != len(ds):
            raise ProgramError(f"tensordot contracts a dim of {n} twice ({list(ds)})", rule=rule)
    for i, j in zip(da, db):
        if a.shape[i] != b.shape[j]:
            raise ProgramError(
                f"tensordot pairs dim {i} of {names[0]}{a.shape_text()} ({a.shape[i]}) with dim {j} of "
                f"{names[1]}{b.shape_text()} ({b.shape[j]})",
                rule=rule,
            )
    need_numbers("tensordot", (a, b), names)
    free_a = [i for i in range(a.ndim) if i not in da]
    free_b = [j for j in range(b.ndim) if j not in db]
    shape = tuple(a.shape[i] for i in free_a) + tuple(b.shape[j] for j in free_b)
    layout = _tensordot_layout(a, b, da, db, free_a, free_b)
    if layout is None:
        hint = ""
        if isinstance(a.layout, Sliced) and isinstance(b.layout, Sliced):
            hint = "; partial sums slice a and b along the same contracted pair"
        raise ProgramError(
            f"no tensordot rule for {a.layout} x {b.layout} over {list(da)}, {list(db)} "
            f"({operands_text(names, (a, b))}); "
            f"allowed: {TENSORDOT_RULES}" + hint,
            rule="tensordot layouts",
        )
    return TensorType(shape, promote([(a, None), (b, None)]), layout)


def _tensordot_layout(
    a: TensorType, b: TensorType, da: tuple[int, ...], db: tuple[int, ...], free_a: list[int], free_b: list[int]
) -> Layout | None:
    la, lb = a.layout, b.layout
    if isinstance(la, Replicated) and isinstance(lb, Replicated):
        return Replicated()
    if isinstance(la, Local) and isinstance(lb, Replicated) or isinstance(la, Replicated) and isinstance(lb, Local):
        return Local()
    if isinstance(la, Sliced) and isinstance(lb, Replicated) and la.dim in free_a:
        return Sliced(free_a.index(la.dim))
    if isinstance(la, Replicated) and isinstance(lb, Sliced) and lb.dim in free_b:
        return Sliced(len(free_a) + free_b.index(lb.dim))
    if isinstance(la, Sliced) and isinstance(lb, Sliced) and (la.dim, lb.dim) in zip(da, db):
        return Local()
    return None


def canonical_dims(op: str, types: Sequence[TensorType], attrs: dict, labels: Sequence[str]) -> dict:
    """transpose's two dims counted from the front, in order (a swap is symmetric); tensordot's dims as a
    pair of tuples of dims counted from the front."""
    attrs = dict(attrs)
    if op == "transpose":
        d0, d1 = (dim_index(types[0], attrs[k], op, labels[0]) for k in ("dim0", "dim1"))
        attrs["dim0"], attrs["dim1"] = min(d0, d1), max(d0, d1)
        return attrs
    a, b = types
    dims = attrs["dims"]
    if isinstance(dims, int):
        if dims > min(a.ndim, b.ndim):
            raise ProgramError(
                f"tensordot contracts {dims} dims but {labels[0]} has {a.ndim} and {labels[1]} {b.ndim}",
                rule="tensordot(a, b, dims): dims index the shapes",
            )
        dims = (tuple(range(a.ndim - dims, a.ndim)), tuple(range(dims)))
    attrs["dims"] = tuple(tuple(dim_index(t, d, op, n) for d in ds) for ds, t, n in zip(dims, (a, b), labels))
    return attrs


def whole_operand_cut(op: str, a: TensorType, b: TensorType, attrs: dict) -> tuple[int, int] | None:
    """A product with one operand sliced where the other is whole (Replicated) runs on the whole one's rows
    that pair with the slice: (the whole operand's index, 0 or 1; its dim to slice), else None. For a batch of
    products, along the sliced batch dim; for a tensordot, along the other dim of a sliced contracted pair."""
    if op == "matmul":
        return batch_slice(a, b)
    j = contracted_pair(a, b, attrs["dims"])
    return None if j is None else (0 if isinstance(a.layout, Replicated) else 1, j)


def contracted_pair(a: TensorType, b: TensorType, dims: tuple[tuple[int, ...], tuple[int, ...]]) -> int | None:
    """For a tensordot with one operand sliced along a contracted dim and the other whole (Replicated), the
    whole one's dim that pairs with it (the builder slices it there: partial sums), else None."""
    for i, j in zip(*dims):
        if isinstance(b.layout, Replicated) and a.layout == Sliced(i):
            return j
        if isinstance(a.layout, Replicated) and b.layout == Sliced(j):
            return i
    return None


def batch_slice(a: TensorType, b: TensorType) -> tuple[int, int] | None:
    """For a batch of products with one operand sliced along a batch dim and the other whole (Replicated):
    (the whole operand's index, 0 or 1; the dim), which the builder slices there, else None."""
    if a.ndim != b.ndim or a.ndim < 3 or a.shape[:-2] != b.shape[:-2]:
        return None
    for whole, (x, y) in enumerate(((b, a), (a, b))):
        if isinstance(x.layout, Sliced) and x.layout.dim < x.ndim - 2 and isinstance(y.layout, Replicated):
            return whole, x.layout.dim
    return None
