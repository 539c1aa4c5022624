"""Builds verified programs statement by statement (used by the DSL and by ``load``).

Every statement is checked as it is added — attributes by schema, operands by
the inference rules — so an error names the statement the user just wrote.
Two things the semantics leave implicit are made explicit here, once, for
both front ends: ``norm``/``sum`` of a Sliced value become a per-rank
``partial_sum`` and an ``allreduce``; ``update`` of Replicated state from a
Sliced value goes through an ``all_gather``; a ``slice`` of a value a rewrite
has sliced along the same dim is that value; ``matmul`` of Replicated ``a`` by
``b`` Sliced along its rows is this rank's columns of ``a`` times those rows, a
partial product, and an ``allreduce`` (and so is a ``tensordot`` with one operand
sliced along a contracted dim and the other whole); a batch of products with one
operand sliced along a batch dim and the other whole is the whole one's rows
along that dim (a ``slice``) by the sliced one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

from coconet.errors import ProgramError
from coconet.schedules import infer, linalg
from coconet.schedules.attrs import ARITY, REQ, SCHEMAS
from coconet.schedules.dims import IDENT, parse_dim
from coconet.schedules.ir import (
    BINARY,
    BUILTIN_OPS,
    COMPARE,
    CONVS,
    EFFECTS,
    MAX_DIMS,
    MAX_NAME,
    MAX_STATEMENTS,
    NORMALIZERS,
    PARTIAL_COLLECTIVE,
    REDUCE_KINDS,
    UNARY,
    Program,
    Stmt,
)
from coconet.schedules.types import Replicated, Sliced, TensorType, as_layout, float_dtype


class CustomSpec(Protocol):
    """What the builder reads of a custom op: ``coconet.schedules.custom.CustomOp``, which builds its
    statements through the DSL and so sits above this module."""

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def arity(self) -> int: ...

    @property
    def attrs(self) -> tuple[str, ...]: ...

    @property
    def infer(self) -> Callable[..., tuple[tuple, str]] | None: ...


PREFIX = {
    "allreduce": "ar",
    "reduce_scatter": "rs",
    "all_gather": "ag",
    "broadcast": "bc",
    "matmul": "mm",
    "tensordot": "td",
    "transpose": "tr",
    "conv1d": "conv",
    "conv2d": "conv",
    "dropout": "drop",
    "const": "c",
    "partial_sum": "psum",
    "slice": "sl",
    "send": "send",
}


@dataclass
class _Node:
    name: str
    op: str
    args: tuple[int, ...]
    attrs: tuple[tuple[str, Any], ...]
    type: TensorType | None


def typed_attrs(canon: tuple) -> tuple:
    """Attributes compared with their Python types: the literals 2 and 2.0 compare equal but promote differently."""
    return tuple((k, type(v), v) for k, v in canon)


def _inference_key(op: str, types: list, weak: list, canon: tuple) -> tuple:
    # typed literals: 2 and 2.0 compare equal but promote differently
    return (op, tuple(types), tuple((type(w), w) for w in weak), canon)


class Builder:
    """Mutable construction state; ``finish`` returns the immutable ``Program``."""

    def __init__(
        self, name: str, dims: tuple[str, ...] | list[str] = (), custom_ops: Mapping[str, CustomSpec] | None = None
    ):
        if not isinstance(name, str) or not IDENT.match(name) or len(name) > MAX_NAME:
            raise ProgramError(f"program name {name!r} must be an identifier of at most {MAX_NAME} characters")
        if isinstance(dims, str):
            dims = tuple(dims.replace(",", " ").split())
        dims = tuple(dims)
        if len(dims) > MAX_DIMS:
            raise ProgramError(f"program {name} declares {len(dims)} dims; at most {MAX_DIMS} are supported")
        for d in dims:
            if not isinstance(d, str) or not IDENT.match(d) or len(d) > MAX_NAME:
                raise ProgramError(f"program {name}: dim {d!r} must be an identifier", rule="dims are names")
        if len(set(dims)) != len(dims):
            raise ProgramError(f"program {name}: dims {dims} repeat a name", rule="dims are names")
        self.name = name
        self.dims = dims
        self.nodes: list[_Node] = []
        self.index: dict[str, int] = {}
        self.cons: dict[tuple, int] = {}
        self.counters: dict[str, int] = {}
        self.locations: dict[int, str] = {}
        self.updated: set[int] = set()
        self.custom_ops: dict[str, CustomSpec] = dict(custom_ops or {})
        self.used_ops: dict[str, CustomSpec] = {}
        self.reserved: set[str] = set()
        # (op, operand types, weak literals, attrs) -> type: inference is a function of these alone
        self.inferred: dict[tuple, TensorType | None] = {}

    # --- naming ---

    def _auto_name(self, op: str, attrs: dict) -> str:
        if op == "update":
            return self._fresh(f"upd_{self.nodes[attrs['__target']].name}")
        if op == "output":
            return self._fresh(attrs["name"] if attrs["name"] not in self.index else f"out_{attrs['name']}")
        prefix = PREFIX.get(op, op)
        if op in ("reduce", "partial_reduce"):  # named by kind: mean0, pmax0
            prefix = ("p" if op == "partial_reduce" else "") + attrs["op"]
        while True:
            k = self.counters.get(prefix, 0)
            self.counters[prefix] = k + 1
            name = f"{prefix}{k}"
            if name not in self.index and name not in self.reserved:
                return name

    def _fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self.index or name in self.reserved:
            name, k = f"{base}_{k}", k + 1
        return name

    def _peek_name(self, op: str, kind: Any = None) -> str:
        prefix = PREFIX.get(op, op)
        if op in ("reduce", "partial_reduce") and kind in REDUCE_KINDS:
            prefix = ("p" if op == "partial_reduce" else "") + kind
        k = self.counters.get(prefix, 0)
        while f"{prefix}{k}" in self.index or f"{prefix}{k}" in self.reserved:
            k += 1
        return f"{prefix}{k}"

    def rename(self, idx: int, new: str) -> None:
        new = self._check_name(new, None)
        old = self.nodes[idx].name
        if new == old:
            return
        if new in self.index:
            raise ProgramError(f"name {new!r} is already used by another statement", statement=old)
        if self.nodes[idx].op in ("input", "scalar", "recv"):
            raise ProgramError("inputs keep the name they were declared with", statement=old)
        del self.index[old]
        self.index[new] = idx
        self.nodes[idx].name = new

    def _check_name(self, name: str, op: str | None) -> str:
        if not isinstance(name, str) or not IDENT.match(name) or len(name) > MAX_NAME:
            raise ProgramError(f"statement name {name!r} must be an identifier of at most {MAX_NAME} characters", op=op)
        return name

    # --- adding statements ---

    def type_of(self, idx: int) -> TensorType:
        t = self.nodes[idx].type
        assert t is not None
        return t

    def add(
        self,
        op: str,
        args: tuple[int, ...] = (),
        attrs: Mapping[str, Any] | None = None,
        *,
        name: str | None = None,
        location: str | None = None,
    ) -> int:
        attrs = dict(attrs or {})
        label = name or self._peek_name(op, attrs.get("op"))
        return self._labelled(op, label, location, lambda: self._add(op, tuple(args), attrs, name, location, label))

    def add_verified(
        self,
        op: str,
        args: tuple[int, ...],
        canon: tuple,
        ty: TensorType,
        *,
        name: str | None = None,
        location: str | None = None,
    ) -> int:
        """A statement verified before with operands of these very types (a rewrite's copy of one it left
        alone): its canonical attributes and its type are taken as they are, not checked and inferred again,
        which made a schedule of a program with many tensors take seconds to apply."""

        def add() -> int:
            self._check_room(op, name)
            if op == "update":
                self._check_update_target(args[0])
            return self._append(
                op, args, canon, ty, name, location, self.custom_ops.get(op) if op not in BUILTIN_OPS else None
            )

        return self._labelled(op, name or self._peek_name(op), location, add)

    @staticmethod
    def _labelled(op: str, label: str, location: str | None, add) -> int:
        try:
            return add()
        except ProgramError as err:
            if err.statement is None:
                err.statement = label
                err.op = op
            if err.location is None:
                err.location = location
            raise

    def _check_room(self, op: str, name: str | None) -> None:
        if len(self.nodes) >= MAX_STATEMENTS:
            raise ProgramError(f"program has more than {MAX_STATEMENTS} statements", rule="program size")
        if name is not None:
            self._check_name(name, op)
            if name in self.index:
                raise ProgramError(f"name {name!r} is defined twice", rule="statement names are unique")

    def _add(
        self, op: str, args: tuple[int, ...], attrs: dict, name: str | None, location: str | None, label: str
    ) -> int:
        self._check_room(op, name)
        custom = self.custom_ops.get(op) if op not in BUILTIN_OPS else None
        if op not in BUILTIN_OPS and custom is None:
            raise ProgramError(
                f"unknown op {op!r}"
                + (" (a custom op must be passed to load via ops=...)" if op.isidentifier() else ""),
                rule="ops are the built-in ones or registered custom ops",
            )
        lo, hi = (custom.arity, custom.arity) if custom else ARITY[op]
        if not lo <= len(args) <= hi:
            want = str(lo) if lo == hi else f"{lo} or {hi}"
            raise ProgramError(f"{op} takes {want} operands, got {len(args)}", rule=f"arity of {op}")
        canon = self._check_attrs(op, attrs, custom)
        if op in ("reduce", "partial_reduce") or op in NORMALIZERS:
            canon = self._canonical_dim(op, args, canon)
        if op in ("transpose", "tensordot"):
            canon = self._canonical_dims(op, args, canon)

        # Semantics made explicit (see module docstring).
        if op == "slice" and isinstance(self.type_of(args[0]).layout, Sliced):
            x = self.type_of(args[0])
            if x.layout.dim == infer.normalize_dim(dict(canon)["dim"], x.ndim, label):
                return args[0]  # a rewrite sliced the value already: each rank holds its rows
        if op in ("sum", "norm") and isinstance(self.type_of(args[0]).layout, Sliced):
            x = args[0]
            if op == "norm":
                x = self.add("mul", (x, x), location=location)
            part = self.add("partial_sum", (x,), location=location)
            total = self.add("allreduce", (part,), {"op": "sum"}, location=location)
            return self.add("sqrt", (total,), location=location, name=name) if op == "norm" else total
        if op == "reduce" and self._over_slices(args[0], dict(canon).get("dim")):
            # each rank reduces its rows; the collective of the kind combines the partial results
            part = self.add("partial_reduce", args, dict(canon), location=location)
            kind = PARTIAL_COLLECTIVE[dict(canon)["op"]]
            return self.add("allreduce", (part,), {"op": kind}, location=location, name=name)
        if op in NORMALIZERS and self._over_slices(args[0], dict(canon)["dim"]):
            return self._normalize_slices(op, args[0], dict(canon)["dim"], name, location)
        if op == "matmul" and self._partial_product(args):
            # R×S(K): each rank multiplies its columns of a by its rows of b, and the partial products add up
            a = self.add("slice", (args[0],), {"dim": -1}, location=location)
            part = self.add("matmul", (a, args[1]), location=location)
            return self.add("allreduce", (part,), {"op": "sum"}, location=location)
        if op in ("matmul", "tensordot"):
            cut = linalg.whole_operand_cut(op, self.type_of(args[0]), self.type_of(args[1]), dict(canon))
            if cut is not None:
                # the whole operand's rows that pair with the slice: a batch dim's (the result stays sliced), a
                # contracted dim's (partial sums, which an allreduce adds up)
                whole, dim = cut
                part = self.add("slice", (args[whole],), {"dim": dim}, location=location)
                args = (part, args[1]) if whole == 0 else (args[0], part)
                if op == "tensordot":
                    part = self.add(op, args, dict(canon), location=location)
                    return self.add("allreduce", (part,), {"op": "sum"}, location=location, name=name)
        if op == "update":
            self._check_update_target(args[0])
            t, v = self.type_of(args[0]), self.type_of(args[1])
            if isinstance(t.layout, Replicated) and isinstance(v.layout, Sliced):
                args = (args[0], self.add("all_gather", (args[1],), location=location))

        key = _inference_key(op, [self.type_of(a) for a in args], [self._weak(a) for a in args], canon)
        if key in self.inferred:
            ty = self.inferred[key]
        else:
            ty = self.inferred[key] = self._infer(op, args, dict(canon), custom)
        return self._append(op, args, canon, ty, name, location, custom)

    def _append(
        self,
        op: str,
        args: tuple[int, ...],
        canon: tuple,
        ty: TensorType | None,
        name: str | None,
        location: str | None,
        custom: CustomSpec | None,
    ) -> int:
        key = None
        if op not in EFFECTS and op not in ("input", "scalar", "recv"):
            key = (op, args, typed_attrs(canon))
            if key in self.cons:
                return self.cons[key]
        if op == "update":
            self.updated.add(args[0])
        if op == "output":
            if any(n.op == "output" and dict(n.attrs)["name"] == canon_dict(canon)["name"] for n in self.nodes):
                raise ProgramError(
                    f"output {canon_dict(canon)['name']!r} is defined twice", rule="output names are unique"
                )
        if name is None:
            name = self._auto_name(op, {"__target": args[0] if args else None, **dict(canon)})
        idx = len(self.nodes)
        self.nodes.append(_Node(name, op, args, canon, ty))
        self.index[name] = idx
        if key is not None:
            self.cons[key] = idx
        if location:
            self.locations[idx] = location
        if custom is not None:
            self.used_ops[custom.name] = custom
        return idx

    def _check_attrs(self, op: str, attrs: dict, custom: CustomSpec | None) -> tuple[tuple[str, Any], ...]:
        if custom is not None:
            unknown = sorted(set(attrs) - set(custom.attrs))
            if unknown:
                raise ProgramError(f"unknown attributes {unknown} for custom op {op}", rule=f"attributes of {op}")
            for k, v in attrs.items():
                if not isinstance(v, (int, float, str, bool)):
                    raise ProgramError(f"attribute {k}={v!r} must be a number or a string", rule=f"attributes of {op}")
            return tuple(sorted(attrs.items()))
        schema = SCHEMAS.get(op, {})
        unknown = sorted(set(attrs) - set(schema))
        if unknown:
            raise ProgramError(
                f"unknown attributes {unknown} for {op}" + (f" (allowed: {sorted(schema)})" if schema else ""),
                rule=f"attributes of {op}",
            )
        out = {}
        for key, (check, default) in schema.items():
            if key not in attrs or attrs[key] is None:
                if default is REQ:
                    raise ProgramError(f"{op} needs attribute {key!r}", rule=f"attributes of {op}")
                if default is not None:
                    out[key] = default
                continue
            try:
                out[key] = check(attrs[key])
            except ValueError as e:
                raise ProgramError(f"attribute {key}: {e}", rule=f"attributes of {op}") from None
        return tuple(sorted(out.items()))

    def _canonical_dim(self, op: str, args: tuple[int, ...], canon: tuple) -> tuple:
        """The dim counted from the front, so ``sum(x, -1)`` and ``sum(x, 1)`` are one statement."""
        attrs = dict(canon)
        if attrs.get("dim") is None:
            return canon
        x = self.type_of(args[0])
        kind = attrs.get("op", op)
        attrs["dim"] = infer.dim_index(x, attrs["dim"], kind, self.nodes[args[0]].name)
        return tuple(sorted(attrs.items()))

    def _over_slices(self, x: int, dim: int | None) -> bool:
        layout = self.type_of(x).layout
        return isinstance(layout, Sliced) and (dim is None or layout.dim == dim)

    def _normalize_slices(self, op: str, x: int, dim: int, name: str | None, location: str | None) -> int:
        """softmax along the sliced dim: the dim's max and sum of exponentials are partial reductions that
        allreduces complete; the rest is pointwise on this rank's slice."""
        peak = self.add("reduce", (x,), {"op": "max", "dim": dim, "keepdim": True}, location=location)
        shifted = self.add("sub", (x, peak), location=location)
        e = self.add("exp", (shifted,), location=location)
        total = self.add("reduce", (e,), {"op": "sum", "dim": dim, "keepdim": True}, location=location)
        if op == "softmax":
            return self.add("div", (e, total), location=location, name=name)
        return self.add("sub", (shifted, self.add("log", (total,), location=location)), location=location, name=name)

    def _partial_product(self, args: tuple[int, ...]) -> bool:
        a, b = (self.type_of(x) for x in args)
        return (
            isinstance(a.layout, Replicated)
            and a.ndim >= 1
            and (b.ndim == 2 or (b.ndim == a.ndim and a.shape[:-2] == b.shape[:-2]))
            and b.layout == Sliced(b.ndim - 2)
            and a.shape[-1] == b.shape[-2]
            and "bool" not in (a.dtype, b.dtype)
        )

    def _canonical_dims(self, op: str, args: tuple[int, ...], canon: tuple) -> tuple:
        attrs = linalg.canonical_dims(
            op, [self.type_of(a) for a in args], dict(canon), [self.nodes[a].name for a in args]
        )
        return tuple(sorted(attrs.items()))

    def _check_update_target(self, target: int) -> None:
        node = self.nodes[target]
        if node.op not in ("input", "scalar"):
            raise ProgramError(
                f"update target {node.name} is a {node.op}, not a tensor or scalar declared with p.tensor/p.scalar",
                rule="update(t, e): t is program state",
            )
        if target in self.updated:
            raise ProgramError(f"{node.name} is updated twice", rule="each state is updated at most once")

    def _weak(self, idx: int) -> Any:
        node = self.nodes[idx]
        return dict(node.attrs).get("value") if node.op == "const" else None

    def _infer(self, op: str, args: tuple[int, ...], attrs: dict, custom: CustomSpec | None) -> TensorType | None:
        types = [self.type_of(a) for a in args]
        names = [self.nodes[a].name for a in args]
        weak = [self._weak(a) for a in args]
        if op in ("input", "recv"):
            shape = tuple(parse_dim_checked(d, self.dims) for d in attrs["shape"])
            layout = as_layout(attrs["layout"])
            if isinstance(layout, Sliced):
                if not shape:
                    raise ProgramError("a scalar cannot be Sliced", rule="Sliced(dim) indexes the shape")
                dim = infer.normalize_dim(layout.dim, len(shape), "the tensor")
                layout = Sliced(dim)
            return TensorType(shape, attrs["dtype"], layout)
        if op == "scalar":
            return TensorType((), attrs["dtype"], Replicated())
        if op == "const":
            return TensorType((), None, Replicated())
        if custom is not None:
            return self._infer_custom(custom, types, names, weak, attrs)
        if op == "cast":
            return infer.cast(types[0], attrs["dtype"])
        if op in UNARY or op in BINARY or op in COMPARE or op == "where":
            return infer.pointwise(types, names, weak, op)
        if op == "dropout":
            if len(args) == 1 and "seed" not in attrs:
                raise ProgramError("dropout needs a seed: an int or an int64 scalar", rule="dropout(x, p, seed)")
            if len(args) == 2 and "seed" in attrs:
                raise ProgramError("dropout has both a seed operand and a seed attribute", rule="dropout(x, p, seed)")
            return infer.dropout(types[0], names, types[1] if len(types) > 1 else None)
        if op in ("sum", "norm", "partial_sum"):
            return infer.reduction(types[0], op, names)
        if op in ("reduce", "partial_reduce"):
            return infer.reduce_dim(
                types[0], attrs["op"], attrs.get("dim"), attrs["keepdim"], names, partial=op == "partial_reduce"
            )
        if op in NORMALIZERS:
            return infer.normalize(types[0], op, attrs["dim"], names)
        if op == "matmul" and types[1].ndim >= 3:
            return linalg.batched_matmul(types[0], types[1], names)
        if op == "matmul":
            return infer.matmul(types[0], types[1], names)
        if op == "tensordot":
            return linalg.tensordot(types[0], types[1], attrs["dims"], names)
        if op == "transpose":
            return linalg.transpose(types[0], attrs["dim0"], attrs["dim1"])
        if op in CONVS:
            return infer.conv(types[0], types[1], op, attrs, names)
        if op == "allreduce":
            return infer.allreduce(types[0], names)
        if op == "reduce_scatter":
            return infer.reduce_scatter(types[0], attrs["dim"], names)
        if op == "all_gather":
            return infer.all_gather(types[0], names)
        if op == "broadcast":
            return infer.broadcast(types[0], names)
        if op == "slice":
            return infer.slice_view(types[0], attrs["dim"], names)
        if op == "update":
            infer.update(types[0], types[1], names)
            return None
        if op in ("output", "send"):
            if op == "send" and not types[0].shape:
                raise ProgramError("send of a scalar; pipeline stages exchange tensors", rule="send(x: tensor)")
            return None
        raise AssertionError(op)

    def _infer_custom(self, custom: CustomSpec, types, names, weak, attrs) -> TensorType:
        if custom.kind == "pointwise":
            return infer.pointwise(types, names, weak, custom.name)
        for n, t in zip(names, types):
            if isinstance(t.layout, Sliced):
                raise ProgramError(
                    f"custom op {custom.name} is 'local' and cannot take Sliced {n}",
                    rule="local custom ops take Replicated or Local operands",
                )
        try:
            shape, dtype = custom.infer(types, attrs)
            shape = tuple(parse_dim_checked(d, self.dims) for d in shape)
            dtype = float_dtype(dtype)
        except ProgramError:
            raise
        except Exception as e:  # a user's rule failing is the user's error, reported as such
            raise ProgramError(
                f"the infer rule of custom op {custom.name} failed: {e}", rule=f"{custom.name}.infer"
            ) from None
        layout = infer.pointwise_layout(types, shape, names) if types else Replicated()
        return TensorType(shape, dtype, layout)

    # --- finishing ---

    def reserve(self, names) -> None:
        """Keep auto-naming off ``names`` (a rewrite copies them in later)."""
        self.reserved = set(names)

    def finish(self, groups: tuple = ()) -> Program:
        live = [False] * len(self.nodes)
        for i in range(len(self.nodes) - 1, -1, -1):
            n = self.nodes[i]
            if n.op in EFFECTS or n.op in ("input", "scalar", "recv"):
                live[i] = True
            if live[i]:
                for a in n.args:
                    live[a] = True
        if not any(n.op in EFFECTS for n in self.nodes):
            raise ProgramError(
                f"program {self.name} has no effect: add p.update(...), p.output(...) or send(...)",
                rule="a program updates state, outputs or sends",
            )
        self._check_channels()
        stmts = []
        locations = {}
        for i, n in enumerate(self.nodes):
            if not live[i]:
                continue
            stmts.append(Stmt(n.name, n.op, tuple(self.nodes[a].name for a in n.args), n.attrs, n.type))
            if i in self.locations:
                locations[n.name] = self.locations[i]
        return Program(
            self.name, self.dims, tuple(stmts), tuple(groups), custom_ops=dict(self.used_ops), locations=locations
        )

    def _check_channels(self) -> None:
        """A recv and the send of the same tag carry the same type: stage s+1 receives what stage s sent."""
        sends = {dict(n.attrs)["tag"]: n for n in self.nodes if n.op == "send"}
        for n in self.nodes:
            if n.op != "recv":
                continue
            tag = dict(n.attrs)["tag"]
            if sends.get(tag) is None:
                continue
            sent = self.type_of(sends[tag].args[0])
            if (sent.shape, sent.dtype, sent.layout) != (n.type.shape, n.type.dtype, n.type.layout):
                raise ProgramError(
                    f"receives {n.type} on tag {tag!r} but the stage sends {sent}",
                    statement=n.name,
                    op="recv",
                    rule="recv and send of one tag carry one type",
                    location=self.locations.get(self.index[n.name]),
                )
        tags = [dict(n.attrs)["tag"] for n in self.nodes if n.op == "send"]
        if len(tags) != len(set(tags)):
            raise ProgramError(f"two sends use one tag ({tags})", rule="one send per tag")


def canon_dict(attrs: tuple[tuple[str, Any], ...]) -> dict:
    return dict(attrs)


def parse_dim_checked(spec: Any, dims: tuple[str, ...]):
    try:
        return parse_dim(spec, dims)
    except ValueError as e:
        raise ProgramError(str(e), rule="shapes use the program's dims") from None
