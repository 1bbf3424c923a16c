"""The event spool: append-only JSON lines, one file per (run, attempt, rank).

Layout: ``<root>/<run_id>/attempt-<a>.rank-<r>.jsonl`` (rank -1, the driver, is
``attempt-<a>.driver.jsonl``). Each event is written as one line with one write(2) before
`record` returns, so a process killed at any instant loses nothing already recorded (the
kernel holds it). Every event is also fsynced before `record` returns, against a machine
crash, except those recorded with ``sync=False`` (training steps, hundreds per second; the
spans of init stages and recovery phases; the driver's scheduling and hand-off, which the
ranks' next phase would otherwise wait behind): a background thread fsyncs those within
``lazy_fsync_s`` (group commit), on its own descriptor and without the writer's lock, so such
a `record` never waits for a disk flush. Each line
carries its sequence number in the file, which with (run, attempt, rank) keys it in the
warehouse, so archiving twice never duplicates.

The spool never truncates what it had: files are only ever opened to append (``O_APPEND``,
never ``O_TRUNC``), and a line cut short by a failed write stays as it is (the next writer ends
it, the reader reports it). When the disk refuses a write or an fsync (ENOSPC, EIO, ...), the
writer raises `SpoolWriteError`: an `OSError` that keeps the errno and the file, and a
`FailureError` carrying a `storage` failure, so the rank or driver stops its attempt with that
class. An fsync that fails in the group-commit thread is raised by the next `record` (and every
one after it: the writer is broken once the kernel lost a write).

An event whose write was refused is not dropped: the process keeps it (`kept_events`, at most
`KEPT_LIMIT` per file) and the next write to that file, by any writer of this process, writes
the kept ones first, in order, under the sequence numbers they would have had (`write_kept`
does it without a new event). `read_spool` in that process returns them beside what the file
holds, so a run whose first event found the disk full still has its events where its own
process archives it (the flow's final hook writes its row to the warehouse, which may live on
another disk), and in its spool once the disk has room again.

The reader keeps every good line: a torn last line (a write cut by a kill or a full disk) is reported and
skipped, and so is any corrupt line, each with its file and line number. `SpoolRead.bytes`
is how much it read, which the archive stores to tell later whether the spool grew.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import threading
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .events import MARKERS, OFF_CLOCK, EventError, PhaseEvent
from .failures import Failure, FailureClass, FailureError
from .settled import unsettle


class SpoolWriteError(OSError, FailureError):
    """The spool could not be written (a full disk, an I/O error). `errno` and `filename` are
    the OS error's; `failure` is the `storage` failure that stops the attempt."""

    def __init__(self, errno_: int | None, strerror: str | None, filename: str) -> None:
        OSError.__init__(self, errno_, strerror, filename)
        self.failure = Failure(
            failure_class=FailureClass.STORAGE, path=filename,
            reason=f"cannot append to the event spool {filename}: {strerror or 'write failed'}",
            detail=f"errno {errno_}: {strerror}",
        )

    @classmethod
    def of(cls, exc: OSError, path: Path | str) -> SpoolWriteError:
        if isinstance(exc, SpoolWriteError):
            return exc
        return cls(exc.errno, exc.strerror or str(exc), str(path))

    def __str__(self) -> str:
        return (f"{self.failure.reason} (errno {self.errno}); the spool keeps every line it had. "
                "Free space on that disk (or point ETTFLOW_SPOOL at one with room) and run again")

    def __reduce__(self):  # picklable across Ray with its errno and path
        return (type(self), (self.errno, self.strerror, self.filename))


_ENCODE = json.JSONEncoder(separators=(",", ":")).encode  # json.dumps's output, without a new encoder per line

KEPT_LIMIT = 10_000  # events kept per file when the disk refuses them; a rank stops its attempt at the first
_kept: dict[Path, list[PhaseEvent]] = {}  # by spool file: events this process could not write yet, oldest first
_kept_dropped: dict[Path, int] = {}
_kept_lock = threading.Lock()


def _keep(path: Path, event: PhaseEvent) -> None:
    with _kept_lock:
        held = _kept.setdefault(path, [])
        if len(held) < KEPT_LIMIT:
            held.append(event)
        else:
            _kept_dropped[path] = _kept_dropped.get(path, 0) + 1


def _lines_in(path: Path) -> int:
    """The lines a writer would count in `path` (a torn last line is ended, so it counts)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def kept_events(root: Path | str, run_id: str) -> list[PhaseEvent]:
    """The run's events this process could not write yet, each under the sequence number it
    will have in its file (the file's lines now, then in order)."""
    folder = Path(root) / run_id
    with _kept_lock:
        held = {path: list(evs) for path, evs in _kept.items() if path.parent == folder and evs}
    out = []
    for path, evs in sorted(held.items()):
        first = _lines_in(path)
        out += [replace(e, seq=first + i) for i, e in enumerate(evs)]
    return out


def kept_dropped(root: Path | str, run_id: str) -> int:
    """Events of the run this process could neither write nor keep (past `KEPT_LIMIT`)."""
    folder = Path(root) / run_id
    with _kept_lock:
        return sum(n for path, n in _kept_dropped.items() if path.parent == folder)


def write_kept(root: Path | str, run_id: str) -> int:
    """Write the run's kept events to their files (see the module's docstring); the number
    still kept (0: all written). Raises nothing: a disk still full keeps them."""
    folder = Path(root) / run_id
    with _kept_lock:  # each file's writer is named by its first kept event (every event of a file is its)
        owners = [(evs[0].attempt, evs[0].rank) for path, evs in _kept.items() if path.parent == folder and evs]
    for attempt, rank in owners:
        try:
            with SpoolWriter(root, run_id, attempt, rank) as writer:
                writer.flush_kept()
        except OSError:
            pass  # still refused: they stay kept
    return len(kept_events(root, run_id))


def spool_file(root: Path | str, run_id: str, attempt: int, rank: int) -> Path:
    who = "driver" if rank < 0 else f"rank-{rank}"
    return Path(root) / run_id / f"attempt-{attempt:03d}.{who}.jsonl"


class SpoolWriter:
    """Durable appender for the events of one (run, attempt, rank). Thread-safe; safe
    against another process appending to the same file (an exclusive lock per write)."""

    def __init__(self, root: Path | str, run_id: str, attempt: int, rank: int, *, lazy_fsync_s: float = 0.2) -> None:
        self.run_id, self.attempt, self.rank = run_id, attempt, rank
        self.lazy_fsync_s = lazy_fsync_s
        self._dirty = False
        self._flusher: threading.Thread | None = None
        self._sync_fd = -1  # the group-commit thread's own descriptor of the file
        self._closing = threading.Event()
        self._error: SpoolWriteError | None = None  # an fsync of the group-commit thread that failed
        self.path = spool_file(root, run_id, attempt, rank)
        self._fd = -1
        self._closed = False
        try:
            self._open()
        except SpoolWriteError:
            pass  # the disk refused even the file: `record` tries again, and keeps the event if it fails
        self._lock = threading.Lock()
        self._seq = 0
        self._size = -1  # file size after our last write; another writer changes it
        self.recorded_until: float | None = None  # the latest end of an on-clock interval recorded here

    def _open(self) -> None:
        if self._fd >= 0:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # append only: never O_TRUNC, so reopening a file never loses a line it had
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise SpoolWriteError.of(exc, self.path) from exc
        unsettle(self.path.parent.parent, self.run_id)  # its row may change now (`ett.settled`)

    def close(self) -> None:
        """Fsync what is not yet durable and close; raises `SpoolWriteError` if that fsync fails."""
        self._closing.set()
        self._closed = True
        flusher = self._flusher
        if flusher is not None and flusher is not threading.current_thread():
            flusher.join()  # it ends an fsync in progress first
        with self._lock:
            if self._fd < 0:
                return
            try:
                if self._dirty and self._error is None:
                    self._fsync()
            finally:
                os.close(self._fd)
                self._fd = -1
                if self._sync_fd >= 0:
                    os.close(self._sync_fd)
                    self._sync_fd = -1
                unsettle(self.path.parent.parent, self.run_id)  # a late writer's lines count too

    def _fsync(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as exc:
            self._error = SpoolWriteError.of(exc, self.path)
            raise self._error from exc
        self._dirty = False

    def _write_all(self, data: bytes) -> None:
        """One line, all of it (a short write goes on where it stopped); an OS error is a
        `SpoolWriteError` and leaves what the file had untouched."""
        view = memoryview(data)
        while view:
            try:
                n = os.write(self._fd, view)
            except OSError as exc:
                raise SpoolWriteError.of(exc, self.path) from exc
            if n <= 0:
                raise SpoolWriteError(errno.EIO, "write returned no progress", str(self.path))
            view = view[n:]

    def _flush_loop(self) -> None:
        """The group commit: every `lazy_fsync_s`, fsync what was written since the last one, on
        a descriptor of its own and outside the lock, so `record` never waits for a disk flush."""
        while not self._closing.wait(self.lazy_fsync_s):
            with self._lock:
                if not self._dirty or self._fd < 0 or self._error is not None:
                    continue
                self._dirty = False  # a write after this point sets it again; this fsync covers the ones before
            try:
                os.fsync(self._sync_fd)
            except OSError as exc:
                with self._lock:
                    self._error = SpoolWriteError.of(exc, self.path)  # the next record() raises it
                return

    def __enter__(self) -> SpoolWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _resync(self) -> None:
        """Count the lines already in the file and end a torn last line, so new lines stay
        whole and sequence numbers never repeat."""
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            self._write_all(b"\n")
            data += b"\n"
        self._seq = data.count(b"\n")
        self._size = len(data)

    def _write_event(self, event: PhaseEvent) -> PhaseEvent:
        """One line under the next sequence number; the event as written."""
        event = replace(event, seq=self._seq)
        line = (_ENCODE(event.to_dict()) + "\n").encode()
        self._write_all(line)
        self._seq += 1
        self._size += len(line)
        return event

    def _write_kept_first(self) -> None:
        """This process's kept events of this file, oldest first; each leaves the buffer once
        written, so a refused one stays first."""
        if not _kept.get(self.path):  # the common case, on every step's record: no lock taken
            return
        while True:
            with _kept_lock:
                held = _kept.get(self.path)
                if not held:
                    return
                event = held[0]
            self._write_event(event)
            with _kept_lock:
                held.pop(0)

    def _prepare(self) -> None:
        """Open (a first open may have been refused), take the file lock, count its lines."""
        self._open()
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        if os.fstat(self._fd).st_size != self._size:
            self._resync()

    def flush_kept(self) -> None:
        """Write this process's kept events of this file (raises `SpoolWriteError` if refused)."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"spool writer for {self.path} is closed")
            try:
                self._prepare()
                self._write_kept_first()
                self._fsync()
            finally:
                if self._fd >= 0:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)

    def record(self, phase: str, start: float, end: float, *, sync: bool = True, **attrs: Any) -> PhaseEvent:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"spool writer for {self.path} is closed")
            if self._error is not None:
                raise self._error
            event = PhaseEvent(run_id=self.run_id, attempt=self.attempt, rank=self.rank, phase=phase,
                               start=float(start), end=float(end), attrs=attrs)
            try:
                try:
                    self._prepare()
                    self._write_kept_first()
                    event = self._write_event(event)
                except SpoolWriteError:
                    _keep(self.path, event)  # written first by the next write that succeeds
                    raise
                if sync:
                    self._fsync()
                else:
                    self._dirty = True
                    if self._flusher is None:
                        self._sync_fd = os.dup(self._fd)
                        self._flusher = threading.Thread(target=self._flush_loop, name="ettflow-spool-fsync",
                                                         daemon=True)
                        self._flusher.start()
                if phase not in OFF_CLOCK and phase not in MARKERS and (
                        self.recorded_until is None or event.end > self.recorded_until):
                    self.recorded_until = event.end
                return event
            finally:
                if self._fd >= 0:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)

    def mark(self, phase: str, at: float | None = None, **attrs: Any) -> PhaseEvent:
        at = time.time() if at is None else at
        return self.record(phase, at, at, **attrs)

    @contextlib.contextmanager
    def span(self, phase: str, *, sync: bool = False, **attrs: Any) -> Iterator[dict[str, Any]]:
        """Record `phase` around a block; the block may add attributes to the yielded dict.
        A block that raises is still recorded, with its error. The event is written before the
        block's caller goes on (a kill loses nothing) and fsynced by the group commit unless
        `sync`: what follows the block (the next init stage, the next recovery phase) does not
        wait on a disk flush, which no event would cover (seen: 0.18 s gaps between init stages
        while another job wrote to the same disk)."""
        start = time.time()
        extra: dict[str, Any] = dict(attrs)
        try:
            yield extra
        except BaseException as exc:
            extra["error"] = f"{type(exc).__name__}: {exc}"[:500]
            raise
        finally:
            self.record(phase, start, time.time(), sync=sync, **extra)


@dataclass(frozen=True)
class SpoolProblem:
    path: str
    line: int
    message: str
    torn: bool = False  # the last line of a file, cut by a kill or a refused write (ENOSPC) mid-line

    def __str__(self) -> str:
        kind = "torn last line" if self.torn else "corrupt line"
        return f"{self.path}:{self.line}: {kind}: {self.message}"


@dataclass
class SpoolRead:
    events: list[PhaseEvent] = field(default_factory=list)
    problems: list[SpoolProblem] = field(default_factory=list)
    bytes: int = 0  # total size of the files read, as read
    kept: int = 0  # events of `events` held by this process, not (yet) in a file: the disk refused them


def read_file(path: Path | str, into: SpoolRead | None = None, *,
              phases: frozenset[str] | None = None) -> SpoolRead:
    """`phases`: only events of these phases are read (a line that does not name one of them
    is not decoded: a run's steps are most of its spool)."""
    out = into if into is not None else SpoolRead()
    path = Path(path)
    data = path.read_bytes()
    out.bytes += len(data)
    lines = data.split(b"\n")
    complete = data.endswith(b"\n")
    if complete:
        lines = lines[:-1]
    wanted = tuple(json.dumps(p).encode() for p in phases) if phases is not None else None
    for number, raw in enumerate(lines, start=1):
        if not raw.strip() or (wanted is not None and not any(w in raw for w in wanted)):
            continue
        torn = not complete and number == len(lines)
        try:
            record = json.loads(raw)
            if phases is not None and record.get("phase") not in phases:
                continue
            out.events.append(PhaseEvent.from_dict(record, where=f"at {path}:{number}"))
        except (ValueError, EventError) as exc:
            message = str(exc) if isinstance(exc, EventError) else f"not valid JSON ({exc})"
            out.problems.append(SpoolProblem(str(path), number, message, torn=torn))
    return out


def read_spool(root: Path | str, run_id: str, *, phases: frozenset[str] | None = None) -> SpoolRead:
    """Every event of a run (`phases`: only those phases'), from all its files and the ones
    this process keeps for them (`kept_events`), ordered by start time."""
    folder = Path(root) / run_id
    kept = [e for e in kept_events(root, run_id) if phases is None or e.phase in phases]
    if not folder.is_dir() and not kept:
        raise FileNotFoundError(f"no spool for run {run_id!r} under {root} (expected {folder})")
    out = SpoolRead(kept=len(kept))
    for path in sorted(folder.glob("*.jsonl")):
        read_file(path, out, phases=phases)
    out.events += kept  # this process's events the disk refused (see the module's docstring)
    out.events.sort(key=lambda e: (e.start, e.end, e.attempt, e.rank, e.seq or 0))
    return out


def spool_bytes(root: Path | str, run_id: str) -> int:
    """The total size of a run's spool files now (what `SpoolRead.bytes` would read)."""
    folder = Path(root) / run_id
    total = 0
    for path in folder.glob("*.jsonl"):
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_size
    return total


def run_folders(root: Path | str, skip: Collection[str] = frozenset()) -> list[str]:
    """The names of the run folders under the spool `root` (one listing, no file of theirs
    opened), but those in `skip` and the spool's own hidden ones (`ett.settled`'s index)."""
    if not Path(root).is_dir():
        return []
    with os.scandir(root) as entries:
        return [e.name for e in entries if e.name not in skip and not e.name.startswith(".") and e.is_dir()]


def spooled_runs(root: Path | str, skip: Collection[str] = frozenset()) -> list[str]:
    """The runs with a spool file under `root`, but those in `skip` (never opened)."""
    return sorted(name for name in run_folders(root, skip) if any((Path(root) / name).glob("*.jsonl")))
