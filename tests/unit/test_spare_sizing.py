"""Spares sized by their expected saving (`ett/spare_sizing.py`): exact numbers."""

from __future__ import annotations

import math

import pytest

from ettflow.ett.spare_sizing import SHARED, SpareInputs, SpareShare, size_shared_spares, size_spares


def test_a_rare_failure_on_a_small_job_does_not_pay_for_a_spare():
    # 1 failure/h over a 60 s run on 2 slots: 1/60 failure x 8 s saved x 2 slots = 0.27 slot-s << 60
    d = size_spares(SpareInputs(world_size=2, wall_s=60.0, rate_per_s=1 / 3600))
    assert d.spares == 0 and d.expected_failures == pytest.approx(1 / 60)
    assert d.saving_slot_s == (pytest.approx(1 / 60 * 8.0 * 2),) and d.cost_slot_s == 60.0
    assert "does not pay" in d.reason and d.to_attrs()["rule"] == "spare-by-saving"


def test_a_large_job_pays_for_its_first_spare_and_for_more_only_when_failures_bunch():
    # 1000 slots, 2 h, 0.5 failures/h: 1 failure x 598 s x 1000 slots = 598,000 slot-s against 7,200
    def decide(replace_s):
        return size_spares(SpareInputs(world_size=1000, wall_s=7200.0, rate_per_s=0.5 / 3600, ttr_with_s=2.0,
                                       ttr_without_s=600.0, replace_s=replace_s), max_spares=3)

    quick = decide(60.0)  # a spare replaced in a minute: a second one saves 598,000 x 0.0083 = 4,963 < 7,200
    p = 1 - math.exp(-0.5 / 3600 * 60.0)
    assert quick.saving_slot_s == pytest.approx((598_000.0, 598_000.0 * p, 598_000.0 * p * p))
    assert quick.spares == 1 and "a spare pays" in quick.reason
    slow = decide(600.0)  # ten minutes to replace one: the second pays (47,800), the third not (3,822)
    assert slow.spares == 2


def test_failures_the_run_scripts_are_expected_and_the_wall_is_what_a_spare_costs():
    d = size_spares(SpareInputs(world_size=2, wall_s=12.0, rate_per_s=0.0, scripted_failures=1))
    assert d.expected_failures == 1.0 and d.saving_slot_s == (16.0,) and d.cost_slot_s == 12.0 and d.spares == 1
    assert size_spares(SpareInputs(world_size=2, wall_s=20.0, rate_per_s=0.0, scripted_failures=1)).spares == 0


def test_inputs_out_of_range_are_refused():
    with pytest.raises(ValueError, match="out of range"):
        SpareInputs(world_size=0, wall_s=1.0, rate_per_s=0.0)


def test_a_shared_spare_for_one_run_is_what_the_run_would_hold_itself():
    # both sides of the run's own decision divided by its wall: the same verdict, per second held
    for inputs in (SpareInputs(world_size=2, wall_s=60.0, rate_per_s=1 / 3600),
                   SpareInputs(world_size=2, wall_s=60.0, rate_per_s=1 / 3600, scripted_failures=8),
                   SpareInputs(world_size=1000, wall_s=7200.0, rate_per_s=0.5 / 3600, ttr_without_s=600.0,
                               replace_s=600.0)):
        own = size_spares(inputs, max_spares=3)
        shared = size_shared_spares([SpareShare.of("a", inputs)], max_spares=3)
        assert shared.spares == own.spares and shared.rule == SHARED == "spare-shared"
        assert shared.saving_slot_s == pytest.approx(tuple(s / inputs.wall_s for s in own.saving_slot_s))
        assert shared.cost_slot_s == own.cost_slot_s / inputs.wall_s == 1.0


def test_runs_whose_own_spares_would_not_pay_pay_one_together_and_none_train_holds_none():
    # each of 3 runs: 2 failures expected over 60 s x 8 s saved x 2 slots = 32 slot-s < 60 held alone;
    # per second: 0.533 each, 1.6 together > 1 slot
    inputs = SpareInputs(world_size=2, wall_s=60.0, rate_per_s=1 / 30)
    assert size_spares(inputs).spares == 0
    shares = [SpareShare.of(run, inputs) for run in ("a", "b", "c")]
    assert shares[0].saving_per_s == pytest.approx(32 / 60) and shares[0].failures_per_s == pytest.approx(1 / 30)
    assert size_shared_spares(shares[:1]).spares == 0
    together = size_shared_spares(shares, max_spares=2)
    # the second: only for a failure while the first is replaced (10 s at 0.1 failure/s: p = 0.632)
    p = 1 - math.exp(-0.1 * 10.0)
    assert together.saving_slot_s == pytest.approx((1.6, 1.6 * p)) and together.spares == 2
    assert together.reason == "3 run(s) training: 1.6 slot-s saved per s held against 1 slot(s): 2 shared spare(s) pay"
    assert together.to_attrs()["rule"] == "spare-shared"
    own = size_spares(inputs)
    assert together.beside(own).reason == f"{together.reason}; this run alone: {own.reason}"
    assert together.beside(own).spares == 2 and together.beside(own).rule == SHARED
    assert size_shared_spares([]).spares == 0
    with pytest.raises(ValueError, match="spare share out of range"):
        SpareShare(run_id="a", saving_per_s=-1.0, failures_per_s=0.0)
