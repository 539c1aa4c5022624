"""Symbolic sizes: a dimension is a polynomial over the program's dims.

Shapes are written with dim names (``"N"``), integers, or expressions with
``+ - *`` (``"4*H"``). They are kept in a normal form so that ``"H*4"`` and
``"4 * H"`` compare equal; sizes are bound only at run/tune time.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Mapping, Union

from coconet.errors import SizeError

# A monomial is a sorted tuple of dim names (with repetition); a Dim maps monomials to coefficients.
_Terms = tuple[tuple[tuple[str, ...], int], ...]

MAX_DIM_TEXT = 64
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True, order=True)
class Dim:
    terms: _Terms

    @staticmethod
    def const(value: int) -> "Dim":
        return Dim((((), value),)) if value else Dim(())

    @staticmethod
    def var(name: str) -> "Dim":
        return Dim((((name,), 1),))

    @property
    def names(self) -> frozenset[str]:
        return frozenset(n for mono, _ in self.terms for n in mono)

    @property
    def value(self) -> int | None:
        """The integer value when the dim has no symbols."""
        if not self.terms:
            return 0
        if len(self.terms) == 1 and self.terms[0][0] == ():
            return self.terms[0][1]
        return None

    def __add__(self, other: "Dim") -> "Dim":
        return _from_dict(_merge(dict(self.terms), dict(other.terms), 1))

    def __sub__(self, other: "Dim") -> "Dim":
        return _from_dict(_merge(dict(self.terms), dict(other.terms), -1))

    def __mul__(self, other: "Dim") -> "Dim":
        out: dict[tuple[str, ...], int] = {}
        for m1, c1 in self.terms:
            for m2, c2 in other.terms:
                mono = tuple(sorted(m1 + m2))
                out[mono] = out.get(mono, 0) + c1 * c2
        return _from_dict(out)

    def evaluate(self, sizes: Mapping[str, int]) -> int:
        total = 0
        for mono, coeff in self.terms:
            term = coeff
            for name in mono:
                if name not in sizes:
                    raise SizeError(f"no size given for dim {name!r} (needed by {self})")
                term *= sizes[name]
            total += term
        return total

    def __str__(self) -> str:
        if not self.terms:
            return "0"
        pieces = []
        # Highest degree first, constants last: "4*H + 1".
        for mono, coeff in sorted(self.terms, key=lambda t: (-len(t[0]), t[0])):
            body = "*".join(mono)
            if not body:
                text = str(abs(coeff))
            elif abs(coeff) == 1:
                text = body
            else:
                text = f"{abs(coeff)}*{body}"
            sign = "-" if coeff < 0 else "+"
            pieces.append((sign, text))
        first_sign, first = pieces[0]
        out = ("-" if first_sign == "-" else "") + first
        for sign, text in pieces[1:]:
            out += f" {sign} {text}"
        return out

    def __repr__(self) -> str:
        return f"Dim({str(self)!r})"

    def to_json(self) -> int | str:
        v = self.value
        return v if v is not None else str(self)


def _merge(a: dict, b: dict, sign: int) -> dict:
    out = dict(a)
    for mono, coeff in b.items():
        out[mono] = out.get(mono, 0) + sign * coeff
    return out


def _from_dict(d: dict) -> Dim:
    return Dim(tuple(sorted((m, c) for m, c in d.items() if c != 0)))


def parse_dim(spec: Union[int, str, Dim], known: tuple[str, ...] | frozenset[str] | None = None) -> Dim:
    """Parse ``4``, ``"N"`` or ``"4*H + 1"``; names must be in ``known`` when given.

    Raises ValueError with a message naming what is wrong (callers wrap it in ProgramError).
    """
    if isinstance(spec, Dim):
        dim = spec
    elif isinstance(spec, bool):
        raise ValueError(f"dim {spec!r} is a bool, not a size")
    elif isinstance(spec, int):
        dim = Dim.const(spec)
    elif isinstance(spec, str):
        if len(spec) > MAX_DIM_TEXT:
            raise ValueError(f"dim expression longer than {MAX_DIM_TEXT} characters")
        try:
            tree = ast.parse(spec.strip(), mode="eval")
        except SyntaxError:
            raise ValueError(f"dim {spec!r} is not an expression of names and integers") from None
        dim = _eval(tree.body, spec)
    else:
        raise ValueError(f"dim {spec!r} must be an int, a dim name or an expression like '4*H'")
    if known is not None:
        unknown = sorted(dim.names - set(known))
        if unknown:
            raise ValueError(f"dim {str(dim)!r} uses {', '.join(unknown)}, not among the program's dims {tuple(known)}")
    v = dim.value
    if v is not None and v <= 0:
        raise ValueError(f"dim {spec!r} must be positive")
    return dim


def _eval(node: ast.AST, spec: str) -> Dim:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Dim.const(node.value)
    if isinstance(node, ast.Name):
        return Dim.var(node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return Dim.const(0) - _eval(node.operand, spec)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        left, right = _eval(node.left, spec), _eval(node.right, spec)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        return left * right
    raise ValueError(f"dim {spec!r}: only names, integers, + - * are allowed")


def parse_sizes(specs: str | list[str] | tuple[str, ...], dims: tuple[str, ...] | None = None) -> dict[str, int]:
    """Parse CLI size bindings: ``N=2^20``, ``B=8,S=1024,H=3072``, several specs allowed.

    With ``dims`` given, every dim must be bound and no other name may appear.
    """
    if isinstance(specs, str):
        specs = [specs]
    sizes: dict[str, int] = {}
    for spec in specs:
        for item in spec.split(","):
            item = item.strip()
            if not item:
                continue
            name, sep, value = item.partition("=")
            name, value = name.strip(), value.strip()
            if not sep or not IDENT.match(name):
                raise SizeError(f"size {item!r} is not NAME=VALUE (e.g. N=2^20 or B=8,S=1024)")
            if name in sizes:
                raise SizeError(f"size {name} given twice")
            sizes[name] = _parse_size_value(name, value)
    if dims is not None:
        extra = sorted(set(sizes) - set(dims))
        if extra:
            raise SizeError(
                f"size given for {', '.join(extra)}, which the program does not have "
                f"(dims: {', '.join(dims) or 'none'})"
            )
        missing = [d for d in dims if d not in sizes]
        if missing:
            raise SizeError(f"no size given for {', '.join(missing)} (e.g. --size {missing[0]}=2^20)")
    return sizes


MAX_SIZE = 2**40


def _parse_size_value(name: str, value: str) -> int:
    # ASCII digits only: int() would also read '+8', '1_000' and other scripts' digits ('٣' as 3)
    m = re.fullmatch(r"([0-9]+)\s*\^\s*([0-9]+)", value)
    if m:
        base, exp = int(m.group(1)), int(m.group(2))
        if exp > 64:
            raise SizeError(f"size {name}={value} is too large")
        n = base**exp
    elif re.fullmatch(r"[0-9]+", value):
        n = int(value)
    else:
        raise SizeError(f"size {name}={value!r}: value must be an integer or 2^k")
    if n <= 0:
        raise SizeError(f"size {name}={value} must be positive")
    if n > MAX_SIZE:
        raise SizeError(f"size {name}={value} is larger than 2^40")
    return n


def format_sizes(sizes: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in sizes.items())
