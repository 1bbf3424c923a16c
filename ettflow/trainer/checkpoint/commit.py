"""A checkpoint folder's commit, torch-free: what rank 0 does once every rank's DCP write
ended (`manager.py`), and what the driver does with the anchor the ranks handed off
(`trainer/group/anchor_seal.py`, in a process that never imports torch)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ettflow.trainer.checkpoint.catalog import prune
from ettflow.trainer.checkpoint.layout import final_dir, publish, remove_tree
from ettflow.trainer.checkpoint.verify import seal, verify

log = logging.getLogger(__name__)


def commit_folder(tmp: Path, root: Path, *, step: int, world_size: int, cursors: list[Any],
                  keep_last: int) -> tuple[Path, int]:
    """A folder DCP finished writing (every rank's files), committed: hashed and sealed, renamed
    to `step_<n>`, verified, then checkpoints beyond the newest `keep_last` pruned. Returns the
    committed folder and its bytes; raises (and removes what it left) when any part fails, so
    nothing torn looks committed."""
    final = final_dir(root, step)
    published = False
    try:
        nbytes = seal(tmp, step=step, world_size=world_size, cursors=cursors)
        publish(tmp, final)
        published = True
        verify(final)
    except BaseException:
        left = final if published else tmp
        try:
            remove_tree(left)
        except OSError as e:
            log.warning("could not remove %s after a failed commit (the next start will): %s", left, e)
        raise
    try:
        prune(root, keep_last)
    except OSError as e:
        log.warning("checkpoint prune under %s failed (will retry next save): %s", root, e)
    return final, nbytes
