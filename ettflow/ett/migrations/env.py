"""Alembic environment of the ettflow warehouse.

Run from the package (`ettflow.ett.warehouse_db.upgrade`), which passes its connection in
`config.attributes["connection"]` inside an open transaction and holds the migration lock.
Without one (the alembic CLI with `-x url=...` or `sqlalchemy.url` set), it connects to
that URL, or to `default_url()`.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from ettflow.ett.warehouse_db import default_url, make_engine
from ettflow.ett.warehouse_models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    return (
        context.get_x_argument(as_dictionary=True).get("url")
        or config.get_main_option("sqlalchemy.url")
        or default_url()
    )


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        compare_type=True,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite ALTERs by copy
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(_url())
    try:
        with engine.begin() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
