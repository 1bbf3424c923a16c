"""The warm pool's hold decision (`trainer/group/hold_rule.py`): exact numbers on a fake clock."""

from __future__ import annotations

import pytest

from ettflow.trainer.group.hold_rule import (
    DEFAULT_PREWARM_S,
    SAMPLES_KEPT,
    HoldRule,
    PrewarmEstimate,
    decide_hold,
)


def test_the_estimate_is_the_mean_and_spread_of_the_newest_measured_prewarms():
    est = PrewarmEstimate.of([10.0, 12.0, 14.0])
    assert (est.mean_s, round(est.sd_s, 6), est.samples) == (12.0, round((8 / 3) ** 0.5, 6), 3)
    assert est.lead_s(5.0) == pytest.approx(12.0 + 2 * (8 / 3) ** 0.5 + 5.0)
    old = PrewarmEstimate.of([100.0] * 5 + [4.0] * SAMPLES_KEPT)  # only the newest count
    assert (old.mean_s, old.sd_s, old.samples) == (4.0, 0.0, SAMPLES_KEPT)


def test_with_nothing_measured_the_default_stands_in_and_says_so():
    est = PrewarmEstimate.of([float("nan"), -1.0])
    assert (est.mean_s, est.samples) == (DEFAULT_PREWARM_S, 0)
    assert "default" in est.describe()


def test_a_scheduled_run_far_ahead_is_prewarmed_just_in_time_and_nothing_held_before():
    est = PrewarmEstimate.of([10.0, 10.0])
    d = decide_hold(1000.0, 1000.0 + 6 * 3600, est, margin_s=5.0, max_keep_alive_s=600.0)
    assert d.rule is HoldRule.JUST_IN_TIME and d.rule.value == "just-in-time"
    assert d.start_at == 1000.0 + 6 * 3600 - 15.0 and not d.starts_now(1000.0)
    assert d.release_at == 1000.0 + 6 * 3600 + 5.0
    assert not d.expired(1000.0 + 6 * 3600 + 5.0, ready_at=None) and d.expired(1000.0 + 6 * 3600 + 5.1, ready_at=None)
    assert "next scheduled run in 21600 s" in d.reason


def test_a_scheduled_run_closer_than_the_lead_starts_its_prewarm_at_once():
    d = decide_hold(1000.0, 1010.0, PrewarmEstimate.of([10.0]), margin_s=5.0, max_keep_alive_s=600.0)
    assert d.rule is HoldRule.JUST_IN_TIME and d.starts_now(1000.0) and d.release_at == 1015.0


def test_with_no_schedule_a_ready_worker_is_held_for_the_cold_start_it_saves():
    d = decide_hold(1000.0, None, PrewarmEstimate.of([8.0, 12.0]), margin_s=5.0, max_keep_alive_s=600.0)
    assert d.rule is HoldRule.KEEP_ALIVE and d.starts_now(1000.0) and d.keep_alive_s == 10.0
    assert not d.expired(1500.0, ready_at=None)  # still prewarming: its hold has not begun
    assert not d.expired(1020.0, ready_at=1010.0) and d.expired(1020.1, ready_at=1010.0)
    capped = decide_hold(0.0, None, PrewarmEstimate.of([900.0]), margin_s=5.0, max_keep_alive_s=600.0)
    assert capped.keep_alive_s == 600.0


def test_with_no_schedule_a_model_whose_runs_come_later_than_a_hold_lasts_gets_nothing_prewarmed():
    est = PrewarmEstimate.of([10.0])  # a worker ready 10 s after the release, kept 10 s more: runs within 20 s
    late = decide_hold(0.0, None, est, margin_s=5.0, max_keep_alive_s=600.0, gaps=[25.0, 40.0, 18.0])
    assert late.rule is HoldRule.NONE and not late.starts_now(0.0)
    assert "1 of the model's last 3 runs came within the 20 s" in late.reason and "median gap 25 s" in late.reason
    soon = decide_hold(0.0, None, est, margin_s=5.0, max_keep_alive_s=600.0, gaps=[25.0, 12.0, 18.0])
    assert soon.rule is HoldRule.KEEP_ALIVE and soon.starts_now(0.0)  # 2 of 3 came in time
    scheduled = decide_hold(0.0, 100.0, est, margin_s=5.0, max_keep_alive_s=600.0, gaps=[500.0])
    assert scheduled.rule is HoldRule.JUST_IN_TIME  # a schedule is known: the gaps do not matter
