"""Sealing a written checkpoint (manifest + COMMITTED marker) and verifying it before use.

The manifest records what a complete checkpoint is: the step, the world size, every rank's
data cursor, and the size and sha256 of EVERY file in the folder when it was sealed (DCP's
`.metadata` and each `.distcp` storage file). Its own sha256, over the canonical JSON of the
rest, is stored inside it and in COMMITTED. `verify` re-checks all of that, sizes first and
then a streaming sha256 of each file; a checkpoint that fails any check is torn and is never
restored. Files added after the commit (the anchor's `anchor.json`) are not part of it: no
restore reads them as checkpoint data.

Sealing runs after DCP has finished writing on every rank (in the background thread of an
async save), so the checksums cover the bytes on disk, and before COMMITTED is written.
Nothing here unpickles a file: `seal` reads the `.metadata` it checks through
`reading.read_dcp_metadata`, and `verify` only hashes.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ettflow.trainer.checkpoint.config import CheckpointError, TornCheckpointError
from ettflow.trainer.checkpoint.layout import (
    COMMITTED,
    DCP_METADATA,
    MANIFEST,
    atomic_write_text,
    parse_name,
)

FORMAT = "ettflow-checkpoint/2"
# format 1 pickled per-rank state and checksummed only .metadata: refused with this advice
_OLD_FORMATS = {
    "ettflow-checkpoint/1": "it holds pickled per-rank state and unchecksummed data files, and is never "
    "restored by this ettflow (loading it could run code): start from a newer checkpoint or from scratch",
}


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """A committed, verified checkpoint."""

    step: int
    path: Path
    world_size: int
    cursors: tuple[Mapping[str, Any], ...]  # per rank, in rank order
    created_at: float  # epoch seconds of the commit


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """The sha256 of a file, read in `chunk`-byte blocks (memory stays flat)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _canonical_sha(body: Mapping[str, Any]) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _referenced_files(path: Path) -> dict[str, int]:
    """Storage files the DCP metadata references -> the bytes they must at least hold."""
    from ettflow.trainer.checkpoint.reading import read_dcp_metadata  # torch: only when a checkpoint is read

    metadata = read_dcp_metadata(path)
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = info.relative_path
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise CheckpointError(f"DCP metadata in {path} references {rel!r} outside the folder")
        need[rel] = max(need.get(rel, 0), info.offset + info.length)
    return need


def _folder_files(path: Path) -> list[str]:
    """Every file under a checkpoint folder (relative, sorted) but the seal's own."""
    files = []
    for f in path.rglob("*"):
        rel = f.relative_to(path).as_posix()
        if f.is_file() and rel not in (MANIFEST, COMMITTED) and ".partial-" not in f.name:
            files.append(rel)
    return sorted(files)


def seal(path: Path, *, step: int, world_size: int, cursors: Sequence[Mapping[str, Any]]) -> int:
    """Check a folder DCP finished writing, then write manifest.json and COMMITTED into it.

    Returns the checkpoint's size in bytes (all its files). Raises CheckpointError (nothing
    sealed) if DCP's metadata is missing or a storage file it references is missing or too
    short; OSError (errno kept) if the disk fails while hashing or writing the seal.
    """
    if not (path / DCP_METADATA).is_file():
        raise CheckpointError(f"{path} has no DCP {DCP_METADATA}: the DCP save did not finish")
    for rel, need in sorted(_referenced_files(path).items()):
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{path}: storage file {rel} referenced by DCP is missing")
        size = f.stat().st_size
        if size < need:
            raise CheckpointError(f"{path}: storage file {rel} has {size} bytes, DCP needs {need}")
    files = {rel: {"size": (path / rel).stat().st_size, "sha256": sha256_file(path / rel)}
             for rel in _folder_files(path)}
    body = {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "cursors": [dict(c) for c in cursors],
        "created_at": time.time(),
        "files": files,
    }
    digest = _canonical_sha(body)
    atomic_write_text(path / MANIFEST, json.dumps({**body, "manifest_sha256": digest}, indent=1))
    atomic_write_text(path / COMMITTED, digest + "\n")
    return sum(f["size"] for f in files.values())


def check_size(path: Path, rel: str, expect: Mapping[str, Any]) -> None:
    """The file `rel` of `path` is there, with the size its manifest entry `expect` records."""
    f = path / rel
    if not f.is_file():
        raise TornCheckpointError(path, f"storage file {rel} is missing", file=rel)
    size = f.stat().st_size
    if size != expect["size"]:
        raise TornCheckpointError(
            path, f"storage file {rel} has {size} bytes, the manifest recorded {expect['size']}", file=rel
        )


def _check_sha(path: Path, rel: str, expect: Mapping[str, Any]) -> None:
    check_sha(path, rel, expect, sha256_file(path / rel))


def check_sha(path: Path, rel: str, expect: Mapping[str, Any], digest: str) -> None:
    """`digest` (of the file `rel` of `path`, or of its bytes already read) is the one its manifest records."""
    if digest != expect["sha256"]:
        raise TornCheckpointError(path, f"{rel} sha256 mismatch (its bytes changed after the commit)", file=rel)


def read_manifest(path: Path) -> dict[str, Any]:
    """The sealed manifest of a checkpoint folder, its own sha256 and COMMITTED checked (not its files)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        recorded = manifest.pop("manifest_sha256")
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        raise TornCheckpointError(path, f"{MANIFEST} is missing or unreadable ({e})", file=MANIFEST) from e
    if _canonical_sha(manifest) != recorded:
        raise TornCheckpointError(path, f"{MANIFEST} does not match its own sha256", file=MANIFEST)
    if (path / COMMITTED).read_text(encoding="utf-8").strip() != recorded:
        raise TornCheckpointError(path, f"{COMMITTED} does not name this {MANIFEST}", file=COMMITTED)
    fmt = manifest.get("format")
    if fmt in _OLD_FORMATS:
        raise TornCheckpointError(path, f"format {fmt}: {_OLD_FORMATS[fmt]}", file=MANIFEST)
    if fmt != FORMAT:
        raise TornCheckpointError(path, f"unknown format {fmt!r} (this ettflow reads {FORMAT})", file=MANIFEST)
    files = manifest.get("files")
    if not isinstance(files, dict) or DCP_METADATA not in files:
        raise TornCheckpointError(path, f"{MANIFEST} lists no {DCP_METADATA}", file=MANIFEST)
    for rel, expect in files.items():
        if Path(rel).is_absolute() or ".." in Path(rel).parts or not isinstance(expect, dict):
            raise TornCheckpointError(path, f"{MANIFEST} lists {rel!r}, not a file of the folder", file=MANIFEST)
    return manifest


def verify(path: Path | str) -> CheckpointInfo:
    """Verify a committed checkpoint folder: marker, manifest, and the size and sha256 of
    every file it lists. Raises TornCheckpointError saying what is wrong (and `.file`, which
    file). Reads every byte once; unpickles nothing."""
    path = Path(path)
    manifest = committed_manifest(path)
    files = manifest["files"]
    for rel in sorted(files):  # sizes first: a missing or cut file is found without hashing
        check_size(path, rel, files[rel])
    for rel in sorted(files):
        _check_sha(path, rel, files[rel])
    return info_of(path, manifest)


def committed_manifest(path: Path) -> dict[str, Any]:
    """A committed checkpoint folder's manifest: its name, marker and manifest checked (its files not)."""
    parsed = parse_name(path.name)
    if parsed is None or parsed[1] != "final":
        raise TornCheckpointError(path, "not a committed checkpoint folder name (step_<n>)")
    if not (path / COMMITTED).is_file():
        raise TornCheckpointError(path, f"no {COMMITTED} marker: the save never committed", file=COMMITTED)
    manifest = read_manifest(path)
    if manifest["step"] != parsed[0]:
        raise TornCheckpointError(path, f"manifest step {manifest['step']} != folder step", file=MANIFEST)
    return manifest


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    """The sha256 a manifest (as `read_manifest` returns it) records of itself: what COMMITTED names."""
    return _canonical_sha(manifest)


def info_of(path: Path, manifest: Mapping[str, Any]) -> CheckpointInfo:
    return CheckpointInfo(step=manifest["step"], path=path, world_size=manifest["world_size"],
                          cursors=tuple(manifest["cursors"]), created_at=manifest["created_at"])
