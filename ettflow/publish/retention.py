"""What a model's snapshot root keeps: the retention policy for its published snapshots.

    <snapshot_root>/<run_id>/                    a snapshot (`manifest.json`; a delta names its base)
    <snapshot_root>/<run_id>.ett-timeline.png    its run's timeline picture
    <snapshot_root>/.<run_id>.tmp-*, .old-*      a publish's staging (`manifest.staging_dir`)

Policy (`doomed_snapshots`, pure): of the snapshot folders the model's own refreshes installed
(its lineage names them: a folder it does not name, a snapshot published by hand or by another
tool, is never removed), keep

- the snapshots of the model's last `keep` published refreshes (newest first): what a rollback
  serves (a gated snapshot never served, so it does not count);
- the current one (`current`), whatever its age, and this run's (published or gated);
- every base a kept delta snapshot's chain needs, down to its full snapshot: a delta is read
  materialized through them (`delta_snapshot.chain_of`); every folder that is not the model's
  own refresh counts as kept here, so a snapshot published by hand as a delta on one of the
  model's keeps its base;

and remove the others, each with its timeline picture. When a kept snapshot's manifest cannot
be read, its chain is unknown and nothing is removed. (A delta published by hand into another
root, on a base here, is not seen: materialize it, `ettflow publish --materialize`.) A staging
folder (`.<run_id>.tmp-<pid>-<n>`, `.<run_id>.old-<pid>-<n>`) is removed once nothing in it
changed for a day (`staging_folders`): an interrupted publish leaves one, and another run's
publish cleans only its own (a publish takes minutes, so a day-old one has no writer).
Each snapshot is a model's size (about 8 MB for the default model, a delta much less): kept
forever, a refresh every few hours filled a disk in months.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ettflow.publish.config import PublishError
from ettflow.publish.manifest import MANIFEST_FILE, read_manifest

TIMELINE_SUFFIX = ".ett-timeline.png"  # the run's picture beside its folder (`tasks/artifacts.py`)


@dataclass(frozen=True)
class Snapshot:
    """What retention reads of one snapshot folder's manifest. base: the folder name of the
    snapshot it is a delta on, when that lies under the same root (None: a full snapshot, or a
    base elsewhere); readable: False when the manifest could not be read."""

    base: str | None = None
    readable: bool = True


def doomed_snapshots(snapshots: Mapping[str, Snapshot], newest_first: Sequence[tuple[str, bool]], *, keep: int,
                     protected: Collection[str]) -> list[str]:
    """Folder names that go: `snapshots` maps every snapshot folder under the root to its
    manifest's facts; `newest_first` are the model's refreshes' folder names, newest first, each
    with whether it was published (only these folders may go); `protected` are kept whatever
    their age (the current one, this run's)."""
    ours = list(dict.fromkeys(name for name, _ in newest_first if name in snapshots))
    published = list(dict.fromkeys(name for name, served in newest_first if served and name in snapshots))
    kept = set(published[:keep]) | {name for name in protected if name in snapshots} | (set(snapshots) - set(ours))
    todo = list(kept)
    while todo:
        entry = snapshots[todo.pop()]
        if not entry.readable:
            return []  # its chain is unknown: any folder may be a base it needs
        if entry.base in snapshots and entry.base not in kept:
            kept.add(entry.base)
            todo.append(entry.base)
    return sorted(name for name in ours if name not in kept)


def read_snapshots(root: Path) -> dict[str, Snapshot]:
    """Every snapshot folder under `root` (one holding a manifest, readable or not) and its facts."""
    if not root.is_dir():
        return {}
    found: dict[str, Snapshot] = {}
    for folder in root.iterdir():
        if folder.name.startswith(".") or not folder.is_dir() or not (folder / MANIFEST_FILE).exists():
            continue
        try:
            delta = read_manifest(folder).delta
            base = Path(delta["base"]) if delta.get("base") else None
        except (PublishError, AttributeError, TypeError, KeyError):  # not a manifest's shape: unknown chain
            found[folder.name] = Snapshot(readable=False)
            continue
        # by name: a host that mounts the shared root elsewhere wrote another absolute path
        found[folder.name] = Snapshot(base=base.name if base is not None else None)
    return found


# `manifest.staging_dir`'s and `install`'s names, and `remove_snapshot`'s
STAGING = re.compile(r"\..+\.(tmp|old)-\d+-(\d+|retention)")


def staging_folders(root: Path) -> list[Path]:
    """The staging folders publishes left under `root` (`STAGING`: nothing else of a user's)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if STAGING.fullmatch(p.name) and p.is_dir())


def remove_snapshot(root: Path, name: str) -> None:
    """Remove the snapshot folder `name` and its timeline picture. The folder is first renamed
    to a staging name (atomic): a reader sees the whole snapshot or none, and what a removal cut
    short leaves is a staging folder, removed a day later."""
    gone = root / f".{name}.old-{os.getpid()}-retention"
    try:
        (root / name).rename(gone)
    except FileNotFoundError:
        pass
    shutil.rmtree(gone, ignore_errors=True)
    (root / f"{name}{TIMELINE_SUFFIX}").unlink(missing_ok=True)
