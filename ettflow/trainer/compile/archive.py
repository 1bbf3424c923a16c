"""Pack a working folder into one tar archive (written atomically, bounded), and unpack it.

An archive holds `inductor/...` (the working folder's compile caches, lock files left out)
and optionally `mega_cache.bin` (torch.compiler.save_cache_artifacts()). Writing goes to a
temporary file beside the target, aborted as soon as it passes `max_bytes`, then
`os.replace`d: readers see the old archive or the new one, never a torn one.

Each archive `pt2-<key>.tar[.gz]` has a manifest `pt2-<key>.manifest.json` (archive name,
size, SHA-256, written atomically after the archive): `verify` checks an archive against it
before anything is unpacked, so a damaged or swapped archive is never loaded.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .trust import make_private_dir

MEGA_CACHE_NAME = "mega_cache.bin"
SUFFIX = {"gz": ".tar.gz", "none": ".tar"}
MANIFEST_SUFFIX = ".manifest.json"
MANIFEST_FORMAT = 1
UNPACK_ERRORS = (tarfile.TarError, OSError, EOFError, zlib.error, ValueError)


class ArchiveTooLarge(Exception):
    pass


class ArchiveUnverified(Exception):
    """An archive whose manifest is missing or unreadable, or does not match it (size, SHA-256):
    it is not unpacked."""


@dataclass(frozen=True)
class Packed:
    path: Path
    bytes: int
    files: int
    sha256: str = ""


class _HashingWriter:
    """File-like that hashes (SHA-256) what it writes through to `raw`, so a save reads
    nothing back to checksum its archive."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.sha256 = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        return self.raw.write(data)

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()


def archive_path(root: Path, key: str, codec: str) -> Path:
    return root / f"pt2-{key}{SUFFIX[codec]}"


def manifest_path(archive: Path) -> Path:
    """`pt2-<key>.manifest.json` beside `pt2-<key>.tar[.gz]`."""
    for suffix in sorted(SUFFIX.values(), key=len, reverse=True):
        if archive.name.endswith(suffix):
            return archive.with_name(archive.name[: -len(suffix)] + MANIFEST_SUFFIX)
    raise ValueError(f"{archive} is not a compile-cache archive (expected a name ending in {tuple(SUFFIX.values())})")


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(archive: Path, *, sha256: str | None = None, files: int = 0) -> Path:
    """Write the manifest of `archive` atomically (temporary file, fsync, rename; mode 0644).
    `sha256`: the archive's digest if known (computed from the file otherwise)."""
    record = {"format": MANIFEST_FORMAT, "archive": archive.name, "bytes": archive.stat().st_size,
              "sha256": sha256 or sha256_of(archive), "files": files}
    dest = manifest_path(archive)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, dest)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return dest


def verify(archive: Path) -> dict[str, Any]:
    """Check `archive` against its manifest (name, size, then SHA-256 of every byte); returns the
    manifest. Raises ArchiveUnverified saying what did not match."""
    manifest = manifest_path(archive)
    try:
        record = json.loads(manifest.read_text())
        expected_name, expected_bytes, expected_sha = record["archive"], record["bytes"], record["sha256"]
    except FileNotFoundError:
        raise ArchiveUnverified(f"archive {archive} has no manifest {manifest.name}") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ArchiveUnverified(f"manifest {manifest} is unreadable ({type(e).__name__}: {e})") from None
    if expected_name != archive.name:
        raise ArchiveUnverified(f"manifest {manifest} describes {expected_name}, not {archive.name}")
    size = archive.stat().st_size
    if size != expected_bytes:
        raise ArchiveUnverified(f"archive {archive} has {size} bytes, its manifest says {expected_bytes}")
    actual = sha256_of(archive)
    if actual != expected_sha:
        raise ArchiveUnverified(f"archive {archive} does not match its manifest's checksum "
                                f"(sha256 {actual[:16]}..., expected {expected_sha[:16]}...)")
    return record


def find_archive(root: Path, key: str) -> Path | None:
    """The newest archive for `key`, whatever its codec."""
    found = [p for codec in SUFFIX if (p := archive_path(root, key, codec)).is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def cache_files(folder: Path) -> Iterator[Path]:
    """Files worth archiving: everything but lock files (held by live processes, empty)."""
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d != "locks")
        for name in sorted(filenames):
            if not name.endswith(".lock"):
                yield Path(dirpath) / name


def pack(folder: Path, arcname: str, dest: Path, *, codec: str, compresslevel: int,
         max_bytes: int, mega_cache: bytes | None = None) -> Packed:
    """Archive `folder` as `arcname/...` (+ the mega-cache) into `dest`. Raises
    ArchiveTooLarge (nothing written) if the archive would pass `max_bytes`. Writes the
    manifest after the archive (a reader in between sees a mismatch: a miss, never a load)."""
    make_private_dir(dest.parent)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    files = 0
    try:
        with os.fdopen(fd, "wb") as raw:
            kwargs = {"compresslevel": compresslevel} if codec == "gz" else {}
            mode = "w:gz" if codec == "gz" else "w"
            hashing = _HashingWriter(raw)
            with tarfile.open(fileobj=hashing, mode=mode, **kwargs) as tar:
                if mega_cache:
                    info = tarfile.TarInfo(MEGA_CACHE_NAME)
                    info.size = len(mega_cache)
                    tar.addfile(info, io.BytesIO(mega_cache))
                for path in cache_files(folder):
                    tar.add(path, arcname=f"{arcname}/{path.relative_to(folder).as_posix()}")
                    files += 1
                    if raw.tell() > max_bytes:
                        raise ArchiveTooLarge(
                            f"passed max_bytes={max_bytes} after {files} files"
                        )
            raw.flush()
            os.fsync(raw.fileno())
            size = raw.tell()
        if size > max_bytes:
            raise ArchiveTooLarge(f"{size} bytes > max_bytes={max_bytes}")
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600: let every rank and later run read it
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sha256 = hashing.sha256.hexdigest()
    write_manifest(dest, sha256=sha256, files=files)
    return Packed(path=dest, bytes=size, files=files, sha256=sha256)


def unpack(archive: Path, dest: Path) -> tuple[int, bytes | None]:
    """Extract into `dest` (data filter: no absolute paths, links out or devices). Returns the
    number of files and the mega-cache bytes if stored. Raises one of UNPACK_ERRORS on a
    corrupt or truncated archive; the caller cleans `dest`. Call `verify` first."""
    files = 0
    mega: bytes | None = None
    with tarfile.open(archive, mode="r:*") as tar:
        for member in tar:
            if member.name == MEGA_CACHE_NAME:
                handle = tar.extractfile(member)
                mega = handle.read() if handle else None
                continue
            if hasattr(tarfile, "data_filter"):
                tar.extract(member, dest, filter="data")
            else:  # Python < 3.11.4
                if member.name.startswith("/") or ".." in Path(member.name).parts:
                    raise ValueError(f"unsafe path {member.name!r} in {archive}")
                tar.extract(member, dest)
            files += member.isfile()
    return files, mega


def prune(root: Path, *, keep: int, protect: Path, stale_tmp_s: float = 3600.0) -> list[Path]:
    """Remove the oldest archives so at most `keep` remain (never `protect`), and temporary
    files of saves killed mid-way (older than `stale_tmp_s`). Returns those; the manifest of a
    removed archive goes with it (not listed)."""
    cutoff = time.time() - stale_tmp_s
    removed = []
    for tmp in root.glob(".pt2-*.tmp"):
        try:
            if tmp.stat().st_mtime < cutoff:
                tmp.unlink()
                removed.append(tmp)
        except FileNotFoundError:  # another rank removed it
            pass
    archives = sorted(root.glob("pt2-*.tar*"), key=_mtime, reverse=True)
    others = [p for p in archives if p != protect]
    for path in others[max(keep - 1, 0):]:
        path.unlink(missing_ok=True)
        removed.append(path)
        remove_manifest_if_orphan(path)
    return removed


def remove_manifest_if_orphan(archive: Path) -> None:
    """Remove the manifest of `archive`'s key once no archive of that key (any codec) is left."""
    manifest = manifest_path(archive)
    stem = manifest.name[: -len(MANIFEST_SUFFIX)]
    if not any((manifest.parent / f"{stem}{suffix}").exists() for suffix in SUFFIX.values()):
        manifest.unlink(missing_ok=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # pruned by another rank meanwhile
        return 0.0
