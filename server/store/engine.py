"""A store's database: the engines a URL opens (SQLite by default, PostgreSQL at scale), their settings, the
schema's migration to head, and the transactions and reads every part of the store runs in, whose failures
leave as a ``StoreError`` naming the operation and the cause."""

from __future__ import annotations

import os
import time
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

from sqlalchemy import Engine, create_engine, event, inspect, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session

from coconet.errors import StoreError
from coconet.paths import data_dir
from coconet.server.models import VERSION_TABLE

ENV_URL = "COCONET_DATABASE_URL"
# The newest migration in server/migrations/versions (a test keeps the two equal). Knowing it here
# lets an up-to-date database open without importing Alembic, which costs half a second per CLI call.
SCHEMA_HEAD = "0005"
SQLITE_BUSY_S = 30  # how long a write waits for SQLite's lock or a connection, unless opened with wait_s
OPTUNA_CREATE_TRIES = 5
MIGRATIONS = Path(__file__).resolve().parents[1] / "migrations"
_WRITE = "coconet_write"


def default_url() -> str:
    """``$COCONET_DATABASE_URL``, else ``sqlite:///<data dir>/coconet.db`` (``coconet.paths.data_dir``)."""
    env = os.environ.get(ENV_URL)
    if env:
        return env

    return f"sqlite:///{data_dir() / 'coconet.db'}"


_R = TypeVar("_R")
_S = TypeVar("_S", bound="StoreBase")


class StoreBase:
    """A store's engines and transactions, which its parts (programs, jobs, measurements, winners) run on."""

    def __init__(self, engine: Engine, url: str, wait_s: float = SQLITE_BUSY_S) -> None:
        self._engine = engine
        # Reads have pools of their own: writers waiting for a lock, as many as the write pool holds, leave
        # reads a connection. _reads runs transactions (the ORM's reads), _reader the hot path's statements.
        self._reads = _reads_engine(engine)
        self._reader = _read_engine(engine, self._reads)
        self._wait_s = wait_s
        self.url = url

    @classmethod
    def open(cls: type[_S], url: str | None = None, *, create: bool = True, wait_s: float | None = None) -> _S:
        """Open (and create or migrate) the store; ``url`` beats ``$COCONET_DATABASE_URL`` beats the default.
        ``create=False``, for a lookup: a SQLite file that does not exist is refused, not made (a mistyped path
        would otherwise leave an empty store, and its folders, behind). With ``wait_s``, a write waits at most
        that long for a connection of the pool and as long again for the database's lock (SQLite's file,
        PostgreSQL's rows and key locks), then fails with a StoreError whose ``busy`` is True; without, it waits
        SQLITE_BUSY_S for SQLite's lock and as long as it takes for PostgreSQL's."""
        engine, shown = _engine(url or default_url(), create=create, wait_s=wait_s)
        store = cls(engine, shown, SQLITE_BUSY_S if wait_s is None else wait_s)
        try:
            store._upgrade()
        except BaseException:
            store.close()
            raise
        return store

    def close(self) -> None:
        self._reader.dispose()
        self._reads.dispose()
        self._engine.dispose()

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def optuna_storage(self) -> Any:
        """Optuna's RDB storage on this store's database: studies live beside the results they led to."""
        import optuna

        url = self._engine.url.render_as_string(hide_password=False)
        kwargs = {"connect_args": {"timeout": 30}} if self.dialect == "sqlite" else {"pool_pre_ping": True}
        # Optuna makes its tables on first use, looking before it creates: of the processes doing that at once on
        # a fresh database all but one fail ("table studies already exists", a second revision row). Making them
        # is idempotent, so a loser makes them again and finds them there.
        tries = 0
        while True:
            try:
                return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
            except SQLAlchemyError as err:
                tries += 1
                message = str(getattr(err, "orig", None) or err).lower()
                lost = any(m in message for m in ("already exists", "unique constraint", "duplicate key", "locked"))
                if not lost or tries == OPTUNA_CREATE_TRIES:
                    raise StoreError(f"Optuna's storage on {self.url}: {_cause(err)}", url=self.url) from err
                time.sleep(0.05 * tries)

    @property
    def dialect(self) -> str:
        return self._engine.dialect.name

    def reading(self, what: str) -> AbstractContextManager[Session]:
        """A read-only transaction for queries written outside the store (the dashboard's filtered pages), on
        the read pool; SQLAlchemy's errors leave as a StoreError naming ``what``."""
        return self._tx(what)

    def _read(self, what: str, read: Callable[[Any], _R]) -> _R:
        """``read(cursor)`` on a DB-API cursor of the read engine, outside a transaction: for reads of rows that
        are never updated (each statement sees one snapshot). The pool does not ping a connection before each
        use; one the database dropped (a restart) fails on first use instead, and the read, which changes
        nothing, runs once more on a fresh connection."""
        dialect = self._reader.dialect
        for attempt in (1, 2):
            try:
                conn = self._reader.raw_connection()
            except SQLAlchemyError as err:
                raise self._failed(what, err) from err
            try:
                cursor = conn.cursor()
                try:
                    return read(cursor)
                finally:
                    cursor.close()
            except dialect.loaded_dbapi.Error as err:
                if attempt == 1 and dialect.is_disconnect(err, conn.dbapi_connection, None):
                    conn.invalidate(err)
                    continue
                raise self._failed(what, err) from err
            finally:
                conn.close()
        raise AssertionError("unreachable: the second attempt returns or raises")

    @contextmanager
    def _tx(self, what: str, write: bool = False) -> Iterator[Session]:
        """One transaction, on the write pool if ``write``, else on the read pool; SQLAlchemy's errors leave as a
        StoreError naming the operation and the cause."""
        try:
            with (self._engine if write else self._reads).connect() as conn:
                if write:
                    conn.execution_options(**{_WRITE: True})
                with Session(bind=conn, expire_on_commit=False) as session, session.begin():
                    yield session
        except SQLAlchemyError as err:
            raise self._failed(what, err) from err

    def _failed(self, what: str, err: Exception) -> StoreError:
        """The StoreError for ``what`` failing with ``err``: ``operation`` names what failed, ``busy`` says whether
        it only waited too long (for a connection of the pool, or for a lock another connection held)."""
        busy = _busy(err)
        cause = _cause(err, self._wait_s) if isinstance(err, SQLAlchemyError) else " ".join(str(err).split())
        if busy and "locked" not in cause:
            cause += f" (waited {self._wait_s:g} s)"
        return StoreError(f"{what} on {self.url}: {cause}", url=self.url, operation=what, busy=busy)

    def _upgrade(self) -> None:
        try:
            with self._engine.connect() as conn:
                if _revision(conn) == SCHEMA_HEAD:
                    return
                conn.rollback()
                conn.execution_options(**{_WRITE: True})
                from alembic import command
                from alembic.util import CommandError

                config = alembic_config()
                config.attributes["connection"] = conn
                try:
                    command.upgrade(config, "head")
                except CommandError as err:
                    raise StoreError(
                        f"the database at {self.url} has a schema this coconet does not know ({err}); "
                        "is it from a newer coconet?",
                        url=self.url,
                    ) from err
        except SQLAlchemyError as err:
            raise StoreError(f"cannot open the store at {self.url}: {_cause(err)}", url=self.url) from err


def alembic_config() -> Any:
    """An Alembic config for the store's migrations, no alembic.ini needed; set ``attributes["connection"]``."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


def _engine(url_text: str, create: bool = True, wait_s: float | None = None) -> tuple[Engine, str]:
    try:
        url = make_url(url_text)
    except ArgumentError:
        raise StoreError(
            f"{url_text!r} is not a database URL (e.g. sqlite:////path/coconet.db or postgresql://user@host/db)"
        ) from None
    if url.drivername == "postgresql":
        # psycopg 3 is the driver coconet declares; SQLAlchemy would otherwise look for psycopg2.
        url = url.set(drivername="postgresql+psycopg")
    shown = url.render_as_string(hide_password=True)
    is_sqlite = url.get_backend_name() == "sqlite"
    file = _sqlite_file(url) if is_sqlite else None
    if file is not None and not create and not file.exists():
        raise StoreError(f"no store at {shown}: the file does not exist (coconet tune makes one)", url=shown)
    if is_sqlite:
        _make_parent_dir(url)
    busy_s = SQLITE_BUSY_S if wait_s is None else wait_s
    # an in-memory SQLite database lives in one connection (SingletonThreadPool): no pool to wait for
    in_memory = is_sqlite and _sqlite_file(url) is None
    options: dict[str, Any] = {} if in_memory else {"pool_timeout": busy_s}
    if wait_s is not None and not is_sqlite:  # PostgreSQL waits for a lock as long as it is held, unless told
        options["connect_args"] = {"options": f"-c lock_timeout={round(wait_s * 1000)}"}
    try:
        engine = create_engine(url, pool_pre_ping=not is_sqlite, **options)
    except (ArgumentError, NoSuchModuleError, ImportError) as err:
        raise StoreError(f"cannot open the store at {shown}: {err}", url=shown) from err
    if is_sqlite:
        event.listen(engine, "connect", partial(_sqlite_connect, busy_s=busy_s))
        event.listen(engine, "begin", _sqlite_begin)
    return engine, shown


def _reads_engine(engine: Engine) -> Engine:
    """The engine of the store's read transactions: the write engine's settings on a pool of its own."""
    if engine.dialect.name == "postgresql":
        return create_engine(engine.url, pool_pre_ping=True)
    if _sqlite_file(engine.url) is None:  # an in-memory database is its one connection: another would be empty
        return engine
    reads = create_engine(engine.url)
    event.listen(reads, "connect", _sqlite_connect)
    event.listen(reads, "begin", _sqlite_begin)
    return reads


def _read_engine(engine: Engine, reads: Engine) -> Engine:
    """The engine Store._read uses. On PostgreSQL its own pool: connections in autocommit for good (no BEGIN and
    ROLLBACK round trips) and no ping before each use (a round trip per lookup). On SQLite the read pool (its
    connections are in sqlite3's autocommit mode until the store emits BEGIN, which _read never does)."""
    if engine.dialect.name == "postgresql":
        return create_engine(engine.url, isolation_level="AUTOCOMMIT")
    return reads


class Rendered:
    """A Core statement rendered once for one dialect and run on a plain DB-API cursor: on the API's hot path
    SQLAlchemy's work per execution (a Connection, the compiled-cache lookup, result metadata, row objects)
    cost more than the indexed read itself. Values still go through SQLAlchemy's own result processors (JSON,
    SQLite's datetimes), chosen once from the cursor's description. Parameters go as they are: the statements
    bind only strings and integers, which no dialect here converts."""

    def __init__(self, statement: Any, dialect: Any) -> None:
        self._compiled = statement.compile(dialect=dialect)
        self._sql = str(self._compiled)
        self._types = [c.type.dialect_impl(dialect) for c in statement.selected_columns]
        self._dialect = dialect
        self._processors: list[Any] | None = None

    def rows(self, cursor: Any, values: Mapping[str, Any]) -> list[list[Any]]:
        self._execute(cursor, values)
        return [self.processed(cursor, row) for row in cursor.fetchall()]

    def first(self, cursor: Any, values: Mapping[str, Any], keep: Callable[[Sequence[Any]], bool]) -> list[Any] | None:
        """The first row ``keep`` takes, judged on the values as the driver gives them (before JSON and dates are
        processed: only the row kept pays for that)."""
        for row in self.each(cursor, values):
            if keep(row):
                return self.processed(cursor, row)
        return None

    def each(self, cursor: Any, values: Mapping[str, Any]) -> Iterator[Sequence[Any]]:
        """The rows as the driver gives them; ``processed`` turns the one kept into values, before the cursor
        runs anything else."""
        self._execute(cursor, values)
        while rows := cursor.fetchmany(64):
            yield from rows

    def _execute(self, cursor: Any, values: Mapping[str, Any]) -> None:
        params = self._compiled.construct_params(values)
        cursor.execute(
            self._sql, tuple(params[k] for k in self._compiled.positiontup) if self._compiled.positional else params
        )

    def processed(self, cursor: Any, row: Sequence[Any]) -> list[Any]:
        if self._processors is None:
            self._processors = [
                t.result_processor(self._dialect, d[1]) for t, d in zip(self._types, cursor.description)
            ]
        return [f(v) if f else v for f, v in zip(self._processors, row)]


def _sqlite_file(url: URL) -> Path | None:
    db = url.database or ""
    return Path(db).expanduser() if db and db != ":memory:" and not db.startswith("file:") else None


def _make_parent_dir(url: URL) -> None:
    path = _sqlite_file(url)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StoreError(f"cannot create the directory of {path}: {err.strerror}") from None


def _sqlite_connect(dbapi_conn: Any, _record: Any, busy_s: float = SQLITE_BUSY_S) -> None:
    # We emit BEGIN ourselves (below), so sqlite3's own transaction handling is turned off.
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout = {round(busy_s * 1000)}")
    _sqlite_wal(cur, dbapi_conn.OperationalError, busy_s)
    cur.execute("PRAGMA synchronous = NORMAL")  # durable enough under WAL, and much faster per commit
    cur.execute("PRAGMA foreign_keys = ON")
    cur.close()


def _sqlite_wal(cur: Any, busy: type[Exception], busy_s: float = SQLITE_BUSY_S) -> None:
    """Puts the file in WAL mode, where readers never wait for the writer. Processes opening a fresh file at
    once can meet mid-change, and SQLite then fails one with "database is locked" at once instead of calling
    the busy handler: that one tries again, for as long as the busy timeout would have waited."""
    deadline = time.monotonic() + busy_s
    pause = 0.001
    while True:
        try:
            if cur.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                cur.execute("PRAGMA journal_mode = WAL")
            return
        except busy as err:
            if "locked" not in str(err) or time.monotonic() + pause > deadline:
                raise
            time.sleep(pause)
            pause = min(2 * pause, 0.1)


def _sqlite_begin(conn: Any) -> None:
    # A deferred transaction that reads and then writes fails at once with "database is locked" when another
    # process wrote in between (busy_timeout cannot help); writers take the lock up front and wait for it instead.
    conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITE) else "BEGIN")


def _revision(conn: Any) -> str | None:
    if not inspect(conn).has_table(VERSION_TABLE):
        return None
    return conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()


def _cause(err: SQLAlchemyError, busy_s: float = SQLITE_BUSY_S) -> str:
    cause = getattr(err, "orig", None) or err
    message = " ".join(str(cause).split())
    if "database is locked" in message:
        message += f" (another process kept the SQLite file locked; busy timeout {busy_s:g} s)"
    return message[:500]


def unavailable(err: StoreError) -> str:
    """What a client may be told of a failure of the store: whether it was busy, and what failed; never the
    cause's text, which names the database (its URL, host and port, the driver's words)."""
    if getattr(err, "busy", False):
        return "the results store is busy; retry"
    what = getattr(err, "operation", None)
    return f"the results store is unavailable ({f'{what} failed; ' if what else ''}the server's log says why)"


def _busy(err: Exception) -> bool:
    """Whether ``err`` is a wait given up: for a connection of the pool, SQLite's file lock, a PostgreSQL lock."""
    if isinstance(err, PoolTimeout):
        return True
    cause = getattr(err, "orig", None)
    if getattr(cause, "sqlstate", None) == "55P03":  # lock_not_available: lock_timeout ran out
        return True
    return isinstance(err, OperationalError) and any(
        m in str(cause) for m in ("database is locked", "database is busy")
    )
