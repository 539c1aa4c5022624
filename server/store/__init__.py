"""The results store: programs, topologies, tuning jobs, measurements and winners (docs/architecture.md, "Data flow").

``Store.open(url)`` takes any SQLAlchemy URL (SQLite by default, PostgreSQL at
scale), upgrades the schema to head and hands back plain frozen records, never
ORM objects. Measurements and winners are append-only: a newer tuning adds a
winner and ``best`` takes the newest one whose measurement is valid.

``Store`` is one class made of its parts, each a module: ``engine`` (the database, its engines, migrations and
transactions), ``programs`` (programs and topologies), ``jobs`` (the job queue), ``measurements`` and
``winners`` (with the answers read from them, ``best`` and ``results``); ``rows`` holds what they share.
"""

from __future__ import annotations

from coconet.server.records import (
    Best,
    DoneKey,
    JobRecord,
    MeasurementDigest,
    MeasurementRecord,
    NewMeasurement,
    ProgramRecord,
    ProgramSummary,
    Progress,
    TopologyRecord,
    WinnerRecord,
)
from coconet.server.store.engine import (
    ENV_URL,
    MIGRATIONS,
    OPTUNA_CREATE_TRIES,
    SCHEMA_HEAD,
    SQLITE_BUSY_S,
    alembic_config,
    default_url,
    unavailable,
)
from coconet.server.store.jobs import ACTIVE_STATES, NEXT_STATES, RETAKEN, JobQueue
from coconet.server.store.measurements import Measurements
from coconet.server.store.programs import Programs
from coconet.server.store.winners import Winners

__all__ = [
    "ACTIVE_STATES",
    "ENV_URL",
    "MIGRATIONS",
    "NEXT_STATES",
    "OPTUNA_CREATE_TRIES",
    "RETAKEN",
    "SCHEMA_HEAD",
    "SQLITE_BUSY_S",
    "Best",
    "DoneKey",
    "JobRecord",
    "MeasurementDigest",
    "MeasurementRecord",
    "NewMeasurement",
    "ProgramRecord",
    "ProgramSummary",
    "Progress",
    "Store",
    "TopologyRecord",
    "WinnerRecord",
    "alembic_config",
    "default_url",
    "unavailable",
]


class Store(Programs, JobQueue, Measurements, Winners):
    """A results store on one database. Open with ``Store.open(url)``; close with ``close()`` or ``with``."""
