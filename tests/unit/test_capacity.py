"""Capacity held for a run outside its slots (`ett.capacity`), with exact numbers: a pooled
worker that became rank 0 (held before the run began), a spare never used (pure cost), a spare
that replaced a rank (held until it was taken)."""

from __future__ import annotations

import pytest

from ettflow.ett.capacity import HeldCapacity, capacity_ett_pct, held_capacity
from ettflow.ett.run_metrics import compute_run_metrics

from helpers.timelines import Timeline


def _run(*, spare: dict | None) -> Timeline:
    t = Timeline("held")  # submitted at 10; 2 ranks train 12-22: effective 10 s of a 12 s wall
    t.ev("spare_start", 0, 5, rank=-1, pooled=True, for_rank=0, taken_at=11)  # prewarmed 0-5, taken at 11
    t.mark("submitted", 10).ev("scheduling", 10, 12, rank=-1, world_size=2)
    if spare is not None:
        t.ev("spare_start", 12, 14, rank=-1, **spare)
    t.steps(12, 0, 10, rank=0)
    return t.steps(12, 0, 10, rank=1)


def test_a_spare_never_used_is_cost_and_a_pooled_rank_counts_until_the_run_began():
    m = compute_run_metrics(_run(spare={"pooled": False, "used": False, "released_at": 22}).events)
    assert (m.wall_s, m.effective_s) == (12.0, 10.0)
    assert m.held == HeldCapacity(slots=2, pooled_s=10.0, spare_s=10.0, unused_spare_s=10.0)
    assert m.ett_pct == pytest.approx(100 * 10 / 12)  # the study's per-run ETT is unchanged
    assert m.capacity_ett_pct == pytest.approx(100 * 10 * 2 / (12 * 2 + 20))  # 45.45%


def test_a_used_spare_counts_until_it_was_taken_and_nothing_held_leaves_the_ett():
    used = compute_run_metrics(_run(spare={"pooled": True, "used": True, "taken_at": 17}).events)
    assert used.held == HeldCapacity(slots=2, pooled_s=10.0, spare_s=5.0, unused_spare_s=0.0)
    bare = Timeline("bare")
    bare.mark("submitted", 10).ev("scheduling", 10, 12, rank=-1, world_size=2).steps(12, 0, 10, rank=0)
    m = compute_run_metrics(bare.steps(12, 0, 10, rank=1).events)
    assert m.held.held_s == 0.0 and m.capacity_ett_pct == pytest.approx(m.ett_pct)


def test_capacity_ett_is_never_above_the_ett():
    held = held_capacity([], 0.0, 1.0)
    assert held.slots == 1 and capacity_ett_pct(5.0, 10.0, held) == 50.0
    assert capacity_ett_pct(5.0, 10.0, HeldCapacity(2, 1.0, 2.0, 2.0)) < 50.0
    assert capacity_ett_pct(0.0, 0.0, held) == 0.0
