"""Hypothesis strategies: random but legal coconet programs.

Programs are grown through the DSL by drawing ops and operands at random and
keeping what the builder accepts, so every program the strategy yields passed
the same verification a user's program does, and the refused draws exercise
the error paths.
"""

from __future__ import annotations

import runpy
from pathlib import Path

from hypothesis import strategies as st

import coconet as cc
from coconet.errors import ProgramError

LAYOUTS = ["Local", "Replicated", "Sliced(0)", "Sliced(1)"]
SHAPES = [("N",), ("N", "M"), ("M",), ("2*N", "M"), ("M", "N")]
DTYPES = ["float32", "float64", "float16", "bfloat16"]
UNARY = [cc.sqrt, cc.exp, cc.abs, lambda x: -x, lambda x: cc.cast(x, "float64")]
BINARY = [lambda a, b: a + b, lambda a, b: a - b, lambda a, b: a * b, lambda a, b: a / b, cc.maximum, cc.minimum]


@st.composite
def programs(draw, max_ops: int = 12, collectives: bool = True, dtypes: bool = True):
    p = cc.Program("rand", dims=("N", "M"))
    pool = []
    n_inputs = draw(st.integers(1, 4))
    for i in range(n_inputs):
        shape = draw(st.sampled_from(SHAPES))
        layout = draw(st.sampled_from(LAYOUTS[:3] if len(shape) == 1 else LAYOUTS))
        dtype = draw(st.sampled_from(DTYPES)) if dtypes else "float32"
        pool.append(p.tensor(f"t{i}", shape, layout=layout, dtype=dtype))
    pool.extend(p.scalars("alpha beta"))
    for _ in range(draw(st.integers(1, max_ops))):
        kind = draw(
            st.sampled_from(["unary", "binary", "binary", "const", "where", "reduce", "coll", "matmul", "dropout"])
        )
        a = draw(st.sampled_from(pool))
        b = draw(st.sampled_from(pool))
        try:
            if kind == "unary":
                e = draw(st.sampled_from(UNARY))(a)
            elif kind == "binary":
                e = draw(st.sampled_from(BINARY))(a, b)
            elif kind == "const":
                e = a * draw(st.sampled_from([0.5, 2, 1.5]))
            elif kind == "where":
                e = cc.where(a > b, a, b)
            elif kind == "reduce":
                e = draw(st.sampled_from([cc.norm, cc.sum]))(a) * b
            elif kind == "coll" and collectives:
                e = draw(st.sampled_from([cc.allreduce, cc.reduce_scatter, cc.all_gather]))(a)
            elif kind == "matmul":
                e = cc.matmul(a, b)
            elif kind == "dropout":
                e = cc.dropout(a, 0.25, draw(st.integers(0, 2**40)))
            else:
                continue
        except ProgramError:
            continue
        pool.append(e)
    produced = pool[n_inputs + 2 :]
    targets = draw(st.lists(st.sampled_from(pool[:n_inputs]), unique_by=id, max_size=n_inputs))
    effects = 0
    for t in targets:
        for value in reversed(produced):
            try:
                p.update(t, value)
                effects += 1
                break
            except ProgramError:
                continue
    for i, value in enumerate(produced[-2:]):
        p.output(f"o{i}", value)
        effects += 1
    if not effects:
        p.output("o", pool[0] * 2.0)
    return p


POINTWISE_BINARY = BINARY + [lambda a, b: cc.where(a > b, a, b)]


@st.composite
def collective_programs(draw):
    """A random pointwise DAG around one or more allreduces, with updates of
    replicated state — the shape of an optimizer step or a layer epilogue."""
    two_d = draw(st.booleans())
    shape = ("N", "M") if two_d else ("N",)
    p = cc.Program("randc", dims=("N", "M"))
    pool, state = [], []
    if draw(st.booleans()) and two_d:
        x = p.tensor("x", ("N", "M"), layout=cc.Sliced(1))
        w = p.tensor("wt", ("M", "M"), layout=cc.Sliced(0))
        pool.append(cc.allreduce(cc.matmul(x, w)))
    scalars = list(p.scalars("a b"))
    # what each rank computes from its own before the reduction: the gradient scaled (predivided, unscaled),
    # added to those accumulated over earlier micro-batches (a Local state the step clears or refills)
    acc = p.tensor("acc", shape, layout=cc.Local) if draw(st.booleans()) else None
    grads = []
    for i in range(draw(st.integers(1, 2))):
        g = p.tensor(f"g{i}", shape, layout=cc.Local)
        grads.append(g)
        pre = draw(
            st.sampled_from(
                ["none", "none", "scale", "acc", "acc_scale"] if acc is not None else ["none", "none", "scale"]
            )
        )
        x = g + acc if pre.startswith("acc") else g
        op = draw(st.sampled_from(["sum", "sum", "avg", "max", "min"]))  # an amax, a minimum over ranks
        pool.append(cc.allreduce(draw(st.sampled_from(scalars)) * x if pre.endswith("scale") else x, op=op))
    if acc is not None:
        p.update(acc, draw(st.sampled_from([acc * 0.0, acc + grads[0], grads[-1] * 0.5])))
    for i in range(draw(st.integers(1, 3))):
        s = p.tensor(f"s{i}", shape, layout=cc.Replicated)
        pool.append(s)
        state.append(s)
    products = []
    if two_d and draw(st.booleans()):
        # per-row and per-column factors (Adafactor's factored moments, a per-channel scale): broadcast against
        # the rows a schedule cuts (the column factor whole on every rank, the row factor cut with them)
        for name, factor in (("rv", ("N", 1)), ("cv", (1, "M"))):
            t = p.tensor(name, factor, layout=cc.Replicated)
            pool.append(t)
            state.append(t)
    if two_d and draw(st.booleans()):
        # row or column sums (what feeds such factors) of reduced values: a product on the rows a rank holds,
        # or partial products of its rows and an allreduce
        products = [
            p.tensor("by_col", ("M", 1), layout=cc.Replicated),
            p.tensor("by_row", (1, "N"), layout=cc.Replicated),
        ]
    if draw(st.booleans()):
        # a 0-d state (a step counter, a loss scale): broadcast into the others, never sliced
        k = p.tensor("k", (), layout=cc.Replicated)
        pool.append(k)
        state.append(k)
    for _ in range(draw(st.integers(1, 10))):
        kind = draw(st.sampled_from(["bin", "bin", "scal", "unary", "norm", "drop"] + ["prod"] * 2 * bool(products)))
        x = draw(st.sampled_from(pool))
        y = draw(st.sampled_from(pool))
        if kind == "prod":
            full = [e for e in pool if e.shape == grads[0].shape]
            x = draw(st.sampled_from(full))
            prod = cc.matmul(x, products[0]) if draw(st.booleans()) else cc.matmul(products[1], x)
            pool.append(prod)  # a factor's new value, or broadcast into the next statement
            e = x / (prod * prod + 1.0)
        elif kind == "bin":
            e = draw(st.sampled_from(POINTWISE_BINARY))(x, y)
        elif kind == "scal":
            e = draw(st.sampled_from(scalars)) * x + draw(st.sampled_from([0.5, 1.0, 2.0]))
        elif kind == "unary":
            e = draw(st.sampled_from([cc.sqrt, cc.exp, cc.abs, lambda v: -v]))(x)
        elif kind == "norm":
            e = x / (draw(st.sampled_from([cc.norm, cc.sum]))(y) + 1.0)
        else:
            e = cc.dropout(x, 0.3, draw(st.integers(0, 2**31)))
        pool.append(e)
    state_ids = {id(s) for s in state}
    derived = [e for e in pool if id(e) not in state_ids]
    for s in draw(st.lists(st.sampled_from(state), unique_by=id, min_size=1, max_size=len(state))):
        # another state's value before the step too: states swapped, a moment kept from the step before
        values = [e for e in derived + [t for t in state if t is not s] if e.shape == s.shape]
        if not s.shape:
            values += [s + 1.0, s * draw(st.sampled_from(scalars)) + cc.norm(draw(st.sampled_from(pool)))]
        elif not values:  # a factor nothing of its shape was computed from
            values = [s * draw(st.sampled_from(scalars)) + cc.norm(draw(st.sampled_from(pool)))]
        p.update(s, draw(st.sampled_from(values)))
    if draw(st.booleans()):
        p.output("out", draw(st.sampled_from(pool)))  # a state's own value before the step too
    return p


def adam_over(tensors: int):
    """Adam over many tensors, each with its own allreduce: the program a model's parameter list makes, as
    benchmarks/space_scaling.py times it."""
    path = Path(__file__).parents[1] / "benchmarks" / "space_scaling.py"
    return runpy.run_path(str(path))["adam_over"](tensors)
