"""The programs and topologies a store records: written once, never overwritten."""

from __future__ import annotations

import importlib
import json
from typing import Any, Mapping

from sqlalchemy import inspect, select
from sqlalchemy.orm import Session

from coconet.errors import StoreError
from coconet.schedules.dsl import Program as DslProgram
from coconet.schedules.ir import Program
from coconet.schedules.serialize import to_dict
from coconet.server.models import Base, ProgramRow, TopologyRow, utcnow
from coconet.server.records import ProgramRecord, ProgramSummary, TopologyRecord
from coconet.server.store.engine import StoreBase
from coconet.server.store.rows import record, utc


class Programs(StoreBase):
    """The programs and topologies of a store."""

    def add_program(self, program: Program | DslProgram) -> str:
        """Record a program (IR, or a DSL ``Program``); returns its hash. Idempotent."""
        ir = program.ir if isinstance(program, DslProgram) else program
        if not isinstance(ir, Program):
            raise StoreError(f"add_program takes a Program, not {type(program).__name__} (JSON: coconet.load it first)")
        values = {"hash": ir.hash, "name": ir.name, "ir": to_dict(ir), "created_at": utcnow()}
        with self._tx("add_program", write=True) as s:
            _insert_missing(s, ProgramRow, values)
        return ir.hash

    def program(self, program_hash: str) -> ProgramRecord | None:
        with self._tx("program") as s:
            row = s.get(ProgramRow, program_hash)
            return record(ProgramRecord, row) if row else None

    def programs(self, limit: int | None = None, *, newest_first: bool = False) -> list[ProgramSummary]:
        """The recorded programs, oldest first (or newest first), at most ``limit`` of them."""
        p = ProgramRow
        order = (p.created_at.desc(), p.hash.desc()) if newest_first else (p.created_at, p.hash)
        with self._tx("programs") as s:
            rows = s.execute(select(p.hash, p.name, p.ir, p.created_at).order_by(*order).limit(limit))
            return [
                ProgramSummary(h, name, list(ir.get("dims", [])), len(ir.get("statements", [])), utc(created))
                for h, name, ir, created in rows
            ]

    def add_topology(self, name: str, fingerprint: Mapping[str, Any], source: str = "config") -> str:
        """Record a topology; the same name again must come with the same fingerprint (records are not overwritten)."""
        # As it will read back from JSON (tuples become lists), so that equal fingerprints compare equal.
        try:
            fingerprint = json.loads(json.dumps(dict(fingerprint)))
        except (TypeError, ValueError) as err:
            raise StoreError(f"the fingerprint of topology {name!r} is not JSON: {err}", topology=name) from None
        values = {"name": name, "fingerprint": fingerprint, "source": source, "created_at": utcnow()}
        with self._tx("add_topology", write=True) as s:
            _insert_missing(s, TopologyRow, values)
            recorded = s.get(TopologyRow, name).fingerprint
            if recorded != values["fingerprint"]:
                raise StoreError(
                    f"topology {name!r} is already recorded with another fingerprint: this store's results for it "
                    f"are of other machines ({_fingerprint_text(recorded)}), not these "
                    f"({_fingerprint_text(values['fingerprint'])}); tune into another store (--db), or calibrate "
                    f"these machines under a name of their own (coconet calibrate --name NAME) and pass "
                    f"--topology NAME",
                    topology=name,
                )
        return name

    def topology(self, name: str) -> TopologyRecord | None:
        with self._tx("topology") as s:
            row = s.get(TopologyRow, name)
            return record(TopologyRecord, row) if row else None


def _fingerprint_text(fp: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(fp.items()) if k in ("machine", "cpu", "cpus", "gpus", "cores"))


def _insert_missing(s: Session, model: type[Base], values: dict[str, Any]) -> None:
    """Insert unless the primary key exists, without a race between two writers (PostgreSQL does not lock as
    SQLite's BEGIN IMMEDIATE does)."""
    name = s.get_bind().dialect.name
    if name in ("postgresql", "sqlite"):
        dialect = importlib.import_module(f"sqlalchemy.dialects.{name}")
        s.execute(dialect.insert(model).values(**values).on_conflict_do_nothing())
    elif s.get(model, values[inspect(model).primary_key[0].name]) is None:
        s.add(model(**values))
