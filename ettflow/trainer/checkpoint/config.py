"""Configuration of checkpointing, and the errors it raises."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MODES: tuple[str, ...] = ("sync", "async")


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, committed or restored (the message says why)."""


class TornCheckpointError(CheckpointError):
    """A checkpoint folder is not a complete, verified checkpoint: never restore it.

    file: the file inside the folder that failed verification (relative to it), when one did.
    """

    def __init__(self, path: Path, reason: str, *, file: str | None = None) -> None:
        super().__init__(f"checkpoint {path} is torn or partial: {reason}")
        self.path = path
        self.reason = reason
        self.file = file


class RefusedCheckpointError(CheckpointError):
    """Every rank refused to restore a checkpoint together, before reading any of it: it failed
    its check (a file's checksum, its metadata) on at least one rank. Damage, never a bug."""


class CheckpointStorageError(CheckpointError, OSError):
    """The storage under a checkpoint failed (ENOSPC, EIO, ...) while saving it.

    An OSError with the failing call's `errno` and `filename` (the file, or the checkpoint
    folder being written), so a failure classifier sorts it as `storage` by its errno and
    never by its message. The save did not commit: nothing of it is ever restored.
    """

    def __init__(self, errno: int, message: str, path: Path | str) -> None:
        OSError.__init__(self, errno, message, str(path))

    def __reduce__(self):  # picklable across Ray with errno and path (OSError drops filename)
        return (type(self), (self.errno, self.strerror, self.filename))


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where and how checkpoints are written.

    root: folder holding one sub-folder per checkpoint (`step_0000000100`); it must be
        visible to every rank (a shared file system when ranks run on several hosts).
    mode: "sync" blocks the training loop for the whole write; "async" blocks only while
        the state is copied into host memory and writes in the background.
    keep_last: committed checkpoints kept; older ones are deleted after each commit.

    Every file of a checkpoint is checksummed (sha256) at commit and verified before a
    restore (`verify.py`); there is no switch to turn that off.
    """

    root: Path | str
    mode: str = "async"
    keep_last: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.root, (str, Path)) or not str(self.root).strip():
            raise ValueError(f"CheckpointConfig.root must be a folder path, got {self.root!r}")
        object.__setattr__(self, "root", Path(self.root))
        if self.mode not in MODES:
            raise ValueError(
                f"CheckpointConfig.mode must be one of {MODES}, got {self.mode!r}: use 'async' "
                "to overlap the write with training, 'sync' for the blocking baseline"
            )
        if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int):
            raise ValueError(f"CheckpointConfig.keep_last must be an int, got {self.keep_last!r}")
        if self.keep_last < 1:
            raise ValueError(
                f"CheckpointConfig.keep_last must be >= 1 (a restart needs one committed "
                f"checkpoint), got {self.keep_last}"
            )
