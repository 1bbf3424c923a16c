"""Sealing a written checkpoint (manifest + COMMITTED marker) and verifying it before use.

The manifest records what a complete checkpoint is: the step, the world size, every rank's
data cursor, the DCP `.metadata` file's size and sha256, and the size (optionally sha256) of
every storage file that metadata references. Its own sha256, over the canonical JSON of the
rest, is stored inside it and in COMMITTED. `verify` re-checks all of that; a checkpoint that
fails any check is torn and is never restored.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader

from ettflow.trainer.checkpoint.config import CheckpointError, TornCheckpointError
from ettflow.trainer.checkpoint.layout import (
    COMMITTED,
    DCP_METADATA,
    MANIFEST,
    atomic_write_text,
    parse_name,
)

FORMAT = "ettflow-checkpoint/1"


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """A committed, verified checkpoint."""

    step: int
    path: Path
    world_size: int
    cursors: tuple[Mapping[str, Any], ...]  # per rank, in rank order
    created_at: float  # epoch seconds of the commit


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
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
    metadata = FileSystemReader(str(path)).read_metadata()
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = info.relative_path
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise CheckpointError(f"DCP metadata in {path} references {rel!r} outside the folder")
        need[rel] = max(need.get(rel, 0), info.offset + info.length)
    return need


def seal(
    path: Path,
    *,
    step: int,
    world_size: int,
    cursors: Sequence[Mapping[str, Any]],
    checksum_data_files: bool,
) -> int:
    """Check a folder DCP finished writing, then write manifest.json and COMMITTED into it.

    Returns the checkpoint's size in bytes (DCP metadata and storage files). Raises
    CheckpointError (nothing sealed) if DCP's metadata is missing or a storage file it
    references is missing or too short.
    """
    if not (path / DCP_METADATA).is_file():
        raise CheckpointError(f"{path} has no DCP {DCP_METADATA}: the DCP save did not finish")
    files: dict[str, dict[str, Any]] = {}
    for rel, need in sorted(_referenced_files(path).items()):
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{path}: storage file {rel} referenced by DCP is missing")
        size = f.stat().st_size
        if size < need:
            raise CheckpointError(f"{path}: storage file {rel} has {size} bytes, DCP needs {need}")
        files[rel] = {"size": size}
        if checksum_data_files:
            files[rel]["sha256"] = sha256_file(f)
    meta = path / DCP_METADATA
    body = {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "cursors": [dict(c) for c in cursors],
        "created_at": time.time(),
        "dcp_metadata": {"size": meta.stat().st_size, "sha256": sha256_file(meta)},
        "files": files,
    }
    digest = _canonical_sha(body)
    atomic_write_text(path / MANIFEST, json.dumps({**body, "manifest_sha256": digest}, indent=1))
    atomic_write_text(path / COMMITTED, digest + "\n")
    return body["dcp_metadata"]["size"] + sum(f["size"] for f in files.values())


def _check_file(path: Path, rel: str, expect: Mapping[str, Any]) -> None:
    f = path / rel
    if not f.is_file():
        raise TornCheckpointError(path, f"storage file {rel} is missing")
    size = f.stat().st_size
    if size != expect["size"]:
        raise TornCheckpointError(path, f"storage file {rel} has {size} bytes, the manifest recorded {expect['size']}")
    if "sha256" in expect and sha256_file(f) != expect["sha256"]:
        raise TornCheckpointError(path, f"storage file {rel} does not match its sha256")


def verify(path: Path | str) -> CheckpointInfo:
    """Verify a committed checkpoint folder; raises TornCheckpointError saying what is wrong."""
    path = Path(path)
    parsed = parse_name(path.name)
    if parsed is None or parsed[1] != "final":
        raise TornCheckpointError(path, "not a committed checkpoint folder name (step_<n>)")
    if not (path / COMMITTED).is_file():
        raise TornCheckpointError(path, f"no {COMMITTED} marker: the save never committed")
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        recorded = manifest.pop("manifest_sha256")
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise TornCheckpointError(path, f"{MANIFEST} is missing or unreadable ({e})") from e
    if _canonical_sha(manifest) != recorded:
        raise TornCheckpointError(path, f"{MANIFEST} does not match its own sha256")
    if (path / COMMITTED).read_text(encoding="utf-8").strip() != recorded:
        raise TornCheckpointError(path, f"{COMMITTED} does not name this {MANIFEST}")
    if manifest.get("format") != FORMAT:
        raise TornCheckpointError(path, f"unknown format {manifest.get('format')!r}")
    if manifest["step"] != parsed[0]:
        raise TornCheckpointError(path, f"manifest step {manifest['step']} != folder step")
    _check_file(path, DCP_METADATA, manifest["dcp_metadata"])
    for rel, expect in manifest["files"].items():
        _check_file(path, rel, expect)
    return CheckpointInfo(
        step=manifest["step"],
        path=path,
        world_size=manifest["world_size"],
        cursors=tuple(manifest["cursors"]),
        created_at=manifest["created_at"],
    )
