"""A fused collective's chunk as C: the pointwise statements, one pass over the chunk's rows, with this
rank's new rows of a gathered state stored into every peer's copy with non-temporal stores. A fuse
group that writes its rows into the peers' copies of a state (after a norm's allreduce, say) is one
chunk of this rank's rows.

Inductor's kernel stores into the peers' copies with ordinary stores, and an ordinary store to a line
that is not cached reads it first (read-for-ownership): at world 4, ZeRO-1 Adam's step then moves 16
words an element where it needs 13. Non-temporal stores skip that read, but only when they fill whole
64-byte lines back to back (a line left half-written in a write-combining buffer goes out as partial
writes): so the rows are computed a line (16 floats, two 8-wide vectors) at a time, and each line is
streamed whole into every peer. The vectors are GCC's vector extensions: the compiler lowers them to
whatever the machine has (-march=native), SSE at least.

Only float32 statements of the ``OPS`` table (IEEE operations the C compiler keeps as written: no
contraction into fused multiply-adds, no reassociation), powers by the constants of ``POWERS``,
comparisons and the ``where`` and ``cast`` that read them, and partial sums (summed in double) are
translated (and bfloat16 or float16 rows of every rank that a cast to float32 reads before they are summed,
the mixed-precision gradient; the rows of a bfloat16 or float16 state that a cast to float32 reads, moments
kept in half precision; and a cast to bfloat16 or float16 that is only stored, into a state of that
dtype and the peers' copies of it, the half-precision copy of the weights that mixed-precision training keeps
beside the float32 master, or into this rank's slot of the gather of a program output); anything else keeps
Inductor's kernel. float16 is converted as torch's vectorised cast converts it, by F16C where the machine
has it and by hand where it does not.
exp and log among them: in C (Cephes' polynomials, 16 floats a vector, fused multiply-adds) the chunk of an
Adam with a softplus (benchmarks/programs/sadam.py) stepped 1.10x Inductor's at world 2 and 0.99x at world
4, Sleef's exp and log winning back what the streamed stores save. A chunk is C only where it stores into
the peers' copies of a state or into a gather's slot: with neither, C and Inductor's kernel step alike.
The bits are those of Inductor's kernel, which the chunk stands in for, but for a power by -0.5 or -2:
here the reciprocal of the correctly rounded square root or square, as eager torch computes it, where
Inductor's kernel is at times an ulp from it. A host number divided by a tensor is the tensor's reciprocal
times the number, as both compute it (RDIV).
The generated module checks at each call that every tensor is a contiguous float32 CPU tensor (the
half-precision rows of their dtype) of the chunk's length and every scalar one number, and hands the call to
Inductor's kernel otherwise (a broadcast operand but a row or column factor's, a tensor that needs autograd).
"""

from __future__ import annotations

from dataclasses import dataclass

# op -> C over operand texts (each a name or a load: free to repeat), per element and per 8-wide vector.
# maximum and minimum propagate NaN as torch's do.
OPS = {
    "add": ("({0} + {1})", "({0} + {1})"), "sub": ("({0} - {1})", "({0} - {1})"),
    "mul": ("({0} * {1})", "({0} * {1})"), "div": ("({0} / {1})", "({0} / {1})"),
    "neg": ("(-{0})", "(-{0})"), "sqrt": ("sqrtf({0})", "vsqrt({0})"),
    "rsqrt": ("(1.0f / sqrtf({0}))", "(1.0f / vsqrt({0}))"), "abs": ("fabsf({0})", "vabs({0})"),
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
    0.0: ("1.0f", "((v8){{0}} + 1.0f)"), 1.0: ("{0}", "{0}"),
    2.0: ("({0} * {0})", "({0} * {0})"), 3.0: ("(({0} * {0}) * {0})", "(({0} * {0}) * {0})"),
    -1.0: ("(1.0f / {0})", "(1.0f / {0})"), -2.0: ("(1.0f / ({0} * {0}))", "(1.0f / ({0} * {0}))"),
    0.5: OPS["sqrt"], -0.5: OPS["rsqrt"],
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
DTYPE = {tag: dtype for dtype, tag in HALF.items()}

KINDS = {"dim": "d", "scalar": "s", "rows": "t", "parts": "l", "bf16 parts": "h", "peers": "p", "rank numbers": "q",
         "bf16 rows": "u", "bf16 peers": "b", "f16 parts": "k", "f16 rows": "x", "f16 peers": "y",
         "row factor": "r", "column factor": "c"}
FACTORS = ("row factor", "column factor")


def half(kind: str | None) -> str | None:
    """The half-precision tag of a kind (``bf16 rows`` -> ``bf16``); None for a float32 one."""
    tag = (kind or "").split(" ")[0]
    return tag if tag in DTYPE else None


def unhalved(kind: str | None) -> str | None:
    """A kind without its half-precision tag (``f16 peers`` -> ``peers``); a float32 kind as it is."""
    return kind.split(" ", 1)[1] if half(kind) else kind


def _rounded(tag: str, x: str, vector: bool) -> str:
    """C text of ``x`` rounded to the half dtype ``tag`` (``bf16``, ``f16``) as torch casts it, kept as float32."""
    return f"{'vround' if vector else 'round'}_{tag}({x})"


_PRELUDE = """#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));

static inline v8 ld(const float *p) { v8 x; memcpy(&x, p, sizeof x); return x; }
/* bfloat16 is float32's upper half: widened exactly, as torch casts it */
typedef unsigned short v8h __attribute__((vector_size(16)));
typedef unsigned int v8u __attribute__((vector_size(32)));
static inline float bf16(uint16_t x) { uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, sizeof f); return f; }
static inline v8 ld_bf16(const uint16_t *p) {
    v8h h; memcpy(&h, p, sizeof h); v8u u = __builtin_convertvector(h, v8u) << 16; return (v8)u;
}
static inline void st(float *p, v8 x) { memcpy(p, &x, sizeof x); }
/* x in every lane (as (v8){0} + x would not be for x = -0.0, which the sign of an infinity after may show) */
static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }
/* a cast to bfloat16 as torch rounds it (to nearest, ties to even; every NaN 0xffff), kept as the float32 it
   widens back to: stored, its upper half is the bfloat16 */
static inline float round_bf16(float x) {
    uint32_t u; memcpy(&u, &x, sizeof u);
    u = x != x ? 0xffff0000u : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    float f; memcpy(&f, &u, sizeof f); return f;
}
static inline v8 vround_bf16(v8 x) {
    v8u u = (v8u)x, nan = (v8u)(x != x);
    return (v8)((nan & 0xffff0000u) | (~nan & ((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u)));
}
static inline uint16_t bits_bf16(float x) { uint32_t u; memcpy(&u, &x, sizeof u); return (uint16_t)(u >> 16); }
static inline v8h vbits_bf16(v8 x) { return __builtin_convertvector((v8u)x >> 16, v8h); }
static inline void st_bf16(uint16_t *p, v8 x) { v8h h = vbits_bf16(x); memcpy(p, &h, sizeof h); }
static inline v8 vabs(v8 x) { return (v8)((v8i)x & 0x7fffffff); }
static inline v8 vsel(v8i m, v8 x, v8 y) { return (v8)(((v8i)x & m) | ((v8i)y & ~m)); }
static inline v8 vmax(v8 x, v8 y) { return vsel((x > y) | (x != x), x, y); }
static inline v8 vmin(v8 x, v8 y) { return vsel((x < y) | (x != x), x, y); }
/* a sum's running totals: four lanes of double, each taking two lanes of every vector summed, so that
   nothing is summed in float (to overflow or round) and the sum costs a few vector operations a line */
typedef float v4 __attribute__((vector_size(16)));
typedef double v4d __attribute__((vector_size(32)));
static inline v4d widen(v8 x) {
    v4 lo, hi; memcpy(&lo, &x, sizeof lo); memcpy(&hi, (const char *)&x + sizeof lo, sizeof hi);
    return __builtin_convertvector(lo, v4d) + __builtin_convertvector(hi, v4d);
}
static inline double hsum4(v4d x) { return (x[0] + x[1]) + (x[2] + x[3]); }
static inline v8 vsqrt(v8 x) {
#ifdef __AVX__
    return (v8)_mm256_sqrt_ps((__m256)x);
#else
    float t[8]; st(t, x); for (int q = 0; q < 8; q++) t[q] = sqrtf(t[q]); return ld(t);
#endif
}
/* one 64-byte line, its address aligned, past the cache */
static inline void stream_line(float *d, v8 x, v8 y) {
#ifdef __AVX__
    _mm256_stream_ps(d, (__m256)x); _mm256_stream_ps(d + 8, (__m256)y);
#else
    float t[16] __attribute__((aligned(64))); st(t, x); st(t + 8, y);
    for (int q = 0; q < 16; q += 4) _mm_stream_ps(d + q, _mm_load_ps(t + q));
#endif
}
"""

_F16 = """/* float16 as torch's vectorised cast has it (F16C's conversions): widened exactly, rounded to nearest,
   ties to even. Without F16C, by hand (FP16's fp16_ieee_{to,from}_fp32_value): the same bits but a NaN's payload */
#ifdef __F16C__
static inline float f16(uint16_t x) { return _cvtsh_ss(x); }
static inline uint16_t bits_f16(float x) { return (uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }
static inline v8 vwiden_f16(v8h h) { return (v8)_mm256_cvtph_ps((__m128i)h); }
static inline v8h vbits_f16(v8 x) { return (v8h)_mm256_cvtps_ph((__m256)x, _MM_FROUND_TO_NEAREST_INT); }
#else
static inline float f16(uint16_t x) {
    const uint32_t w = (uint32_t)x << 16, sign = w & 0x80000000u, two_w = w + w;
    uint32_t u = (two_w >> 4) + (0xe0u << 23); float normal; memcpy(&normal, &u, sizeof u); normal *= 0x1.0p-112f;
    u = (two_w >> 17) | (126u << 23); float subnormal; memcpy(&subnormal, &u, sizeof u); subnormal -= 0.5f;
    const float f = two_w < (1u << 27) ? subnormal : normal;
    memcpy(&u, &f, sizeof u); u |= sign; float r; memcpy(&r, &u, sizeof r); return r;
}
static inline uint16_t bits_f16(float x) {
    float base = (fabsf(x) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t w; memcpy(&w, &x, sizeof w);
    const uint32_t shl1 = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1 & 0xff000000u; if (bias < 0x71000000u) bias = 0x71000000u;
    bias = (bias >> 1) + 0x07800000u; float b; memcpy(&b, &bias, sizeof b); base = b + base;
    uint32_t bits; memcpy(&bits, &base, sizeof bits);
    return (uint16_t)((sign >> 16) | (shl1 > 0xff000000u ? 0x7e00u : ((bits >> 13) & 0x7c00u) + (bits & 0x0fffu)));
}
static inline v8 vwiden_f16(v8h h) { float t[8]; for (int q = 0; q < 8; q++) t[q] = f16(h[q]); return ld(t); }
static inline v8h vbits_f16(v8 x) {
    float t[8]; st(t, x); v8h h; for (int q = 0; q < 8; q++) h[q] = bits_f16(t[q]); return h;
}
#endif
static inline v8 ld_f16(const uint16_t *p) { v8h h; memcpy(&h, p, sizeof h); return vwiden_f16(h); }
static inline float round_f16(float x) { return f16(bits_f16(x)); }
static inline v8 vround_f16(v8 x) { return vwiden_f16(vbits_f16(x)); }
static inline void st_f16(uint16_t *p, v8 x) { v8h h = vbits_f16(x); memcpy(p, &h, sizeof h); }
"""

# one 64-byte line of 32 half-precision values, its address aligned, past the cache: four 16-byte streamed
# stores back to back fill the write-combining buffer whole
_HALF_LINE = """static inline void stream_line_TAG(uint16_t *d, v8 x, v8 y, v8 z, v8 w) {
    const v8h h[4] = {vbits_TAG(x), vbits_TAG(y), vbits_TAG(z), vbits_TAG(w)};
    for (int q = 0; q < 4; q++) _mm_stream_si128((__m128i *)d + q, (__m128i)h[q]);
}
"""


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


def _literal(value) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Untranslatable(f"constant {value!r}")
    value = float(value)
    if value != value:
        return "NAN"
    if abs(value) == float("inf"):
        return "INFINITY" if value > 0 else "-INFINITY"
    return value.hex()


def c_source(k: ChunkKernel) -> str:
    """The C text of ``k``: ``void coconet_chunk(long n, void **ptr, const long *count, const float *scal,
    double *sums)``, ``ptr`` the data of every rows, parts and peers tensor in parameter order, ``count`` the
    length of each list, ``scal`` the scalars in order, ``sums`` where the chunk's sums go. Program names
    become ``p_<name>`` (a program may name a value ``n``). Raises Untranslatable."""
    kind = dict(k.params)
    masks = {name for name, op, *_ in (*k.pre, *k.stmts) if op in COMPARE}
    # values of a half-precision dtype (casts to one, a sum of half rows): held as the float32 they widen to,
    # which arithmetic whose result is float32 reads exactly, as torch promotes them; stored only into tensors of
    # that dtype, never summed over the rows. (Arithmetic whose result stays half is the lowering's to refuse:
    # rounding every op as torch's half kernels do made C slower than Inductor's chunk, which rounds once.)
    halves = {name: value for name, op, _, value in k.stmts if op == "cast" and value in HALF}
    summed_half = half(kind.get(k.parts[1])) if k.parts and not k.pre else None
    if summed_half:  # half-precision rows summed as they are: the total is a value of that dtype too
        halves[k.parts[0]] = DTYPE[summed_half]
    values = {name for name, *_ in (*k.pre, *k.stmts)} | ({k.parts[0]} if k.parts else set())
    values |= ({k.part} if k.part else set()) | {name for name, _ in (*k.ranked, *k.also)}
    rows_of = ({k.part: k.parts[1]} if k.part and k.parts else {}) | dict(k.also)  # each input's parts
    tensors = values - k.numbers - masks
    # the values known here, for a power's exponent: the chunk's constants and those passed in as scalars
    known = [(name, value) for name, op, _, value in (*k.pre, *k.stmts) if op == "const"] + list(k.constants)
    constants = {name: float(value) for name, value in known
                 if isinstance(value, (int, float)) and not isinstance(value, bool)}

    def ref(name: str, vector: bool, stored: str | None = None) -> str:
        """``name``'s value as float32, read by arithmetic or (``stored``) stored as a tensor of that dtype."""
        if name in masks:
            raise Untranslatable(f"comparison {name} read as a number")
        held = halves.get(name) or DTYPE.get(half(kind.get(name)), "float32")
        if stored is not None and held != stored:
            raise Untranslatable(f"{name} ({held}) stored as {stored}")
        if name in k.numbers:
            return f"vn_{name}" if vector else f"((float)p_{name})"
        if name in tensors or kind.get(name) == "scalar":
            return f"p_{name}"
        if kind.get(name) == "rows":
            return f"ld(p_{name} + i)" if vector else f"p_{name}[i]"
        if kind.get(name) == "row factor":  # the value of the row, in every lane
            return f"splat(a->p_{name}[a->q])" if vector else f"a->p_{name}[a->q]"
        if kind.get(name) == "column factor":  # the row's columns from i on
            return f"ld(a->p_{name} + (i - a->c0))" if vector else f"a->p_{name}[i - a->c0]"
        if unhalved(kind.get(name)) == "rows":  # a half-precision state's rows, widened exactly as they load
            tag = half(kind[name])
            return f"ld_{tag}(p_{name} + i)" if vector else f"{tag}(p_{name}[i])"
        raise Untranslatable(f"operand {name}")

    def number_ref(name: str) -> str:
        if name in k.numbers:
            return f"p_{name}"
        raise Untranslatable(f"host number {name} of a tensor")

    fields, unpack, scalars, lists = [], [], 0, 0
    for name, what in k.params:
        if what == "scalar":
            fields.append(f"float p_{name};")
            unpack.append(f"a.p_{name} = scal[{scalars}];")
            scalars += 1
        elif unhalved(what) == "rows":
            element = "uint16_t" if half(what) else "float"
            fields.append(f"{element} *p_{name};")
            unpack.append(f"a.p_{name} = ({element} *)ptr[at++];")
        elif what == "rank numbers" or what in FACTORS:
            fields.append(f"const float *p_{name};")
            unpack.append(f"a.p_{name} = (const float *)ptr[at++];")
        elif unhalved(what) in ("parts", "peers"):
            element = ("const uint16_t" if unhalved(what) == "parts" else "uint16_t") if half(what) else "float"
            fields += [f"{element} *const *p_{name};", f"long n_{name};"]
            unpack.append(f"a.p_{name} = ({element} *const *)(ptr + at); a.n_{name} = count[{lists}]; "
                          f"at += count[{lists}];")
            lists += 1
    numbers = []
    for name, op, args, value in k.stmts:
        if name not in k.numbers:
            continue
        if op == "const":
            numbers.append(f"const double p_{name} = {_literal(value)};")
        elif op in NUMBER_OPS:
            numbers.append(f"const double p_{name} = {NUMBER_OPS[op].format(*map(number_ref, args))};")
        else:
            raise Untranslatable(f"{op} of host numbers")

    def statements(stmts, vector: bool) -> list[str]:
        t = "v8" if vector else "float"
        out = []
        for name, op, args, value in stmts:
            if name in k.numbers:
                continue
            if op == "const":
                lit = f"(float){_literal(value)}"
                expr = f"splat({lit})" if vector else lit
            elif op == "pow" and constants.get(args[1]) in POWERS and args[0] not in k.numbers:
                expr = POWERS[constants[args[1]]][vector].format(ref(args[0], vector))
            elif op == "div" and args[0] in k.numbers | k.host:
                expr = RDIV[vector].format(*(ref(x, vector) for x in args))
            elif op in OPS:
                expr = OPS[op][vector].format(*(ref(x, vector) for x in args))
            elif op in COMPARE:
                x, y = (ref(a, vector) for a in args)
                out.append(f"const {'v8i' if vector else 'int'} p_{name} = ({x} {COMPARE[op]} {y});")
                continue
            elif op == "where" and args[0] in masks:
                x, y = (ref(a, vector) for a in args[1:])
                expr = f"vsel(p_{args[0]}, {x}, {y})" if vector else f"(p_{args[0]} ? {x} : {y})"
            elif op == "where" and kind.get(args[0]) == "scalar":  # a mask passed in: one choice for every row
                x, y = (ref(a, vector) for a in args[1:])
                expr = f"(a->p_{args[0]} != 0.0f) ? {x} : {y}"
            elif op == "cast" and value == "float32" and args[0] in masks:
                one = "(v8){0} + 1.0f" if vector else "1.0f"
                expr = f"vsel(p_{args[0]}, {one}, (v8){{0}})" if vector else f"(p_{args[0]} ? {one} : 0.0f)"
            elif op == "cast" and value == "float32" and args[0] not in k.numbers:
                expr = ref(args[0], vector)  # float32 already, or a half widened exactly as it was loaded
            elif op == "cast" and value in HALF and args[0] not in k.numbers:
                expr = _rounded(HALF[value], ref(args[0], vector), vector)
            else:
                raise Untranslatable(op)
            out.append(f"const {t} p_{name} = {expr};")
        return out

    def body(vector: bool) -> list[str]:
        t = "v8" if vector else "float"
        out = [f"const {t} p_{n} = " + (f"splat(a->p_{n});" if vector else f"a->p_{n};")
               for n, what in k.params if what == "scalar"]
        out += [f"float *const p_{n} = a->p_{n};" for n, what in k.params if what == "rows"]
        out += [f"uint16_t *const p_{n} = a->p_{n};" for n, what in k.params if half(what) and unhalved(what) == "rows"]
        out += numbers
        if vector:
            out += [f"const v8 vn_{n} = splat((float)p_{n});" for n in sorted(k.numbers)]
        if k.parts is not None:
            total, plist, op = k.parts
            if unhalved(kind.get(plist)) != "parts" or op not in REDUCE:
                raise Untranslatable(f"parts {plist} ({op})")

            def rounded(x: str) -> str:
                # torch's half-precision add (mul, div) rounds each result to its dtype: so does the sum here,
                # computed in float32 first (exact, or rounded twice to the same value: 24 >= 2 * 11 + 2 bits)
                return _rounded(summed_half, x, vector) if summed_half else x

            def combine(x: str) -> str:  # p_total <- p_total (op) x, in the order torch reduces them
                combined = REDUCE[op][vector].format(f'p_{total}', x)
                return f"p_{total} = {combined if op in ('max', 'min') else rounded(combined)};"

            def load(param: str, rank: str) -> str:
                tag = half(kind.get(param))
                if tag and unhalved(kind[param]) == "parts":  # widened exactly: summed as they are, or (pre) read
                    if k.pre:  # only through casts to float32
                        name = next((x for x, q in rows_of.items() if q == param), None)
                        if name is None or any(name in args and (op != "cast" or value != "float32")
                                               for _, op, args, value in k.pre):
                            raise Untranslatable(f"{DTYPE[tag]} rows {param} read but by a cast to float32")
                    return f"ld_{tag}(a->p_{param}[{rank}] + i)" if vector else f"{tag}(a->p_{param}[{rank}][i])"
                if kind.get(param) != "parts":
                    raise Untranslatable(f"rows {param} of every rank not passed as such")
                return f"ld(a->p_{param}[{rank}] + i)" if vector else f"a->p_{param}[{rank}][i]"

            if k.pre:  # each rank's rows of the value summed, from its rows of the inputs: summed in rank order
                if any(kind.get(param) != "rank numbers" for _, param in k.ranked):
                    raise Untranslatable("numbers of every rank not passed as such")
                each = [f"const {t} p_{x} = {load(param, 'r')};" for x, param in rows_of.items()]
                each += [f"const {t} p_{x} = " + (f"splat(a->p_{param}[r]);" if vector else f"a->p_{param}[r];")
                         for x, param in k.ranked]
                each += statements(k.pre, vector)
                out += [f"{t} p_{total};", f"for (long r = 0; r < a->n_{plist}; r++) {{",
                        *("    " + x for x in each),
                        f"    if (r == 0) p_{total} = p_{k.pre[-1][0]}; else {combine(f'p_{k.pre[-1][0]}')}", "}"]
            else:
                out += [f"{t} p_{total} = {load(plist, '0')};",
                        f"for (long r = 1; r < a->n_{plist}; r++) {combine(load(plist, 'r'))}"]
            if op == "avg":
                out.append(f"p_{total} = {rounded(f'p_{total} / (float)a->n_{plist}')};" if summed_half
                           else f"p_{total} /= (float)a->n_{plist};")
        out += statements(k.stmts, vector)
        for target, value in k.writes:
            tag = half(kind.get(target))
            # a value of the chunk, or rows passed in as they are (Adan keeps the reduced gradient it was given)
            if unhalved(kind.get(target)) != "rows" or (value not in values and unhalved(kind.get(value)) != "rows"):
                raise Untranslatable(f"a write of {value} into {target}")
            if tag:
                out.append(f"st_{tag}(p_{target} + i, {ref(value, True, DTYPE[tag])});" if vector
                           else f"p_{target}[i] = bits_{tag}({ref(value, False, DTYPE[tag])});")
            else:
                out.append(f"st(p_{target} + i, {ref(value, True, 'float32')});" if vector
                           else f"p_{target}[i] = {ref(value, False, 'float32')};")
        for s, (target, value) in enumerate(k.streams):
            if unhalved(kind.get(target)) != "peers" or value not in tensors:
                raise Untranslatable(f"a stream of {value} into {target}")
            out.append(f"out[{s}] = {ref(value, vector, DTYPE.get(half(kind[target]), 'float32'))};")
        for s, (_, value) in enumerate(k.sums, len(k.streams)):
            if value not in tensors:
                raise Untranslatable(f"a sum of {value}")
            out.append(f"out[{s}] = {ref(value, vector, 'float32')};")
        return out

    ns, nout = len(k.streams), max(1, len(k.streams) + len(k.sums))
    peers = [target for target, _ in k.streams]
    halved = {p: half(kind[p]) for p in peers if half(kind[p])}
    factored = any(what in FACTORS for _, what in k.params)
    if factored and halved:
        raise Untranslatable("a row or column factor beside half-precision peers")
    end = "e" if factored else "n"  # where the rows stop: the chunk's, or (factored) the row's
    streamed = [p for p in peers if p not in halved]
    ind = "    "
    f16 = "float16" in halves.values() or any(half(what) == "f16" for _, what in k.params)
    lines = [_PRELUDE + (_F16 if f16 else "")
             + "".join(_HALF_LINE.replace("TAG", tag) for tag in sorted(set(halved.values()))),
             "typedef struct {", *(ind + f for f in fields), *([ind + "long q, c0;"] if factored else []),
             "} args_t;", "",
             "/* row i of the chunk; its values for the peers' copies into out */",
             "static inline __attribute__((always_inline)) void row(const args_t *a, long i, float *out) {",
             *(ind + x for x in body(False)), "}", "",
             "/* rows [i, i + 8) */",
             "static inline __attribute__((always_inline)) void rows8(const args_t *a, long i, v8 *out) {",
             *(ind + x for x in body(True)), "}", "",
             "void coconet_chunk(long n, void **ptr, const long *count, const float *scal, double *sums) {",
             ind + "args_t a;", ind + "long at = 0;", ind + "(void)at; (void)count; (void)scal; (void)sums;",
             *(ind + x for x in unpack),
             ind + f"float o[{nout}];", ind + f"v8 x[{nout}], y[{nout}];"]
    if k.sums:
        lines.append(ind + f"double tot[{len(k.sums)}] = {{0}};")
        lines.append(ind + f"v4d acc[{len(k.sums)}] = {{{{0}}}};")
    summed = [f"tot[{j}] += (double)o[{ns + j}];" for j in range(len(k.sums))]
    plain = [f"for (long r = 0; r < a.n_{p}; r++) a.p_{p}[r][i] = " + (f"bits_{halved[p]}(o[{s}]);" if p in halved
                                                                        else f"o[{s}];") for s, p in enumerate(peers)]

    def one_by_one(until: str) -> list[str]:  # rows i .. until, one at a time (a head or the tail)
        return [ind + f"for (; {until}; i++) {{", ind * 2 + "row(&a, i, o);",
                *(ind * 2 + x for x in plain + summed), ind + "}"]

    def same_offset(flag: str, off: str, group: list[str]) -> list[str]:
        return [ind + f"for (long r = 0; r < a.n_{p}; r++) {flag} = {flag} && ((uintptr_t)a.p_{p}[r] & 63) == {off};"
                for p in group]

    if halved:
        # a half-precision line holds 32 rows: the loop takes 32 a step so that each line is streamed whole (half
        # a line a step went out as partial writes), from the row where the half copies' lines start; the
        # float32 copies are streamed too where their lines start on that row
        first = sorted(halved)[0]
        lines += [ind + f"uintptr_t off16 = a.n_{first} ? (uintptr_t)a.p_{first}[0] & 63 : 0;",
                  ind + "int nt16 = (off16 & 1) == 0;", *same_offset("nt16", "off16", sorted(halved)),
                  ind + "long head = nt16 ? (long)((64 - off16) & 63) / 2 : 0, i = 0;"]
        if streamed:
            lines += [ind + f"uintptr_t off = a.n_{streamed[0]} ? (uintptr_t)a.p_{streamed[0]}[0] & 63 : 0;",
                      ind + "int nt = (off & 3) == 0 && ((off + 4 * (uintptr_t)head) & 63) == 0;",
                      *same_offset("nt", "off", streamed)]
        lines += one_by_one("i < head && i < n")
        parts = ("x", "y", "z", "u")
        lines.append(ind + f"v8 z[{nout}], u[{nout}];")
    elif streamed:
        lines += [
            ind + "/* streamed where every destination has the same offset in its line, on a float */",
            ind + f"uintptr_t off = a.n_{streamed[0]} ? (uintptr_t)a.p_{streamed[0]}[0] & 63 : 0;",
            ind + "int nt = (off & 3) == 0;",
            *same_offset("nt", "off", streamed),
        ]
        if not factored:
            lines += [ind + "long head = nt ? (long)((64 - off) & 63) / 4 : 0, i = 0;",
                      *one_by_one("i < head && i < n")]
        parts = ("x", "y")
    else:
        if not factored:
            lines.append(ind + "long i = 0;")
        parts = ("x", "y")
    if factored:
        # a row at a time, its factor's value and its columns' start set before its first: every row's lines
        # begin at their own offset, so each has a head of its own
        lines += [ind + f"const long width = count[{lists}];",
                  ind + "for (long q0 = 0; width > 0 && q0 < n; q0 += width) {",
                  ind + "a.q = q0 / width; a.c0 = q0;",
                  ind + "const long e = q0 + width;",
                  ind + "long i = q0;"]
        if streamed:
            lines += [ind + "const long head = nt ? (long)((64 - ((off + 4 * (uintptr_t)q0) & 63)) & 63) / 4 : 0;",
                      *one_by_one("i < q0 + head && i < e")]

    def at(j: int, width: int) -> str:
        return f"d + {width * j}" if j else "d"

    def branch(flag: str, fast: list[str], slow: list[str]) -> str:
        streamed_text = fast[0] if len(fast) == 1 else "{ " + " ".join(fast) + " }"
        return f"if ({flag}) {streamed_text} else {{ {' '.join(slow)} }}"

    step = LINE * len(parts) // 2  # two vectors of 8 a float32 line
    lines += [ind + f"for (; i + {step} <= {end}; i += {step}) {{",
              *(ind * 2 + f"rows8(&a, {'i' if j == 0 else f'i + {8 * j}'}, {v});" for j, v in enumerate(parts))]
    for s, p in enumerate(peers):
        if p in halved:
            tag = halved[p]
            store = branch("nt16", [f"stream_line_{tag}(d, {', '.join(f'{v}[{s}]' for v in parts)});"],
                           [f"st_{tag}({at(j, 8)}, {v}[{s}]);" for j, v in enumerate(parts)])
        else:
            store = branch("nt", [f"stream_line({at(j, 16)}, {parts[2 * j]}[{s}], {parts[2 * j + 1]}[{s}]);"
                                  for j in range(len(parts) // 2)],
                           [f"st({at(j, 8)}, {v}[{s}]);" for j, v in enumerate(parts)])
        lines += [ind * 2 + f"for (long r = 0; r < a.n_{p}; r++) {{",
                  ind * 3 + f"{'uint16_t' if p in halved else 'float'} *d = a.p_{p}[r] + i;",
                  ind * 3 + store, ind * 2 + "}"]
    lines += [ind * 2 + f"acc[{j}] += " + " + ".join(f"widen({v}[{ns + j}])" for v in parts) + ";"
              for j in range(len(k.sums))]
    lines += [ind + "}", *one_by_one(f"i < {end}")]
    if factored:
        lines.append(ind + "}")
    lines += [ind + f"sums[{j}] = tot[{j}] + hsum4(acc[{j}]);" for j in range(len(k.sums))]
    if peers:
        lines.append(ind + "_mm_sfence();  /* the streamed stores are visible before the barrier's flag after */")
    lines.append("}")
    return "\n".join(lines) + "\n"
