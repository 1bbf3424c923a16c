"""A run whose driver died: the orchestrator failure that its spool must show.

When the flow's process dies (SIGKILL, a lost node, a worker's flow process that Prefect
marks CRASHED), nobody records the failure. This module writes it into the spool, once, as
the two markers every failure has, on the driver's file (rank -1):

- ``failure`` at `failed_at`: the last time the run was known alive: its driver's last
  heartbeat or the end of the last spooled on-clock event, whichever is later (ranks outlive
  their driver for a moment, and a timeline must not show work after its failure);
- ``failure_detected`` at `detected_at`: when the death was noticed. For a run found by its
  stale heartbeat this is the last beat + the heartbeat bound (`HeartbeatRecord.detection_at`,
  a function of the spool, so re-archiving gives the same row); for Prefect's CRASHED state,
  the time the hook ran. Never before the end of the last spooled on-clock event.

Both carry `Failure(ORCHESTRATOR).to_attrs()`. The failure goes on the last attempt, or on the
next one when the last attempt already failed (its failure was detected and the driver died
before starting the restart), so NoF counts it. When the last attempt's failure is the stop of
the run's own process, recorded by its driver or task (a `preemption` with `process_stopped`, or
`task`: a SIGTERM of `ettflow refresh`), the crash is that stop and nothing is added: one
failure, with its real class; when an operator stopped it (an `operator_stop` marker: a
cancel), nothing is added either: no failure at all.
Nothing trains after it: its TTR runs to the wall end, which is the detection, and the time
from the last finished work to the detection is lost in flight (`ett.timeline`). Idempotent: a
run whose last attempt already holds an orchestrator failure gets none added, and two processes
reconciling one run at once add one (they serialize on the lock file
``<spool>/<run_id>/.orphan.lock``). One whose `failure` was written but not its
`failure_detected` (the writer died, or the disk refused it, between the two) gets the missing
marker, at the detection it would have had: without it the run's wall ended at the failure.
"""

from __future__ import annotations

import fcntl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .events import FAILURE, FAILURE_DETECTED, OFF_CLOCK, OPERATOR_STOP, PhaseEvent
from .failures import Failure, FailureClass
from .spool import SpoolWriteError, SpoolWriter, read_spool


@dataclass(frozen=True, kw_only=True)
class OrphanFailure:
    """Where an orchestrator failure goes in a run's timeline."""

    attempt: int
    failed_at: float
    detected_at: float
    missing: tuple[str, ...] = (FAILURE, FAILURE_DETECTED)  # the markers to write
    attrs: dict | None = None  # a half-written failure's own attributes, for the marker it lacks


def last_on_clock_end(events: Sequence[PhaseEvent]) -> float | None:
    ends = [e.end for e in events if e.phase not in OFF_CLOCK]
    return max(ends) if ends else None


def has_orchestrator_failure(events: Sequence[PhaseEvent], attempt: int) -> bool:
    return any(e.attempt == attempt and e.phase in (FAILURE, FAILURE_DETECTED)
               and e.info.failure_class == FailureClass.ORCHESTRATOR.value for e in events)


def place_orphan_failure(events: Sequence[PhaseEvent], *, last_alive: float | None,
                         detected_at: float) -> OrphanFailure | None:
    """Pure: the attempt and times of the failure to add, or None when it is already there
    (or the run has no event to place it after)."""
    if not events:
        return None
    last = max(e.attempt for e in events)
    if has_orchestrator_failure(events, last):
        return _half_written(events, last, detected_at)
    if any(e.attempt == last and e.phase == FAILURE_DETECTED
           and (e.info.process_stopped or e.info.task)
           and e.info.failure_class == FailureClass.PREEMPTION.value for e in events):
        return None  # the process was stopped, and its driver or task said so: the crash is that stop
    if any(e.attempt == last and e.phase == OPERATOR_STOP for e in events):
        return None  # an operator stopped it (a cancel): the crash is their stop, no failure
    failed = any(e.attempt == last and e.phase in (FAILURE, FAILURE_DETECTED) for e in events)
    end = last_on_clock_end(events)
    # never before the last spooled work: a rank's steps recorded after the flow's last heartbeat
    # (the ranks outlive their driver for a moment) are drawn before the failure, not after it
    known = [t for t in (last_alive, end) if t is not None]
    failed_at = max(known) if known else max(e.end for e in events)
    detected = max(detected_at, failed_at, end if end is not None else failed_at)
    return OrphanFailure(attempt=last + 1 if failed else last, failed_at=failed_at, detected_at=detected)


def _half_written(events: Sequence[PhaseEvent], attempt: int, detected_at: float) -> OrphanFailure | None:
    """The `failure_detected` an orchestrator failure whose `failure` alone was written lacks."""
    mine = [e for e in events if e.attempt == attempt and e.phase in (FAILURE, FAILURE_DETECTED)
            and e.info.failure_class == FailureClass.ORCHESTRATOR.value]
    if any(e.phase == FAILURE_DETECTED for e in mine):
        return None
    first = min(mine, key=lambda e: e.start)
    end = last_on_clock_end(events)
    detected = max(detected_at, first.start, end if end is not None else first.start)
    return OrphanFailure(attempt=attempt, failed_at=first.start, detected_at=detected, missing=(FAILURE_DETECTED,),
                         attrs=dict(first.attrs))


def record_orchestrator_failure(spool_root: Path | str, run_id: str, *, last_alive: float | None,
                                detected_at: float, reason: str, detection: str,
                                detail: str = "") -> OrphanFailure | None:
    """Add the run's orchestrator failure to its spool unless it is there (see the module);
    returns what was added, or None. `detection` says how it was found ("heartbeat",
    "prefect_crashed"); raises `SpoolWriteError` when the spool cannot be written."""
    lock = Path(spool_root) / run_id / ".orphan.lock"
    try:
        fh = open(lock, "a")  # noqa: SIM115 - held for the whole read-then-write below
    except OSError as exc:
        raise SpoolWriteError.of(exc, lock) from exc
    with fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        events = read_spool(spool_root, run_id).events
        placed = place_orphan_failure(events, last_alive=last_alive, detected_at=detected_at)
        if placed is None:
            return None
        failure = Failure(failure_class=FailureClass.ORCHESTRATOR, rank=-1, attempt=placed.attempt,
                          reason=reason, detail=detail)
        attrs = {**failure.to_attrs(), "detection": detection}
        if placed.attrs is not None:  # the failure that was written, as it was written (an injected kill...)
            attrs = {"detection": detection, **placed.attrs}
        with SpoolWriter(spool_root, run_id, placed.attempt, -1) as rec:
            if FAILURE in placed.missing:
                rec.mark(FAILURE, placed.failed_at, **attrs)
            rec.mark(FAILURE_DETECTED, placed.detected_at, **attrs)
        return placed
