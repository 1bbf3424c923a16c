"""Level 2: partition a run's wall clock into the six components by a sweep.

Every on-clock event becomes one or more `Interval`s labelled with a component and a phase.
Two labels are derived here, in the open, never silently:

- a training step is effective where it advances the furthest data cursor its rank has
  reached so far in the run (across attempts); the rest is replay (`train_step_replay`,
  wasted training);
- a step that took longer than `STALL_FACTOR` times its expected time (the median of its
  rank's last `STALL_BASELINE_STEPS` steps in the attempt, at least `STALL_MIN_STEPS` of them)
  and more than `STALL_MIN_S` beyond it is cut at its expected time: the rest is a stall
  (wasted training, never effective), `host_stall` where a `process_paused` event of any rank
  of the attempt covers it (the process was not running: the host's), else `step_stall` (the
  rank's); a stalled step enters its rank's history at its expected time;
- a `process_paused` span within an attempt's training (its first step's start to its last
  step's end) is `host_stall` itself, and a host stall takes the whole instant from the other
  phases of its component (a save or a peer's step that waited for the stopped process);
- the work in flight when a fault happened (from the failed attempt's last finished activity
  to the fault's detection) is `lost_in_flight` (wasted training once the attempt trained,
  `failed_startup` in trainer init before that), or `hang` when the fault was a hang (the
  watchdog's wait is the hung rank's, not the checkpoint interval's).

The sweep then gives each instant of [wall start, wall end] to the highest-priority component
covering it (effective > wasted > compile > init > scheduling > shutdown); an instant nothing
covers is `unattributed`. Within the winning component, concurrent phases share the instant
equally: that is each phase's exposed (critical-path) time. Raw time is the union of a
phase's intervals. Pure: no I/O.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .events import (
    COMPONENTS,
    FAILURE,
    FAILURE_DETECTED,
    HANG,
    HOST_STALL,
    MARKERS,
    OFF_CLOCK,
    OPERATOR_STOP,
    PROCESS_PAUSED,
    STEP_STALL,
    TRAIN_STEP,
    UNATTRIBUTED,
    Cursor,
    PhaseEvent,
)

REPLAY = "train_step_replay"
LOST_IN_FLIGHT = "lost_in_flight"
FAILED_STARTUP = "failed_startup"
_PRIORITY = {name: i for i, name in enumerate(COMPONENTS)}
STALL_BASELINE_STEPS = 5
STALL_MIN_STEPS = 3
STALL_FACTOR = 3.0
STALL_MIN_S = 1.0


@dataclass(frozen=True)
class Interval:
    start: float
    end: float
    component: str
    phase: str
    attempt: int
    rank: int


@dataclass(frozen=True)
class PhaseTime:
    raw_s: float
    exposed_s: float


@dataclass(frozen=True)
class Partition:
    wall_start: float
    wall_end: float
    components: dict[str, float]  # the six components + unattributed, exposed seconds
    components_raw: dict[str, float]  # union of each component's intervals, overlaps included
    phases: dict[str, PhaseTime]
    effective: tuple[Interval, ...]  # effective step intervals, by start time
    replayed_steps: int
    effective_steps: int

    @property
    def wall_s(self) -> float:
        return self.wall_end - self.wall_start


@dataclass(frozen=True)
class Fault:
    """One failure: the attempt it ended, when it happened and when the driver noticed."""

    attempt: int
    failed_at: float
    detected_at: float
    rank: int
    failure_class: str
    reason: str
    hang: bool = False  # the watchdog found the attempt hung (or a scripted hang fired)


def _split_step(ev: PhaseEvent, furthest: Cursor | None) -> tuple[float, Cursor]:
    """Fraction of the step that replays data already trained, and the new furthest cursor."""
    c0, c1 = ev.cursor_start, ev.cursor_end
    if furthest is None or c0 >= furthest:
        return 0.0, c1
    if c1 <= furthest:
        return 1.0, furthest
    # Partly new: split in proportion where the cursors differ only in their last coordinate
    # (same window and file); otherwise the step advanced into data no step reached, and the
    # whole step counts as new.
    if c0[:-1] == c1[:-1] == furthest[:-1]:
        return (furthest[-1] - c0[-1]) / (c1[-1] - c0[-1]), c1
    return 0.0, c1


def expected_step_s(history: Sequence[float]) -> float | None:
    """A step's expected duration: the median of its rank's last `STALL_BASELINE_STEPS` steps
    of the attempt; None with fewer than `STALL_MIN_STEPS` (no baseline, no stall)."""
    recent = sorted(history[-STALL_BASELINE_STEPS:])
    if len(recent) < STALL_MIN_STEPS:
        return None
    mid = len(recent) // 2
    return recent[mid] if len(recent) % 2 else (recent[mid - 1] + recent[mid]) / 2


def stall_cut(duration: float, expected: float | None) -> float | None:
    """Where a step of `duration` stops being its own work (seconds from its start), None when
    it did not stall."""
    if expected is None or duration <= STALL_FACTOR * expected or duration - expected <= STALL_MIN_S:
        return None
    return expected


def split_by_cover(start: float, end: float, cover: Sequence[tuple[float, float]]) -> list[tuple[float, float, bool]]:
    """[start, end] in pieces, each flagged whether `cover` (sorted, possibly overlapping spans) covers it."""
    pieces: list[tuple[float, float, bool]] = []
    at = start
    for s, e in cover:
        s, e = max(s, at), min(e, end)
        if e <= s:
            continue
        if s > at:
            pieces.append((at, s, False))
        pieces.append((s, e, True))
        at = e
    if at < end:
        pieces.append((at, end, False))
    return pieces


def resolve_steps(events: Iterable[PhaseEvent]) -> tuple[list[Interval], int, int]:
    """Label each training step (or its parts) effective or replay, per rank across attempts,
    and cut its stall off (module docstring)."""
    by_rank: dict[int, list[PhaseEvent]] = defaultdict(list)
    paused: dict[int, list[tuple[float, float]]] = defaultdict(list)  # attempt -> spans
    for ev in events:
        if ev.phase == TRAIN_STEP:
            by_rank[ev.rank].append(ev)
        elif ev.phase == PROCESS_PAUSED and ev.end > ev.start:
            paused[ev.attempt].append((ev.start, ev.end))
    for spans in paused.values():
        spans.sort()
    out: list[Interval] = []
    effective_steps = replayed_steps = 0
    for rank, steps in by_rank.items():
        furthest: Cursor | None = None
        history: dict[int, list[float]] = defaultdict(list)  # attempt -> step durations
        for ev in sorted(steps, key=lambda e: (e.start, e.attempt, e.end)):
            cut_at = stall_cut(ev.duration, expected_step_s(history[ev.attempt]))
            own_end = ev.end if cut_at is None else ev.start + cut_at
            history[ev.attempt].append(own_end - ev.start)
            for s, e, host in split_by_cover(own_end, ev.end, paused.get(ev.attempt, ())):
                out.append(Interval(s, e, "wasted_training", HOST_STALL if host else STEP_STALL, ev.attempt, rank))
            wasted_frac, furthest = _split_step(ev, furthest)
            cut = ev.start + wasted_frac * (own_end - ev.start)
            if wasted_frac > 0:
                out.append(Interval(ev.start, cut, "wasted_training", REPLAY, ev.attempt, rank))
                replayed_steps += 1
            if wasted_frac < 1:
                out.append(Interval(cut, own_end, "effective_training", TRAIN_STEP, ev.attempt, rank))
                effective_steps += 1
    return out, effective_steps, replayed_steps


def operator_stops(events: Sequence[PhaseEvent]) -> dict[int, float]:
    """When an operator stopped each attempt it stopped (its earliest `operator_stop` marker)."""
    out: dict[int, float] = {}
    for ev in events:
        if ev.phase == OPERATOR_STOP:
            out[ev.attempt] = min(ev.start, out.get(ev.attempt, ev.start))
    return out


# a rank's own preemption this long before its attempt's operator stop is that stop too: a
# Prefect worker signals the whole process group, so the ranks may see the SIGTERM before the
# driver's next poll records the operator's stop
OPERATOR_STOP_SLACK_S = 5.0


def failure_markers(events: Sequence[PhaseEvent]) -> list[PhaseEvent]:
    """The `failure` and `failure_detected` markers that are failures: not those an attempt's
    ranks and tasks wrote from an operator's stop on, nor the ranks' preemptions just before it
    (`OPERATOR_STOP_SLACK_S`): a cancel is the operator's, never a failure (not in NoF, the
    failure budget or the failure history)."""
    stops = operator_stops(events)

    def stopped(ev: PhaseEvent) -> bool:
        if ev.attempt not in stops:
            return False
        since = stops[ev.attempt] - (OPERATOR_STOP_SLACK_S if ev.info.failure_class == "preemption" else 0.0)
        return ev.start >= since

    return [ev for ev in events if ev.phase in (FAILURE, FAILURE_DETECTED) and not stopped(ev)]


def faults(events: Sequence[PhaseEvent]) -> list[Fault]:
    """One fault per failed attempt: the earliest failure marker and the earliest detection
    (`failure_markers`: an operator's stop is none)."""
    failed: dict[int, list[PhaseEvent]] = defaultdict(list)
    detected: dict[int, list[PhaseEvent]] = defaultdict(list)
    for ev in failure_markers(events):
        if ev.phase == FAILURE:
            failed[ev.attempt].append(ev)
        elif ev.phase == FAILURE_DETECTED:
            detected[ev.attempt].append(ev)
    out = []
    for attempt in sorted(set(failed) | set(detected)):
        f = min(failed.get(attempt) or detected[attempt], key=lambda e: e.start)
        d = min(detected.get(attempt) or failed[attempt], key=lambda e: e.start)
        # the driver's detection types the attempt when it found the cause itself (the ranks'
        # owner lost: their own markers, a SIGTERM taken for a preemption, are its consequence)
        first = next((e for e in detected.get(attempt, ()) if e.info.owner_lost), None) or \
            (f if f.phase == FAILURE else d)
        out.append(
            Fault(
                attempt=attempt,
                failed_at=min(f.start, d.start),
                detected_at=max(d.start, f.start),
                rank=first.info.failed_rank if first.info.failed_rank is not None else first.rank,
                failure_class=first.info.failure_class or "infrastructure",
                reason=first.info.reason or "",
                hang=any(ev.info.hang for ev in (*failed.get(attempt, ()), *detected.get(attempt, ()))),
            )
        )
    return out


def lost_in_flight(events: Sequence[PhaseEvent], run_faults: Iterable[Fault]) -> list[Interval]:
    """Work in flight at each fault: last finished activity of the attempt -> detection."""
    out = []
    for fault in run_faults:
        done = [
            ev
            for ev in events
            if ev.attempt == fault.attempt
            and ev.phase not in MARKERS
            and ev.phase not in OFF_CLOCK
            and ev.end <= fault.failed_at
        ]
        if not done:
            continue
        last = max(ev.end for ev in done)
        trained = any(ev.phase == TRAIN_STEP for ev in done)
        if last < fault.detected_at:
            component, phase = (
                ("wasted_training", HANG if fault.hang else LOST_IN_FLIGHT) if trained
                else ("trainer_init", FAILED_STARTUP)
            )
            out.append(Interval(last, fault.detected_at, component, phase, fault.attempt, fault.rank))
    return out


def paused_in_training(events: Sequence[PhaseEvent]) -> list[Interval]:
    """Each `process_paused` span, clipped to its attempt's training (first step start to last
    step end), as a host stall."""
    trained: dict[int, tuple[float, float]] = {}
    for ev in events:
        if ev.phase == TRAIN_STEP:
            lo, hi = trained.get(ev.attempt, (ev.start, ev.end))
            trained[ev.attempt] = (min(lo, ev.start), max(hi, ev.end))
    out = []
    for ev in events:
        if ev.phase == PROCESS_PAUSED and ev.attempt in trained:
            lo, hi = trained[ev.attempt]
            s, e = max(ev.start, lo), min(ev.end, hi)
            if e > s:
                out.append(Interval(s, e, "wasted_training", HOST_STALL, ev.attempt, ev.rank))
    return out


def intervals_of(events: Sequence[PhaseEvent], run_faults: Iterable[Fault]) -> tuple[list[Interval], int, int]:
    steps, n_eff, n_rep = resolve_steps(events)
    plain = [
        Interval(ev.start, ev.end, ev.component, ev.phase, ev.attempt, ev.rank)
        for ev in events
        if ev.component is not None and ev.end > ev.start
    ]
    return plain + steps + lost_in_flight(events, run_faults) + paused_in_training(events), n_eff, n_rep


def sweep(
    intervals: Sequence[Interval], wall_start: float, wall_end: float
) -> tuple[dict[str, float], dict[str, float], dict[str, PhaseTime]]:
    """Exposed and raw seconds per component, and per phase."""
    deltas: dict[float, list[tuple[Interval, int]]] = defaultdict(list)
    for iv in intervals:
        s, e = max(iv.start, wall_start), min(iv.end, wall_end)
        if e > s:
            deltas[s].append((iv, 1))
            deltas[e].append((iv, -1))
    points = sorted(set(deltas) | {wall_start, wall_end})
    comp_count: dict[str, int] = defaultdict(int)
    phase_count: dict[tuple[str, str], int] = defaultdict(int)  # (component, phase)
    components = {name: 0.0 for name in (*COMPONENTS, UNATTRIBUTED)}
    components_raw = dict.fromkeys(COMPONENTS, 0.0)
    raw: dict[str, float] = defaultdict(float)
    exposed: dict[str, float] = defaultdict(float)
    for left, right in zip(points, points[1:]):
        for iv, d in deltas.get(left, ()):
            comp_count[iv.component] += d
            phase_count[(iv.component, iv.phase)] += d
        span = right - left
        active = [key for key, n in phase_count.items() if n > 0]
        for phase in {p for _, p in active}:
            raw[phase] += span
        live = [c for c, n in comp_count.items() if n > 0]
        for c in live:
            components_raw[c] += span
        if not live:
            components[UNATTRIBUTED] += span
            continue
        winner = min(live, key=_PRIORITY.__getitem__)
        components[winner] += span
        sharing = sorted({p for c, p in active if c == winner})
        if HOST_STALL in sharing:  # the others waited for a process that did not run
            sharing = [HOST_STALL]
        for phase in sharing:
            exposed[phase] += span / len(sharing)
    phases = {p: PhaseTime(raw_s=raw[p], exposed_s=exposed.get(p, 0.0)) for p in raw}
    components_raw[UNATTRIBUTED] = components[UNATTRIBUTED]
    return components, components_raw, phases


def union_length(spans: Iterable[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > reach:
            total += e - max(s, reach)
            reach = e
    return total


def partition(events: Sequence[PhaseEvent], run_faults: Sequence[Fault] | None = None) -> Partition:
    on_clock = [ev for ev in events if ev.phase not in OFF_CLOCK]
    if not on_clock:
        raise ValueError("no on-clock events: cannot measure a run without a timeline")
    run_faults = faults(events) if run_faults is None else run_faults
    wall_start = min(ev.start for ev in on_clock)
    wall_end = max(ev.end for ev in on_clock)
    intervals, n_eff, n_rep = intervals_of(events, run_faults)
    components, components_raw, phases = sweep(intervals, wall_start, wall_end)
    # Background work (async checkpoint writes, standalone publishing) claims no wall time:
    # its raw duration is reported beside the partition.
    for name in OFF_CLOCK:
        spans = [(ev.start, ev.end) for ev in events if ev.phase == name]
        if spans:
            phases[name] = PhaseTime(raw_s=union_length(spans), exposed_s=0.0)
    effective = tuple(
        sorted((iv for iv in intervals if iv.component == "effective_training"), key=lambda iv: iv.start)
    )
    return Partition(wall_start, wall_end, components, components_raw, phases, effective, n_rep, n_eff)
