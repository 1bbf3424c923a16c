"""Issue 26 #3: a stalled step is not effective training. The part of a step beyond what its
rank's recent steps took (above the bound) is a stall, owned by the evidence: a paused
process (the host), else the rank; a hang's wait is the hang's. Every number worked out by hand."""

from __future__ import annotations

import pytest

from ettflow.ett.event_attrs import FailureAttrs
from ettflow.ett.events import (
    COMPONENTS,
    HANG,
    HOST_STALL,
    NOT_INTERVAL_WASTE,
    PROCESS_PAUSED,
    STEP_STALL,
    UNATTRIBUTED,
    component_of,
    owner_of,
)
from ettflow.ett.failures import Failure, FailureClass
from ettflow.ett.run_metrics import compute_run_metrics
from ettflow.ett.timeline import STALL_FACTOR, STALL_MIN_S, expected_step_s, split_by_cover, stall_cut
from ettflow.trainer.rank_heartbeat import PAUSE_MIN_S, Hang, Pause

from helpers import timelines


def l2(m):
    return {c: pytest.approx(v, abs=1e-9) for c, v in m.components.items()}


def expect(**parts):
    return {c: pytest.approx(parts.get(c, 0.0), abs=1e-9) for c in (*COMPONENTS, UNATTRIBUTED)}


def test_stalls_and_hangs_are_wasted_training_owned_by_the_evidence_never_storage():
    for phase in (STEP_STALL, HOST_STALL, HANG):
        assert component_of(phase) == "wasted_training" and phase in NOT_INTERVAL_WASTE
    assert (owner_of(STEP_STALL), owner_of(HOST_STALL), owner_of(HANG)) == ("trainer", "host", "trainer")
    assert component_of(PROCESS_PAUSED) is None and owner_of(PROCESS_PAUSED) == "host"  # evidence, not time


def test_the_expected_step_is_the_median_of_the_last_five_and_needs_three():
    assert expected_step_s([1.0, 1.0]) is None
    assert expected_step_s([1.0, 3.0, 2.0]) == 2.0
    assert expected_step_s([9.0, 1.0, 2.0, 3.0, 4.0]) == 3.0
    assert expected_step_s([100.0, 1.0, 1.0, 2.0, 2.0, 5.0]) == 2.0  # the oldest one has left the window
    assert expected_step_s([1.0, 2.0, 3.0, 4.0]) == 2.5


def test_a_stall_is_above_both_bounds():
    assert (STALL_FACTOR, STALL_MIN_S) == (3.0, 1.0)
    assert stall_cut(31.0, 1.0) == 1.0
    assert stall_cut(3.0, 1.0) is None  # not more than 3x
    assert stall_cut(1.2, 0.1) == 0.1  # 12x and 1.1 s beyond
    assert stall_cut(0.9, 0.01) is None  # 90x, but 0.89 s beyond: under the 1 s bound
    assert stall_cut(5.0, None) is None  # no baseline yet


def test_a_30s_stall_of_one_rank_is_wasted_not_effective_and_owned_by_the_rank():
    # 5 steps of 1 s, then one step of 31 s, then 2 more steps of 1 s
    t = timelines.Timeline("stall")
    t.mark("submitted", 0).steps(0, 0, 5)
    t.ev("train_step", 5, 36, cursor_start=5, cursor_end=6).steps(36, 6, 2)
    m = compute_run_metrics(t.events)
    m.check_partition()
    assert l2(m) == expect(effective_training=8, wasted_training=30)
    assert m.exposed(STEP_STALL) == 30 and m.exposed(HOST_STALL) == 0
    assert m.effective_steps == 8 and m.replayed_steps == 0


def test_a_stall_covered_by_a_paused_process_is_the_hosts_and_two_ranks_share_the_instant():
    t = timelines.Timeline("paused")
    t.mark("submitted", 0)
    for rank in (0, 1):  # rank 1 was stopped in [10, 30]: both ranks' step 5 lasted 31 s
        t.steps(0, 100 * rank, 5, rank=rank)
        t.ev("train_step", 5, 36, rank=rank, cursor_start=100 * rank + 5, cursor_end=100 * rank + 6)
    t.ev(PROCESS_PAUSED, 10, 30, rank=1)
    m = compute_run_metrics(t.events)
    m.check_partition()
    assert l2(m) == expect(effective_training=6, wasted_training=30)
    assert m.exposed(HOST_STALL) == 20 and m.exposed(STEP_STALL) == 10  # [6, 10] and [30, 36] uncovered
    assert m.raw(PROCESS_PAUSED) == 20 and m.wall_s == 36  # evidence claims no time
    # the component's owner in this run is its largest phase's: the host, not storage (wasted
    # training's usual owner, for checkpoint blocking)
    assert m.owner("wasted_training") == "host" and owner_of("wasted_training") == "storage"
    assert m.owner("effective_training") == owner_of("effective_training") and m.owner(HOST_STALL) == "host"


def test_a_pause_during_a_save_is_the_hosts_whole_instant_and_a_pause_before_training_is_not():
    t = timelines.Timeline("save")
    t.mark("submitted", 0).ev("device_init", 0, 2, rank=0).ev(PROCESS_PAUSED, 0.5, 1.5, rank=0)
    for rank in (0, 1):
        t.steps(2, 100 * rank, 5, rank=rank)
    # rank 0 stopped for 30 s in its save at step 5; rank 1's step 5 waited the whole time
    t.ev("checkpoint_save_blocking", 7, 37, rank=0, step=5).ev(PROCESS_PAUSED, 7, 37, rank=0)
    t.ev("train_step", 7, 38, rank=1, cursor_start=105, cursor_end=106)
    t.steps(37, 5, 1, rank=0)
    m = compute_run_metrics(t.events)
    m.check_partition()
    # rank 1's step 5 did its expected 1 s of work [7, 8]; rank 0's step 5 is [37, 38]
    assert l2(m) == expect(trainer_init=2, effective_training=7, wasted_training=29)
    assert m.exposed(HOST_STALL) == 29 and m.exposed("checkpoint_save_blocking") == 0
    assert m.raw(PROCESS_PAUSED) == 31  # the pause in init is evidence only: init keeps its time


def test_a_stall_does_not_raise_the_baseline_of_the_steps_after_it():
    t = timelines.Timeline("twice")
    t.steps(0, 0, 3)
    t.ev("train_step", 3, 13, cursor_start=3, cursor_end=4)  # 10 s: stalled, enters the history as 1 s
    t.ev("train_step", 13, 18, cursor_start=4, cursor_end=5)  # 5 s: stalled too (median stays 1 s)
    m = compute_run_metrics(t.events)
    assert l2(m) == expect(effective_training=5, wasted_training=13)


def test_the_baseline_is_per_attempt_and_a_replayed_step_is_cut_too():
    t = timelines.Timeline("attempts")
    t.steps(0, 0, 4).fail(4, 4, failure_class="infrastructure")
    t.next_attempt()
    # attempt 1 replays batch 3 slowly: no baseline in the attempt yet, so it is not a stall
    t.ev("train_step", 10, 15, cursor_start=3, cursor_end=4).steps(15, 4, 3)
    m = compute_run_metrics(t.events)
    assert m.exposed(STEP_STALL) == 0 and m.exposed("train_step_replay") == 5
    t.ev("train_step", 18, 28, cursor_start=7, cursor_end=8)  # 10 s after three 1 s steps of attempt 1
    m = compute_run_metrics(t.events)
    assert m.exposed(STEP_STALL) == 9 and m.effective_steps == 8


def test_split_by_cover():
    assert split_by_cover(0, 10, [(2, 4), (3, 6), (8, 20)]) == [
        (0, 2, False), (2, 4, True), (4, 6, True), (6, 8, False), (8, 10, True)]
    assert split_by_cover(0, 1, []) == [(0, 1, False)]


def test_a_hangs_wait_is_the_hang_not_work_lost_in_flight():
    hang = Hang(rank=1, phase="train_step", since=5.0, for_s=61.0, bound_s=60.0, step=5).failure(attempt=0)
    assert hang.hang and hang.to_attrs()["hang"] is True and FailureAttrs.parse(hang.to_attrs()).failure().hang
    assert "hang" not in Failure(failure_class=FailureClass.INFRASTRUCTURE).to_attrs()
    t = timelines.Timeline("hung")
    t.mark("submitted", 0).steps(0, 0, 5)
    t.mark("failure_detected", 66, **hang.to_attrs())
    m = compute_run_metrics(t.events)
    assert l2(m) == expect(effective_training=5, wasted_training=61)
    assert m.exposed(HANG) == 61 and m.exposed("lost_in_flight") == 0


def test_a_pause_is_a_late_wake_up_with_almost_no_cpu():
    assert PAUSE_MIN_S == 1.0
    assert Pause.between(100.0, 130.5, slept_s=30.5, planned_s=0.5, cpu_s=0.01) == Pause(100.0, 130.5)
    assert Pause.between(100.0, 101.4, slept_s=1.4, planned_s=0.5, cpu_s=0.0) is None  # 0.9 s late
    # late, but the process ran (a thread holding the interpreter lock): not a pause
    assert Pause.between(100.0, 110.0, slept_s=10.0, planned_s=0.5, cpu_s=9.0) is None
