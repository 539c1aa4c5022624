"""What a chunk kernel computes (``ChunkKernel``), and the tables its C is written from: each op's C per element and
per 8-wide vector, the powers, comparisons and reductions translated, the half-precision dtypes and the kinds of
parameter (``coconet.kernels.native`` writes the C; ``coconet.kernels.copier`` compiles and calls it)."""

from __future__ import annotations

from dataclasses import dataclass

# op -> C over operand texts (each a name or a load: free to repeat), per element and per 8-wide vector.
# maximum and minimum propagate NaN as torch's do.
OPS = {
    "add": ("({0} + {1})", "({0} + {1})"),
    "sub": ("({0} - {1})", "({0} - {1})"),
    "mul": ("({0} * {1})", "({0} * {1})"),
    "div": ("({0} / {1})", "({0} / {1})"),
    "neg": ("(-{0})", "(-{0})"),
    "sqrt": ("sqrtf({0})", "vsqrt({0})"),
    "rsqrt": ("(1.0f / sqrtf({0}))", "(1.0f / vsqrt({0}))"),
    "abs": ("fabsf({0})", "vabs({0})"),
    "maximum": ("(({0} > {1} || {0} != {0}) ? {0} : {1})", "vmax({0}, {1})"),
    "minimum": ("(({0} < {1} || {0} != {0}) ? {0} : {1})", "vmin({0}, {1})"),
    "slice": ("{0}", "{0}"),  # a chunk's rows of a replicated value are its rows of the slice
}
# a host number divided by a tensor: torch's Tensor.__rtruediv__ multiplies the number by the tensor's
# reciprocal (eager and compiled alike), an ulp from the quotient at times
RDIV = ("((1.0f / {1}) * {0})", "((1.0f / {1}) * {0})")
# x ** c for a constant c: what torch computes for these (ATen's pow of a tensor and a number multiplies,
# divides or takes a square root), on one operand text. Any other exponent keeps Inductor's kernel.
POWERS = {
    0.0: ("1.0f", "((v8){{0}} + 1.0f)"),
    1.0: ("{0}", "{0}"),
    2.0: ("({0} * {0})", "({0} * {0})"),
    3.0: ("(({0} * {0}) * {0})", "(({0} * {0}) * {0})"),
    -1.0: ("(1.0f / {0})", "(1.0f / {0})"),
    -2.0: ("(1.0f / ({0} * {0}))", "(1.0f / ({0} * {0}))"),
    0.5: OPS["sqrt"],
    -0.5: OPS["rsqrt"],
}
# comparisons: a mask, an int per element (0 or 1) and a v8i per vector (0 or -1), as GCC's vector compares give
COMPARE = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
# host-number arithmetic (constants and int scalars), in double as Python computes it: the per-element forms
NUMBER_OPS = {op: OPS[op][0] for op in ("add", "sub", "mul", "div", "neg")}
# a reduction over ranks -> the op combining a running total with the next rank's rows (avg: a sum, divided after)
REDUCE = {"sum": OPS["add"], "avg": OPS["add"], "prod": OPS["mul"], "max": OPS["maximum"], "min": OPS["minimum"]}

LINE = 16  # float32 values per 64-byte cache line

# the half-precision dtypes, by the name their C helpers take (ld_bf16, round_f16, …): a value of one is held as
# the float32 it widens to
HALF = {"bfloat16": "bf16", "float16": "f16"}
# by half tag; a float32 kind has none (half() gives None), which a lookup with a default takes
DTYPE: dict[str | None, str] = {tag: dtype for dtype, tag in HALF.items()}

KINDS = {
    "dim": "d",
    "scalar": "s",
    "rows": "t",
    "parts": "l",
    "bf16 parts": "h",
    "peers": "p",
    "rank numbers": "q",
    "bf16 rows": "u",
    "bf16 peers": "b",
    "f16 parts": "k",
    "f16 rows": "x",
    "f16 peers": "y",
    "row factor": "r",
    "column factor": "c",
}
FACTORS = ("row factor", "column factor")


def half(kind: str | None) -> str | None:
    """The half-precision tag of a kind (``bf16 rows`` -> ``bf16``); None for a float32 one."""
    tag = (kind or "").split(" ")[0]
    return tag if tag in DTYPE else None


def unhalved(kind: str | None) -> str | None:
    """A kind without its half-precision tag (``f16 peers`` -> ``peers``); a float32 kind as it is."""
    return kind.split(" ", 1)[1] if kind is not None and half(kind) else kind


def rounded(tag: str, x: str, vector: bool) -> str:
    """C text of ``x`` rounded to the half dtype ``tag`` (``bf16``, ``f16``) as torch casts it, kept as float32."""
    return f"{'vround' if vector else 'round'}_{tag}({x})"


@dataclass(frozen=True)
class ChunkKernel:
    """What a chunk computes, by the names of the Python kernel it stands in for.

    ``params``: (name, kind) in the Python kernel's order; kind is ``dim`` (unused here), ``scalar`` (a number or a
    one-element tensor), ``rows`` (the chunk's rows of a tensor), ``parts`` (the chunk's rows on every rank, summed;
    ``bf16 parts`` or ``f16 parts`` where they are bfloat16 or float16, which only casts to float32 read), ``rank
    numbers`` (see ``ranked``) or ``peers`` (the chunk's rows of every peer's copy of a state); ``bf16 rows`` and
    ``bf16 peers`` (``f16 …``) the same of a bfloat16 (float16) state, which only the values of casts to its dtype
    are stored into; ``row factor`` and ``column factor`` an (m, 1) and a (1, w) float32 tensor broadcast to the
    chunk's (m, w) rows (Adafactor's second moment, factored), which the chunk then takes a row at a time, w given
    after the lists' counts. ``parts``: (the value they sum to, their parameter, ``sum`` or ``avg``). ``stmts``:
    (name, op, operands, constant) in order. ``numbers``: the statements that are host numbers. ``writes``: (rows
    parameter, value stored into it). ``streams``: (peers parameter, value stored into each). ``sums``: (name,
    value): the chunk's sum of each value over its rows (a partial sum), returned in order. ``constants``: (scalar
    parameter, value) for the scalars that are the program's constants (a power's exponent is compiled in).
    ``host``: the scalar parameters that the Python kernel is given as Python numbers, not tensors (a constant,
    arithmetic of constants), which torch divides by a tensor otherwise (see RDIV). A comparison is a mask that only
    ``where`` and a ``cast`` to float32 (its constant the dtype) read; a scalar may be a mask that ``where`` reads
    (a bool passed in, as 1 or 0: whether a loss scaler found an overflow). ``pre``: statements computed on each
    rank's rows before they are summed, the rows named ``part``; the last is the value summed. ``also``: (name,
    parts parameter) for rows of other inputs ``pre`` reads alongside, rank by rank (a gradient and the sum of the
    earlier micro-batches' gradients).
    ``ranked``: (number, its ``rank numbers`` parameter: every rank's, a float32 each in the order of the
    parts) for the numbers ``pre`` reads that each rank holds its own of."""

    params: tuple[tuple[str, str], ...]
    parts: tuple[str, str, str] | None
    stmts: tuple[tuple[str, str, tuple[str, ...], object], ...]
    numbers: frozenset[str]
    writes: tuple[tuple[str, str], ...]
    streams: tuple[tuple[str, str], ...]
    sums: tuple[tuple[str, str], ...] = ()
    constants: tuple[tuple[str, float], ...] = ()
    host: frozenset[str] = frozenset()
    pre: tuple[tuple[str, str, tuple[str, ...], object], ...] = ()
    part: str | None = None
    ranked: tuple[tuple[str, str], ...] = ()
    also: tuple[tuple[str, str], ...] = ()

    @property
    def kinds(self) -> str:
        return "".join(KINDS[k] for _, k in self.params)


class Untranslatable(ValueError):
    """The chunk has a statement the C kernel does not translate; Inductor's kernel serves."""


def literal(value) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Untranslatable(f"constant {value!r}")
    value = float(value)
    if value != value:
        return "NAN"
    if abs(value) == float("inf"):
        return "INFINITY" if value > 0 else "-INFINITY"
    return value.hex()
