"""A model's `current` snapshot pointer: the snapshot its users serve, moved only on publish.

    <snapshot_root>/current      JSON: {"snapshot", "path", "anchor", "moved_at", "metrics"}

A refresh installs its snapshot as `<snapshot_root>/<run_id>/` either way; only a snapshot
that passes the publish gate (`gate.py`) moves the pointer. `move_current` writes the new
pointer into a temp file beside it, fsyncs it and puts it in place with `os.replace`, so a
reader sees the old pointer or the new one, never a torn one. Retention reads
`read_current(...).anchor` so it never removes the checkpoint the current snapshot came from.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ettflow.publish.config import PublishError
from ettflow.publish.manifest import SnapshotManifest
from ettflow.trainer.checkpoint.layout import fsync_dir

CURRENT_FILE = "current"


@dataclass(frozen=True, kw_only=True)
class CurrentPointer:
    """What `current` names. snapshot: the snapshot's folder name (its run id); path: the
    folder; anchor: the checkpoint it was published from; moved_at: epoch seconds; metrics:
    its held-out metrics when it was published (auc_snapshot, logloss_snapshot, ...)."""

    snapshot: str
    path: str
    anchor: str | None
    moved_at: float
    metrics: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Any, *, where: Path) -> CurrentPointer:
        try:
            return cls(snapshot=str(data["snapshot"]), path=str(data["path"]), anchor=data.get("anchor"),
                       moved_at=float(data["moved_at"]), metrics=dict(data.get("metrics") or {}))
        except (KeyError, TypeError, ValueError) as e:
            raise PublishError(f"{where} is not a snapshot pointer ({type(e).__name__}: {e}): remove it to "
                               "publish the next snapshot as the first of its model") from e


def current_file(snapshot_root: Path | str) -> Path:
    return Path(snapshot_root) / CURRENT_FILE


def read_current(snapshot_root: Path | str) -> CurrentPointer | None:
    """The model's current snapshot, None before its first publish."""
    path = current_file(snapshot_root)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise PublishError(f"{path} is unreadable ({e}): remove it to publish the next snapshot as the first "
                           "of its model") from e
    return CurrentPointer.from_json(data, where=path)


def move_current(snapshot_root: Path | str, manifest: SnapshotManifest) -> CurrentPointer:
    """Point `current` at the installed snapshot of `manifest` (atomic: temp file, fsync, os.replace)."""
    root = Path(snapshot_root)
    pointer = CurrentPointer(snapshot=Path(manifest.path).name, path=manifest.path,
                             anchor=manifest.source.get("checkpoint"), moved_at=time.time(),
                             metrics=dict(manifest.metrics))
    tmp = root / f".{CURRENT_FILE}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(asdict(pointer), indent=1, sort_keys=True, allow_nan=False))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, current_file(root))
    fsync_dir(root)
    return pointer
