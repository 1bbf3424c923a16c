"""Where a training step's recorded interval starts, and when its fetch is a data stall.

The rule (issue 12: no unattributed time inside training). A rank's recorded intervals tile
its training time without gaps:

- Step s's interval starts where the rank's previous on-clock interval ended: the training
  start for the first step of an attempt, else the previous step's end, or the end of the
  blocking part of a save the loop waited for (the save records its own event,
  `checkpoint_save_blocking` or `memory_save_blocking`, so a step never contains one). Every
  thing between that start and the step's end belongs to the step: fetching its batch, the
  heartbeat, the preemption agreement (one all-reduce), recording the previous step.
- A fetch that waited on the data pipeline for longer than `STALL_THRESHOLD_S` is a data stall:
  a `data_stall` event [interval start, batch ready], owned by `data`, and the step's interval
  starts at batch ready. It waited on the pipeline when no batch was ready: the prefetch queue
  was empty (`Fetch.batch_was_ready` False), or the batches are made in the training thread
  (no prefetch: the fetch is the pipeline's own work). Its `wait_s` is the measured wait of
  the fetch alone; the stall also holds the bookkeeping between the previous interval's end
  and the fetch (microseconds), so stall and step tile the time exactly. A shorter wait stays
  inside the step, and so does any wait for a batch that was ready: measured on 2 shared
  cores, every one of a run's 1-50 ms fetches found 16 batches queued (the training thread got
  the CPU back late, not the data); it is the step's, like the rest of its CPU contention.

Pure: the loop passes the times it measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Longer than a fetch from a non-empty queue (tens of microseconds, a GIL hand-off at most)
# and far shorter than a step: a wait above it means the queue was empty.
STALL_THRESHOLD_S = 0.001


@dataclass(frozen=True, kw_only=True)
class Fetch:
    """One step's fetch: `since` where its interval would start (the previous on-clock
    interval's end), `fetch_start` when next(batches) was called, `ready` when it returned;
    `batch_was_ready` whether a prepared batch was waiting when it was called (a prefetcher's
    queue held one)."""

    since: float
    fetch_start: float
    ready: float
    batch_was_ready: bool = False
    threshold_s: float = STALL_THRESHOLD_S

    def __post_init__(self) -> None:
        for name in ("since", "fetch_start", "ready", "threshold_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"Fetch.{name} must be a finite number, got {value!r}")
        if not self.since <= self.fetch_start <= self.ready:
            raise ValueError(f"Fetch needs since <= fetch_start <= ready, got {self.since!r}, "
                             f"{self.fetch_start!r}, {self.ready!r}")
        if not isinstance(self.batch_was_ready, bool):
            raise ValueError(f"Fetch.batch_was_ready must be a bool, got {self.batch_was_ready!r}")
        if self.threshold_s < 0:
            raise ValueError(f"Fetch.threshold_s must be >= 0, got {self.threshold_s!r}")

    @property
    def wait_s(self) -> float:
        """How long next(batches) took."""
        return self.ready - self.fetch_start

    @property
    def stalled(self) -> bool:
        """The step waited on the data pipeline: no batch was ready, and the wait was long."""
        return not self.batch_was_ready and self.wait_s > self.threshold_s

    @property
    def stall(self) -> tuple[float, float] | None:
        """The `data_stall` interval, None when the fetch did not stall."""
        return (self.since, self.ready) if self.stalled else None

    @property
    def step_start(self) -> float:
        """Where the step's recorded interval starts."""
        return self.ready if self.stalled else self.since


def resume_after(step_end: float, recorded_until: float | None) -> float:
    """Where the next step's interval starts after a step that ended at `step_end`: the end of
    the latest on-clock interval the rank recorded since (a save's blocking part), if later."""
    return step_end if recorded_until is None else max(step_end, recorded_until)
