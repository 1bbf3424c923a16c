"""Spares sized by their expected saving (`ett/spare_sizing.py`): exact numbers."""

from __future__ import annotations

import math

import pytest

from ettflow.ett.spare_sizing import SpareInputs, size_spares


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
