"""What a save and a restore report: the timings the trainer turns into phase events."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from ettflow.trainer.checkpoint.verify import CheckpointInfo


@dataclass(frozen=True, kw_only=True)
class CommitResult:
    """The end of a save: the background write, commit and pruning (`checkpoint_save_background`).

    In sync mode all of it happened while blocking, and the background span is empty. A save
    that did not commit left no committed-looking folder (its `.tmp` folder is removed).
    """

    step: int
    committed: bool
    path: Path | None  # the committed folder
    nbytes: int | None  # its size (DCP metadata and storage files)
    background_start: float  # epoch seconds
    background_end: float
    error: str | None = None
    errno: int | None = None  # the OSError errno behind `error` (ENOSPC, EIO, ...), if any
    error_path: str | None = None  # the file or folder that failed (the `.tmp` folder at least)

    @property
    def background_s(self) -> float:
        return self.background_end - self.background_start


@dataclass(frozen=True, kw_only=True)
class SaveResult:
    """What `CheckpointManager.save` blocked the training loop for (`checkpoint_save_blocking`).

    blocking_start/blocking_end: epoch seconds of the `save` call; it includes
    `waited_previous_s`, the time spent finishing the previous async save first. With async
    staging (`staged_async`), the copy into host memory is not in it: the rest of the copy is
    waited for by `CheckpointManager.wait_staged` (a `StagingWait`), and a save's blocking is
    both spans together.
    """

    step: int
    mode: str
    blocking_start: float
    blocking_end: float
    waited_previous_s: float
    staged_async: bool = False
    commit_future: Future[CommitResult] = field(repr=False, compare=False)
    staging_future: Future | None = field(default=None, repr=False, compare=False)  # the async copy

    @property
    def blocking_s(self) -> float:
        return self.blocking_end - self.blocking_start

    def staged(self) -> bool:
        """True once the state is copied into host memory (always, unless `staged_async`)."""
        return self.staging_future is None or self.staging_future.done()

    def done(self) -> bool:
        """True once the background write has committed or failed."""
        return self.commit_future.done()

    def commit_result(self, timeout: float | None = None) -> CommitResult:
        """Wait for the background part and return it (failures come back in `.error`)."""
        return self.commit_future.result(timeout=timeout)


@dataclass(frozen=True, kw_only=True)
class StagingWait:
    """What `CheckpointManager.wait_staged` blocked the loop for (with async staging): the
    rest of the copy of the save at `step` into host memory, waited for before the next
    backward pass; `checkpoint_save_blocking` of that save, after `SaveResult`'s span."""

    step: int
    start: float  # epoch seconds
    end: float

    @property
    def waited_s(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, kw_only=True)
class RestoreResult:
    """A restore (`checkpoint_restore`): which checkpoint, and when it ran (epoch seconds)."""

    checkpoint: CheckpointInfo
    start: float
    end: float

    @property
    def duration_s(self) -> float:
        return self.end - self.start
