"""Hypothesis strategies: random but legal coconet programs.

Programs are grown through the DSL by drawing ops and operands at random and
keeping what the builder accepts, so every program the strategy yields passed
the same verification a user's program does, and the refused draws exercise
the error paths.
"""

from __future__ import annotations

from hypothesis import strategies as st

import coconet as cc
from coconet.errors import ProgramError

LAYOUTS = ["Local", "Replicated", "Sliced(0)", "Sliced(1)"]
SHAPES = [("N",), ("N", "M"), ("M",), ("2*N", "M"), ("M", "N")]
DTYPES = ["float32", "float64", "float16", "bfloat16"]
UNARY = [cc.sqrt, cc.exp, cc.abs, lambda x: -x, lambda x: cc.cast(x, "float64")]
BINARY = [
    lambda a, b: a + b,
    lambda a, b: a - b,
    lambda a, b: a * b,
    lambda a, b: a / b,
    cc.maximum,
    cc.minimum,
]


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
        kind = draw(st.sampled_from(["unary", "binary", "binary", "const", "where", "reduce", "coll", "matmul", "dropout"]))
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
    produced = pool[n_inputs + 2:]
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
