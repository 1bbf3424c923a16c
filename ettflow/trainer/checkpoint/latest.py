"""The checkpoint a new attempt or run resumes from: the newest committed one under a root."""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

from ettflow.ett.events import CHECKPOINT_FALLBACK
from ettflow.trainer.checkpoint.catalog import CheckpointProblem, CheckpointScan, scan
from ettflow.trainer.checkpoint.verify import CheckpointInfo

if TYPE_CHECKING:
    from ettflow.ett.spool import SpoolWriter
    from ettflow.trainer.config import TrainerConfig

log = logging.getLogger("ettflow.trainer")
_MARKED: weakref.WeakKeyDictionary[SpoolWriter, set[str]] = weakref.WeakKeyDictionary()  # folders marked per writer


def latest_checkpoint(source: TrainerConfig | Path | str) -> CheckpointInfo | None:
    """The newest verified checkpoint of a trainer config (its `checkpoint_dir`) or of a
    checkpoint root; every folder skipped on the way (torn, uncommitted) is logged."""
    return checked_scan(source).latest


def checked_scan(source: TrainerConfig | Path | str) -> CheckpointScan:
    """`scan` of the root, every folder skipped on the way (torn, uncommitted) logged."""
    root = Path(source) if isinstance(source, (str, Path)) else source.checkpoint_dir
    found = scan(root)
    for problem in found.problems:
        log.warning("checkpoint skipped: %s", problem)
    return found


def fallbacks(found: CheckpointScan, world_size: int | None = None) -> list[CheckpointProblem]:
    """The damaged checkpoints (or deltas) newer than the step a restore uses (`found.chain`):
    each made the restore fall back to an older step (or to none), and the steps between are
    trained again."""
    restored = found.chain(world_size).step
    return [p for p in found.problems
            if p.damaged and p.step is not None and (restored is None or p.step > restored)]


def mark_fallbacks(rec: SpoolWriter, found: CheckpointScan, world_size: int | None = None) -> None:
    """The run's record of checkpoint damage: a `checkpoint_fallback` marker per damaged
    checkpoint a restore skipped (`fallbacks`). One rank writes them: every rank read the same
    folder. Once per folder and attempt (`rec`): a full restart's ranks scan at their start and
    again when the in-memory point they were sent to falls to the durable tier."""
    done = _MARKED.setdefault(rec, set())
    for damaged in fallbacks(found, world_size):
        if str(damaged.path) in done:
            continue
        done.add(str(damaged.path))
        rec.mark(CHECKPOINT_FALLBACK, damaged_step=damaged.step, restored_step=damaged.fallback,
                 file=damaged.file, reason=damaged.reason[:300], path=str(damaged.path))
