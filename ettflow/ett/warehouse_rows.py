"""A run as warehouse rows: `RunInfo` + phase events + `RunMetrics` -> one list of plain
row dicts per table. Pure: no I/O; `Warehouse.archive_run` writes what this returns.

The rows are checked before anything is written: every event belongs to the run and has a
seq (the spool assigns them), no two events share (attempt, rank, seq), and the metrics are
the run's. A bad input raises `EventError` (a ValueError) naming the event.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from .capacity import holdings_of_run
from .events import (
    COMPONENTS,
    UNATTRIBUTED,
    EventError,
    PhaseEvent,
    owner_of,
)
from .failures import FailureClass
from .run_metrics import RunMetrics
from .warehouse_models import Attempt, Checkpoint, Event, Failure, HeldCapacityRow, Run, RunComponent

CHECKPOINT_KINDS = {
    "checkpoint_save_blocking": "blocking",
    "checkpoint_save_background": "background",
}
@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """What the metrics do not know about a run: who it is and how it ended."""

    run_id: str
    model: str  # model or job name
    mode: str  # e.g. "baseline" or "optimized"
    flow_run_id: str | None = None
    tags: Mapping[str, Any] = field(default_factory=dict)  # e.g. {"benchmark": True}
    status: str = "completed"

    def __post_init__(self) -> None:
        for name in ("run_id", "model", "mode", "status"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"RunInfo.{name} must be a non-empty string, got {value!r}")
        if not isinstance(self.tags, Mapping):
            raise ValueError(f"RunInfo.tags must be a mapping, got {self.tags!r}")


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _check(info: RunInfo, events: Sequence[PhaseEvent], metrics: RunMetrics) -> None:
    if metrics.run_id != info.run_id:
        raise ValueError(f"metrics are of run {metrics.run_id!r}, not of run {info.run_id!r}")
    seen: set[tuple[int, int, int]] = set()
    for ev in events:
        if ev.run_id != info.run_id:
            raise EventError(f"{ev.describe()} is not of run {info.run_id!r}")
        if ev.seq is None:
            raise EventError(
                f"field 'seq' is missing in {ev.describe()}: the warehouse keys events by "
                "(run, attempt, rank, seq); archive events read from the spool, which numbers them"
            )
        key = (ev.attempt, ev.rank, ev.seq)
        if key in seen:
            raise EventError(f"two events share (attempt, rank, seq) {key} in {ev.describe()}")
        seen.add(key)


def run_row(info: RunInfo, m: RunMetrics, archived_at: datetime) -> dict[str, Any]:
    return {
        "run_id": info.run_id,
        "model": info.model,
        "flow_run_id": info.flow_run_id,
        "mode": info.mode,
        "status": info.status,
        "tags": dict(info.tags),
        "wall_start": m.wall_start,
        "wall_end": m.wall_end,
        "wall_s": m.wall_s,
        "tts_s": m.tts_s,
        "started_training": m.started_training,
        "nof": m.nof,
        "ttr_total_s": m.ttr_total_s,
        "ttr_mean_s": m.ttr_mean_s,
        "ett_pct": m.ett_pct,
        "ett_l1_pct": m.ett_l1_pct,
        "effective_steps": m.effective_steps,
        "replayed_steps": m.replayed_steps,
        "checkpoint_saves": m.checkpoint_saves,
        "checkpoint_blocking_s": m.checkpoint_blocking_s,
        "held_s": m.held.held_s,
        "unused_spare_s": m.held.unused_spare_s,
        "capacity_ett_pct": m.capacity_ett_pct,
        "archived_at": archived_at,
    }


def component_rows(run_id: str, m: RunMetrics) -> list[dict[str, Any]]:
    rows = [
        {"run_id": run_id, "kind": "component", "name": name, "exposed_s": m.components[name],
         "raw_s": m.components_raw[name], "owner": m.owner(name)}
        for name in (*COMPONENTS, UNATTRIBUTED)
    ]
    rows += [
        {"run_id": run_id, "kind": "phase", "name": name, "exposed_s": t.exposed_s,
         "raw_s": t.raw_s, "owner": owner_of(name)}
        for name, t in sorted(m.phases.items())
    ]
    return rows


def event_row(ev: PhaseEvent) -> dict[str, Any]:
    return {"run_id": ev.run_id, "attempt": ev.attempt, "rank": ev.rank, "seq": ev.seq,
            "phase": ev.phase, "start": ev.start, "end": ev.end, "attrs": dict(ev.attrs)}


def checkpoint_row(ev: PhaseEvent) -> dict[str, Any]:
    a = ev.info
    return {"run_id": ev.run_id, "attempt": ev.attempt, "rank": ev.rank, "seq": ev.seq,
            "kind": CHECKPOINT_KINDS[ev.phase], "start": ev.start, "end": ev.end,
            "duration_s": ev.duration, "step": a.step, "path": a.path, "bytes": _int_or_none(a.bytes)}


def rows_for_run(
    info: RunInfo,
    events: Sequence[PhaseEvent],
    metrics: RunMetrics,
    *,
    archived_at: datetime | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Table name -> rows (column name -> value), `runs` first."""
    _check(info, events, metrics)
    run_id = info.run_id
    archived_at = archived_at or datetime.now(timezone.utc)
    return {
        Run.__tablename__: [run_row(info, metrics, archived_at)],
        Attempt.__tablename__: [
            {"run_id": run_id, "attempt": a.attempt, "start": a.start, "end": a.end,
             "failed": a.failed, "phase_raw_s": dict(a.phase_raw_s)}
            for a in metrics.attempts
        ],
        RunComponent.__tablename__: component_rows(run_id, metrics),
        Event.__tablename__: [event_row(ev) for ev in events],
        Failure.__tablename__: failure_rows(run_id, metrics),
        Checkpoint.__tablename__: [
            checkpoint_row(ev) for ev in events if ev.phase in CHECKPOINT_KINDS
        ],
        HeldCapacityRow.__tablename__: [
            h.row() for h in holdings_of_run(run_id, info.model, events, metrics.wall_start, metrics.wall_end)
        ],
    }


def failure_rows(run_id: str, metrics: RunMetrics) -> list[dict[str, Any]]:
    """One row per failure, keyed (attempt, seq): seq 0 for an attempt's own failure, 1..n for
    its failed publish tries, in order."""
    rows, seqs = [], defaultdict(int)
    for f in metrics.failures:
        seq = seqs[f.attempt] + 1 if f.failure_class == FailureClass.PUBLISH.value else 0
        seqs[f.attempt] = max(seqs[f.attempt], seq)
        rows.append({"run_id": run_id, "attempt": f.attempt, "seq": seq, "rank": f.rank,
                     "failure_class": f.failure_class, "reason": f.reason, "failed_at": f.failed_at,
                     "detected_at": f.detected_at, "ttr_s": f.ttr_s, "recovered": f.recovered,
                     "cascaded": f.cascaded})
    return rows
