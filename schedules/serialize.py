"""The canonical JSON form of a program (the only form the server accepts).

``{"version": 1, "name": ..., "dims": [...], "statements": [{"name", "op", "args", "attrs"}, ...]}``.
Inferred types are not stored: ``load`` infers them again, so a JSON program
is verified exactly like one built from Python. Unknown keys and ops, dangling
or cyclic references, bad dims and oversized programs are refused with one
message naming the statement.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

from coconet.errors import ProgramError
from coconet.schedules.builder import Builder
from coconet.schedules.custom import CustomOp, OpRegistry, as_op_map
from coconet.schedules.ir import MAX_STATEMENTS, SCHEMA_VERSION, Program

MAX_JSON_BYTES = 16 * 2**20
TOP_KEYS = {"version", "name", "dims", "statements"}
STMT_KEYS = {"name", "op", "args", "attrs"}


def to_dict(program: Program) -> dict[str, Any]:
    stmts = []
    for s in program.stmts:
        entry: dict[str, Any] = {"name": s.name, "op": s.op}
        if s.args:
            entry["args"] = list(s.args)
        if s.attrs:
            entry["attrs"] = {k: list(v) if isinstance(v, tuple) else v for k, v in s.attrs}
        stmts.append(entry)
    return {"version": SCHEMA_VERSION, "name": program.name, "dims": list(program.dims), "statements": stmts}


def export(program: Program, indent: int | None = 2) -> str:
    return json.dumps(to_dict(program), indent=indent)


def load(
    source: str | bytes | Mapping[str, Any], ops: OpRegistry | Mapping[str, CustomOp] | Iterable[CustomOp] | None = None
) -> Program:
    """Parse and verify a JSON program; raises ``ProgramError``."""
    data = _parse(source) if isinstance(source, (str, bytes)) else source
    if not isinstance(data, Mapping):
        raise ProgramError("a JSON program is an object with version, name, dims and statements")
    unknown = sorted(set(data) - TOP_KEYS)
    if unknown:
        raise ProgramError(f"unknown keys {unknown} in the program (allowed: {sorted(TOP_KEYS)})")
    missing = sorted(TOP_KEYS - set(data))
    if missing:
        raise ProgramError(f"the program lacks {missing}")
    if type(data["version"]) is not int or data["version"] != SCHEMA_VERSION:  # true == 1 and 1.0 == 1 in Python
        raise ProgramError(f"schema version {data['version']!r} is not supported (this coconet reads {SCHEMA_VERSION})")
    dims = data["dims"]
    if not isinstance(dims, list):
        raise ProgramError("dims must be a list of names")
    stmts = data["statements"]
    if not isinstance(stmts, list):
        raise ProgramError("statements must be a list")
    if len(stmts) > MAX_STATEMENTS:
        raise ProgramError(f"program has {len(stmts)} statements; at most {MAX_STATEMENTS} are accepted")

    b = Builder(data["name"], tuple(dims), as_op_map(ops))
    entries: dict[str, dict] = {}
    order: list[str] = []
    for i, entry in enumerate(stmts):
        where = f"statements[{i}]"
        if not isinstance(entry, Mapping):
            raise ProgramError(f"{where} is not an object")
        name = entry.get("name")
        if not isinstance(name, str):
            raise ProgramError(f"{where} has no string 'name'")
        bad = sorted(set(entry) - STMT_KEYS)
        if bad:
            raise ProgramError(f"unknown keys {bad} (allowed: {sorted(STMT_KEYS)})", statement=name)
        if not isinstance(entry.get("op"), str):
            raise ProgramError("'op' must be a string", statement=name)
        args = entry.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ProgramError("'args' must be a list of statement names", statement=name, op=entry["op"])
        attrs = entry.get("attrs", {})
        if not isinstance(attrs, Mapping):
            raise ProgramError("'attrs' must be an object", statement=name, op=entry["op"])
        if name in entries:
            raise ProgramError(f"name {name!r} is defined twice", statement=name, rule="statement names are unique")
        entries[name] = entry
        order.append(name)

    idx: dict[str, int] = {}
    for name in _topological(entries, order):
        e = entries[name]
        idx[name] = b.add(e["op"], tuple(idx[a] for a in e.get("args", [])), dict(e.get("attrs", {})), name=name)
    return b.finish()


def _parse(source: str | bytes) -> Any:
    if len(source) > MAX_JSON_BYTES:
        raise ProgramError(f"program JSON is {len(source)} bytes; at most {MAX_JSON_BYTES} are accepted")
    try:
        return json.loads(source)
    except RecursionError:
        raise ProgramError("program JSON is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ProgramError(f"not valid JSON: {e}") from None


def _topological(entries: dict[str, dict], order: list[str]) -> list[str]:
    """Statements in dependency order (stable); names dangling and cyclic references."""
    for name in order:
        for a in entries[name].get("args", []):
            if a not in entries:
                raise ProgramError(
                    f"refers to {a!r}, which no statement defines",
                    statement=name,
                    op=entries[name]["op"],
                    rule="references name earlier statements",
                )
    state: dict[str, int] = {}  # 1 visiting, 2 done
    out: list[str] = []
    for root in order:
        if state.get(root):
            continue
        stack: list[tuple[str, int]] = [(root, 0)]
        state[root] = 1
        while stack:
            name, i = stack[-1]
            args = entries[name].get("args", [])
            if i < len(args):
                stack[-1] = (name, i + 1)
                nxt = args[i]
                if state.get(nxt) == 1:
                    cycle = [n for n, _ in stack[[n for n, _ in stack].index(nxt) :]] + [nxt]
                    raise ProgramError(
                        f"cyclic reference: {' -> '.join(cycle)}",
                        statement=nxt,
                        op=entries[nxt]["op"],
                        rule="programs are acyclic",
                    )
                if not state.get(nxt):
                    state[nxt] = 1
                    stack.append((nxt, 0))
            else:
                state[name] = 2
                out.append(name)
                stack.pop()
    return out
