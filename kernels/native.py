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

from .c_helpers import F16, HALF_LINE, PRELUDE
from .c_loop import IND, Loop
from .chunk import (
    COMPARE,
    DTYPE,
    FACTORS,
    HALF,
    NUMBER_OPS,
    OPS,
    POWERS,
    RDIV,
    REDUCE,
    ChunkKernel,
    Untranslatable,
    half,
    literal,
    rounded,
    unhalved,
)


def c_source(k: ChunkKernel) -> str:
    """The C text of ``k``: ``void coconet_chunk(long n, void **ptr, const long *count, const float *scal,
    double *sums)``, ``ptr`` the data of every rows, parts and peers tensor in parameter order, ``count`` the
    length of each list, ``scal`` the scalars in order, ``sums`` where the chunk's sums go. Program names
    become ``p_<name>`` (a program may name a value ``n``). Raises Untranslatable."""
    return _Source(k).text()


class _Source:
    """The translation of one chunk kernel: what each of its names is, read once, then the C of each part (the
    arguments' struct, a row's and eight rows' computation, the loop over the chunk's rows that stores them)."""

    def __init__(self, k: ChunkKernel) -> None:
        self.k = k
        self.kind = kind = dict(k.params)
        self.masks = {name for name, op, *_ in (*k.pre, *k.stmts) if op in COMPARE}
        # values of a half-precision dtype (casts to one, a sum of half rows): held as the float32 they widen to,
        # which arithmetic whose result is float32 reads exactly, as torch promotes them; stored only into tensors
        # of that dtype, never summed over the rows. (Arithmetic whose result stays half is the lowering's to
        # refuse: rounding every op as torch's half kernels do made C slower than Inductor's chunk, which rounds
        # once.)
        self.halves = {name: value for name, op, _, value in k.stmts if op == "cast" and value in HALF}
        self.summed_half = half(kind.get(k.parts[1])) if k.parts and not k.pre else None
        if self.summed_half and k.parts:  # half-precision rows summed as they are: the total is of that dtype too
            self.halves[k.parts[0]] = DTYPE[self.summed_half]
        values = {name for name, *_ in (*k.pre, *k.stmts)} | ({k.parts[0]} if k.parts else set())
        self.values = values | ({k.part} if k.part else set()) | {name for name, _ in (*k.ranked, *k.also)}
        self.rows_of = ({k.part: k.parts[1]} if k.part and k.parts else {}) | dict(k.also)  # each input's parts
        self.tensors = self.values - k.numbers - self.masks
        # the values known here, for a power's exponent: the chunk's constants and those passed in as scalars
        known = [(name, value) for name, op, _, value in (*k.pre, *k.stmts) if op == "const"] + list(k.constants)
        self.constants = {
            name: float(value)
            for name, value in known
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        self.fields, self.unpack, self.lists = self._arguments()
        self.numbers = self._numbers()

    # --- names as C operands ---

    def ref(self, name: str, vector: bool, stored: str | None = None) -> str:
        """``name``'s value as float32, read by arithmetic or (``stored``) stored as a tensor of that dtype."""
        k, kind = self.k, self.kind
        if name in self.masks:
            raise Untranslatable(f"comparison {name} read as a number")
        held = self.halves.get(name) or DTYPE.get(half(kind.get(name)), "float32")
        if stored is not None and held != stored:
            raise Untranslatable(f"{name} ({held}) stored as {stored}")
        if name in k.numbers:
            return f"vn_{name}" if vector else f"((float)p_{name})"
        if name in self.tensors or kind.get(name) == "scalar":
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

    def number_ref(self, name: str) -> str:
        if name in self.k.numbers:
            return f"p_{name}"
        raise Untranslatable(f"host number {name} of a tensor")

    # --- the arguments and the host numbers ---

    def _arguments(self) -> tuple[list[str], list[str], int]:
        """The struct's fields, the lines that fill them from ``ptr``, ``count`` and ``scal``, and how many lists."""
        fields, unpack, scalars, lists = [], [], 0, 0
        for name, what in self.k.params:
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
                unpack.append(
                    f"a.p_{name} = ({element} *const *)(ptr + at); a.n_{name} = count[{lists}]; at += count[{lists}];"
                )
                lists += 1
        return fields, unpack, lists

    def _numbers(self) -> list[str]:
        numbers = []
        for name, op, args, value in self.k.stmts:
            if name not in self.k.numbers:
                continue
            if op == "const":
                numbers.append(f"const double p_{name} = {literal(value)};")
            elif op in NUMBER_OPS:
                numbers.append(f"const double p_{name} = {NUMBER_OPS[op].format(*map(self.number_ref, args))};")
            else:
                raise Untranslatable(f"{op} of host numbers")
        return numbers

    # --- a row's (or eight rows') computation ---

    def statements(self, stmts, vector: bool) -> list[str]:
        t = "v8" if vector else "float"
        out = []
        for name, op, args, value in stmts:
            if name in self.k.numbers:
                continue
            if op in COMPARE:
                x, y = (self.ref(a, vector) for a in args)
                out.append(f"const {'v8i' if vector else 'int'} p_{name} = ({x} {COMPARE[op]} {y});")
                continue
            out.append(f"const {t} p_{name} = {self._expression(op, args, value, vector)};")
        return out

    def _expression(self, op: str, args: tuple[str, ...], value: object, vector: bool) -> str:
        k, ref = self.k, self.ref
        if op == "const":
            lit = f"(float){literal(value)}"
            return f"splat({lit})" if vector else lit
        if op == "pow" and self.constants.get(args[1]) in POWERS and args[0] not in k.numbers:
            return POWERS[self.constants[args[1]]][vector].format(ref(args[0], vector))
        if op == "div" and args[0] in k.numbers | k.host:
            return RDIV[vector].format(*(ref(x, vector) for x in args))
        if op in OPS:
            return OPS[op][vector].format(*(ref(x, vector) for x in args))
        if op == "where" and args[0] in self.masks:
            x, y = (ref(a, vector) for a in args[1:])
            return f"vsel(p_{args[0]}, {x}, {y})" if vector else f"(p_{args[0]} ? {x} : {y})"
        if op == "where" and self.kind.get(args[0]) == "scalar":  # a mask passed in: one choice for every row
            x, y = (ref(a, vector) for a in args[1:])
            return f"(a->p_{args[0]} != 0.0f) ? {x} : {y}"
        if op == "cast" and value == "float32" and args[0] in self.masks:
            one = "(v8){0} + 1.0f" if vector else "1.0f"
            return f"vsel(p_{args[0]}, {one}, (v8){{0}})" if vector else f"(p_{args[0]} ? {one} : 0.0f)"
        if op == "cast" and value == "float32" and args[0] not in k.numbers:
            return ref(args[0], vector)  # float32 already, or a half widened exactly as it was loaded
        if op == "cast" and value in HALF and args[0] not in k.numbers:
            return rounded(HALF[value], ref(args[0], vector), vector)
        raise Untranslatable(op)

    def body(self, vector: bool) -> list[str]:
        k = self.k
        t = "v8" if vector else "float"
        out = [
            f"const {t} p_{n} = " + (f"splat(a->p_{n});" if vector else f"a->p_{n};")
            for n, what in k.params
            if what == "scalar"
        ]
        out += [f"float *const p_{n} = a->p_{n};" for n, what in k.params if what == "rows"]
        out += [f"uint16_t *const p_{n} = a->p_{n};" for n, what in k.params if half(what) and unhalved(what) == "rows"]
        out += self.numbers
        if vector:
            out += [f"const v8 vn_{n} = splat((float)p_{n});" for n in sorted(k.numbers)]
        if k.parts is not None:
            out += self._reduction(vector)
        out += self.statements(k.stmts, vector)
        return out + self._stores(vector)

    # --- the sum over the ranks' rows ---

    def _rounded_sum(self, x: str, vector: bool) -> str:
        # torch's half-precision add (mul, div) rounds each result to its dtype: so does the sum here,
        # computed in float32 first (exact, or rounded twice to the same value: 24 >= 2 * 11 + 2 bits)
        return rounded(self.summed_half, x, vector) if self.summed_half else x

    def _combine(self, x: str, vector: bool) -> str:
        """p_total <- p_total (op) x, in the order torch reduces them."""
        assert self.k.parts is not None
        total, _, op = self.k.parts
        combined = REDUCE[op][vector].format(f"p_{total}", x)
        return f"p_{total} = {combined if op in ('max', 'min') else self._rounded_sum(combined, vector)};"

    def _load_part(self, param: str, rank: str, vector: bool) -> str:
        k, kind = self.k, self.kind
        tag = half(kind.get(param))
        if tag and unhalved(kind[param]) == "parts":  # widened exactly: summed as they are, or (pre) read
            if k.pre:  # only through casts to float32
                name = next((x for x, q in self.rows_of.items() if q == param), None)
                if name is None or any(
                    name in args and (op != "cast" or value != "float32") for _, op, args, value in k.pre
                ):
                    raise Untranslatable(f"{DTYPE[tag]} rows {param} read but by a cast to float32")
            return f"ld_{tag}(a->p_{param}[{rank}] + i)" if vector else f"{tag}(a->p_{param}[{rank}][i])"
        if kind.get(param) != "parts":
            raise Untranslatable(f"rows {param} of every rank not passed as such")
        return f"ld(a->p_{param}[{rank}] + i)" if vector else f"a->p_{param}[{rank}][i]"

    def _reduction(self, vector: bool) -> list[str]:
        k, kind = self.k, self.kind
        assert k.parts is not None
        t = "v8" if vector else "float"
        total, plist, op = k.parts
        if unhalved(kind.get(plist)) != "parts" or op not in REDUCE:
            raise Untranslatable(f"parts {plist} ({op})")
        out = []
        if k.pre:  # each rank's rows of the value summed, from its rows of the inputs: summed in rank order
            if any(kind.get(param) != "rank numbers" for _, param in k.ranked):
                raise Untranslatable("numbers of every rank not passed as such")
            each = [f"const {t} p_{x} = {self._load_part(param, 'r', vector)};" for x, param in self.rows_of.items()]
            each += [
                f"const {t} p_{x} = " + (f"splat(a->p_{param}[r]);" if vector else f"a->p_{param}[r];")
                for x, param in k.ranked
            ]
            each += self.statements(k.pre, vector)
            last = k.pre[-1][0]
            out += [
                f"{t} p_{total};",
                f"for (long r = 0; r < a->n_{plist}; r++) {{",
                *("    " + x for x in each),
                f"    if (r == 0) p_{total} = p_{last}; else {self._combine(f'p_{last}', vector)}",
                "}",
            ]
        else:
            out += [
                f"{t} p_{total} = {self._load_part(plist, '0', vector)};",
                f"for (long r = 1; r < a->n_{plist}; r++) {self._combine(self._load_part(plist, 'r', vector), vector)}",
            ]
        if op == "avg":
            out.append(
                f"p_{total} = {self._rounded_sum(f'p_{total} / (float)a->n_{plist}', vector)};"
                if self.summed_half
                else f"p_{total} /= (float)a->n_{plist};"
            )
        return out

    # --- what a row stores ---

    def _stores(self, vector: bool) -> list[str]:
        k, kind, ref = self.k, self.kind, self.ref
        out = []
        for target, value in k.writes:
            tag = half(kind.get(target))
            # a value of the chunk, or rows passed in as they are (Adan keeps the reduced gradient it was given)
            if unhalved(kind.get(target)) != "rows" or (
                value not in self.values and unhalved(kind.get(value)) != "rows"
            ):
                raise Untranslatable(f"a write of {value} into {target}")
            if tag:
                out.append(
                    f"st_{tag}(p_{target} + i, {ref(value, True, DTYPE[tag])});"
                    if vector
                    else f"p_{target}[i] = bits_{tag}({ref(value, False, DTYPE[tag])});"
                )
            else:
                out.append(
                    f"st(p_{target} + i, {ref(value, True, 'float32')});"
                    if vector
                    else f"p_{target}[i] = {ref(value, False, 'float32')};"
                )
        for s, (target, value) in enumerate(k.streams):
            if unhalved(kind.get(target)) != "peers" or value not in self.tensors:
                raise Untranslatable(f"a stream of {value} into {target}")
            out.append(f"out[{s}] = {ref(value, vector, DTYPE.get(half(kind[target]), 'float32'))};")
        for s, (_, value) in enumerate(k.sums, len(k.streams)):
            if value not in self.tensors:
                raise Untranslatable(f"a sum of {value}")
            out.append(f"out[{s}] = {ref(value, vector, 'float32')};")
        return out

    # --- the whole kernel ---

    def text(self) -> str:
        loop = Loop(self)  # refuses what it cannot store before a row's code is made
        return "\n".join(self._functions(loop) + loop.lines()) + "\n"

    def _functions(self, loop: Loop) -> list[str]:
        """The helpers, the arguments' struct, and a row's and eight rows' computation."""
        f16 = "float16" in self.halves.values() or any(half(what) == "f16" for _, what in self.k.params)
        return [
            PRELUDE
            + (F16 if f16 else "")
            + "".join(HALF_LINE.replace("TAG", tag) for tag in sorted(set(loop.halved.values()))),
            "typedef struct {",
            *(IND + f for f in self.fields),
            *([IND + "long q, c0;"] if loop.factored else []),
            "} args_t;",
            "",
            "/* row i of the chunk; its values for the peers' copies into out */",
            "static inline __attribute__((always_inline)) void row(const args_t *a, long i, float *out) {",
            *(IND + x for x in self.body(False)),
            "}",
            "",
            "/* rows [i, i + 8) */",
            "static inline __attribute__((always_inline)) void rows8(const args_t *a, long i, v8 *out) {",
            *(IND + x for x in self.body(True)),
            "}",
            "",
        ]
