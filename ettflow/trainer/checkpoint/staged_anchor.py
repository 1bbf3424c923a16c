"""A parent anchor staged in host memory ahead of the run that warm starts from it.

A worker the pool prewarms for one of a model's next run's ranks
(`pooled_worker.prewarm_for_next_run`; its spares stage nothing) is told the anchor that run
will most likely warm start from: the releasing run's (`StageRequest`). Its `AnchorStaging`
thread waits for that anchor's seal (with release-before-seal the driver seals it after the
devices are released, while the pool already prewarms), reads every file the manifest lists into
memory and checks each one's size and sha256 against it: the check `verify.verify` makes on
disk, so what a rank restores from memory was checksummed. When the worker becomes a rank of a
run whose `warm_start_from` is that folder, and the folder's COMMITTED still names the manifest
staged, the restore reads DCP from memory (`StagedReader`): a warm run's init is the hand-off,
not the read and its checksum pass. Anything else (another parent, a folder sealed again since,
a staging that failed, timed out or was over its bound) reads the disk as before, and the
restore's `staged_miss` says why.

A staged worker holds the whole anchor (every rank's files: it does not know its rank until a
run takes it, and a warm start may reshard); `StageRequest.max_bytes` bounds it (the pool's
policy), and the bytes are dropped once the restore has read them.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata

from ettflow.trainer.checkpoint.config import CheckpointError, TornCheckpointError
from ettflow.trainer.checkpoint.layout import COMMITTED, DCP_METADATA
from ettflow.trainer.checkpoint.reading import SafeFileSystemReader, read_dcp_metadata
from ettflow.trainer.checkpoint.verify import (
    CheckpointInfo,
    check_sha,
    check_size,
    committed_manifest,
    info_of,
    manifest_digest,
)
from ettflow.trainer.protocol import StageRequest, StagingState, StagingStatus

log = logging.getLogger("ettflow.trainer")
POLL_S = 0.1  # how often a staging looks for the anchor's seal


@dataclass(frozen=True, eq=False)
class StagedAnchor:
    """A sealed anchor's files in memory, each checked against its manifest: `digest` is the
    manifest's sha256 (what COMMITTED names), `read_s` the read and check."""

    path: Path
    digest: str
    manifest: Mapping[str, Any]
    files: Mapping[str, bytes]
    read_s: float

    @property
    def info(self) -> CheckpointInfo:
        return info_of(self.path, self.manifest)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.files.values())

    def still_sealed(self) -> str | None:
        """None when the folder's COMMITTED still names the manifest staged; else why not."""
        try:
            on_disk = (self.path / COMMITTED).read_text(encoding="utf-8").strip()
        except OSError as exc:
            return f"{self.path}'s {COMMITTED} is unreadable now ({exc})"
        return None if on_disk == self.digest else f"{self.path} was sealed again since it was staged"


def stage_anchor(path: Path, *, max_bytes: int, wait_s: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 cancelled: threading.Event | None = None, sealed: threading.Event | None = None) -> StagedAnchor:
    """Wait up to `wait_s` for `path`'s seal, then read and check every file its manifest lists
    (sizes on disk first: nothing over `max_bytes` is read). Raises CheckpointError saying why
    nothing was staged (no seal in time, over `max_bytes`, a file that does not match its
    manifest: `TornCheckpointError`, `cancelled` set: nobody wants it any more). `sealed` is set
    once the seal is seen and the reading begins."""
    deadline = clock() + wait_s
    while not (path / COMMITTED).is_file():
        if clock() >= deadline:
            raise CheckpointError(f"{path} was not sealed within {wait_s:g} s")
        sleep(POLL_S)
    if sealed is not None:
        sealed.set()
    t0 = time.perf_counter()
    manifest = committed_manifest(path)
    listed = manifest["files"]
    for rel, expect in listed.items():
        check_size(path, rel, expect)
    total = sum(int(f["size"]) for f in listed.values())
    if total > max_bytes:
        raise CheckpointError(f"{path} holds {total} bytes, over the staging bound of {max_bytes}")
    files = {}
    for rel in sorted(listed):
        if cancelled is not None and cancelled.is_set():
            raise CheckpointError(f"staging {path} was given up: the worker is restoring something else")
        files[rel] = _read_checked(path, rel, listed[rel])
    return StagedAnchor(path=path, digest=manifest_digest(manifest), manifest=manifest, files=files,
                        read_s=time.perf_counter() - t0)


def _read_checked(path: Path, rel: str, expect: Mapping[str, Any]) -> bytes:
    """The file's bytes, read once and checked against the manifest (as `verify` hashes it on disk)."""
    import hashlib

    try:
        data = (path / rel).read_bytes()
    except OSError as exc:
        raise TornCheckpointError(path, f"storage file {rel} is unreadable ({exc})", file=rel) from exc
    check_sha(path, rel, expect, hashlib.sha256(data).hexdigest())
    return data


class AnchorStaging:
    """One worker's staging of one anchor, in a thread of its own (the worker's prewarm goes on
    meanwhile); `take` hands it to the restore of the run's parent, once."""

    def __init__(self, request: StageRequest) -> None:
        self.request = request
        self._staged: StagedAnchor | None = None
        self._error: str | None = None
        self._taken = False
        self._cancelled = threading.Event()  # discarded: the thread stops reading, keeps nothing
        self._sealed = threading.Event()  # the anchor's seal was seen: reading it
        self._thread = threading.Thread(target=self._run, name="ettflow-stage-anchor", daemon=True)

    @classmethod
    def start(cls, request: StageRequest) -> AnchorStaging:
        staging = cls(request)
        staging._thread.start()
        return staging

    def _run(self) -> None:
        req = self.request
        try:
            staged = stage_anchor(Path(req.path), max_bytes=req.max_bytes, wait_s=req.wait_s,
                                  cancelled=self._cancelled, sealed=self._sealed)
        except Exception as exc:  # noqa: BLE001 - whatever it was, the restore reads the disk and says why
            self._error = str(exc) if isinstance(exc, (CheckpointError, OSError)) else f"{type(exc).__name__}: {exc}"
            if not self._cancelled.is_set():
                log.warning("staging the next run's parent anchor: nothing staged (%s)", self._error)
            return
        if self._cancelled.is_set():
            return
        self._staged = staged
        log.info("staged the next run's parent anchor %s in memory (%d bytes, read and checked in %.2f s)",
                 staged.path, staged.nbytes, staged.read_s)

    def take(self, parent: Path) -> tuple[StagedAnchor | None, str | None]:
        """The staged anchor when it is `parent`, still sealed as staged (waiting for a staging
        under way: it reads what the restore would), else None and why not. Once: the worker's
        memory is the restore's from here on. The copy is named as `parent` is (every rank's
        restore names the folder alike, staged or not)."""
        if self._taken:
            return None, "the staged copy was already handed to a restore"
        self._taken = True
        if Path(self.request.path).resolve() != Path(parent).resolve():
            self.discard()
            return None, f"staged {self.request.path}, the run warm starts from {parent}"
        self._thread.join(self.request.wait_s)
        staged, error = self._staged, self._error
        self.discard()
        if staged is None:
            return None, error or f"staging {parent} had not finished within {self.request.wait_s:g} s"
        problem = staged.still_sealed()
        return (None, problem) if problem else (replace(staged, path=Path(parent)), None)

    def status(self) -> StagingStatus:
        """Where this staging stands now (a read of its fields: the thread may move on after)."""
        path = self.request.path
        staged, error = self._staged, self._error
        if self._taken:
            return StagingStatus(path=path, state=StagingState.TAKEN)
        if self._cancelled.is_set():
            return StagingStatus(path=path, state=StagingState.DISCARDED)
        if staged is not None:
            return StagingStatus(path=path, state=StagingState.STAGED, nbytes=staged.nbytes, read_s=staged.read_s)
        if error is not None:
            return StagingStatus(path=path, state=StagingState.FAILED, error=error)
        return StagingStatus(path=path, state=StagingState.READING if self._sealed.is_set() else StagingState.WAITING)

    def discard(self) -> None:
        """Drop the staged bytes, and stop a staging still reading (a run that restores something
        else, a spare that joins, a worker told to stage a newer anchor)."""
        self._cancelled.set()
        self._staged = None


class _MemoryFiles(FileSystem):
    """DCP's file system, reading a staged anchor's files (read-only)."""

    def __init__(self, staged: StagedAnchor) -> None:
        self.staged = staged

    @contextmanager
    def create_stream(self, path: str | Any, mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "rb":
            raise CheckpointError(f"a staged anchor is read-only (asked to open {path} with {mode!r})")
        rel = Path(path).relative_to(self.staged.path).as_posix()
        data = self.staged.files.get(rel)
        if data is None:
            raise CheckpointError(f"{self.staged.path}: DCP reads {rel}, which its manifest does not list")
        with io.BytesIO(data) as stream:  # shares the bytes: nothing copied until a slice is read
            yield stream


class StagedReader(SafeFileSystemReader):
    """DCP's reader of a staged anchor: its `.metadata` through the restricted unpickler, its
    storage files from memory (`SafeLoadPlanner` reads non-tensor values as for the disk)."""

    def __init__(self, staged: StagedAnchor) -> None:
        super().__init__(str(staged.path))
        self.fs = _MemoryFiles(staged)
        self.staged = staged

    def _metadata(self) -> Metadata:
        return read_dcp_metadata(self.staged.path, self.staged.files[DCP_METADATA])
