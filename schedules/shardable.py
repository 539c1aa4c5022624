"""The state a tuning question lets a schedule leave sharded.

``as_slice`` hands each rank only its rows of a replicated state after the step. That is ZeRO's point for
optimizer moments that only the step reads, and wrong for weights the model reads whole. Nothing in a
program says which is which, so the question says it, and a winner answers only the questions it was
tuned for.

A set is kept as text (the store's column, a study's name): the names sorted and comma-joined, or ``*``
for every state the program could shard. ``*`` is also what every tuning recorded before the set existed
searched.
"""

from __future__ import annotations

import re
from typing import Iterable

from coconet.errors import CoconetError
from coconet.schedules.ir import Program
from coconet.schedules.types import Replicated

EVERY = "*"
ALL = "all"  # the word a user writes for EVERY
_TEXT = re.compile(r"\*|[A-Za-z_][A-Za-z0-9_]*(,[A-Za-z_][A-Za-z0-9_]*)*|")


def candidates(program: Program) -> tuple[str, ...]:
    """What ``as_slice`` can apply to (``Schedule.sharded``'s universe): updated state declared Replicated."""
    declared = {s.name: s.type.layout for s in program.inputs}
    return tuple(sorted(n for n in program.updates if isinstance(declared.get(n), Replicated)))


def resolve(program: Program, names: Iterable[str]) -> frozenset[str]:
    """The names a user gave (``all`` or ``*`` for every one), checked against the program's state."""
    names = [n.strip() for part in names for n in part.split(",") if n.strip()]
    state = candidates(program)
    if ALL in names or EVERY in names:
        return frozenset(state)
    unknown = sorted(set(names) - set(state))
    if unknown:
        raise CoconetError(
            f"shardable {', '.join(unknown)}: not replicated state {program.name} updates "
            f"(it can shard {', '.join(state) or 'nothing'}; `{ALL}` for every one)"
        )
    return frozenset(names)


def to_text(program: Program, allowed: Iterable[str]) -> str:
    allowed = frozenset(allowed)
    if set(candidates(program)) <= allowed:
        return EVERY
    return ",".join(sorted(allowed))


def names(text: str) -> frozenset[str] | None:
    """The set a text stands for; None for ``*`` (every state, whatever the program's)."""
    check(text)
    if text == EVERY:
        return None
    return frozenset(n for n in text.split(",") if n)


def spelled(text: str) -> tuple[str, ...]:
    """A text as a user writes it: the names, or ``all``."""
    allowed = names(text)
    return (ALL,) if allowed is None else tuple(sorted(allowed))


def words(text: str) -> str:
    """A text for a message: ``any state``, ``nothing`` or the names."""
    allowed = names(text)
    return "any state" if allowed is None else ", ".join(sorted(allowed)) or "nothing"


def check(text: str) -> str:
    if not isinstance(text, str) or _TEXT.fullmatch(text) is None:
        raise CoconetError(f"shardable {text!r} is not `*` or state names joined by commas")
    return text


def answers(tuned: str, asked: str, sharded: Iterable[str]) -> bool:
    """Whether a winner tuned under ``tuned`` answers a question asking ``asked``: it leaves sharded only what
    the question allows, and its search covered every schedule the question allows (else a faster one may be
    among those it never tried). Coverage is judged by the names, not by the space: where no schedule shards a
    name alone, a search without it covered the question all the same, and is passed over."""
    allowed, searched = names(asked), names(tuned)
    if allowed is not None and not set(sharded) <= allowed:
        return False
    return searched is None or (allowed is not None and allowed <= searched)
