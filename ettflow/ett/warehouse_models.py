"""Warehouse schema: typed SQLAlchemy 2 models, one table per thing a run is made of.

- `runs`: one row per run (L1 summary, counts, status, tags).
- `attempts`: one row per attempt of a run (its span, whether it failed, raw phase seconds).
- `run_components`: one row per L2 component (the six + `unattributed`, kind 'component')
  and per phase the sweep saw (kind 'phase'), exposed and raw seconds, and who owns it.
  Components carry no raw time (the partition gives only their exposed seconds): raw_s NULL.
- `events`: every phase event, keyed like the spool: (run, attempt, rank, seq).
- `failures`: one row per failed attempt with its TTR.
- `checkpoints`: the checkpoint-save events with the step, path and size they recorded.
- `refresh_lineage`: one row per refresh of a model: the windows it trained, its parent
  (anchor and snapshot), its own anchor and snapshot, and its outcome (`ett.lineage`).
- `window_claims`: which refresh holds (or has trained) which window of a model (`ett.lineage`).

Times are epoch seconds (double precision) as in `PhaseEvent`; `archived_at` is a UTC
timestamp. The Alembic migrations in `ett/migrations/versions` create exactly this schema
(a test compares them). Pure declarations: no I/O here.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Double,
    ForeignKey,
    Integer,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    type_annotation_map = {
        float: Double(),
        int: Integer(),
        bool: Boolean(),
        str: String(255),
        dict[str, Any]: JSON(),
        datetime: DateTime(timezone=True),
    }


def _run_fk() -> Mapped[str]:
    return mapped_column(
        String(255), ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True
    )


class Run(Base):
    __tablename__ = "runs"

    run_id: Mapped[str] = mapped_column(primary_key=True)
    model: Mapped[str] = mapped_column(index=True)  # model or job name
    flow_run_id: Mapped[str | None]
    mode: Mapped[str] = mapped_column(String(64))  # e.g. baseline / optimized
    status: Mapped[str] = mapped_column(String(32))
    tags: Mapped[dict[str, Any]]  # e.g. {"benchmark": true}
    wall_start: Mapped[float] = mapped_column(index=True)
    wall_end: Mapped[float]
    wall_s: Mapped[float]
    tts_s: Mapped[float]
    started_training: Mapped[bool]
    nof: Mapped[int]
    ttr_total_s: Mapped[float]
    ttr_mean_s: Mapped[float]
    ett_pct: Mapped[float]
    ett_l1_pct: Mapped[float]
    effective_steps: Mapped[int]
    replayed_steps: Mapped[int]
    checkpoint_saves: Mapped[int]
    checkpoint_blocking_s: Mapped[float]  # mean blocking time of one save (CSBT)
    # capacity held for the run outside its slots (pooled workers, spares; `ett.capacity`),
    # and the ETT that counts it; NULL in rows archived before migration 0003
    held_s: Mapped[float | None]
    unused_spare_s: Mapped[float | None]
    capacity_ett_pct: Mapped[float | None]
    archived_at: Mapped[datetime]


class Attempt(Base):
    __tablename__ = "attempts"

    run_id: Mapped[str] = _run_fk()
    attempt: Mapped[int] = mapped_column(primary_key=True)
    start: Mapped[float]
    end: Mapped[float]
    failed: Mapped[bool]
    phase_raw_s: Mapped[dict[str, Any]]  # phase -> raw seconds in this attempt


class RunComponent(Base):
    __tablename__ = "run_components"

    run_id: Mapped[str] = _run_fk()
    # 'component' or 'phase': part of the key because some names are both (scheduling,
    # pt2_compile, shutdown are a component and a phase of it).
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    exposed_s: Mapped[float]
    raw_s: Mapped[float | None]
    owner: Mapped[str | None] = mapped_column(String(32))


class Event(Base):
    __tablename__ = "events"

    run_id: Mapped[str] = _run_fk()
    attempt: Mapped[int] = mapped_column(primary_key=True)
    rank: Mapped[int] = mapped_column(primary_key=True)
    seq: Mapped[int] = mapped_column(primary_key=True)
    phase: Mapped[str] = mapped_column(String(64))
    start: Mapped[float]
    end: Mapped[float]
    attrs: Mapped[dict[str, Any]]


class Failure(Base):
    __tablename__ = "failures"

    run_id: Mapped[str] = _run_fk()
    attempt: Mapped[int] = mapped_column(primary_key=True)
    # 0: the attempt's own failure; 1..n: publish tries that failed after it (migration 0005)
    seq: Mapped[int] = mapped_column(primary_key=True, server_default="0")
    rank: Mapped[int]
    failure_class: Mapped[str] = mapped_column(String(32))
    reason: Mapped[str] = mapped_column(Text)
    failed_at: Mapped[float]
    detected_at: Mapped[float]
    ttr_s: Mapped[float]
    recovered: Mapped[bool]
    cascaded: Mapped[bool]


class Checkpoint(Base):
    __tablename__ = "checkpoints"

    run_id: Mapped[str] = _run_fk()
    attempt: Mapped[int] = mapped_column(primary_key=True)
    rank: Mapped[int] = mapped_column(primary_key=True)
    seq: Mapped[int] = mapped_column(primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))  # 'blocking' or 'background'
    start: Mapped[float]
    end: Mapped[float]
    duration_s: Mapped[float]
    step: Mapped[int | None] = mapped_column(BigInteger)
    path: Mapped[str | None] = mapped_column(Text)
    size_bytes: Mapped[int | None] = mapped_column("bytes", BigInteger)


class HeldCapacityRow(Base):
    """The held-capacity ledger (`ett.capacity.Holding`): one row per pooled worker, spare,
    keeper or prefetched flow process held outside a run's own slots. `run_id` is the run it
    was for, NULL for what the pool released unclaimed (no foreign key: those have no run)."""

    __tablename__ = "held_capacity"

    holding_id: Mapped[str] = mapped_column(primary_key=True)
    run_id: Mapped[str | None] = mapped_column(index=True)
    model: Mapped[str] = mapped_column(index=True)
    kind: Mapped[str] = mapped_column(String(32))
    used: Mapped[bool]
    requested_at: Mapped[float]
    released_at: Mapped[float]
    held_s: Mapped[float]
    reason: Mapped[str] = mapped_column(String(32))
    slots: Mapped[float]
    gpus: Mapped[float]
    cpus: Mapped[float]
    memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    rule: Mapped[str] = mapped_column(String(32), default="", server_default="")
    for_rank: Mapped[int | None] = mapped_column(default=None)


# Child tables in the order an archive writes them (after `runs`).
CHILD_TABLES = (Attempt, RunComponent, Event, Failure, Checkpoint, HeldCapacityRow)


class RefreshLineage(Base):
    """One refresh of a model (`ett.lineage.LineageRecord`); no foreign key to `runs`: the
    lineage is written by the flow, the run row by its hooks, in either order."""

    __tablename__ = "refresh_lineage"

    run_id: Mapped[str] = mapped_column(primary_key=True)
    model: Mapped[str] = mapped_column(index=True)
    windows: Mapped[list[str]] = mapped_column(JSON())
    first_window: Mapped[str | None]
    last_window: Mapped[str | None]
    parent_run_id: Mapped[str | None]
    parent_anchor: Mapped[str | None] = mapped_column(Text)
    parent_snapshot: Mapped[str | None] = mapped_column(Text)
    anchor: Mapped[str | None] = mapped_column(Text)
    snapshot: Mapped[str | None] = mapped_column(Text)
    outcome: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[float]
    finished_at: Mapped[float | None]


class WindowClaim(Base):
    """A window of a model that a refresh holds (`state` 'claimed') or has trained ('done')."""

    __tablename__ = "window_claims"

    model: Mapped[str] = mapped_column(primary_key=True)
    window: Mapped[str] = mapped_column(primary_key=True)
    run_id: Mapped[str] = mapped_column(index=True)
    state: Mapped[str] = mapped_column(String(16))
    claimed_at: Mapped[float]
