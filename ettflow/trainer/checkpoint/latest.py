"""The checkpoint a new attempt or run resumes from: the newest committed one under a root."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from ettflow.trainer.checkpoint.catalog import scan
from ettflow.trainer.checkpoint.verify import CheckpointInfo

if TYPE_CHECKING:
    from ettflow.trainer.config import TrainerConfig

log = logging.getLogger("ettflow.trainer")


def latest_checkpoint(source: TrainerConfig | Path | str) -> CheckpointInfo | None:
    """The newest verified checkpoint of a trainer config (its `checkpoint_dir`) or of a
    checkpoint root; every folder skipped on the way (torn, uncommitted) is logged."""
    root = Path(source) if isinstance(source, (str, Path)) else source.checkpoint_dir
    found = scan(root)
    for problem in found.problems:
        log.warning("checkpoint skipped: %s", problem)
    return found.latest
