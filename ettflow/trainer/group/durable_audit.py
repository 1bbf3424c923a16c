"""The durable checkpoints, verified while the memory tier serves a recovery (issue 42 #3).

A recovery restored from the in-memory tier never reads the durable checkpoint, so damage to it
(a flipped byte, a cut shard, a lost file) would stay unnoticed until a restart needs it; the
restart then falls back to an older step and trains the steps between again. So when a
recovery is served from memory, the driver verifies the durable tier in a thread of its own
(every byte, as a restart's restore would: `catalog.scan`; off the recovery's clock, the ranks
train meanwhile). Each damaged checkpoint it finds is recorded once per run: a
`checkpoint_damaged` marker (the damaged step, the step a restart would restore instead, the
file, the reason), a warning, and the row's `checkpoint_damaged` tag (`ett.archive`). Nothing
is deleted: a restart's own scan skips the folder, and a person may want to read it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path

from ettflow.ett.events import CHECKPOINT_DAMAGED
from ettflow.ett.spool import SpoolWriter
from ettflow.trainer.checkpoint.catalog import CheckpointProblem, scan

log = logging.getLogger("ettflow.trainer")

MEMORY_RECOVERY = "memory_recovery"  # what noticed the damage: a recovery the memory tier served


class DurableAudit:
    """One run's checks of its durable tier (`start` per memory-served recovery; at most one
    runs at a time)."""

    def __init__(self, root: Path | str, spool_root: Path | str, run_id: str) -> None:
        self.root, self.spool_root, self.run_id = Path(root), Path(spool_root), run_id
        self._recorded: set[str] = set()  # folders already recorded (once per run)
        self._thread: threading.Thread | None = None

    def start(self, attempt: int, served_step: int) -> bool:
        """Verify the durable tier in the background; False when a check is still running."""
        if self._thread is not None and self._thread.is_alive():
            return False
        self._thread = threading.Thread(target=self.check, args=(attempt, served_step), daemon=True,
                                        name=f"durable-audit-{self.run_id[:8]}")
        self._thread.start()
        return True

    def join(self, timeout_s: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def check(self, attempt: int, served_step: int) -> list[CheckpointProblem]:
        """The damaged checkpoints not recorded before, each recorded now (see the module)."""
        try:
            found = scan(self.root)
        except OSError as exc:  # the storage itself: a restart would meet it too, and say so
            log.warning("attempt %d: the durable checkpoints under %s could not be verified (%s)", attempt,
                        self.root, exc)
            return []
        new = [p for p in found.problems if p.damaged and str(p.path) not in self._recorded]
        for damaged in new:
            self._recorded.add(str(damaged.path))
            instead = f"step {damaged.fallback}" if damaged.fallback is not None else "nothing (from scratch)"
            log.warning("attempt %d: durable checkpoint step %s is damaged (%s: %s); the memory tier served this "
                        "recovery (step %d), a restart would restore %s", attempt, damaged.step,
                        damaged.file or "its folder", damaged.reason, served_step, instead)
            with contextlib.suppress(OSError), SpoolWriter(self.spool_root, self.run_id, attempt, -1) as rec:
                rec.mark(CHECKPOINT_DAMAGED, damaged_step=damaged.step, restored_step=damaged.fallback,
                         file=damaged.file, reason=damaged.reason[:300], path=str(damaged.path),
                         noticed=MEMORY_RECOVERY, served_step=served_step)
        return new
