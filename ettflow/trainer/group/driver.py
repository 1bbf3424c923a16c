"""The training driver: runs the rank group, watches it, recovers it, as its failure policy says.

Per attempt: reserve the group (the wait is the `scheduling` phase), launch training on every
rank, then watch. A rank whose process dies, whose code raises, that writes its own `failure`
marker to the spool (read at once, before Ray or gloo report anything), or that stays in one
phase (init stage, compile, restore, step, save) longer than that phase's bound (its heartbeat,
`rank_heartbeat.find_hang`) is a failure: a typed `Failure`. The driver records its
detection (`failure_detected`, the failure's attributes), tears the whole group down
(`shutdown`), and asks its `FailurePolicy` what to do with the failure and the run's history
(failures of earlier tries of the task included, so the run has one budget): RESTART starts
the next attempt, which restores the latest checkpoint and the compile cache and replays from
the checkpoint's cursor; RAISE stops the run with `TrainingFailed`. Scripted SIGKILLs by time
are sent from here, once per run (`faults.pending_faults`).

A stop of the driver's own process while it watches (SIGTERM of `ettflow refresh`, Ctrl-C,
the worker's cancellation: a BaseException `classify.stop_signal` names) preempts every rank
(`WorkerGroup.preempt`: each takes its emergency checkpoint when its grace allows), waits for
them within `preemption_grace_s`, records the run's one `preemption` failure and lets the stop
go on. A stop check that raises `stop_request.RunWithdrawn` (the run's work went to another
refresh while its process stood still) tears the ranks down at once, records their `shutdown`
(withdrawn) and no failure, and lets it go on.

Live recovery (`Switches.live_recovery`, trainer/rank/live_recovery.py): with a group that can
(`LiveGroup`), a failure the group can recover live (one rank's lost process, the others
parked) is not torn down. The driver still records the detection and the policy decides; on
RESTART the next attempt runs on the same group: a warm spare takes the failed rank
(`hand_off`, recorded as `spare_handoff`), and the survivors and the spare resume from the
group's restore point (`resume`). The driver asks the group for its spare once training runs
(`training_started`). A failure it cannot recover live restarts every rank, as above.

The group is a collaborator (`group_factory(attempt) -> WorkerGroup`), and so is the policy,
so tests can step this loop with a dummy group and no cluster; `RayWorkerGroup` is the real one.
A group that is also a `PlacedGroup` says how many ranks its attempt runs (an elastic restart
may run fewer than the config's `world_size`) and on which node each is; the attempt's
`scheduling` record carries both (`world_size`, `nodes`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol, runtime_checkable

from ettflow.ett.events import FAILURE_DETECTED, FAULT_UNFIRED, OPERATOR_STOP, TRAIN_STEP
from ettflow.ett.failures import Failure, FailureClass
from ettflow.ett.spool import SpoolWriter, read_file, spool_file
from ettflow.trainer.checkpoint.config import CheckpointError
from ettflow.trainer.classify import is_process_loss, primary_failure, stop_signal
from ettflow.trainer.config import ANCHOR_SEAL, FailAt, TrainerConfig
from ettflow.trainer.faults import is_scripted_hang, pending_faults, record_fired
from ettflow.trainer.group.anchor_seal import SEAL_TRIES, seal_anchor
from ettflow.trainer.group.failure_policy import DefaultFailurePolicy, FailureDecision, FailurePolicy, failure_counts
from ettflow.trainer.group.progress import SpoolTail
from ettflow.trainer.group.stop_request import RunWithdrawn, ask_stop_cause
from ettflow.trainer.protocol import AnchorHandOff, PollStatus, RankResult, RestorePoint
from ettflow.trainer.rank_heartbeat import PhaseBounds, beat_file, find_hang, read_beat

log = logging.getLogger("ettflow.trainer")

# The longest the driver waits for its ranks' emergency checkpoints once its own process was
# told to stop: whoever sent the stop kills after a grace of its own (the `ettflow refresh`
# worker's guard after 20 s, which also covers the run's crash handling; Docker after 10 s), and
# a rank that cannot save in time (a hung peer) must not hold the run's record back past it
STOP_WAIT_S = 10.0


class WorkerGroup(Protocol):
    def reserve(self) -> None: ...  # placement + processes up

    def launch(self) -> None: ...  # start training on every rank

    def poll(self, timeout_s: float) -> PollStatus: ...

    def kill(self, rank: int) -> None: ...  # SIGKILL the rank's process

    def teardown(self) -> None: ...  # stop every rank and release the devices


@runtime_checkable
class PlacedGroup(WorkerGroup, Protocol):
    """A group that knows its layout once reserved."""

    @property
    def world_size(self) -> int: ...  # the ranks this attempt runs

    @property
    def placement(self) -> tuple[str, ...]: ...  # each rank's node, by rank


@runtime_checkable
class ReleasingGroup(WorkerGroup, Protocol):
    """A group whose `teardown` does more after the devices are released (the pool's fill for
    the next run): when it released them, so `shutdown` ends there (None: not released yet)."""

    @property
    def released_at(self) -> float | None: ...


@runtime_checkable
class PreemptibleGroup(WorkerGroup, Protocol):
    """A group whose ranks can be preempted (`preemption.py`): when the driver's own process is
    told to stop, each rank gets the chance of an emergency checkpoint."""

    def preempt(self) -> None: ...  # SIGTERM every rank: each ends as preempted, saving if it has the grace


@runtime_checkable
class OwnedGroup(WorkerGroup, Protocol):
    """A group whose rank processes may be owned by another actor (the cluster's pool, which
    prewarmed them): Ray ends them when it dies, with a SIGTERM a rank takes for a preemption."""

    def owner_cause(self, failure: Failure) -> Failure: ...  # `failure`, or its owner's loss when that ended it


@runtime_checkable
class LiveGroup(WorkerGroup, Protocol):
    """A group that can recover live: its healthy ranks keep running through a peer's failure
    and a warm spare takes the failed rank (live_recovery.py)."""

    def training_started(self) -> None: ...  # the attempt trains: prepare a spare now

    def prepare_live(self, failure: Failure) -> RestorePoint | None: ...  # None: restart every rank

    def hand_off(self, attempt: int, failure: Failure) -> None: ...  # a spare takes the failed rank's place

    def resume(self, point: RestorePoint) -> None: ...  # survivors rejoin, the spare joins: training goes on


@dataclass(frozen=True)
class AttemptSucceeded:
    """Every rank finished; `ranks` holds what each returned."""

    ranks: dict[int, RankResult]


@dataclass(frozen=True)
class AttemptFailed:
    """The attempt ended with `failure` (its cause); `all_failures`: every rank's failure seen."""

    failure: Failure
    all_failures: tuple[Failure, ...]
    live: tuple[LiveGroup, RestorePoint] | None = None  # the group kept for a live recovery, and its restore point


AttemptOutcome = AttemptSucceeded | AttemptFailed


class TrainingFailed(RuntimeError):
    """The run stopped, or a task's try ended, as the failure policy decided.

    failures: every failure of the run, oldest first (earlier tries of the task included).
    decision: the policy's decision on the last one (RAISE from the driver; RESTART when a
        task's try failed outside the driver and the budget allows another try).
    why: the policy's rule, one line.
    """

    def __init__(self, run_id: str, failures: Sequence[Failure], decision: FailureDecision, why: str) -> None:
        self.run_id, self.failures, self.decision, self.why = run_id, list(failures), decision, why
        n = len(self.failures)
        lines = "; ".join(f"attempt {f.attempt}: {f.summary}" for f in self.failures)
        verb = "stopped" if decision is FailureDecision.RAISE else "failed, to be restarted,"
        super().__init__(f"run {run_id} {verb} after {n} failure{'s' if n != 1 else ''} "
                         f"({failure_counts(self.failures)}): {why}. {lines}")

    @property
    def failure(self) -> Failure | None:
        """The failure the decision was about."""
        return self.failures[-1] if self.failures else None

    def __reduce__(self):  # survives pickling (Prefect, Ray) with its attributes
        return (type(self), (self.run_id, self.failures, self.decision, self.why))


@dataclass
class TrainingResult:
    run_id: str
    attempts: int
    failures: list[Failure] = field(default_factory=list)  # this run's, in order
    ranks: dict[int, RankResult] = field(default_factory=dict)  # what each rank returned
    unfired: tuple[FailAt, ...] = ()  # scripted faults the run ended without reaching (`fault_unfired`)

    @property
    def rank0(self) -> RankResult:
        """Rank 0's result (the driver returns only when every rank finished)."""
        return self.ranks[0]


class TrainingDriver:
    def __init__(
        self,
        config: TrainerConfig,
        run_id: str,
        spool_root: Path | str,
        group_factory: Callable[[int], WorkerGroup],
        *,
        failure_policy: FailurePolicy | None = None,
        poll_s: float = 0.25,
        grace_s: float = 2.0,
        clock: Callable[[], float] = time.time,
        stop_check: Callable[[], None] = lambda: None,
        stop_cause: Callable[[], str | None] = lambda: None,
    ) -> None:
        """`failure_policy`: default `DefaultFailurePolicy(max_failures=config.max_failures)`.
        `stop_check`: raises a stop of this process noted since (`stop_request.DeferredStop.check`)
        or `RunWithdrawn`, called after each poll. `stop_cause`: asked when this process is stopped, who stopped it
        when an operator did (a cancel: a sentence; None: a preemption)."""
        self.config, self.run_id, self.spool_root = config, run_id, Path(spool_root)
        self.group_factory = group_factory
        self.policy = failure_policy or DefaultFailurePolicy(max_failures=config.max_failures)
        self.poll_s, self.grace_s, self.clock = poll_s, grace_s, clock
        self.stop_check = stop_check
        self.stop_cause = stop_cause

    def run(self, *, first_attempt: int = 0, submitted_at: float | None = None,
            prior_failures: Sequence[Failure] = ()) -> TrainingResult:
        """Train to the end or raise `TrainingFailed`. `prior_failures`: the run's failures
        before this call (earlier tries of the task, from the spool); they count against the
        same budget and history."""
        result = TrainingResult(self.run_id, attempts=0)
        history = list(prior_failures)
        attempt = first_attempt
        if submitted_at is not None or first_attempt == 0:
            with SpoolWriter(self.spool_root, self.run_id, attempt, -1) as rec:
                rec.mark("submitted", submitted_at if submitted_at is not None else self.clock())
        live: tuple[LiveGroup, RestorePoint, Failure] | None = None
        while True:
            result.attempts += 1
            outcome = self._attempt(attempt, live)
            if isinstance(outcome, AttemptSucceeded):
                result.ranks = outcome.ranks
                result.unfired = self._report_unfired(attempt)
                return result
            failure = outcome.failure
            decision = self.policy.decide(failure, history)
            why = self.policy.explain(failure, history)
            history.append(failure)
            result.failures.append(failure)
            if decision is FailureDecision.RAISE:
                if outcome.live is not None:
                    outcome.live[0].teardown()
                raise TrainingFailed(self.run_id, history, decision, why)
            live = (*outcome.live, failure) if outcome.live is not None else None
            attempt += 1

    def _report_unfired(self, attempt: int) -> tuple[FailAt, ...]:
        """The scripted faults that never fired (the run ended before their step, time or
        phase, or they target an attempt it never ran): each a `fault_unfired` marker and a
        warning, so a test or a benchmark that expected one does not pass on its absence."""
        unfired = pending_faults(self.config, self.spool_root, self.run_id).failures
        if not unfired:
            return ()
        now = self.clock()
        try:
            with SpoolWriter(self.spool_root, self.run_id, attempt, -1) as rec:
                for f in unfired:
                    rec.mark(FAULT_UNFIRED, now, kind=f.kind, fault_index=f.index, fault_rank=f.rank, step=f.step,
                             fault_attempt=f.attempt, spec=f.spec)
        except OSError as exc:  # a full disk must not turn a trained run into a failed one: the warning says it
            log.warning("could not record the unfired scripted faults in the spool: %s", exc)
        log.warning("the run ended without firing %d scripted fault(s): %s", len(unfired),
                    ", ".join(f.spec for f in unfired))
        return unfired

    def _attempt(self, attempt: int, live: tuple[LiveGroup, RestorePoint, Failure] | None = None) -> AttemptOutcome:
        rec = SpoolWriter(self.spool_root, self.run_id, attempt, -1)
        try:
            if live is not None:
                group, point, failure = live
                t0 = self.clock()
                try:  # the spare takes the failed rank; survivors and spare resume (live_recovery.py)
                    group.hand_off(attempt, failure)
                    handed = True
                except Exception as exc:  # noqa: BLE001 - no spare: every rank restarts, the slower way
                    log.warning("attempt %d: no spare took rank %d (%s): every rank restarts", attempt,
                                failure.rank, exc)
                    group.teardown()
                    handed = False
                layout = {"nodes": list(group.placement)} if isinstance(group, PlacedGroup) else {}
                rec.record("spare_handoff", t0, self.clock(), sync=False, world_size=self._world(group),
                           rank=failure.rank, restore_step=point.step, handed=handed, **layout)
                if handed:
                    group.resume(point)
                    return self._watch(attempt, group, rec)
            group = self.group_factory(attempt)
            t0 = self.clock()
            try:
                group.reserve()
            finally:
                layout = {"nodes": list(group.placement)} if isinstance(group, PlacedGroup) else {}
                rec.record("scheduling", t0, self.clock(), sync=False, world_size=self._world(group), **layout)
            group.launch()
            return self._watch(attempt, group, rec)
        finally:
            rec.close()

    def _world(self, group: WorkerGroup) -> int:
        """The ranks the attempt runs: the group's, else the config's."""
        return group.world_size if isinstance(group, PlacedGroup) else self.config.world_size

    def _watch(self, attempt: int, group: WorkerGroup, rec: SpoolWriter) -> AttemptOutcome:
        try:
            return self._watch_until_done(attempt, group, rec)
        except RunWithdrawn as exc:
            self._withdraw(attempt, group, rec, exc)
            raise
        except BaseException as exc:
            stopped = stop_signal(exc)
            if stopped is not None:  # the driver's own process is being stopped: its ranks are preempted with it
                self._preempt(attempt, group, rec, stopped)
            raise

    def _withdraw(self, attempt: int, group: WorkerGroup, rec: SpoolWriter, why: RunWithdrawn) -> None:
        """The run's work went to another refresh (`stop_request.RunWithdrawn`): its ranks are
        torn down now, with nothing saved, and the time from here to their release is the
        attempt's `shutdown` (`withdrawn`, not failed). The caller re-raises; no failure is
        recorded (the stand-still that cost the run its work is in its spool already)."""
        detected = self.clock()
        log.warning("attempt %d: the run was withdrawn (%s): its ranks are stopped now, nothing is saved", attempt,
                    why)
        try:
            group.teardown()
        except Exception as exc:  # noqa: BLE001 - the caller releases the devices whatever happened here
            log.warning("attempt %d: tearing down the withdrawn run's ranks failed (%s: %s)", attempt,
                        type(exc).__name__, exc)
        released = group.released_at if isinstance(group, ReleasingGroup) else None
        with contextlib.suppress(Exception):  # a full disk: the row misses the shutdown, the ranks are stopped
            rec.record("shutdown", detected, max(detected, released or self.clock()), failed=False, live=False,
                       withdrawn=True)

    def _preempt(self, attempt: int, group: WorkerGroup, rec: SpoolWriter, stopped: str) -> None:
        """The process running the driver was told to stop (SIGTERM of `ettflow refresh`, a
        worker's cancellation, Ctrl-C): that is a preemption of the run, unless `stop_cause`
        says an operator stopped it (a cancel): then an `operator_stop` marker, first, and no
        failure (the ranks' preemption markers after it are the stop's). Every rank gets SIGTERM,
        so each ends as a rank does when its own scheduler takes it back (`preemption.py`: an
        emergency checkpoint at the next step boundary when the grace allows); the driver waits
        for them up to `preemption_grace_s` (at most `STOP_WAIT_S`), then records the run's one failure, class
        `preemption`, as its own process's stop (`process_stopped`: the crash that follows is
        this stop, `ett.orphans`). The caller re-raises the stop; the devices are released by
        whoever holds the lease."""
        detected = self.clock()
        wait_s = min(self.config.preemption_grace_s, STOP_WAIT_S)
        operator = ask_stop_cause(self.stop_cause)
        log.warning("attempt %d: this process was stopped (%s%s): every rank is preempted with it (emergency "
                    "checkpoint within %.0f s)", attempt, stopped, f", {operator}" if operator else "", wait_s)
        if operator:  # first: what the ranks mark from now on is the stop (`ett.timeline.failure_markers`)
            with contextlib.suppress(OSError):
                rec.mark(OPERATOR_STOP, detected, reason=f"{operator} ({stopped})",
                         process_stopped=True)
        try:
            if not isinstance(group, PreemptibleGroup):
                raise TypeError(f"{type(group).__name__} cannot preempt its ranks")
            group.preempt()
            deadline = detected + wait_s
            ended: set[int] = set()
            world = self._world(group)
            while len(ended) < world and self.clock() < deadline:
                status = group.poll(self.poll_s)
                ended |= set(status.finished) | {f.rank for f in status.failed}
        except BaseException as exc:  # noqa: BLE001 - a second stop, or the group gone: the failure is still recorded
            log.warning("attempt %d: the ranks' preemption did not finish (%s: %s)", attempt, type(exc).__name__, exc)
        if operator:  # an operator's action, not a failure: no failure marker, nothing spent of the budget
            with contextlib.suppress(Exception):
                rec.record("shutdown", detected, self.clock(), failed=False, live=False, operator=True)
            return
        failure = Failure(failure_class=FailureClass.PREEMPTION, rank=-1, attempt=attempt,
                          reason=f"the process running the refresh was stopped ({stopped}): every rank was preempted "
                                 "with it",
                          detail=f"stop {stopped} of pid {os.getpid()}")
        with contextlib.suppress(OSError):  # a full disk: the task records it, or the process keeps it (`ett.spool`)
            rec.mark(FAILURE_DETECTED, detected, **failure.to_attrs(), process_stopped=True)
        with contextlib.suppress(Exception):
            rec.record("shutdown", detected, self.clock(), failed=True, live=False)

    def _watch_until_done(self, attempt: int, group: WorkerGroup, rec: SpoolWriter) -> AttemptOutcome:
        world = self._world(group)
        tail = SpoolTail(self.spool_root, self.run_id, attempt, world)
        pending = pending_faults(self.config, self.spool_root, self.run_id).failures
        timed_kills = [f for f in pending if f.after_s is not None and f.attempt in (None, attempt) and f.rank < world]
        bounds, launched_at = PhaseBounds.of(self.config), self.clock()
        finished: dict[int, RankResult] = {}
        spare_asked = False
        while True:
            status = group.poll(self.poll_s)
            self.stop_check()
            finished.update(status.finished)
            failed = list(status.failed)
            tail.poll()
            failed = failed + self._marked_failures(tail, attempt)
            now = self.clock()
            started = tail.training_started
            if started is not None and not spare_asked and self._live_on(group):
                spare_asked = True
                group.training_started()
            for fault in list(timed_kills):
                if started is not None and now >= started + fault.after_s:
                    timed_kills.remove(fault)
                    record_fired(fault, rec, rank=fault.rank, step=None, at=now)
                    group.kill(fault.rank)
            if not failed and len(finished) < world:
                hang = find_hang(tail.beats(), bounds, now, launched_at=launched_at, done=set(finished))
                if hang is not None:
                    failed = [hang.failure(attempt)]
            if failed:
                return self._recover(attempt, group, rec, failed)
            if len(finished) == world:
                # shutdown runs from the ranks' end of work until the devices are released
                ended = min(min(r.finished_at or now for r in finished.values()), now)
                group.teardown()
                released = group.released_at if isinstance(group, ReleasingGroup) else None
                rec.record("shutdown", ended, max(ended, released or self.clock()), failed=False)
                handoffs = [r.anchor_handoff for r in finished.values() if r.anchor_handoff is not None]
                failure = self._seal(attempt, handoffs, rec) if handoffs else None
                if failure is not None:
                    return AttemptFailed(failure, (failure,))
                return AttemptSucceeded(finished)

    def _seal(self, attempt: int, handoffs: list[AnchorHandOff], rec: SpoolWriter) -> Failure | None:
        """The anchor the ranks handed off, written and sealed here once their devices are
        released (`anchor_seal.py`), recorded as `anchor_seal` (off the clock: no device waits);
        retried from the host copy; None when sealed, else the attempt's failure (`storage`)."""
        t0 = self.clock()
        pending = pending_faults(self.config, self.spool_root, self.run_id).failures  # read once, not per hook call
        scripted = next((f for f in pending if f.phase == ANCHOR_SEAL and f.attempt in (None, attempt)), None)
        error: BaseException | None = None
        for tries in range(1, SEAL_TRIES + 1):
            try:
                sealed = seal_anchor(handoffs, keep_last=self.config.keep_checkpoints,
                                     fault=lambda phase: self._seal_fault(scripted, phase, rec))
            except (OSError, CheckpointError) as exc:
                error = exc
                log.warning("attempt %d: sealing the anchor failed (try %d of %d): %s", attempt, tries, SEAL_TRIES, exc)
                continue
            rec.record("anchor_seal", t0, self.clock(), step=sealed.step, path=str(sealed.path), bytes=sealed.nbytes,
                       tries=tries)
            return None
        detected = self.clock()
        failure = Failure(failure_class=FailureClass.STORAGE, rank=-1, attempt=attempt, step=handoffs[0].step,
                          reason=f"the anchor of step {handoffs[0].step} could not be written from the host copy "
                                 f"({SEAL_TRIES} tries): {error}; the attempt restarts from the last durable "
                                 "checkpoint")
        with contextlib.suppress(OSError):  # the disk that failed the seal may fail this too
            rec.record("anchor_seal", t0, detected, step=handoffs[0].step, failed=True, tries=SEAL_TRIES)
            rec.mark(FAILURE_DETECTED, detected, **failure.to_attrs())
        return failure

    def _seal_fault(self, fault: FailAt | None, phase: str, rec: SpoolWriter) -> None:
        """The scripted kill of this process while it seals the anchor (`kill:phase=anchor_seal`,
        whichever rank the item names), at that point of the seal."""
        if fault is not None and phase == ANCHOR_SEAL:
            record_fired(fault, rec, rank=-1, step=None)
            log.warning("scripted fault %s: SIGKILL of the driver's process (pid %d)", fault.spec, os.getpid())
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # the signal is delivered asynchronously

    def _marked_failures(self, tail: SpoolTail, attempt: int) -> list[Failure]:
        """The failures the ranks wrote as `failure` markers since the last poll. A scripted
        hang's marker is left out: it only records when the hang began, and the watchdog must
        find the hang as it would a real one."""
        out = []
        for rank, marker in tail.new_failure_markers():
            if is_scripted_hang(self.config.failures, marker.info.fault_index):
                continue
            failure = marker.info.failure(attempt)
            out.append(failure if failure.rank >= 0 else replace(failure, rank=rank))
        return out

    def _recover(self, attempt: int, group: WorkerGroup, rec: SpoolWriter, failed: list[Failure]) -> AttemptFailed:
        detected = self.clock()
        deadline = detected + self.grace_s  # let a dead process's outcome arrive: it is the cause
        while not any(is_process_loss(f) for f in failed) and self.clock() < deadline:
            failed = failed + list(group.poll(self.poll_s).failed)
        failure = primary_failure(failed)
        if isinstance(group, OwnedGroup) and is_process_loss(failure):
            failure = group.owner_cause(failure)
        failure = replace(failure, attempt=attempt,
                          step=failure.step if failure.step is not None else self._step_of(attempt, failure.rank))
        rec.mark(FAILURE_DETECTED, detected, **failure.to_attrs())
        point = None
        try:
            if self._live_on(group):
                point = group.prepare_live(failure)
            if point is None:
                group.teardown()
        except BaseException:
            group.teardown()
            raise
        finally:
            rec.record("shutdown", detected, self.clock(), failed=True, live=point is not None)
        return AttemptFailed(failure, tuple(failed), live=(group, point) if point is not None else None)

    def _live_on(self, group: WorkerGroup) -> bool:
        return self.config.switches.live_recovery and isinstance(group, LiveGroup)

    def _step_of(self, attempt: int, rank: int) -> int | None:
        """The step `rank` was at when it failed: one past its last recorded step in the
        attempt or the step its heartbeat last named in training, whichever is later (a dead
        rank's steps are written lazily: its last ones may never reach the spool, its beat
        file is rewritten every half second), else the step it restored (None: unknown, e.g.
        before its first step)."""
        if rank < 0:
            return None
        last: int | None = None
        restored: int | None = None
        path = spool_file(self.spool_root, self.run_id, attempt, rank)
        for ev in read_file(path).events if path.is_file() else ():
            if ev.phase == TRAIN_STEP and ev.info.step is not None:
                last = max(last if last is not None else -1, ev.info.step)
            elif ev.phase == "checkpoint_restore" and ev.info.step is not None:
                restored = ev.info.step
        beat = read_beat(beat_file(self.spool_root, self.run_id, attempt, rank))
        at = [s for s in (last + 1 if last is not None else None,
                          beat.step if beat is not None and beat.training_since is not None else None) if s is not None]
        return max(at) if at else restored
