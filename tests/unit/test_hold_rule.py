"""The warm pool's hold decision (`trainer/group/hold_rule.py`): exact numbers on a fake clock."""

from __future__ import annotations

import pytest

from ettflow.trainer.group.hold_rule import (
    DEFAULT_PREWARM_S,
    MAX_EXPLORATIONS,
    SAMPLES_KEPT,
    HoldRule,
    PrewarmEstimate,
    StartSaving,
    decide_hold,
)

TEN = PrewarmEstimate.of([10.0, 10.0])  # a 10 s prewarm, no spread: with a 5 s margin its lead is 15 s
SAVES_50 = StartSaving.of([60.0], [10.0])  # cold ranks start in 60 s, pooled ones in 10 s


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


def test_the_start_a_pooled_run_saves_is_cold_less_pooled_and_at_most_the_prewarm_until_measured():
    est = PrewarmEstimate.of([12.0])
    nothing = StartSaving.of([], [float("nan")])
    assert (nothing.per_run_s(est), nothing.cold_samples) == (12.0, 0) and "no cold start" in nothing.describe(est)
    cold = StartSaving.of([30.0, 40.0], [])
    assert (cold.cold_s, cold.per_run_s(est)) == (35.0, 12.0) and "no pooled start" in cold.describe(est)
    both = StartSaving.of([30.0, 40.0], [10.0])
    assert both.per_run_s(est) == 25.0 and "cold 35.0 s over 2, pooled 10.0 s over 1" in both.describe(est)
    assert StartSaving.of([5.0], [10.0]).per_run_s(est) == 0.0  # pooled slower: saves nothing
    assert StartSaving.of([100.0] * 5 + [4.0] * SAMPLES_KEPT, []).cold_s == 4.0  # only the newest count


def test_a_scheduled_run_far_ahead_is_prewarmed_just_in_time_when_the_saving_exceeds_the_hold():
    # 2 ranks x 50 s saved = 100 slot-s against 3 workers x 15 s = 45 slot-s
    d = decide_hold(1000.0, 1000.0 + 6 * 3600, TEN, margin_s=5.0, max_keep_alive_s=600.0, saving=SAVES_50,
                    slots=2, workers=3)
    assert d.rule is HoldRule.JUST_IN_TIME and d.rule.value == "just-in-time"
    assert d.start_at == 1000.0 + 6 * 3600 - 15.0 and not d.starts_now(1000.0)
    assert d.release_at == 1000.0 + 6 * 3600 + 5.0
    assert not d.expired(1000.0 + 6 * 3600 + 5.0, ready_at=None) and d.expired(1000.0 + 6 * 3600 + 5.1, ready_at=None)
    assert "next scheduled run in 21600 s" in d.reason and "3 x 15 = 45 slot-s held to save 2 rank(s)" in d.reason
    assert "= 100 slot-s" in d.reason


def test_a_scheduled_run_whose_start_saves_less_than_the_hold_gets_nothing_prewarmed():
    small = StartSaving.of([20.0], [10.0])  # 2 ranks x 10 s = 20 slot-s against 45
    d = decide_hold(1000.0, 1000.0 + 6 * 3600, TEN, margin_s=5.0, max_keep_alive_s=600.0, saving=small,
                    slots=2, workers=3)
    assert d.rule is HoldRule.NONE and not d.starts_now(1000.0) and d.release_at is None
    assert "would hold 3 x 15 s" in d.reason and "= 45 slot-s to save 2 rank(s)" in d.reason
    assert "= 20 slot-s: nothing prewarmed" in d.reason
    # nothing measured: the prewarm stands in for the start saved, which never pays the lead
    unmeasured = decide_hold(0.0, 100.0, TEN, margin_s=5.0, max_keep_alive_s=600.0, slots=2, workers=2)
    assert unmeasured.rule is HoldRule.NONE and "no cold start measured" in unmeasured.reason


def test_a_scheduled_run_closer_than_the_lead_starts_its_prewarm_at_once():
    d = decide_hold(1000.0, 1010.0, TEN, margin_s=5.0, max_keep_alive_s=600.0, saving=SAVES_50)
    assert d.rule is HoldRule.JUST_IN_TIME and d.starts_now(1000.0) and d.release_at == 1015.0


def test_with_no_schedule_a_ready_worker_is_held_for_its_share_of_the_start_saved():
    est = PrewarmEstimate.of([8.0, 12.0])  # ready 10 s after the release
    # 2 ranks x 50 s = 100 slot-s shared by 3 workers: each is held 33.3 s; expected cost 3 x 10 s
    d = decide_hold(1000.0, None, est, margin_s=5.0, max_keep_alive_s=600.0, saving=SAVES_50, slots=2, workers=3)
    assert d.rule is HoldRule.KEEP_ALIVE and d.starts_now(1000.0) and d.keep_alive_s == pytest.approx(100 / 3)
    assert "no runs seen yet" in d.reason and "expected 30 slot-s held for 100 saved" in d.reason
    assert not d.expired(1500.0, ready_at=None)  # still prewarming: its hold has not begun
    assert not d.expired(1043.3, ready_at=1010.0) and d.expired(1043.4, ready_at=1010.0)
    capped = decide_hold(0.0, None, est, margin_s=5.0, max_keep_alive_s=20.0, saving=SAVES_50, slots=2, workers=3)
    assert capped.keep_alive_s == 20.0


def test_with_no_schedule_the_models_gaps_decide_whether_a_keep_alive_pays():
    est = PrewarmEstimate.of([10.0])  # ready 10 s after the release, then held 33.3 s: runs at 10-43.3 s find it
    kw = dict(margin_s=5.0, max_keep_alive_s=600.0, saving=SAVES_50, slots=2, workers=3)
    soon = decide_hold(0.0, None, est, gaps=[25.0, 40.0, 18.0], **kw)  # every run takes: 3 x 27.7 s held for 100
    assert soon.rule is HoldRule.KEEP_ALIVE and "3 of the model's last 3 runs came while a worker would be ready " \
        "(10-43 s after the release)" in soon.reason
    late = decide_hold(0.0, None, est, gaps=[25.0, 60.0, 100.0], **kw)  # 1 of 3: 33 saved for 3 x 37.2 s held
    assert late.rule is HoldRule.NONE and not late.starts_now(0.0)
    assert "1 of the model's last 3 runs came" in late.reason and "hold about 112 slot-s to save 33" in late.reason
    early = decide_hold(0.0, None, est, gaps=[2.0, 3.0, 4.0], **kw)  # before the prewarm is done: nothing to take
    assert early.rule is HoldRule.NONE and "0 of the model's last 3 runs" in early.reason
    scheduled = decide_hold(0.0, 100.0, est, gaps=[500.0], **kw)
    assert scheduled.rule is HoldRule.JUST_IN_TIME  # a schedule is known: the gaps do not matter


def test_on_this_machines_measured_numbers_no_prewarm_pays():
    """BENCHMARKS.md, the README's main job: a prewarm 17.4 s, a run's ranks start in about 30 s
    cold and 11.5 s pooled, 2 ranks and 3 workers (one a spare). 37 slot-s saved cannot pay a
    just-in-time hold of 3 x 47.4 s, nor a keep-alive's 3 x 17.4 s of prewarm."""
    est = PrewarmEstimate.of([17.4])
    saving = StartSaving.of([30.0], [11.5])
    for next_run_at in (3600.0, None):
        d = decide_hold(0.0, next_run_at, est, margin_s=30.0, max_keep_alive_s=600.0, saving=saving,
                        slots=2, workers=3)
        assert d.rule is HoldRule.NONE, d.reason


def test_a_scheduled_run_with_no_pooled_start_measured_is_prewarmed_to_measure_one_where_its_cold_start_would_pay():
    """The study's fleet: 8 ranks start cold in 2,050 s, no pooled start measured, no prewarm
    either (the 20 s default). At most the prewarm saved (8 x 20 = 160 slot-s) never pays a hold
    (8 x 50 s of lead = 400 slot-s), so without exploring the pool would never learn; the whole
    cold start saved (16,400 slot-s) would: it prewarms just in time, once, to measure."""
    fleet = StartSaving.of([2050.0], [])
    args = dict(margin_s=30.0, max_keep_alive_s=600.0, saving=fleet, slots=8, workers=8)
    d = decide_hold(0.0, 6 * 3600.0, PrewarmEstimate.of([]), explore=True, **args)
    assert (d.rule, d.explore, d.start_at, d.release_at) == (HoldRule.JUST_IN_TIME, True, 6 * 3600.0 - 50.0,
                                                              6 * 3600.0 + 30.0)
    assert "no pooled start measured yet: prewarmed to measure one" in d.reason, d.reason
    assert "8 x 50 = 400 slot-s held, less than the 8 rank(s) x 2050.0 s cold start = 16400 slot-s" in d.reason
    no_more = decide_hold(0.0, 6 * 3600.0, PrewarmEstimate.of([]), explore=False, **args)  # the pool's count spent
    assert (no_more.rule, no_more.explore) == (HoldRule.NONE, False)
    # measured since: the numbers decide (8 x 1,750 s saved against 8 x (300 + 30) s held)
    measured = decide_hold(0.0, 6 * 3600.0, PrewarmEstimate.of([300.0]), explore=True,
                           **{**args, "saving": StartSaving.of([2050.0], [300.0])})
    assert (measured.rule, measured.explore) == (HoldRule.JUST_IN_TIME, False)
    assert MAX_EXPLORATIONS >= 1


def test_no_exploration_where_even_the_whole_cold_start_would_not_pay_or_nothing_is_scheduled():
    """This machine: 2 ranks start cold in 30 s, 3 workers of a 17.4 s prewarm and a 30 s margin
    hold 142 slot-s; the whole cold start saved is 60: nothing, even unmeasured. An unscheduled
    run is never prewarmed to explore (its keep-alive's hold is not bounded by a known time)."""
    host = decide_hold(0.0, 3600.0, PrewarmEstimate.of([17.4]), margin_s=30.0, max_keep_alive_s=600.0,
                       saving=StartSaving.of([30.0], []), slots=2, workers=3, explore=True)
    assert (host.rule, host.explore) == (HoldRule.NONE, False), host.reason
    adhoc = decide_hold(0.0, None, PrewarmEstimate.of([]), margin_s=30.0, max_keep_alive_s=600.0,
                        saving=StartSaving.of([2050.0], []), slots=8, workers=8, explore=True)
    assert (adhoc.rule, adhoc.explore) == (HoldRule.NONE, False), adhoc.reason


@pytest.mark.parametrize(("prewarm_s", "pays"), [(600.0, True), (2000.0, True), (3000.0, False)])
def test_a_just_in_time_prewarm_pays_where_the_simulated_refresh_says_it_does(prewarm_s, pays):
    """The rule prices a prewarm as the fleet simulator plays one (`ett.simulate`: every rank's
    worker held `prewarm_s` before the run, which then starts warm): with no spread and no margin
    it prewarms exactly when the simulated refresh's capETT is higher with the prewarm."""
    import random
    from dataclasses import replace

    from ettflow.ett.run_metrics import compute_run_metrics
    from ettflow.ett.simulate import ASSUMED_COSTS, BASELINE, simulate_refresh

    costs, gpus = replace(ASSUMED_COSTS, prewarm_s=prewarm_s), 64  # cold start 2,750 s, warm 404 s

    def cap_ett(prewarm: bool) -> float:
        events = simulate_refresh(costs, replace(BASELINE, prewarm=prewarm), None, gpus, random.Random(0))
        return compute_run_metrics(events).capacity_ett_pct

    decision = decide_hold(0.0, 10_000.0, PrewarmEstimate.of([prewarm_s]), margin_s=0.0, max_keep_alive_s=600.0,
                           saving=StartSaving.of([costs.cold.total_s], [costs.warm.total_s]), slots=gpus, workers=gpus)
    assert (decision.rule is HoldRule.JUST_IN_TIME) == pays == (cap_ett(True) > cap_ett(False)), decision.reason


@pytest.mark.parametrize("gaps", [
    [620.0, 640.0, 700.0],  # every run comes soon after the prewarm is done: held little, saves its start
    [5_000.0, 9_000.0, 20_000.0],  # every run comes long after the keep-alive: released unused
    [100.0, 200.0, 300.0],  # every run comes before the prewarm is done: nothing taken
    [620.0, 20_000.0, 20_000.0, 20_000.0],  # one hit, three misses held to the keep-alive's end
    [620.0, 700.0, 20_000.0],  # two hits pay for one miss
    [1_590.0, 1_599.0, 20_000.0],  # two late hits do not (per worker: 2/3 x 2,346 s saved, 1,596 s held)
    [1_400.0, 1_450.0, 20_000.0],  # two earlier ones do (1,564 s saved, 1,483 s held)
])
def test_a_keep_alive_pays_where_the_simulated_refreshes_say_it_does(gaps):
    """The keep-alive's price is the fleet simulator's (`ett.simulate`, `Policy.keep_alive_gap_s`):
    over the model's gaps from a release to its next run, it keeps ready workers exactly when the
    simulated refreshes (one per gap, workers requested at the release and held until taken or
    kept out) hold fewer slot-seconds in all, so their capETT in all is higher."""
    import random
    from dataclasses import replace

    from ettflow.ett.run_metrics import compute_run_metrics
    from ettflow.ett.simulate import ASSUMED_COSTS, BASELINE, simulate_refresh

    costs, gpus = replace(ASSUMED_COSTS, prewarm_s=600.0), 64  # cold start 2,750 s, warm 404 s
    saving = StartSaving.of([costs.cold.total_s], [costs.warm.total_s])
    decision = decide_hold(0.0, None, PrewarmEstimate.of([costs.prewarm_s]), margin_s=0.0,
                           max_keep_alive_s=1_000.0, gaps=gaps, saving=saving, slots=gpus, workers=gpus)
    keep = min(saving.per_run_s(PrewarmEstimate.of([costs.prewarm_s])), 1_000.0)  # the rule's, kept or not

    def cap_ett(prewarm: bool) -> float:  # over every gap's refresh: effective slot-s / held slot-s
        effective = held = 0.0
        for gap in gaps:
            policy = replace(BASELINE, prewarm=prewarm, keep_alive_gap_s=gap, keep_alive_s=keep)
            m = compute_run_metrics(simulate_refresh(costs, policy, None, gpus, random.Random(0)))
            effective += m.effective_s * m.held.slots
            held += m.wall_s * m.held.slots + m.held.held_s
        return effective / held

    assert (decision.rule is HoldRule.KEEP_ALIVE) == (cap_ett(True) > cap_ett(False)), decision.reason
