"""Reading a test run's spool through the spool reader (never by grepping its JSONL)."""

from __future__ import annotations

from pathlib import Path

from ettflow.ett.events import PhaseEvent
from ettflow.ett.spool import read_spool


def events(spool_root: str | Path, run_id: str, phase: str | None = None, *, attempt: int | None = None,
           rank: int | None = None) -> list[PhaseEvent]:
    """The run's spooled events, optionally of one phase, attempt and rank."""
    return [e for e in read_spool(spool_root, run_id).events
            if (phase is None or e.phase == phase) and (attempt is None or e.attempt == attempt)
            and (rank is None or e.rank == rank)]


def spooled_runs(spool_root: str | Path) -> list[str]:
    root = Path(spool_root)
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def training_started(spool_root: str | Path, run_id: str | None = None, *, min_step: int = 0) -> str | None:
    """The id of a run under `spool_root` (`run_id`, or any) whose ranks recorded a
    `train_step` of step >= `min_step`; None while none has."""
    for rid in [run_id] if run_id else spooled_runs(spool_root):
        try:
            steps = read_spool(spool_root, rid, phases=frozenset({"train_step"})).events
        except FileNotFoundError:
            continue
        if any(e.phase == "train_step" and int(e.attrs.get("step", 0)) >= min_step for e in steps):
            return rid
    return None
