"""Pack a working folder into one tar archive (written atomically, bounded), and unpack it.

An archive holds `inductor/...` (the working folder's compile caches, lock files left out)
and optionally `mega_cache.bin` (torch.compiler.save_cache_artifacts()). Writing goes to a
temporary file beside the target, aborted as soon as it passes `max_bytes`, then
`os.replace`d: readers see the old archive or the new one, never a torn one.
"""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MEGA_CACHE_NAME = "mega_cache.bin"
SUFFIX = {"gz": ".tar.gz", "none": ".tar"}
UNPACK_ERRORS = (tarfile.TarError, OSError, EOFError, zlib.error, ValueError)


class ArchiveTooLarge(Exception):
    pass


@dataclass(frozen=True)
class Packed:
    path: Path
    bytes: int
    files: int


def archive_path(root: Path, key: str, codec: str) -> Path:
    return root / f"pt2-{key}{SUFFIX[codec]}"


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
    ArchiveTooLarge (nothing written) if the archive would pass `max_bytes`."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    files = 0
    try:
        with os.fdopen(fd, "wb") as raw:
            kwargs = {"compresslevel": compresslevel} if codec == "gz" else {}
            mode = "w:gz" if codec == "gz" else "w"
            with tarfile.open(fileobj=raw, mode=mode, **kwargs) as tar:
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
    return Packed(path=dest, bytes=size, files=files)


def unpack(archive: Path, dest: Path) -> tuple[int, bytes | None]:
    """Extract into `dest` (data filter: no absolute paths, links out or devices). Returns the
    number of files and the mega-cache bytes if stored. Raises one of UNPACK_ERRORS on a
    corrupt or truncated archive; the caller cleans `dest`."""
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
    files of saves killed mid-way (older than `stale_tmp_s`)."""
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
    return removed


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # pruned by another rank meanwhile
        return 0.0
