"""Lineage records that wait in the spool while the warehouse is down.

A refresh that published (or gated, or failed) must record its lineage: that record advances
the model's watermark and settles the refresh's window claims. When the warehouse cannot be
written at that moment, the record is kept beside the run's spool instead,

    <spool>/<run_id>/lineage.pending.json      (the LineageRecord, as its warehouse row)

and written by the next reconciliation (`tasks.reconcile`: the start of every refresh on this
spool, and `ettflow archive --pending`) with `lineage.finish_refresh`, then removed. Until then
the run's claims stay live, so no other refresh of the model trains its windows again; a
refresh that starts on this spool first settles the pending record, and so starts from it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from pathlib import Path

from .json_file import replace_json
from .lineage import LineageRecord, Outcome
from .settled import unsettle
from .spool import run_folders

log = logging.getLogger("ettflow.ett")

LINEAGE_PENDING_FILE = "lineage.pending.json"

__all__ = ["LINEAGE_PENDING_FILE", "clear_pending_lineage", "pending_lineage_file", "pending_lineage_runs",
           "read_pending_lineage", "write_pending_lineage"]


def pending_lineage_file(spool_root: Path | str, run_id: str) -> Path:
    return Path(spool_root) / run_id / LINEAGE_PENDING_FILE


def write_pending_lineage(spool_root: Path | str, record: LineageRecord) -> Path:
    """Keep the record in the run's spool folder (atomically, replacing an older one). Raises
    OSError when the disk refuses it: the caller says the lineage is lost."""
    path = pending_lineage_file(spool_root, record.run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_json(path, record.row(), durable=True)
    unsettle(spool_root, record.run_id)  # read by every reconciliation until it is written
    return path


def read_pending_lineage(spool_root: Path | str, run_id: str) -> LineageRecord | None:
    """The run's pending record, or None (none, or unreadable: logged and left in place)."""
    path = pending_lineage_file(spool_root, run_id)
    try:
        row = json.loads(path.read_text())
        return LineageRecord(
            model=row["model"], run_id=row["run_id"], windows=tuple(row.get("windows") or ()),
            outcome=Outcome(row["outcome"]), parent_run_id=row.get("parent_run_id"),
            parent_anchor=row.get("parent_anchor"), parent_snapshot=row.get("parent_snapshot"),
            anchor=row.get("anchor"), snapshot=row.get("snapshot"), reason=row.get("reason"),
            created_at=float(row["created_at"]), finished_at=row.get("finished_at"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("pending lineage record %s is unreadable (%s): left in place; fix or remove it", path, exc)
        return None


def pending_lineage_runs(spool_root: Path | str, skip: Collection[str] = frozenset()) -> list[str]:
    """The runs of the spool with a pending lineage record, oldest file first; those in `skip`
    (settled: `ett.settled`) are not looked at."""
    root = Path(spool_root)
    found = [p for name in run_folders(root, skip) if (p := root / name / LINEAGE_PENDING_FILE).is_file()]
    return [p.parent.name for p in sorted(found, key=lambda p: (p.stat().st_mtime, p.parent.name))]


def clear_pending_lineage(spool_root: Path | str, run_id: str) -> None:
    pending_lineage_file(spool_root, run_id).unlink(missing_ok=True)
