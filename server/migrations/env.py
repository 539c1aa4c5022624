"""Alembic environment of the coconet store (version table ``coconet_alembic_version``).

``coconet.server.store`` runs it on an open connection (``config.attributes["connection"]``);
for ``alembic revision --autogenerate`` during development it opens ``sqlalchemy.url`` itself.
Only ``coconet_*`` tables are ours: Optuna's tables share the database and are left alone.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, text

from coconet.server.models import VERSION_TABLE, Base, include_name

# Any constant: serializes concurrent upgrades of one PostgreSQL database.
_PG_LOCK = 0x636F636F6E6574


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        version_table=VERSION_TABLE,
        include_name=include_name,
        # SQLite runs DDL in transactions too: a migration is all or nothing, and (the store begins writes with
        # BEGIN IMMEDIATE) a second process opening the same new file waits for it, then finds the schema at head.
        transactional_ddl=True,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK})
        context.run_migrations()


connection = context.config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    engine = create_engine(context.config.get_main_option("sqlalchemy.url"))
    with engine.connect() as conn:
        _run(conn)
    engine.dispose()
