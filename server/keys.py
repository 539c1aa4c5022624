"""Canonical keys of the store: a size binding as one string, and the distance between two bindings."""

from __future__ import annotations

import math
from typing import Mapping

from coconet.errors import StoreError


def sizes_key(sizes: Mapping[str, int]) -> str:
    """``{"S": 512, "B": 4}`` -> ``"B=4,S=512"``: names sorted, so one binding has one key."""
    for name, value in sizes.items():
        if not isinstance(name, str) or not name or "=" in name or "," in name:
            raise StoreError(f"size name {name!r} is not a dim name")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise StoreError(f"size {name}={value!r} must be a positive integer")
    return ",".join(f"{k}={sizes[k]}" for k in sorted(sizes))


def parse_sizes_key(key: str) -> dict[str, int]:
    if not key:
        return {}
    out: dict[str, int] = {}
    for item in key.split(","):
        name, _, value = item.partition("=")
        out[name] = int(value)
    return out


def size_distance(a: Mapping[str, int], b: Mapping[str, int]) -> float | None:
    """Sum over dims of |log2 a - log2 b|; None when the two bind different dim names (not comparable)."""
    if set(a) != set(b):
        return None
    return sum(abs(math.log2(a[k]) - math.log2(b[k])) for k in a)
