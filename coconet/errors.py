"""The exception tree of coconet.

Every error a user can cause is a ``CoconetError``. They pickle with their
fields intact because they cross process boundaries (Ray actors, spawned ranks).
"""

from __future__ import annotations


class CoconetError(Exception):
    """Base of every error coconet raises on purpose."""

    def __init__(self, message: str, **fields: object) -> None:
        super().__init__(message)
        self.message = message
        for key, value in fields.items():
            setattr(self, key, value)

    def __reduce__(self):
        # Exception's default pickling replays only ``args``; keep the fields too.
        fields = {k: v for k, v in self.__dict__.items() if k != "message"}
        return (_rebuild, (type(self), self.message, fields))

    def __str__(self) -> str:
        return self.message


def _rebuild(cls: type[CoconetError], message: str, fields: dict) -> CoconetError:
    err = cls.__new__(cls)
    CoconetError.__init__(err, message, **fields)
    return err


class ProgramError(CoconetError):
    """A program is malformed: bad shapes, layouts, dtypes, references or JSON.

    ``statement`` names the offending statement (None when the error is about
    the program as a whole), ``rule`` the rule it broke, ``location`` the user's
    ``file:line`` when the program was built from Python.
    """

    statement: str | None
    op: str | None
    rule: str | None
    location: str | None

    def __init__(
        self,
        message: str,
        *,
        statement: str | None = None,
        op: str | None = None,
        rule: str | None = None,
        location: str | None = None,
    ) -> None:
        super().__init__(message, statement=statement, op=op, rule=rule, location=location)

    def __str__(self) -> str:
        parts = []
        if self.location:
            parts.append(f"{self.location}: ")
        if self.statement is not None:
            what = f"statement {self.statement}"
            if self.op:
                what += f" ({self.op})"
            parts.append(what + ": ")
        parts.append(self.message)
        if self.rule:
            parts.append(f" [rule: {self.rule}]")
        return "".join(parts)


class SizeError(CoconetError):
    """A size binding (``N=2^20``) is malformed, missing or out of range."""


class IllegalTransform(CoconetError):
    """A transform was asked to apply where its preconditions do not hold."""

    transform: str | None

    def __init__(self, message: str, *, transform: str | None = None) -> None:
        super().__init__(message, transform=transform)

    def __str__(self) -> str:
        return f"{self.transform}: {self.message}" if self.transform else self.message


class ScheduleError(CoconetError):
    """A schedule's text or JSON does not describe a schedule of its program."""


class BackendError(CoconetError):
    """A backend cannot run a schedule, or a run failed; ``kind`` classifies it."""

    kind: str
    rank: int | None

    def __init__(self, message: str, *, kind: str = "runtime_error", rank: int | None = None) -> None:
        super().__init__(message, kind=kind, rank=rank)


class ClusterError(CoconetError):
    """The Ray cluster cannot hold what a study needs (from the start, or after losing a node): the study
    stops, where a candidate's own failure would only fail its trial."""


class NotAvailable(CoconetError):
    """A command or feature that this version of coconet does not provide yet."""


class MissingDependency(CoconetError):
    """A command or function needs a package the install lacks: ``module`` is its import name, ``extra`` the pip
    extra of coconet that installs it (``coconet[tune]``), None if none does."""

    module: str
    extra: str | None

    def __init__(self, message: str, *, module: str, extra: str | None) -> None:
        super().__init__(message, module=module, extra=extra)


class StoreError(CoconetError):
    """The results store cannot be opened or reached, or refused a record (unknown program, bad key)."""


class KeyBusy(StoreError):
    """A tuner asked for a key whose job another live process is running; ``running`` is that job's id,
    ``driver`` the text naming its process (``coconet.server.driver``), or None."""

    running: int
    driver: str | None

    def __init__(self, message: str, *, running: int, driver: str | None = None) -> None:
        super().__init__(message, running=running, driver=driver)


class TopologyError(CoconetError):
    """A topology (``configs/topologies/*.yaml``) is missing, malformed, or cannot run what was asked;
    ``field`` names the offending field (``links.intra.bandwidth_GBps``), None when it is the whole file."""

    field: str | None

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message, field=field)


class InputError(CoconetError):
    """A tensor or scalar handed to a compiled step does not fit its schedule: ``input`` names it, ``given``
    says what it was and ``expected`` what the schedule wants on this rank."""

    input: str | None
    given: str | None
    expected: str | None

    def __init__(
        self, message: str, *, input: str | None = None, given: str | None = None, expected: str | None = None
    ) -> None:
        super().__init__(message, input=input, given=given, expected=expected)
