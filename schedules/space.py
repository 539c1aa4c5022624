"""The schedule space: every legal transform sequence up to a depth, deduplicated.

Breadth-first from the untransformed program (always schedule 0, ``baseline``):
each level applies every instance of every transform to every schedule of the
level before, keeping a result only if its scheduled program's structural hash
is new — so two orders that give the same program are one schedule, found by
the shorter (then earlier) path. The order is deterministic: transforms in
``TRANSFORMS`` order, instances in program order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from coconet.errors import CoconetError, IllegalTransform
from coconet.schedules.dsl import as_ir
from coconet.schedules.schedule import Schedule
from coconet.schedules.transforms import TRANSFORMS

DEFAULT_DEPTH = 6
MAX_SCHEDULES = 5000
# Above this many instances of one transform, apply them together (plus the
# class's own named subsets) instead of one by one: a program with k parameter
# tensors would otherwise yield 2^k near-identical schedules per transform.
MAX_SINGLE = 2


@dataclass(frozen=True)
class Space:
    schedules: tuple[Schedule, ...]
    depth: int
    truncated: bool
    # Instances that ``instances`` offered but ``apply`` refused: should be empty;
    # kept as data so that a gap between the two is visible rather than hidden.
    refused: tuple[tuple[str, str], ...] = ()

    def __iter__(self) -> Iterator[Schedule]:
        return iter(self.schedules)

    def __len__(self) -> int:
        return len(self.schedules)

    def __getitem__(self, i: int) -> Schedule:
        return self.schedules[i]

    def find(self, text: str) -> Schedule | None:
        return next((s for s in self.schedules if s.text == text), None)

    def listing(self) -> str:
        """The human listing ``coconet schedules`` prints: id, text, one-line description."""
        prog = self.schedules[0].program
        head = f"{prog.name} (program {prog.hash}): {len(self)} schedules, depth {self.depth}"
        if self.truncated:
            head += f" (truncated at {len(self)})"
        lines = [head]
        memo = self._memo()
        for i, s in enumerate(self.schedules):
            lines.append(f"[{i}] {s.text}")
            lines.append(f"    {s.describe(memo)}")
        return "\n".join(lines) + "\n"

    def _memo(self) -> dict:
        memo: dict = {}
        for s in self.schedules:
            s.remember(memo)
        return memo

    def to_json(self) -> dict:
        prog = self.schedules[0].program
        memo = self._memo()
        return {
            "program": prog.name,
            "program_hash": prog.hash,
            "count": len(self),
            "depth": self.depth,
            "truncated": self.truncated,
            "schedules": [
                {
                    "id": i,
                    "text": s.text,
                    "transforms": s.names,
                    "hash": s.hash,
                    "structure": s.structure,
                    "knobs": {k: {"default": d, "domain": list(dom)} for k, (d, dom) in s.knob_domains.items()},
                    "description": s.describe(memo),
                }
                for i, s in enumerate(self.schedules)
            ],
        }


def generate(program, depth: int = DEFAULT_DEPTH, limit: int = MAX_SCHEDULES) -> Space:
    prog = as_ir(program)
    base = Schedule(prog)
    seen = {prog.hash}
    out = [base]
    level = [(base, prog)]
    truncated = False
    refused: list[tuple[str, str]] = []
    for _ in range(depth):
        nxt = []
        for sched, scheduled in level:
            for cls in TRANSFORMS:
                for step in _steps(cls, scheduled):
                    try:
                        result, applied = _apply_step(scheduled, step)
                    except IllegalTransform as e:
                        refused.append((f"{sched.text}; {step[0].text()}", str(e)))
                        continue
                    if result.hash in seen:
                        continue
                    seen.add(result.hash)
                    child = Schedule(prog, sched.transforms + applied)
                    child.__dict__["scheduled"] = result  # already computed; cached_property slot
                    if len(out) >= limit:
                        truncated = True
                        break
                    out.append(child)
                    nxt.append((child, result))
        level = nxt
        if not level or truncated:
            break
    return Space(tuple(out), depth, truncated, tuple(refused))


def _apply_step(program, step: tuple):
    """Apply a step's transforms in order. Instances of a batch were found on the
    program before the step, so an earlier one may take what a later one
    needed (two fused collectives sharing work): the later one is then left
    out of the step, not an error. The first must apply. A class that can apply a whole step in one
    rebuild (``apply_all``) does so where that gives the same program."""
    result = type(step[0]).apply_all(program, tuple(step)) if len(step) > 1 else None
    if result is not None:
        return result, tuple(step)
    applied = []
    for i, t in enumerate(step):
        try:
            program = t.apply(program)
        except IllegalTransform:
            if i == 0:
                raise
            continue
        applied.append(t)
    return program, tuple(applied)


def _steps(cls, program) -> list[tuple]:
    insts = cls.instances(program)
    if len(insts) <= MAX_SINGLE:
        return [(t,) for t in insts]
    subsets = getattr(cls, "subsets", None)
    extra = [tuple(s) for s in subsets(program, insts)] if subsets else []
    return [tuple(insts)] + [s for s in extra if s and len(s) < len(insts)]


def pick(
    program,
    picks: Sequence[str],
    depth: int = DEFAULT_DEPTH,
    *,
    best: Callable[[], Schedule],
    space: Space | None = None,
) -> list[Schedule]:
    """The schedules ``picks`` name, the baseline first (every speed-up is against it), each once: a schedule's
    text, ``baseline``, ``all`` (the space at ``depth``), an id in that space, or ``best`` (what ``best()``
    answers: the store's winner, looked up only when asked). ``space``: the program's, where the caller made
    it already (else made here at the first ``all`` or id)."""
    chosen: list[Schedule] = [Schedule(program)]
    for name in (p.strip() for p in picks):
        if name == "best":
            chosen.append(best())
            continue
        if name == "all" or name.isdigit():
            space = space if space is not None else generate(program, depth=depth)
            if name == "all":
                chosen.extend(space)
                continue
            if int(name) >= len(space):
                raise CoconetError(f"there is no schedule {name}; the space has {len(space)} (0-{len(space) - 1})")
            chosen.append(space[int(name)])
            continue
        chosen.append(Schedule.parse(name, program))
    unique: dict[str, Schedule] = {}
    for sched in chosen:
        unique.setdefault(sched.hash, sched)
    return list(unique.values())
