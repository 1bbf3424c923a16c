"""Checkpoint folders on disk, and the atomic file operations of the commit protocol.

    root/step_0000000100/        committed: DCP files + manifest.json + COMMITTED
    root/step_0000000200.tmp/    being written (or left by a crash: never restored)
    root/step_0000000050.trash/  being deleted
    root/delta_0000000150/       committed delta on its parent (`delta.py`): rank files + manifest + COMMITTED
    root/delta_0000000160.tmp/   a delta being written (never restored)

A save writes into `step_<n>.tmp`; once DCP has finished on every rank, rank 0 seals it
(manifest.json, then the COMMITTED marker, each written to a temporary name, fsynced and
`os.replace`d) and renames the folder to `step_<n>`. The rename is the commit point: a
folder without the `.tmp` suffix was complete when it was renamed, and verification
(`verify.py`) re-checks it before any restore.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

MANIFEST = "manifest.json"
COMMITTED = "COMMITTED"
DCP_METADATA = ".metadata"
TMP_SUFFIX = ".tmp"
TRASH_SUFFIX = ".trash"
_NAME = re.compile(r"^step_(\d+)(\.tmp|\.trash)?$")
_DELTA_NAME = re.compile(r"^delta_(\d+)(\.tmp|\.trash)?$")


def final_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:010d}"


def tmp_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:010d}{TMP_SUFFIX}"


def parse_name(name: str) -> tuple[int, str] | None:
    """(step, kind) of a checkpoint folder name, kind in final/tmp/trash; None otherwise."""
    return _parse(_NAME, name)


def parse_delta_name(name: str) -> tuple[int, str] | None:
    """(step, kind) of a delta checkpoint's folder name (`delta_<n>`), as `parse_name`."""
    return _parse(_DELTA_NAME, name)


def delta_dir(root: Path, step: int, *, tmp: bool = False) -> Path:
    return Path(root) / f"delta_{step:010d}{TMP_SUFFIX if tmp else ''}"


def _parse(pattern: re.Pattern[str], name: str) -> tuple[int, str] | None:
    m = pattern.match(name)
    if m is None:
        return None
    kind = {None: "final", TMP_SUFFIX: "tmp", TRASH_SUFFIX: "trash"}[m.group(2)]
    return int(m.group(1)), kind


def folder_bytes(folder: Path | str) -> int:
    """The bytes of a checkpoint folder's files (a base's or a delta's: they hold no subfolders)."""
    return sum(f.stat().st_size for f in Path(folder).iterdir() if f.is_file())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so a reader sees either nothing or all of it."""
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    with open(partial, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    fsync_dir(path.parent)


def remove_tree(path: Path) -> None:
    """Delete a checkpoint folder: rename it to `.trash` first, so a crash mid-delete leaves
    a folder that is recognisably garbage rather than a damaged checkpoint."""
    if not path.exists():
        return
    if not path.name.endswith(TRASH_SUFFIX):
        trash = path.with_name(path.name.split(".")[0] + TRASH_SUFFIX)
        if trash.exists():
            shutil.rmtree(trash)
        os.replace(path, trash)
        path = trash
    shutil.rmtree(path)


def publish(tmp: Path, final: Path) -> None:
    """Atomically rename a sealed `.tmp` folder to its final name (the commit point).

    An existing folder of the same step (a torn one, or one written by an earlier attempt
    that replays this step) is moved away first.
    """
    if final.exists():
        remove_tree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
