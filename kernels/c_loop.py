"""``coconet_chunk``'s loop over a chunk's rows (``coconet.kernels.native`` writes the rest of the C): rows one
at a time up to where the peers' lines start, then a line at a time streamed whole into every peer's copy."""

from __future__ import annotations

from typing import Any

from .chunk import FACTORS, LINE, Untranslatable, half

IND = "    "


class Loop:
    """``coconet_chunk`` itself: rows one at a time up to where the peers' lines start, then a line at a time
    (two or four vectors of 8) streamed whole into every peer's copy, then the tail a row at a time; with a row
    or column factor, that per row of the factor."""

    def __init__(self, src: Any) -> None:
        k = src.k
        self.src, self.k = src, k
        self.ns, self.nout = len(k.streams), max(1, len(k.streams) + len(k.sums))
        self.peers = [target for target, _ in k.streams]
        self.halved = {p: tag for p in self.peers if (tag := half(src.kind[p]))}
        self.factored = any(what in FACTORS for _, what in k.params)
        if self.factored and self.halved:
            raise Untranslatable("a row or column factor beside half-precision peers")
        self.end = "e" if self.factored else "n"  # where the rows stop: the chunk's, or (factored) the row's
        self.streamed = [p for p in self.peers if p not in self.halved]
        self.parts = ("x", "y", "z", "u") if self.halved else ("x", "y")
        self.summed = [f"tot[{j}] += (double)o[{self.ns + j}];" for j in range(len(k.sums))]
        self.plain = [
            f"for (long r = 0; r < a.n_{p}; r++) a.p_{p}[r][i] = "
            + (f"bits_{self.halved[p]}(o[{s}]);" if p in self.halved else f"o[{s}];")
            for s, p in enumerate(self.peers)
        ]

    def lines(self) -> list[str]:
        return self._entry() + self._head() + self._factor_rows() + self._line_loop() + self._exit()

    def one_by_one(self, until: str) -> list[str]:
        """Rows i .. until, one at a time (a head or the tail)."""
        return [
            IND + f"for (; {until}; i++) {{",
            IND * 2 + "row(&a, i, o);",
            *(IND * 2 + x for x in self.plain + self.summed),
            IND + "}",
        ]

    @staticmethod
    def same_offset(flag: str, off: str, group: list[str]) -> list[str]:
        return [
            IND + f"for (long r = 0; r < a.n_{p}; r++) {flag} = {flag} && ((uintptr_t)a.p_{p}[r] & 63) == {off};"
            for p in group
        ]

    def _entry(self) -> list[str]:
        k, nout = self.k, self.nout
        out = [
            "void coconet_chunk(long n, void **ptr, const long *count, const float *scal, double *sums) {",
            IND + "args_t a;",
            IND + "long at = 0;",
            IND + "(void)at; (void)count; (void)scal; (void)sums;",
            *(IND + x for x in self.src.unpack),
            IND + f"float o[{nout}];",
            IND + f"v8 x[{nout}], y[{nout}];",
        ]
        if k.sums:
            out.append(IND + f"double tot[{len(k.sums)}] = {{0}};")
            out.append(IND + f"v4d acc[{len(k.sums)}] = {{{{0}}}};")
        return out

    def _head(self) -> list[str]:
        """The rows before the first whole line of the peers' copies, and whether to stream (``nt``, ``nt16``)."""
        halved, streamed = self.halved, self.streamed
        if halved:
            # a half-precision line holds 32 rows: the loop takes 32 a step so that each line is streamed whole
            # (half a line a step went out as partial writes), from the row where the half copies' lines start;
            # the float32 copies are streamed too where their lines start on that row
            first = sorted(halved)[0]
            out = [
                IND + f"uintptr_t off16 = a.n_{first} ? (uintptr_t)a.p_{first}[0] & 63 : 0;",
                IND + "int nt16 = (off16 & 1) == 0;",
                *self.same_offset("nt16", "off16", sorted(halved)),
                IND + "long head = nt16 ? (long)((64 - off16) & 63) / 2 : 0, i = 0;",
            ]
            if streamed:
                out += [
                    IND + f"uintptr_t off = a.n_{streamed[0]} ? (uintptr_t)a.p_{streamed[0]}[0] & 63 : 0;",
                    IND + "int nt = (off & 3) == 0 && ((off + 4 * (uintptr_t)head) & 63) == 0;",
                    *self.same_offset("nt", "off", streamed),
                ]
            return out + self.one_by_one("i < head && i < n") + [IND + f"v8 z[{self.nout}], u[{self.nout}];"]
        if streamed:
            out = [
                IND + "/* streamed where every destination has the same offset in its line, on a float */",
                IND + f"uintptr_t off = a.n_{streamed[0]} ? (uintptr_t)a.p_{streamed[0]}[0] & 63 : 0;",
                IND + "int nt = (off & 3) == 0;",
                *self.same_offset("nt", "off", streamed),
            ]
            if not self.factored:
                out += [
                    IND + "long head = nt ? (long)((64 - off) & 63) / 4 : 0, i = 0;",
                    *self.one_by_one("i < head && i < n"),
                ]
            return out
        return [] if self.factored else [IND + "long i = 0;"]

    def _factor_rows(self) -> list[str]:
        """With a factor, a row at a time, its factor's value and its columns' start set before its first: every
        row's lines begin at their own offset, so each has a head of its own."""
        if not self.factored:
            return []
        out = [
            IND + f"const long width = count[{self.src.lists}];",
            IND + "for (long q0 = 0; width > 0 && q0 < n; q0 += width) {",
            IND + "a.q = q0 / width; a.c0 = q0;",
            IND + "const long e = q0 + width;",
            IND + "long i = q0;",
        ]
        if self.streamed:
            out += [
                IND + "const long head = nt ? (long)((64 - ((off + 4 * (uintptr_t)q0) & 63)) & 63) / 4 : 0;",
                *self.one_by_one("i < q0 + head && i < e"),
            ]
        return out

    def _line_loop(self) -> list[str]:
        parts, end = self.parts, self.end
        step = LINE * len(parts) // 2  # two vectors of 8 a float32 line
        out = [
            IND + f"for (; i + {step} <= {end}; i += {step}) {{",
            *(IND * 2 + f"rows8(&a, {'i' if j == 0 else f'i + {8 * j}'}, {v});" for j, v in enumerate(parts)),
        ]
        for s, p in enumerate(self.peers):
            out += [
                IND * 2 + f"for (long r = 0; r < a.n_{p}; r++) {{",
                IND * 3 + f"{'uint16_t' if p in self.halved else 'float'} *d = a.p_{p}[r] + i;",
                IND * 3 + self._store(s, p),
                IND * 2 + "}",
            ]
        out += [
            IND * 2 + f"acc[{j}] += " + " + ".join(f"widen({v}[{self.ns + j}])" for v in parts) + ";"
            for j in range(len(self.k.sums))
        ]
        out += [IND + "}", *self.one_by_one(f"i < {end}")]
        return out + ([IND + "}"] if self.factored else [])

    def _store(self, s: int, p: str) -> str:
        """Peer ``p``'s line at ``d``: streamed whole where its lines line up, else stored vector by vector."""
        parts = self.parts

        def at(j: int, width: int) -> str:
            return f"d + {width * j}" if j else "d"

        def branch(flag: str, fast: list[str], slow: list[str]) -> str:
            streamed_text = fast[0] if len(fast) == 1 else "{ " + " ".join(fast) + " }"
            return f"if ({flag}) {streamed_text} else {{ {' '.join(slow)} }}"

        if p in self.halved:
            tag = self.halved[p]
            return branch(
                "nt16",
                [f"stream_line_{tag}(d, {', '.join(f'{v}[{s}]' for v in parts)});"],
                [f"st_{tag}({at(j, 8)}, {v}[{s}]);" for j, v in enumerate(parts)],
            )
        return branch(
            "nt",
            [
                f"stream_line({at(j, 16)}, {parts[2 * j]}[{s}], {parts[2 * j + 1]}[{s}]);"
                for j in range(len(parts) // 2)
            ],
            [f"st({at(j, 8)}, {v}[{s}]);" for j, v in enumerate(parts)],
        )

    def _exit(self) -> list[str]:
        out = [IND + f"sums[{j}] = tot[{j}] + hsum4(acc[{j}]);" for j in range(len(self.k.sums))]
        if self.peers:
            out.append(IND + "_mm_sfence();  /* the streamed stores are visible before the barrier's flag after */")
        return out + ["}"]
