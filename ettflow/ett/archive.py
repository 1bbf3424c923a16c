"""Spool -> metrics -> warehouse: the one I/O path every hook and command uses."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .run_metrics import RunMetrics, compute_run_metrics
from .spool import SpoolProblem, read_spool
from .warehouse import RunInfo, Warehouse


@dataclass(frozen=True)
class Archived:
    metrics: RunMetrics
    problems: tuple[SpoolProblem, ...]  # lines of the spool that could not be used
    events: int


def archive_spooled_run(warehouse: Warehouse, spool_root: Path | str, info: RunInfo) -> Archived:
    """Compute a run's ETT from its spool and archive it; idempotent (upserts)."""
    read = read_spool(spool_root, info.run_id)
    if not read.events:
        raise ValueError(
            f"the spool of run {info.run_id!r} under {spool_root} holds no usable event"
            + (f"; problems: {'; '.join(map(str, read.problems))}" if read.problems else "")
        )
    metrics = compute_run_metrics(read.events)
    warehouse.archive_run(info, read.events, metrics)
    return Archived(metrics, tuple(read.problems), len(read.events))
