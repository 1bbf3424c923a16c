"""What the tasks read from and add to a run's spool, beside what the driver and ranks write:
a run's `RunRecorder` does all of it; the pure readers of events follow it.

The tasks write on the driver's files (rank -1): the queueing before the first attempt
(`scheduling`), the release of devices held after training (`shutdown`), failures that the
driver never saw (a task that raised outside its loop, before a task retry), and publishing
(`publish` while the devices are held, `publish_standalone` on the CPU after). Publish
failures are kept as attributes of those spans (`outcome="failed"`, `failure_class="publish"`)
and never as `failure` markers: NoF and TTR are about training (see the flows README notes).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ettflow.ett.event_attrs import SparePlanAttrs
from ettflow.ett.events import (
    CHECKPOINT_INTERVAL,
    CLAIMS_LOST,
    FAILURE,
    FAILURE_DETECTED,
    OFF_CLOCK,
    OPERATOR_STOP,
    PUBLISH_PHASES,
    SPARE_PLAN,
    PhaseEvent,
)
from ettflow.ett.failures import Failure
from ettflow.ett.interval_plan import TAG, PlannedInterval
from ettflow.ett.spare_sizing import SpareDecision
from ettflow.ett.spool import SpoolWriter, read_spool
from ettflow.ett.timeline import failure_markers
from ettflow.trainer.classify import failure_from_exception, stop_signal
from ettflow.trainer.group.stop_request import ask_stop_cause

_ATTEMPT = re.compile(r"attempt-(\d+)\.")


@dataclass(frozen=True)
class RunRecorder:
    """One run's spool as the tasks and hooks read it and write the driver's files (rank -1):
    every spool I/O of a task goes through the run's recorder (`RefreshPlan.recorder`)."""

    root: Path
    run_id: str

    def attempts(self) -> list[int]:
        folder = Path(self.root) / self.run_id
        if not folder.is_dir():
            return []
        found = {int(m.group(1)) for p in folder.glob("attempt-*.jsonl") if (m := _ATTEMPT.match(p.name))}
        return sorted(found)

    def next_attempt(self) -> int:
        done = self.attempts()
        return done[-1] + 1 if done else 0

    def last_attempt(self) -> int:
        done = self.attempts()
        return done[-1] if done else 0

    def events(self) -> list[PhaseEvent]:
        """The run's events: its files', and those this process keeps because the disk refused them."""
        try:
            return read_spool(self.root, self.run_id).events
        except FileNotFoundError:
            return []

    def record(self, attempt: int, phase: str, start: float, end: float, **attrs: Any) -> PhaseEvent:
        with SpoolWriter(self.root, self.run_id, attempt, -1) as rec:
            return rec.record(phase, start, end, **attrs)

    def failures(self) -> list[Failure]:
        """The run's failures so far, one per failed attempt, oldest first: the driver's (or a
        task's) `failure_detected` marker, else the rank's own `failure` marker. What earlier
        tries of the train task spent of the run's failure budget."""
        by_attempt: dict[int, PhaseEvent] = {}
        for ev in sorted(failure_markers(self.events()), key=lambda e: (e.attempt, e.phase != FAILURE_DETECTED,
                                                                        e.start)):
            by_attempt.setdefault(ev.attempt, ev)
        return [ev.info.failure(a) for a, ev in sorted(by_attempt.items())]

    def record_task_failure(self, attempt: int, exc: BaseException, *, task: str, at: float,
                            stop_cause: Callable[[], str | None] | None = None) -> Failure | None:
        """Mark `attempt` failed unless the driver already did; the failure recorded (typed from
        the exception, `failure_from_exception`), or None when the attempt had one already.
        A stop of the process that `stop_cause` says an operator asked for (a cancel) is no
        failure: an `operator_stop` marker instead, and None."""
        evs = [e for e in self.events() if e.attempt == attempt]
        if any(e.phase in (FAILURE, FAILURE_DETECTED, OPERATOR_STOP) for e in evs):
            return None  # marked already, or stopped by an operator (no failure)
        stopped = stop_signal(exc)
        operator = ask_stop_cause(stop_cause) if stopped and stop_cause is not None else None
        if operator:
            with SpoolWriter(self.root, self.run_id, attempt, -1) as rec:
                rec.mark(OPERATOR_STOP, at, reason=f"{operator} ({stopped})", task=task, process_stopped=True)
            return None
        failure = failure_from_exception(exc, rank=-1, attempt=attempt)
        said = f"{task}: {failure.reason}" if stopped else f"{task} raised {type(exc).__name__}: {exc}"
        failure = replace(failure, reason=said[:500])
        with SpoolWriter(self.root, self.run_id, attempt, -1) as rec:
            rec.mark(FAILURE_DETECTED, at, **failure.to_attrs(), task=task, task_retry=True,
                     **({"process_stopped": True} if stopped else {}))
        return failure

    def mark_claims_lost(self, reason: str, at: float) -> None:
        """This try of the run lost its window claims (`lineage.ClaimsLost`): a flow retry ends at once."""
        with SpoolWriter(self.root, self.run_id, self.last_attempt(), -1) as rec:
            rec.mark(CLAIMS_LOST, at, reason=reason[:500])

    def record_prestart(self, attempt: int, started_at: float, submitted_at: float) -> None:
        """The run's process, started ahead of its submission (a worker's prefetch of a scheduled
        run), held for it until then: off the clock, counted as held capacity (`ett.capacity`)."""
        with SpoolWriter(self.root, self.run_id, attempt, -1) as rec:
            rec.record("flow_prestart", started_at, submitted_at, pid=os.getpid())

    def record_interval(self, attempt: int, planned: PlannedInterval, at: float) -> None:
        """The checkpoint interval the refresh trains with, and its inputs (a marker of `attempt`)."""
        with SpoolWriter(self.root, self.run_id, attempt, -1) as rec:
            rec.mark(CHECKPOINT_INTERVAL, at, **planned.to_attrs())

    def record_spare_plan(self, attempt: int, decision: SpareDecision, at: float) -> None:
        """The spares the run holds and the numbers that sized them (a marker of `attempt`)."""
        with SpoolWriter(self.root, self.run_id, attempt, -1) as rec:
            rec.mark(SPARE_PLAN, at, **decision.to_attrs())


def on_clock_end(evs: list[PhaseEvent]) -> float | None:
    ends = [e.end for e in evs if e.phase not in OFF_CLOCK]
    return max(ends) if ends else None


def training_attempts(evs: list[PhaseEvent]) -> list[int]:
    return sorted({e.attempt for e in evs if e.phase == "train_step"})


def claims_lost(evs: list[PhaseEvent]) -> str | None:
    """Why an earlier try of the run lost its window claims (None: none did)."""
    return next((e.info.reason or "its claims were lost" for e in evs if e.phase == CLAIMS_LOST), None)


def measurable(evs: list[PhaseEvent]) -> bool:
    """Whether the run spooled any work on its clock: a run with none (nothing spooled, or only
    work off the clock, such as a stopped run's anchor published on the CPU) has no ETT row."""
    return any(e.phase not in OFF_CLOCK for e in evs)


def submitted(evs: list[PhaseEvent]) -> bool:
    return any(e.phase == "submitted" for e in evs)


def publish_records(evs: list[PhaseEvent]) -> list[PhaseEvent]:
    return sorted((e for e in evs if e.phase in PUBLISH_PHASES), key=lambda e: e.start)


def publish_summary(evs: list[PhaseEvent]) -> dict[str, Any]:
    """Tries, failures and the published snapshot, as warehouse tags."""
    tries = publish_records(evs)
    failed = [e for e in tries if e.info.outcome == "failed"]
    ok = [e for e in tries if e.info.outcome == "published"]
    out: dict[str, Any] = {"publish_tries": len(tries), "publish_failures": len(failed)}
    if failed:
        out["publish_errors"] = [(e.info.error or "")[:200] for e in failed]
    if ok:
        out["snapshot"] = ok[-1].info.snapshot
        out["publish_phase"] = ok[-1].phase
    return out


def _last_mark(evs: list[PhaseEvent], phase: str) -> PhaseEvent | None:
    """The run's last marker of `phase` (by attempt, then time); None: none was recorded."""
    marks = sorted((e for e in evs if e.phase == phase), key=lambda e: (e.attempt, e.start))
    return marks[-1] if marks else None


def spare_plan(evs: list[PhaseEvent]) -> SparePlanAttrs | None:
    """The run's last recorded spare sizing (None: none was recorded)."""
    mark = _last_mark(evs, SPARE_PLAN)
    return mark.info if mark is not None else None


def planned_interval(evs: list[PhaseEvent]) -> PlannedInterval | None:
    """The run's last recorded checkpoint interval (None: none was recorded)."""
    mark = _last_mark(evs, CHECKPOINT_INTERVAL)
    return PlannedInterval.from_attrs(mark.attrs) if mark is not None else None


def interval_tags(evs: list[PhaseEvent]) -> dict[str, Any]:
    """The planned interval as the warehouse tag `checkpoint_interval` (nothing when none)."""
    planned = planned_interval(evs)
    return {TAG: planned.to_attrs()} if planned is not None else {}

