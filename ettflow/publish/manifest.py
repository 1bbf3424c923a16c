"""The snapshot manifest, and installing a snapshot folder atomically.

    <output_root>/<run_id>/model.pt        the TorchScript module (see snapshot.py)
    <output_root>/<run_id>/manifest.json   what it is, where it came from, how it validated

A snapshot is written into `<output_root>/.<run_id>.tmp-<pid>-<n>/`, every file fsynced, and
then put in place with one rename: an atomic exchange with the previous snapshot when there is
one (Linux renameat2 RENAME_EXCHANGE; elsewhere the old folder is renamed away first, leaving
an instant with no folder but never a half one). A reader of `<run_id>/` sees the old snapshot
or the new one, complete; a crashed attempt leaves only a hidden temp folder, removed by the
next attempt.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ettflow.publish.config import PublishError
from ettflow.trainer.checkpoint.layout import fsync_dir
from ettflow.trainer.checkpoint.verify import sha256_file

FORMAT = "ettflow-snapshot/1"
MANIFEST_FILE = "manifest.json"
_counter = itertools.count()


@dataclass(frozen=True, kw_only=True)
class SnapshotManifest:
    """What `manifest.json` holds (see publisher.publish_snapshot for how it is filled)."""

    run_id: str
    step: int
    path: str  # the installed snapshot folder
    created_at: float
    model: dict[str, Any]  # ModelConfig as a dict
    schema: dict[str, Any]  # FeatureSchema.to_dict()
    data: dict[str, Any]  # held-out root, windows, batch size, batches, examples
    source: dict[str, Any]  # anchor checkpoint path, its manifest sha256, world size, cursor
    quantization: dict[str, Any]
    signature: dict[str, Any]
    validation: dict[str, Any]  # tolerance, what it bounds, passed
    metrics: dict[str, Any]  # auc_float, auc_snapshot, max_abs_diff, ..., n_examples
    timings_s: dict[str, float]  # load, data, reference, quantize, script, validate, total
    versions: dict[str, str]
    # parent_snapshot (the model's current snapshot when this one was published), parent_anchor
    # (the checkpoint its training was warm started from), windows (trained), held_out
    lineage: dict[str, Any] = field(default_factory=dict)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> size, sha256
    # a full snapshot stored full although a delta was asked: {"refused": why, "new_base": planned};
    # a delta snapshot (delta_snapshot.py): its base folder, the base's model sha256, rows changed,
    # bytes; a materialized one: where it came from; {}: a full snapshot published as such
    delta: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SnapshotManifest:
        if d.get("format") != FORMAT:
            raise PublishError(f"manifest format {d.get('format')!r} is not {FORMAT!r}")
        return cls(**d)


def checksums(folder: Path) -> dict[str, dict[str, Any]]:
    """size and sha256 of every file of a snapshot folder but the manifest."""
    return {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(Path(folder).iterdir()) if p.is_file() and p.name != MANIFEST_FILE}


def staging_dir(output_root: Path, run_id: str) -> Path:
    """A fresh hidden folder beside the final one; stale ones of this run are removed."""
    output_root.mkdir(parents=True, exist_ok=True)
    for stale in output_root.glob(f".{run_id}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in output_root.glob(f".{run_id}.old-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = output_root / f".{run_id}.tmp-{os.getpid()}-{next(_counter)}"
    tmp.mkdir()
    return tmp


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux renameat2); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    return False  # EINVAL (file system without exchange), ENOSYS: fall back


def install(tmp: Path, manifest: SnapshotManifest, final: Path) -> SnapshotManifest:
    """Checksum the files in `tmp`, write the manifest, fsync, and put `tmp` at `final`."""
    for p in tmp.iterdir():
        fsync_dir(p)
    manifest = SnapshotManifest(**{**manifest.to_dict(), "files": checksums(tmp), "path": str(final)})
    text = json.dumps(manifest.to_dict(), indent=1, sort_keys=True, allow_nan=False)
    with open(tmp / MANIFEST_FILE, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    if final.exists() and _exchange(tmp, final):
        shutil.rmtree(tmp)  # now holds the previous snapshot
    else:
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}-{next(_counter)}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    fsync_dir(final.parent)
    return manifest


def read_manifest(folder: Path | str) -> SnapshotManifest:
    path = Path(folder) / MANIFEST_FILE
    try:
        return SnapshotManifest.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError) as e:
        raise PublishError(f"{path} is missing or unreadable ({e}): not a published snapshot") from e


def verify_snapshot(folder: Path | str) -> SnapshotManifest:
    """Re-check a snapshot folder against its manifest's checksums; raise saying what differs."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    found = checksums(folder)
    if found != manifest.files:
        extra, missing = sorted(set(found) - set(manifest.files)), sorted(set(manifest.files) - set(found))
        changed = sorted(k for k in set(found) & set(manifest.files) if found[k] != manifest.files[k])
        raise PublishError(f"snapshot {folder} does not match its manifest: missing {missing}, "
                           f"unexpected {extra}, changed {changed}; publish it again")
    return manifest
