"""A schedule: a program, an ordered tuple of transform instances, knob values.

Canonical text ``split(ar0); reorder(ag0); fuse_collective(rs0); chunks=4``
(``baseline`` for none) parses back to an equal schedule; ``hash`` is the
database key (program hash + text, knobs included), ``structure`` the
structural hash of the scheduled program (knobs excluded), by which the space
generator dedupes.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping

from coconet.errors import IllegalTransform, ScheduleError
from coconet.schedules.ir import Program
from coconet.schedules.transforms import BY_NAME, Transform
from coconet.schedules.types import Replicated, Sliced

BASELINE = "baseline"
_ITEM = re.compile(r"\s*([a-z_]+)\s*\((.*)\)\s*\Z")
_KNOB = re.compile(r"\s*([a-z_]+)\s*=\s*([0-9]+)\s*\Z")
MAX_KNOB = 2**40
# A text longer than any schedule of its program is refused before parsing. Schedules of a program with
# many tensors name every one (a split, a reorder and two as_slice per tensor, each tensor's kernel in a
# fuse): fifty of Adam's take 12 KB, so the bound grows with the program.
MAX_TEXT = 8192
TEXT_PER_STATEMENT = 256


@dataclass(frozen=True)
class Schedule:
    program: Program
    transforms: tuple[Transform, ...] = ()
    knobs: tuple[tuple[str, int], ...] = field(default=())

    def __post_init__(self) -> None:
        declared = self.knob_domains
        for k, v in self.knobs:
            if k not in declared:
                raise ScheduleError(f"knob {k!r} is not a knob of this schedule (knobs: {sorted(declared) or 'none'})")
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ScheduleError(f"knob {k}={v!r} must be a positive integer")
        # Every knob gets its value (the default unless given): a schedule is its effective configuration.
        full = {k: default for k, (default, _) in declared.items()} | dict(self.knobs)
        object.__setattr__(self, "knobs", tuple(sorted(full.items())))

    @cached_property
    def scheduled(self) -> Program:
        """The program with every transform applied (raises IllegalTransform)."""
        return _apply(self.program, self.transforms)

    @property
    def sharded(self) -> tuple[str, ...]:
        """Updated state the program holds Replicated that this schedule leaves Sliced (``as_slice``): after
        the step each rank holds only its rows of it, ZeRO-style. Fine for optimizer moments that only the
        step reads; not for weights the model reads whole."""
        declared = {s.name: s.type.layout for s in self.program.inputs}
        return tuple(
            s.name
            for s in self.scheduled.inputs
            if s.name in self.program.updates
            and isinstance(declared.get(s.name), Replicated)
            and isinstance(s.type.layout, Sliced)
        )

    @property
    def knob_domains(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        out: dict[str, tuple[int, tuple[int, ...]]] = {}
        for t in self.transforms:
            out.update(t.knobs)
        return out

    @property
    def knob_values(self) -> dict[str, int]:
        return dict(self.knobs)

    def with_knobs(self, **values: int) -> "Schedule":
        merged = {**dict(self.knobs), **values}
        return Schedule(self.program, self.transforms, tuple(sorted(merged.items())))

    @property
    def text(self) -> str:
        if not self.transforms:
            return BASELINE
        items = [t.text() for t in self.transforms] + [f"{k}={v}" for k, v in sorted(self.knobs)]
        return "; ".join(items)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.transforms]

    @property
    def hash(self) -> str:
        return hashlib.sha256(f"{self.program.hash}\n{self.text}".encode()).hexdigest()[:16]

    @property
    def structure(self) -> str:
        return self.scheduled.hash

    def describe(self, memo: dict | None = None) -> str:
        """One phrase per run of alike transforms. ``memo``: shared by the schedules of one program's
        listing, whose schedules extend each other: a run is then worded once, not once per schedule that
        starts with it (re-applying every prefix made a listing quadratic in the program's tensors)."""
        if not self.transforms:
            return "the program as written"
        memo = {} if memo is None else memo
        parts, begin = [], 0
        for end in range(1, len(self.transforms) + 1):
            if end < len(self.transforms) and type(self.transforms[end]) is type(self.transforms[begin]):
                continue
            key = ("phrase", self.transforms[:end])
            if key not in memo:
                run = list(self.transforms[begin:end])
                memo[key] = type(run[0]).describe_many(run, self._after(begin, memo))
            parts.append(memo[key])
            begin = end
        if self.knobs:
            parts.append(", ".join(f"{k}={v}" for k, v in self.knobs))
        return "; ".join(parts)

    def _after(self, count: int, memo: dict) -> Program:
        """The program after the first ``count`` transforms, from the longest prefix ``memo`` holds."""
        have = count
        while have > 0 and ("program", self.transforms[:have]) not in memo:
            have -= 1
        prog = memo[("program", self.transforms[:have])] if have else self.program
        if count > have:
            prog = memo[("program", self.transforms[:count])] = _apply(prog, self.transforms[have:count])
        return prog

    def remember(self, memo: dict) -> None:
        """Gives ``memo`` (for ``describe``) this schedule's program where it is already computed."""
        if "scheduled" in self.__dict__ and self.transforms:
            memo[("program", self.transforms)] = self.__dict__["scheduled"]

    def to_json(self) -> dict[str, Any]:
        return {
            "program": self.program.hash,
            "text": self.text,
            "hash": self.hash,
            "transforms": self.names,
            "knobs": self.knob_values,
        }

    @classmethod
    def parse(cls, text: str, program: Program) -> "Schedule":
        """Parse canonical text; every transform is applied, so an illegal one is refused here."""
        limit = MAX_TEXT + TEXT_PER_STATEMENT * len(program)
        if not isinstance(text, str) or len(text) > limit:
            raise ScheduleError(
                f"schedule text must be a string of at most {limit} characters "
                f"for a program of {len(program)} statements"
            )
        transforms, knobs = _read(text)
        if not transforms and not knobs:
            return cls(program)
        sched = cls(program, tuple(transforms), tuple(sorted(knobs.items())))
        try:
            _ = sched.scheduled  # building it applies, and so checks, every transform
        except IllegalTransform as e:
            raise ScheduleError(f"illegal schedule: {e}") from None
        return sched

    @classmethod
    def from_json(cls, data: Mapping[str, Any], program: Program) -> "Schedule":
        if not isinstance(data, Mapping) or not isinstance(data.get("text"), str):
            raise ScheduleError("a schedule in JSON is an object with a 'text'")
        if data.get("program") not in (None, program.hash):
            raise ScheduleError(f"the schedule is for program {data['program']}, not {program.hash}")
        sched = cls.parse(data["text"], program)
        knobs = data.get("knobs") or {}
        if knobs:
            try:
                sched = sched.with_knobs(**{str(k): v for k, v in knobs.items()})
            except TypeError:
                raise ScheduleError("knobs must be an object of integers") from None
        return sched

    def pretty(self) -> str:
        """The scheduled program: each statement with its layout and the unit it runs in."""
        prog = self.scheduled
        lines = [f"# {prog.name}  schedule: {self.text}"]
        width = max((len(s.name) for s in prog.stmts), default=4)
        for s in prog.stmts:
            group = prog.group_of.get(s.name)
            where = f"  [{group.kind} {group.members[0]}…]" if group else ""
            typ = f"{s.type.shape_text()} {s.type.dtype or 'weak'} {s.type.layout}" if s.type else ""
            attrs = [f"{k}={v}" for k, v in s.attrs if k not in ("shape", "dtype", "layout")]
            lines.append(f"{s.name:<{width}} = {s.op}({', '.join(list(s.args) + attrs)})  {typ}{where}".rstrip())
        return "\n".join(lines)


def _apply(program: Program, transforms: tuple[Transform, ...]) -> Program:
    """``transforms`` applied in order; a run of one class in one rebuild where the class can (``apply_all``):
    one rebuild per transform made reading a schedule of k tensors cost k² statement copies."""
    for _, group in itertools.groupby(transforms, key=type):
        run = tuple(group)
        batched = type(run[0]).apply_all(program, run) if len(run) > 1 else None
        if batched is not None:
            program = batched
            continue
        for t in run:
            program = t.apply(program)
    return program


def _read(text: str) -> tuple[list[Transform], dict[str, int]]:
    """The transforms and knobs of a schedule's text, not yet applied to any program."""
    text = text.strip()
    transforms: list[Transform] = []
    knobs: dict[str, int] = {}
    if text in (BASELINE, ""):
        return transforms, knobs
    for raw in text.split(";"):
        if not raw.strip():
            continue
        m = _ITEM.match(raw)
        if m:
            if knobs:
                raise ScheduleError(f"{raw.strip()!r}: knobs come after every transform")
            name, inner = m.groups()
            if name not in BY_NAME:
                raise ScheduleError(f"unknown transform {name!r} (known: {', '.join(sorted(BY_NAME))})")
            args, kwargs = [], {}
            for a in (x.strip() for x in inner.split(",")):
                if not a:
                    continue
                if "=" in a:
                    k, v = (y.strip() for y in a.split("=", 1))
                    kwargs[k] = v
                else:
                    args.append(a)
            try:
                transforms.append(BY_NAME[name].from_args(args, kwargs))
            except IllegalTransform as e:
                raise ScheduleError(f"{raw.strip()!r}: {e.message}") from None
            continue
        k = _KNOB.match(raw)
        if k:
            name, value = k.group(1), int(k.group(2))
            if name in knobs:
                raise ScheduleError(f"knob {name} given twice ({name}={knobs[name]}, {name}={value})")
            if value > MAX_KNOB:  # a count or a byte size: past 2^40 it is a typo, and torch's int64 overflows
                raise ScheduleError(f"knob {name}={value} is larger than 2^40")
            knobs[name] = value
            continue
        raise ScheduleError(f"{raw.strip()!r} is neither a transform like split(ar0) nor a knob like chunks=4")
    return transforms, knobs


def sharded_by(text: str) -> list[str]:
    """``Schedule.sharded`` of a schedule's text, read without its program (sorted): ``as_slice`` applies only
    to state the program holds Replicated and updates, so its targets are that state."""
    return list(_as_slice_targets(text))


# GET /best answers with three schedules a request: reading each text anew (about 25 us) would add about a
# fifth to its serial latency (0.4 ms)
@functools.lru_cache(maxsize=4096)
def _as_slice_targets(text: str) -> tuple[str, ...]:
    return tuple(sorted(t.tensor for t in _read(text)[0] if t.name == "as_slice"))
