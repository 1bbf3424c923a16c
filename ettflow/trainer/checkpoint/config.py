"""Configuration of checkpointing, and the errors it raises."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MODES: tuple[str, ...] = ("sync", "async")


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, committed or restored (the message says why)."""


class TornCheckpointError(CheckpointError):
    """A checkpoint folder is not a complete, verified checkpoint: never restore it."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"checkpoint {path} is torn or partial: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where and how checkpoints are written.

    root: folder holding one sub-folder per checkpoint (`step_0000000100`); it must be
        visible to every rank (a shared file system when ranks run on several hosts).
    mode: "sync" blocks the training loop for the whole write; "async" blocks only while
        the state is copied into host memory and writes in the background.
    keep_last: committed checkpoints kept; older ones are deleted after each commit.
    checksum_data_files: also record and verify a sha256 of every storage file (catches
        bit rot, not only torn writes; reads every byte at commit and at verification).
    """

    root: Path | str
    mode: str = "async"
    keep_last: int = 3
    checksum_data_files: bool = False

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
        if not isinstance(self.checksum_data_files, bool):
            raise ValueError(f"CheckpointConfig.checksum_data_files must be a bool, got {self.checksum_data_files!r}")
