"""Level 1 and the run summary: TTS, TTR per failure, NoF, ETT%, on top of the L2 partition.

- TTS: submission (wall start) to the start of the first step that advances the data cursor.
- TTR of a failure: its detection to the start of the next step that trains NEW data, or to
  the next failure's detection if the recovery itself failed first (a cascade), so the TTRs
  of a run never overlap. A failure after which nothing new is trained runs to wall end and
  is marked not recovered.
- A failed publish try (a `publish` or `publish_standalone` event with outcome `failed`) is a
  failure too, class `publish`, counted in NoF: detected at the try's end, recovered when a
  later try of the run succeeds; its TTR runs to the next try's start when publishing held the
  devices (`publish`, on the clock), 0 when it ran on the CPU after their release (off it).
- ETT% = effective training / wall. The study's L1 form 1 - (TTS + NoF x TTR) / wall is
  reported beside it (`ett_l1_pct`): it counts save blocking, lost in-flight work and
  shutdown after the last failure as productive, so it is an upper bound of ETT%.
Pure: no I/O.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from .capacity import HeldCapacity, capacity_ett_pct, held_capacity
from .events import (
    COMPONENTS,
    MARKERS,
    OFF_CLOCK,
    PUBLISH_PHASES,
    UNATTRIBUTED,
    PhaseEvent,
    component_of,
    owner_of,
)
from .failures import FailureClass
from .timeline import Fault, Partition, PhaseTime, faults, partition, union_length


@dataclass(frozen=True)
class FailureMetrics:
    attempt: int
    rank: int
    failure_class: str
    reason: str
    failed_at: float
    detected_at: float
    ttr_s: float
    recovered: bool  # new data was trained again after it
    cascaded: bool  # the recovery from it failed before training new data


@dataclass(frozen=True)
class AttemptMetrics:
    attempt: int
    start: float
    end: float
    failed: bool
    phase_raw_s: dict[str, float]  # raw seconds of each recorded phase in this attempt


@dataclass(frozen=True)
class RunMetrics:
    run_id: str
    wall_start: float
    wall_end: float
    wall_s: float
    tts_s: float
    started_training: bool
    failures: tuple[FailureMetrics, ...]
    components: dict[str, float]  # exposed seconds: the six components + unattributed
    components_raw: dict[str, float]  # raw seconds: union of each component's own intervals
    phases: dict[str, PhaseTime]
    attempts: tuple[AttemptMetrics, ...]
    effective_steps: int
    replayed_steps: int
    checkpoint_saves: int
    checkpoint_blocking_s: float  # mean blocking time of one save (CSBT)
    held: HeldCapacity  # slot-seconds held for the run outside its own slots (`ett.capacity`)

    @property
    def nof(self) -> int:
        return len(self.failures)

    @property
    def ttr_total_s(self) -> float:
        return sum(f.ttr_s for f in self.failures)

    @property
    def ttr_mean_s(self) -> float:
        return self.ttr_total_s / self.nof if self.failures else 0.0

    @property
    def effective_s(self) -> float:
        return self.components["effective_training"]

    @property
    def lost_s(self) -> float:
        return self.wall_s - self.effective_s

    @property
    def ett_pct(self) -> float:
        return 100.0 * self.effective_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def capacity_ett_pct(self) -> float:
        """Effective slot-seconds over those held by the run and for it (pool, spares)."""
        return capacity_ett_pct(self.effective_s, self.wall_s, self.held)

    @property
    def ett_l1_pct(self) -> float:
        if self.wall_s <= 0:
            return 0.0
        return 100.0 * (1.0 - (self.tts_s + self.ttr_total_s) / self.wall_s)

    def exposed(self, phase: str) -> float:
        return self.phases[phase].exposed_s if phase in self.phases else 0.0

    def raw(self, phase: str) -> float:
        return self.phases[phase].raw_s if phase in self.phases else 0.0

    def owner(self, name: str) -> str | None:
        """Who owns the time of component or phase `name` in this run: a component's owner is
        its largest exposed phase's (wasted training is checkpoint blocking in one run, a
        stalled host or rank in another), else its usual owner (`owner_of`)."""
        if name in COMPONENTS:
            parts = [(t.exposed_s, phase) for phase, t in self.phases.items()
                     if component_of(phase) == name and t.exposed_s > 0 and owner_of(phase)]
            if parts:
                return owner_of(max(parts)[1])
        return owner_of(name)

    def check_partition(self, tolerance_s: float = 1e-3) -> None:
        total = sum(self.components[c] for c in (*COMPONENTS, UNATTRIBUTED))
        if abs(total - self.wall_s) > tolerance_s:
            raise AssertionError(f"L2 sums to {total:.6f} s but wall is {self.wall_s:.6f} s")


def _failures(fs: Sequence[Fault], part: Partition) -> tuple[FailureMetrics, ...]:
    out = []
    detections = sorted(f.detected_at for f in fs)
    for fault in sorted(fs, key=lambda f: f.detected_at):
        next_new = next((iv.start for iv in part.effective if iv.start >= fault.detected_at), None)
        next_fail = next((t for t in detections if t > fault.detected_at), None)
        ends = [t for t in (next_new, next_fail) if t is not None]
        end = min(ends) if ends else part.wall_end
        out.append(
            FailureMetrics(
                attempt=fault.attempt,
                rank=fault.rank,
                failure_class=fault.failure_class,
                reason=fault.reason,
                failed_at=fault.failed_at,
                detected_at=fault.detected_at,
                ttr_s=end - fault.detected_at,
                recovered=next_new is not None,
                cascaded=next_fail is not None and (next_new is None or next_fail < next_new),
            )
        )
    return tuple(out)


def _publish_failures(events: Sequence[PhaseEvent], wall_end: float) -> tuple[FailureMetrics, ...]:
    tries = sorted((ev for ev in events if ev.phase in PUBLISH_PHASES), key=lambda e: (e.start, e.end))
    out = []
    for i, ev in enumerate(tries):
        if ev.info.outcome != "failed":
            continue
        later = tries[i + 1:]
        retry = later[0] if later else None
        on_clock = ev.phase == "publish"
        ttr = max(0.0, min(retry.start if retry is not None else wall_end, wall_end) - ev.end) if on_clock else 0.0
        out.append(FailureMetrics(
            attempt=ev.attempt, rank=ev.rank, failure_class=FailureClass.PUBLISH.value,
            reason=(ev.info.error or "publish failed")[:500], failed_at=ev.end, detected_at=ev.end,
            ttr_s=ttr, recovered=any(t.info.outcome in ("published", "gated") for t in later),
            cascaded=retry is not None and retry.info.outcome == "failed"))
    return tuple(out)


def _attempts(events: Sequence[PhaseEvent], fs: Sequence[Fault]) -> tuple[AttemptMetrics, ...]:
    failed = {f.attempt for f in fs}
    grouped: dict[int, list[PhaseEvent]] = defaultdict(list)
    for ev in events:
        if ev.phase not in OFF_CLOCK:
            grouped[ev.attempt].append(ev)
    out = []
    for attempt in sorted(grouped):
        evs = grouped[attempt]
        spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for ev in evs:
            if ev.phase not in MARKERS:
                spans[ev.phase].append((ev.start, ev.end))
        out.append(
            AttemptMetrics(
                attempt=attempt,
                start=min(ev.start for ev in evs),
                end=max(ev.end for ev in evs),
                failed=attempt in failed,
                phase_raw_s={p: union_length(s) for p, s in spans.items()},
            )
        )
    return tuple(out)


def _saves(events: Sequence[PhaseEvent]) -> tuple[int, float]:
    """Checkpoint saves counted once per save (on the lowest rank that recorded saves)."""
    saves = [ev for ev in events if ev.phase == "checkpoint_save_blocking"]
    if not saves:
        return 0, 0.0
    rank = min(ev.rank for ev in saves)
    mine = [ev.duration for ev in saves if ev.rank == rank]
    return len(mine), sum(mine) / len(mine)


def compute_run_metrics(events: Sequence[PhaseEvent]) -> RunMetrics:
    """L1 and L2 of one run from all of its phase events (every attempt, every rank)."""
    if not events:
        raise ValueError("a run without events has no metrics")
    run_ids = {ev.run_id for ev in events}
    if len(run_ids) != 1:
        raise ValueError(f"events of several runs given together: {sorted(run_ids)}")
    fs = faults(events)
    part = partition(events, fs)
    first_new = part.effective[0].start if part.effective else None
    saves, csbt = _saves(events)
    return RunMetrics(
        run_id=run_ids.pop(),
        wall_start=part.wall_start,
        wall_end=part.wall_end,
        wall_s=part.wall_s,
        tts_s=(first_new if first_new is not None else part.wall_end) - part.wall_start,
        started_training=first_new is not None,
        failures=_failures(fs, part) + _publish_failures(events, part.wall_end),
        components=part.components,
        components_raw=part.components_raw,
        phases=part.phases,
        attempts=_attempts(events, fs),
        effective_steps=part.effective_steps,
        replayed_steps=part.replayed_steps,
        checkpoint_saves=saves,
        checkpoint_blocking_s=csbt,
        held=held_capacity(events, part.wall_start, part.wall_end),
    )
