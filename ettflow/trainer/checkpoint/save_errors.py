"""What a failed save reports: one line per rank, and the OS error behind it, kept typed.

A save fails on some rank (DCP's write, or rank 0's hashing and sealing); every rank learns
why through the commit's collectives, as plain values (`Report`, `Outcome`). When an OSError
with an errno is behind it (ENOSPC, EIO, ...), its errno and path travel with the message, so
the error finally raised is a `CheckpointStorageError` that a classifier sorts as `storage`.
Some writers lose the errno: torch's zip writer reports a write cut short by a full disk as a
RuntimeError ("enforce fail at inline_container.cc ... unexpected pos"). When no OSError is
behind a failure, the file system under the folder being written is asked: one with almost no
space left (`FULL_BELOW_BYTES`) makes it ENOSPC on that folder (`storage_error_of`).
"""

from __future__ import annotations

import errno as errnos
import os
import shutil
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from ettflow.trainer.checkpoint.config import CheckpointError, CheckpointStorageError

FULL_BELOW_BYTES = 1 << 20  # a file system with less free space than this is full for a checkpoint
# what a rank reports after its DCP write: (error, errno, failing path, cursor JSON)
Report = tuple[str | None, int | None, str | None, str]
# what rank 0 tells every rank: (committed path, bytes, error, errno, failing path)
Outcome = tuple[str | None, int | None, str | None, int | None, str | None]


def describe(error: BaseException) -> str:
    """One line per failed rank for DCP's CheckpointException (its str holds tracebacks)."""
    if isinstance(error, CheckpointException):
        return "; ".join(
            f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in sorted(error.failures.items())
        )
    return f"{type(error).__name__}: {error}"


def os_error_of(error: BaseException) -> tuple[int, str | None] | None:
    """(errno, filename) of the first OSError with an errno inside `error`: itself, DCP's
    per-rank failures, or their causes. None when the failure did not come from the OS."""
    queue: list[BaseException | None] = [error]
    seen: set[int] = set()
    while queue:
        e = queue.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno, None if e.filename is None else str(e.filename)
        if isinstance(e, CheckpointException):
            queue.extend(exc for exc, _ in e.failures.values())
        queue.extend((e.__cause__, e.__context__))
    return None


def free_bytes(folder: Path | str) -> int | None:
    """Free space (for this user) on the file system of `folder`, or of its nearest existing parent."""
    path = Path(folder)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def storage_error_of(error: BaseException, folder: Path | str) -> tuple[int, str | None] | None:
    """`os_error_of`, else ENOSPC on `folder` when its file system is full (a writer that lost
    the errno); None: not a storage fault."""
    found = os_error_of(error)
    if found is not None:
        return found
    free = free_bytes(folder)
    if free is not None and free < FULL_BELOW_BYTES:
        return errnos.ENOSPC, os.fspath(folder)
    return None


def save_error(message: str, error: BaseException, folder: Path) -> CheckpointError:
    """CheckpointStorageError (errno, path) when an OSError (or a full disk) is behind `error`,
    else CheckpointError."""
    found = storage_error_of(error, folder)
    if found is None:
        return CheckpointError(message)
    errno, filename = found
    return CheckpointStorageError(errno, message, filename or folder)


def failure_report(message: str, error: BaseException, folder: Path, cursor: str) -> Report:
    """What a rank reports of its failed part of a save: the message, and the errno and path
    of the OSError behind it (the folder being written when the error names no file)."""
    found = storage_error_of(error, folder)
    if found is None:
        return message, None, str(folder), cursor
    return message, found[0], found[1] or str(folder), cursor
