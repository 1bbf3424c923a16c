"""Detection without a cluster: the watchdog's rules on scripted heartbeats (every phase has a
bound; the culprit is the rank that progressed least), the heartbeat thread that keeps beating
while its rank hangs, and the driver reading a rank's own failure marker at once. A fake clock
makes every detection time exact."""

from __future__ import annotations

import time

import pytest
from test_driver import Run, ScriptedGroup, finish_at

from ettflow.ett.failures import Failure, FailureClass
from ettflow.trainer.config import FailAt, TrainerConfig
from ettflow.trainer.data.schema import criteo_schema
from ettflow.trainer.faults import is_scripted_hang
from ettflow.trainer.group.driver import TrainingDriver
from ettflow.trainer.rank_heartbeat import (
    SAVE,
    TRAINING,
    Pause,
    PauseNotices,
    PhaseBounds,
    RankBeat,
    RankHeartbeat,
    beat_file,
    find_hang,
    read_beat,
    write_beat,
)

BOUNDS = PhaseBounds(startup_s=10, compile_s=5, restore_s=4, step_s=2, save_s=3)
INFRA, PREEMPTION = FailureClass.INFRASTRUCTURE, FailureClass.PREEMPTION


FRESH = float("inf")  # a beat written at the moment the watchdog reads it, whatever the test's clock


def beat(rank: int, phases: dict, *, training_since: float | None = None, step: int | None = None,
         in_step: bool = False, at: float = FRESH, pauses: tuple[Pause, ...] = ()) -> RankBeat:
    return RankBeat(rank=rank, pid=1, beat=at, phases=phases, training_since=training_since, step=step,
                    in_step=in_step, pauses=pauses)


def test_every_phase_has_its_bound():
    for phase, bound in [("device_init", 10), ("process_group_init", 10), ("get_first_batch_data", 10),
                         ("pt2_compile", 5), ("checkpoint_restore", 4), (TRAINING, 2), (SAVE, 3)]:
        assert BOUNDS.bound(phase) == bound
        beats = {0: beat(0, {phase: 100.0}, training_since=100.0 if phase in (TRAINING, SAVE) else None)}
        assert find_hang(beats, BOUNDS, 100.0 + bound, launched_at=90.0) is None  # at the bound: not yet
        hang = find_hang(beats, BOUNDS, 100.5 + bound, launched_at=90.0)
        assert (hang.rank, hang.phase, hang.bound_s) == (0, phase, bound)
        assert hang.failure(3).reason == f"rank 0 hung in {phase} for {bound + 0.5:.1f} s (bound {bound:g} s)"
        assert hang.failure(3).failure_class is INFRA and hang.failure(3).attempt == 3


def test_a_rank_without_a_beat_is_in_startup_since_its_launch():
    beats = {0: beat(0, {"pre_train": 108.0}), 1: None}
    assert find_hang(beats, BOUNDS, 110.0, launched_at=100.0) is None
    hang = find_hang(beats, BOUNDS, 111.0, launched_at=100.0)
    assert (hang.rank, hang.phase, hang.for_s) == (1, "startup", 11.0)


def test_waiting_for_a_compiling_peer_is_not_a_hang_the_peer_is_judged_by_its_bound():
    # rank 0 trains (blocked in the first collective) while rank 1 still compiles: rank 0's
    # step clock does not run; rank 1 is hung only past the compile bound
    beats = {0: beat(0, {TRAINING: 101.0}, training_since=101.0, step=0, in_step=True),
             1: beat(1, {"pt2_compile": 100.0})}
    assert find_hang(beats, BOUNDS, 105.0, launched_at=90.0) is None  # 4 s > step bound, < compile bound
    hang = find_hang(beats, BOUNDS, 105.5, launched_at=90.0)
    assert (hang.rank, hang.phase) == (1, "pt2_compile")


def test_the_step_clock_starts_when_every_rank_trains():
    # rank 0 entered training at 100, rank 1 only at 104: nobody is late before 106
    beats = {0: beat(0, {TRAINING: 100.0}, training_since=100.0, step=0, in_step=True),
             1: beat(1, {TRAINING: 104.0}, training_since=104.0, step=0)}
    assert find_hang(beats, BOUNDS, 106.0, launched_at=90.0) is None
    assert find_hang(beats, BOUNDS, 106.5, launched_at=90.0) is not None


def test_the_culprit_is_the_rank_that_progressed_least():
    # step 0: rank 1 never entered the step (hung before it), rank 0 waits inside it
    beats = {0: beat(0, {TRAINING: 100.0}, training_since=100.0, step=0, in_step=True),
             1: beat(1, {TRAINING: 100.0}, training_since=100.0, step=0)}
    assert find_hang(beats, BOUNDS, 103.0, launched_at=90.0).rank == 1
    # later: rank 0 waits in a save at step 8 while rank 1 is stuck in step 7
    beats = {0: beat(0, {SAVE: 120.0}, training_since=100.0, step=8),
             1: beat(1, {TRAINING: 119.9}, training_since=100.0, step=7, in_step=True)}
    hang = find_hang(beats, BOUNDS, 125.0, launched_at=90.0)
    assert (hang.rank, hang.phase, hang.step) == (1, TRAINING, 7)
    # a finished rank is never judged
    assert find_hang(beats, BOUNDS, 125.0, launched_at=90.0, done={0, 1}) is None


def test_a_rank_ahead_of_a_peer_waits_for_it_and_is_never_the_one_judged():
    # rank 1 hangs before step 12 (its clock from 100.0, step 11's end); rank 0 entered step 12
    # at 100.3 and waits in its first collective. On a loaded host rank 1's clock had 2 s that its
    # process did not run left out, rank 0's none: rank 0's clock runs out first (2.7 s at 103),
    # and the old rule blamed it (CI saw rank 0 named for a hang scripted on rank 1)
    starved = (Pause(100.5, 102.5),)
    beats = {0: beat(0, {TRAINING: 100.3}, training_since=90.0, step=12, in_step=True),
             1: beat(1, {TRAINING: 100.0}, training_since=90.0, step=12, pauses=starved)}
    assert find_hang(beats, BOUNDS, 103.0, launched_at=80.0) is None
    hang = find_hang(beats, BOUNDS, 104.1, launched_at=80.0)
    assert (hang.rank, hang.step, hang.not_running_s) == (1, 12, 2.0)
    # a lower step is less progress than any place in a higher one
    beats = {0: beat(0, {TRAINING: 100.0}, training_since=90.0, step=13),
             1: beat(1, {TRAINING: 101.0}, training_since=90.0, step=12, in_step=True)}
    assert find_hang(beats, BOUNDS, 103.0, launched_at=80.0) is None
    assert find_hang(beats, BOUNDS, 103.1, launched_at=80.0).rank == 1
    # ranks level with each other are both judged: of the two overdue, the one hung longest
    beats = {0: beat(0, {TRAINING: 100.0}, training_since=90.0, step=12, in_step=True),
             1: beat(1, {TRAINING: 100.4}, training_since=90.0, step=12, in_step=True)}
    assert find_hang(beats, BOUNDS, 102.5, launched_at=80.0).rank == 0
    # the save made before step 12 hangs on rank 0's storage; rank 1 saved, entered step 12 and
    # waits in its first collective: rank 1 is ahead, and rank 0 is judged by the save's bound
    beats = {0: beat(0, {SAVE: 100.0}, training_since=90.0, step=12),
             1: beat(1, {TRAINING: 100.5}, training_since=90.0, step=12, in_step=True)}
    assert find_hang(beats, BOUNDS, 102.6, launched_at=80.0) is None
    hang = find_hang(beats, BOUNDS, 103.1, launched_at=80.0)
    assert (hang.rank, hang.phase, hang.step) == (0, SAVE, 12)


def test_time_a_ranks_process_did_not_run_is_not_its_phases_up_to_one_bound():
    # a step began at 100 (bound 2 s); the host starved the process from 100.5 to 102.8 and the
    # thread reported it on waking: 1.2 s of the 3.5 s ran, not hung
    starved = (Pause(100.5, 102.8),)
    beats = {0: beat(0, {TRAINING: 100.0}, training_since=100.0, step=9, in_step=True, at=103.4, pauses=starved)}
    assert find_hang(beats, BOUNDS, 103.5, launched_at=90.0) is None
    # it ran on past its bound: hung, and the reason says how much of the time did not count
    hang = find_hang(beats, BOUNDS, 104.5, launched_at=90.0)
    assert (hang.rank, hang.step, hang.for_s, hang.not_running_s) == (0, 9, 4.5, 2.0)  # capped at the bound
    assert hang.failure(1).reason == "rank 0 hung in train_step for 4.5 s, 2.0 s of it not running (bound 2 s)"
    # a pause before the phase began is not the phase's
    early = beat(0, {TRAINING: 100.0}, training_since=100.0, step=9, at=102.4, pauses=(Pause(90.0, 99.0),))
    assert find_hang({0: early}, BOUNDS, 102.5, launched_at=90.0) is not None


def test_the_console_hears_of_a_first_pause_then_only_of_one_twice_as_long_as_any_it_heard():
    notices = PauseNotices()
    took = (1.6, 1.4, 3.1, 3.2, 0.5, 6.4, 7.0)
    assert [notices.tell(Pause(0.0, s)) for s in took] == [True, False, False, True, False, True, False]
    assert notices.longest_told_s == 6.4


def test_a_silent_beat_is_a_pause_not_yet_reported_and_a_process_stopped_for_good_hangs_at_twice_the_bound():
    # the last beat at 100.2; at 103 the thread has not woken since: 2.3 s past its period, not
    # running as far as the watchdog can tell
    silent = {0: beat(0, {"pt2_compile": 100.0}, at=100.2)}
    assert find_hang(silent, BOUNDS, 103.0 + BOUNDS.compile_s - 2.3, launched_at=90.0) is None
    # ... but never more than one bound's worth: a process stopped for good is hung at 2 x bound
    assert find_hang(silent, BOUNDS, 100.0 + 2 * BOUNDS.compile_s, launched_at=90.0) is None
    hang = find_hang(silent, BOUNDS, 100.1 + 2 * BOUNDS.compile_s, launched_at=90.0)
    assert (hang.phase, hang.not_running_s) == ("pt2_compile", BOUNDS.compile_s)
    # a beat late by less than a pause is on time (a busy host's scheduling)
    late = {0: beat(0, {"pt2_compile": 100.0}, at=104.0)}
    assert find_hang(late, BOUNDS, 105.4, launched_at=90.0).not_running_s == 0.0


def test_the_heartbeat_thread_beats_while_its_rank_hangs(tmp_path):
    now = [1000.0]
    path = beat_file(tmp_path, "r", 0, 1)
    hb = RankHeartbeat(path, 1, every_s=0.02, clock=lambda: now[0]).start()
    try:
        hb.enter("pt2_compile")  # ... and the training thread never leaves it
        now[0] = 1006.0
        deadline = time.monotonic() + 5
        while (b := read_beat(path)) is None or b.beat < 1006.0:
            assert time.monotonic() < deadline, "the thread did not beat"
            time.sleep(0.01)
        assert b.phases == {"pt2_compile": 1000.0} and b.pid > 0  # alive, but in its phase since 1000
        hang = find_hang({1: b}, BOUNDS, now[0], launched_at=990.0)
        assert (hang.rank, hang.phase, hang.for_s) == (1, "pt2_compile", 6.0)
    finally:
        hb.close()
    # training: the clock runs from the last progress; a save leaves training for its duration
    hb = RankHeartbeat(path, 1, clock=lambda: now[0])
    hb.training(4)
    now[0] = 1007.0
    hb.step_started(4)
    snap = hb.snapshot()
    assert (snap.training_since, snap.step, snap.in_step, snap.phases[TRAINING]) == (1006.0, 4, True, 1007.0)
    hb.step_ended(4)
    assert (hb.snapshot().step, hb.snapshot().in_step) == (5, False)


class BeatingGroup(ScriptedGroup):
    """A scripted group whose rank 1 sits in an init phase (`stuck_in`) from launch, with a
    fresh beat at every poll, while rank 0 trains (and then waits for it)."""

    stuck_in = "pt2_compile"

    def launch(self) -> None:
        super().launch()
        self.stuck_since = self.run.clock.t

    def poll(self, timeout_s: float):
        out = super().poll(timeout_s)
        if self.attempt == 0:
            write_beat(beat_file(self.run.spool, self.run.run_id, 0, 1),
                       RankBeat(rank=1, pid=2, beat=self.run.clock.t, phases={self.stuck_in: self.stuck_since}))
        return out


def test_a_hang_in_compile_is_detected_at_its_bound(tmp_path):
    script = {(1, p): "hang" for p in range(1, 100)}
    run = Run(tmp_path, [script, finish_at(2)], compile_timeout_s=5.0, step_timeout_s=2.0)
    groups: list[ScriptedGroup] = []

    def factory(attempt: int):
        group = (BeatingGroup if attempt == 0 else ScriptedGroup)(run, attempt, run.scripts[attempt])
        groups.append(group)
        return group

    driver = TrainingDriver(run.config, run.run_id, run.spool, factory, poll_s=0, grace_s=0, clock=run.clock)
    result = driver.run(submitted_at=run.clock.t)
    (failure,) = result.failures
    # launched at 1002 (after 2 s of queueing); polls at 1003, 1004, ...: past 5 s at 1008
    assert (failure.failure_class, failure.rank) == (INFRA, 1)
    assert failure.reason == "rank 1 hung in pt2_compile for 6.0 s (bound 5 s)"
    (detected,) = run.markers("failure_detected")
    assert detected.start == 1008.0 and result.attempts == 2


class MarkingGroup(ScriptedGroup):
    """Rank 1 writes its own `failure` marker at poll 2 and then goes silent: no Ray outcome,
    no step, a heartbeat that keeps its last step; only the marker says what happened."""

    marker: Failure

    def poll(self, timeout_s: float):
        out = super().poll(timeout_s)
        if self.attempt == 0 and self.polls == 2:
            self.writers[1].mark("failure", self.run.clock.t - 0.5, **self.marker.to_attrs())
        return out


@pytest.mark.parametrize("klass", [PREEMPTION, FailureClass.NUMERICS])
def test_a_ranks_own_failure_marker_is_read_at_once(tmp_path, klass):
    script = {(1, p): "hang" for p in range(2, 100)}
    run = Run(tmp_path, [script, finish_at(2)], step_timeout_s=60.0)
    MarkingGroup.marker = Failure(failure_class=klass, rank=1, step=1, reason=f"rank 1 {klass}")

    def factory(attempt: int):
        group = (MarkingGroup if attempt == 0 else ScriptedGroup)(run, attempt, run.scripts[attempt])
        run.groups.append(group)
        return group

    driver = TrainingDriver(run.config, run.run_id, run.spool, factory, poll_s=0, grace_s=0, clock=run.clock)
    result = driver.run(submitted_at=run.clock.t)
    (failure,) = result.failures
    assert (failure.failure_class, failure.rank, failure.step, failure.attempt) == (klass, 1, 1, 0)
    (marker,) = run.markers("failure")
    (detected,) = run.markers("failure_detected")
    assert detected.start == 1004.0 and detected.start - marker.start == 0.5  # the poll that wrote it
    m = run.metrics()
    assert m.nof == 1 and m.failures[0].failure_class == klass.value
    assert result.attempts == 2  # preemption and a first numerics failure restart


def test_a_scripted_hangs_marker_is_left_to_the_watchdog(tmp_path):
    hang = FailAt(kind="hang", rank=1, step=2)
    run = Run(tmp_path, [{}, finish_at(2)], failures=(hang,), step_timeout_s=4.0)
    result = run.drive()
    (failure,) = result.failures
    (marker,) = run.markers("failure")
    (detected,) = run.markers("failure_detected")
    assert is_scripted_hang(run.config.failures, marker.info.fault_index)
    assert failure.reason.startswith("rank 1 hung in train_step") and failure.step == 2
    # the hang began when rank 1's step 1 ended (1004): the watchdog fires past 4 s
    assert marker.start == 1004.0 and detected.start == 1009.0


def test_bounds_are_validated_and_the_collectives_outwait_them(tmp_path):
    (tmp_path / "d").mkdir()
    base = dict(data_root=str(tmp_path / "d"), schema=criteo_schema(10), work_dir=str(tmp_path))
    for name in ("startup_timeout_s", "compile_timeout_s", "restore_timeout_s", "step_timeout_s", "save_timeout_s",
                 "preemption_grace_s"):
        with pytest.raises(ValueError, match=f"{name} must be > 0"):
            TrainerConfig(**base, **{name: 0})
    cfg = TrainerConfig(**base, startup_timeout_s=7, compile_timeout_s=9, step_timeout_s=3)
    assert cfg.process_group_timeout_s > max(7, 9, 3, cfg.restore_timeout_s, cfg.save_timeout_s)


def test_hang_and_preempt_faults_parse():
    assert FailAt.parse("hang:rank=1:phase=pt2_compile") == FailAt(kind="hang", rank=1, phase="pt2_compile")
    assert FailAt.parse("preempt:rank=1:step=9") == FailAt(kind="preempt", rank=1, step=9)
    assert FailAt.parse("kill:rank=0:phase=anchor_commit") == FailAt(kind="kill", phase="anchor_commit")
    for wrong in ("kill:phase=pt2_compile", "hang:phase=nowhere", "hang:phase=anchor_commit",
                  "raise:phase=anchor_commit"):
        with pytest.raises(ValueError, match="FailAt.phase is for kind='hang'.*kind='kill' in one of .'anchor_commit'"):
            FailAt.parse(wrong)
    with pytest.raises(ValueError, match="exactly one of"):
        FailAt.parse("hang:step=1:phase=pt2_compile")
