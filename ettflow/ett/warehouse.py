"""The warehouse: every archived run's events and metrics, queryable for reports.

    with Warehouse.open() as wh:                 # default_url(): see below
        wh.archive_run(RunInfo(run_id=..., model=..., mode=...), events, metrics)
        wh.runs_frame(model="dlrm")              # one row per run, components as columns
        wh.watermark("dlrm")                     # lineage of the model's refreshes: `ett.lineage`

Where it lives (`default_url()`, first match wins): `ETTFLOW_WAREHOUSE_URL` (PostgreSQL for
a team, e.g. ``postgresql+psycopg://user@host:5432/ettflow``, or any SQLAlchemy URL); else
the SQLite file ``$ETTFLOW_HOME/warehouse.db``; else ``$XDG_DATA_HOME/ettflow/warehouse.db``
(``~/.local/share/ettflow/warehouse.db`` by default). The folder is created. Opening
upgrades the schema with Alembic (`warehouse_db`); the tables are in `warehouse_models`.

Archiving is idempotent. Every table is written with upserts keyed by (run, attempt, rank,
seq) (or the table's own key), all in one transaction, so archiving a run twice, or from
several processes at once, leaves one copy. Archives of one run are serialized (PostgreSQL:
a transaction advisory lock on the run; SQLite: BEGIN IMMEDIATE), and a run's rows that the
new archive no longer has are deleted: the warehouse holds what the last archive was given.
Upserts are native ``INSERT .. ON CONFLICT DO UPDATE``: the warehouse is SQLite or
PostgreSQL (archiving into another database raises `WarehouseError`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, Table, bindparam, select, text
from sqlalchemy.dialects import postgresql, sqlite

from .capacity import Holding
from .events import L2_ORDER, PhaseEvent
from .redact import redact_url
from .run_metrics import RunMetrics
from .warehouse_db import WRITE, WarehouseError, default_url, open_engine
from .warehouse_models import CHILD_TABLES, Base, Event, HeldCapacityRow, Run, RunComponent
from .warehouse_rows import RunInfo, rows_for_run

if TYPE_CHECKING:
    import pandas as pd

    from .lineage import LineageRecord

__all__ = ["RunInfo", "Warehouse", "WarehouseError", "default_url", "COMPONENT_COLUMNS"]

COMPONENT_COLUMNS: tuple[str, ...] = tuple(f"{c}_s" for c in L2_ORDER)
_RUNS: Table = Run.__table__
_UPSERT_INSERT = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}
_IN_CHUNK = 500


def _run_lock_key(run_id: str) -> int:
    return int.from_bytes(hashlib.sha256(run_id.encode()).digest()[:8], "big", signed=True)


def _chunks(items: Sequence[Any], n: int) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


class Warehouse:
    """An open warehouse. Make one with `Warehouse.open(url)`; close it (or use `with`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @classmethod
    def open(cls, url: str | None = None) -> Warehouse:
        """Connect to `url` (default: `default_url()`) and upgrade its schema to head."""
        return cls(open_engine(url))

    @property
    def display_url(self) -> str:
        """The URL with its password masked, for messages."""
        return redact_url(self.engine.url)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Warehouse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Warehouse({self.display_url})"

    # -- archiving -----------------------------------------------------------------------

    def archive_run(
        self, info: RunInfo, events: Sequence[PhaseEvent], metrics: RunMetrics
    ) -> None:
        """Write one run (all attempts and ranks) in one transaction; idempotent."""
        dialect = self.engine.dialect.name
        if dialect not in _UPSERT_INSERT:
            raise WarehouseError(
                f"cannot archive into {self.display_url}: the warehouse supports SQLite and PostgreSQL "
                f"(native upserts), not {dialect}; set ETTFLOW_WAREHOUSE_URL to one of them"
            )
        rows = rows_for_run(info, events, metrics)
        with self.engine.connect() as conn:
            conn.execution_options(**{WRITE: True})
            with conn.begin():
                self._write(conn, info.run_id, rows)

    def _write(self, conn: Connection, run_id: str, rows: dict[str, list[dict]]) -> None:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _run_lock_key(run_id)})
        for table in (_RUNS, *(model.__table__ for model in CHILD_TABLES)):
            table_rows = rows[table.name]
            existing = self._existing_keys(conn, table, run_id)
            keep = {self._key(table, row) for row in table_rows}
            stale = [key for key in existing if key not in keep]
            if stale:
                conn.execute(self._by_key(table, table.delete()), self._key_params(table, stale))
            if table_rows:
                self._upsert(conn, table, table_rows)

    @staticmethod
    def _key(table: Table, row: dict[str, Any]) -> tuple:
        return tuple(row[c.name] for c in table.primary_key.columns)

    @staticmethod
    def _existing_keys(conn: Connection, table: Table, run_id: str) -> set[tuple]:
        pk = list(table.primary_key.columns)
        return {tuple(r) for r in conn.execute(select(*pk).where(table.c.run_id == run_id))}

    @staticmethod
    def _by_key(table: Table, stmt: Any) -> Any:
        return stmt.where(*(c == bindparam(f"k_{c.name}") for c in table.primary_key.columns))

    @staticmethod
    def _key_params(table: Table, keys: Iterable[tuple]) -> list[dict[str, Any]]:
        names = [f"k_{c.name}" for c in table.primary_key.columns]
        return [dict(zip(names, key, strict=True)) for key in keys]

    @staticmethod
    def _upsert(conn: Connection, table: Table, rows: list[dict[str, Any]]) -> None:
        insert = _UPSERT_INSERT[conn.dialect.name](table)
        stmt = insert.on_conflict_do_update(
            index_elements=[c.name for c in table.primary_key.columns],
            set_={c.name: insert.excluded[c.name] for c in table.columns if not c.primary_key},
        )
        conn.execute(stmt, rows)  # executemany (batched VALUES on PostgreSQL)

    # -- the held-capacity ledger (`ett.capacity.Holding`) ---------------------------------

    def record_holdings(self, holdings: Sequence[Holding]) -> int:
        """Write ledger lines (upsert by holding id: writing a line twice is harmless); how many."""
        if not holdings:
            return 0
        with self.engine.connect() as conn:
            conn.execution_options(**{WRITE: True})
            with conn.begin():
                self._upsert(conn, HeldCapacityRow.__table__, [h.row() for h in holdings])
        return len(holdings)

    def holdings(self, model: str | None = None) -> list[Holding]:
        """The ledger (one model's, or all), by request time."""
        t: Table = HeldCapacityRow.__table__
        stmt = select(t).order_by(t.c.requested_at, t.c.holding_id)
        if model is not None:
            stmt = stmt.where(t.c.model == model)
        with self.engine.connect() as conn:
            return [Holding(**{k: v for k, v in r.items() if k != "held_s"}) for r in conn.execute(stmt).mappings()]

    # -- lineage (`ett.lineage`) -----------------------------------------------------------

    def watermark(self, model: str) -> str | None:
        """The last window of the model's last PUBLISHED refresh (None: never published)."""
        from . import lineage

        return lineage.watermark(self, model)

    def last_published(self, model: str) -> LineageRecord | None:
        """The model's last PUBLISHED refresh: the next refresh's parent."""
        from . import lineage

        return lineage.last_published(self, model)

    def record_lineage(self, record: LineageRecord) -> None:
        """Write a refresh's lineage record (upsert by run id)."""
        from . import lineage

        lineage.record_lineage(self, record)

    def lineage(self, model: str) -> list[LineageRecord]:
        """Every refresh of the model, oldest first."""
        from . import lineage

        return lineage.lineage(self, model)

    # -- queries -------------------------------------------------------------------------

    def runs_frame(
        self, model: str | None = None, run_id: str | None = None, limit: int | None = None
    ) -> pd.DataFrame:
        """One row per run (the `runs` columns, then `<component>_s` for the six components
        and `unattributed_s`), by wall start; `limit` keeps the most recent runs."""
        import pandas as pd

        stmt = select(_RUNS)
        if model is not None:
            stmt = stmt.where(_RUNS.c.model == model)
        if run_id is not None:
            stmt = stmt.where(_RUNS.c.run_id == run_id)
        if limit is not None:
            stmt = stmt.order_by(_RUNS.c.wall_start.desc(), _RUNS.c.run_id.desc()).limit(limit)
        rc: Table = RunComponent.__table__
        with self.engine.connect() as conn:
            runs = [dict(r) for r in conn.execute(stmt).mappings()]
            exposed: dict[tuple[str, str], float] = {}
            ids = [r["run_id"] for r in runs]
            for chunk in _chunks(ids, _IN_CHUNK):
                comp = select(rc.c.run_id, rc.c.name, rc.c.exposed_s).where(
                    rc.c.kind == "component", rc.c.run_id.in_(chunk)
                )
                exposed.update({(r.run_id, r.name): r.exposed_s for r in conn.execute(comp)})
        for run in runs:
            for name in L2_ORDER:
                run[f"{name}_s"] = exposed.get((run["run_id"], name), 0.0)
        columns = [c.name for c in _RUNS.columns] + list(COMPONENT_COLUMNS)
        frame = pd.DataFrame(runs, columns=columns)
        frame["archived_at"] = pd.to_datetime(frame["archived_at"], utc=True)
        return frame.sort_values(["wall_start", "run_id"], ignore_index=True)

    def components_frame(self, run_id: str) -> pd.DataFrame:
        """The run's components (priority order, then unattributed), then its phases (most
        exposed first): run_id, kind, name, exposed_s, raw_s, owner."""
        frame = self.table_frame(RunComponent.__tablename__, run_id)
        order = {name: i for i, name in enumerate(L2_ORDER)}
        rank = [
            (0, order.get(name, len(order)), 0.0, name)
            if kind == "component"
            else (1, 0, -s, name)
            for kind, name, s in zip(frame["kind"], frame["name"], frame["exposed_s"], strict=True)
        ]
        frame = frame.iloc[sorted(range(len(frame)), key=rank.__getitem__)]
        return frame.reset_index(drop=True)

    def table_frame(self, table: str, run_id: str | None = None) -> pd.DataFrame:
        """Rows of one warehouse table (all runs, or one), ordered by its key."""
        import pandas as pd

        if table not in Base.metadata.tables:
            known = ", ".join(sorted(Base.metadata.tables))
            raise ValueError(f"no warehouse table {table!r}; tables: {known}")
        t = Base.metadata.tables[table]
        stmt = select(t).order_by(*t.primary_key.columns)
        if run_id is not None:
            stmt = stmt.where(t.c.run_id == run_id)
        with self.engine.connect() as conn:
            rows = [dict(r) for r in conn.execute(stmt).mappings()]
        return pd.DataFrame(rows, columns=[c.name for c in t.columns])

    def events_for(self, run_id: str) -> list[PhaseEvent]:
        """The run's archived phase events (with their seq), by start time."""
        t: Table = Event.__table__
        stmt = select(t).where(t.c.run_id == run_id).order_by(
            t.c.start, t.c.attempt, t.c.rank, t.c.seq
        )
        with self.engine.connect() as conn:
            return [
                PhaseEvent(run_id=r.run_id, attempt=r.attempt, rank=r.rank, phase=r.phase,
                           start=r.start, end=r.end, attrs=r.attrs or {}, seq=r.seq)
                for r in conn.execute(stmt)
            ]
