"""The driver's choice of a live recovery's restore point (`rank/live_recovery.py` has the protocol)."""

from __future__ import annotations

from pathlib import Path

from ettflow.trainer.checkpoint.layout import parse_delta_name, parse_name
from ettflow.trainer.protocol import DURABLE, MEMORY, RestorePoint


def choose_restore_point(memory_step: int | None, durable_step: int | None,
                         durable_path: str | None) -> RestorePoint | None:
    """The newest of the two tiers; memory wins a tie (it is read from host memory). None:
    neither holds a point, and live recovery cannot resume the ranks that kept running."""
    if memory_step is not None and (durable_step is None or memory_step >= durable_step):
        return RestorePoint(step=memory_step, source=MEMORY)
    if durable_step is not None:
        return RestorePoint(step=durable_step, source=DURABLE, path=durable_path)
    return None


def restart_point(memory_step: int | None, durable_step: int | None) -> RestorePoint | None:
    """A full restart's restore point when the in-memory tier holds a newer step than the
    durable checkpoint (every rank restores it, the durable one stays the fallback); None: the
    ranks restore the durable checkpoint (or warm start) as usual. A copy of step 0 with no
    durable checkpoint is where a cold or warm start begins anyway: not worth a restore."""
    if memory_step is None or memory_step <= (durable_step if durable_step is not None else 0):
        return None
    return RestorePoint(step=memory_step, source=MEMORY)


def newest_committed(root: Path) -> tuple[int, str] | None:
    """(step, path) of the newest committed checkpoint folder (a full one or a delta) under
    `root`, by name only: the ranks verify every byte before they read it
    (`CheckpointManager.load`; a delta names its chain, which they scan and verify), so the
    driver's choice does not read the checkpoint (a scan would hash it all on the recovery's clock)."""
    if not root.is_dir():
        return None
    found = [(parsed[0], str(child)) for child in root.iterdir()
             if (parsed := parse_name(child.name) or parse_delta_name(child.name)) is not None
             and parsed[1] == "final" and child.is_dir()]
    return max(found) if found else None
