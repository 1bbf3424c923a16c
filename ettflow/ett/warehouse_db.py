"""Where the warehouse lives, and opening it: URL, engine, schema upgrade.

The warehouse is any SQLAlchemy URL. `default_url()` picks it, first match wins:

1. `ETTFLOW_WAREHOUSE_URL` (e.g. ``postgresql+psycopg://user:pw@host:5432/ettflow`` for a
   team warehouse, or anything else SQLAlchemy reaches);
2. ``sqlite:///$ETTFLOW_HOME/warehouse.db`` when `ETTFLOW_HOME` is set;
3. ``sqlite:///$XDG_DATA_HOME/ettflow/warehouse.db``, with `XDG_DATA_HOME` defaulting to
   ``~/.local/share`` (so ``~/.local/share/ettflow/warehouse.db``).

The folder of the default SQLite file is created (`ettflow.paths.data_home`). `open_engine`
connects, then upgrades the schema to the newest Alembic revision (`ett/migrations`, no
alembic.ini needed). Several processes may open a fresh database at once: the upgrade runs
under a lock (PostgreSQL: a session advisory lock on the migration connection; SQLite: an
fcntl lock on the file ``<db>.migrate.lock`` beside the database), so exactly one of them
creates the tables.
SQLite runs in WAL mode with a 30 s busy timeout, so concurrent writers wait instead of
failing, and with foreign keys on. A database that cannot be reached raises
`WarehouseError`, naming the URL (password masked) and what to check.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, create_engine, event, make_url, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import ArgumentError, InterfaceError, NoSuchModuleError, OperationalError

from ..paths import data_home
from .redact import redact_url, scrub

try:  # POSIX only; elsewhere concurrent first opens of one SQLite file are not serialized
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

ENV_URL = "ETTFLOW_WAREHOUSE_URL"
BUSY_TIMEOUT_S = 30.0
MIGRATIONS = Path(__file__).with_name("migrations")
# Execution option: the transaction will write (SQLite: BEGIN IMMEDIATE takes the write
# lock up front, so a writer waits on the busy timeout instead of failing on a stale snapshot).
WRITE = "ettflow_write"
_MIGRATION_LOCK_KEY = 0x65747466_6C6F7701  # pg_advisory_lock key: "ettflow" + 1


class OpenWarehouse(Protocol):
    """What the table modules (`ett.lineage`, ...) read and write through: an engine and the
    URL to show. `ett.warehouse.Warehouse` is one; they take this, not it, so that it can
    delegate to them without an import circle."""

    engine: Engine

    @property
    def display_url(self) -> str: ...


class WarehouseError(RuntimeError):
    """The warehouse cannot be used; the message names the URL and what to check."""

    explained = True  # shown without a traceback (`ettflow.console`)


def default_url() -> str:
    """The warehouse URL from the environment (see the module docstring)."""
    if os.environ.get(ENV_URL):
        return os.environ[ENV_URL]
    return f"sqlite:///{data_home() / 'warehouse.db'}"  # data_home() creates the folder


def _sqlite_file(url: URL) -> Path | None:
    db = url.database
    if not db or db == ":memory:" or db.startswith("file:") or url.query.get("uri"):
        return None
    return Path(db)


def _unreachable(url: URL, exc: Exception) -> WarehouseError:
    reason = scrub(" ".join(
        line.strip() for line in str(getattr(exc, "orig", None) or exc).splitlines() if line.strip()
    ), url)
    backend = url.get_backend_name()
    if backend == "sqlite":
        hint = f"check that the folder of {url.database!r} exists and is writable"
    elif backend == "postgresql":
        where = f"{url.host or 'localhost'}:{url.port or 5432}"
        hint = (
            f"check that PostgreSQL is running and accepts connections at {where} "
            f"(pg_isready -h {url.host or 'localhost'} -p {url.port or 5432}), that database "
            f"{url.database!r} exists and that user {url.username!r} may log in"
        )
    else:
        hint = f"check that the {backend} server is running and reachable"
    return WarehouseError(
        f"cannot reach the ettflow warehouse at {redact_url(url)}\n  error: {reason}\n"
        f"  {hint[0].upper()}{hint[1:]}; or set {ENV_URL} to a reachable database (unset, "
        f"it is the SQLite file warehouse.db in $ETTFLOW_HOME or $XDG_DATA_HOME/ettflow)."
    )


def _enable_wal(cur) -> None:
    """Switch a database file to WAL once (the mode persists). Switching needs the file to
    itself and SQLite does not wait on the busy handler for it, so a first open that races
    another connection's transaction retries until the busy timeout instead of failing."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    delay = 0.01
    while True:
        mode = cur.execute("PRAGMA journal_mode").fetchone()[0]
        if str(mode).lower() in ("wal", "memory"):
            return
        try:
            cur.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def _sqlite_events(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:
        dbapi_conn.isolation_level = None  # SQLAlchemy emits BEGIN itself (below)
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        _enable_wal(cur)
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        write = conn.get_execution_options().get(WRITE, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def make_engine(url: str | URL) -> Engine:
    try:
        url = make_url(url)
        kwargs: dict = {}
        if url.get_backend_name() == "sqlite":
            kwargs["connect_args"] = {"timeout": BUSY_TIMEOUT_S}
        elif url.get_backend_name() == "postgresql" and "connect_timeout" not in url.query:
            kwargs["connect_args"] = {"connect_timeout": 10}
        engine = create_engine(url, pool_pre_ping=True, **kwargs)
    except (ArgumentError, NoSuchModuleError, ImportError) as exc:
        shown = redact_url(url) if isinstance(url, URL) else "<unparseable URL>"
        raise WarehouseError(
            f"cannot use the warehouse URL {shown}: {exc}. Check {ENV_URL} (a SQLAlchemy URL "
            "such as postgresql+psycopg://user@host:5432/db) and that its driver is installed."
        ) from exc
    if url.get_backend_name() == "sqlite":
        _sqlite_events(engine)
    return engine


def alembic_config(connection: Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS).replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Upgrade the schema under the migration lock; a no-op when already at `revision`."""
    postgres = engine.dialect.name == "postgresql"
    with contextlib.ExitStack() as stack:
        db_file = _sqlite_file(engine.url) if engine.dialect.name == "sqlite" else None
        if db_file is not None:
            stack.enter_context(_file_lock(db_file.with_name(db_file.name + ".migrate.lock")))
        conn = stack.enter_context(engine.connect())
        if postgres:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _MIGRATION_LOCK_KEY})
            conn.commit()
            stack.callback(_pg_unlock, conn)
        conn = conn.execution_options(**{WRITE: True})
        with conn.begin():
            command.upgrade(alembic_config(conn), revision)


def _pg_unlock(conn: Connection) -> None:
    try:
        conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _MIGRATION_LOCK_KEY})
        conn.commit()
    except Exception:  # noqa: BLE001 - a dead connection: dropping it releases the session lock
        conn.invalidate()


def open_engine(url: str | URL | None = None) -> Engine:
    """An engine on the warehouse at `url` (default: `default_url()`), schema at head."""
    engine = make_engine(url if url is not None else default_url())
    try:
        with engine.connect():
            pass
    except (OperationalError, InterfaceError) as exc:
        engine.dispose()
        raise _unreachable(engine.url, exc) from exc
    try:
        upgrade(engine)
    except BaseException:
        engine.dispose()
        raise
    return engine
