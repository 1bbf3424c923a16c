"""The interval bench's pure parts: the seeded Poisson kills and the hindsight replay model."""

from __future__ import annotations

import numpy as np
import pytest

from ettflow.bench.intervals import IntervalBenchPlan, kill_steps, replay_waste


def test_kills_are_seeded_poisson_and_within_the_job():
    draw = [kill_steps(np.random.default_rng(7), rate_per_s=0.5, train_s=10.0, steps=100, max_kills=10)
            for _ in range(2)]
    assert draw[0] == draw[1] and list(draw[0]) == sorted(draw[0])
    assert all(1 <= s < 100 for s in draw[0])
    assert kill_steps(np.random.default_rng(7), rate_per_s=0.0, train_s=10.0, steps=100, max_kills=3) == ()
    many = kill_steps(np.random.default_rng(7), rate_per_s=100.0, train_s=10.0, steps=100, max_kills=3)
    assert len(many) == 3
    counts = [len(kill_steps(np.random.default_rng(s), rate_per_s=0.2, train_s=10.0, steps=100, max_kills=99))
              for s in range(2000)]
    assert np.mean(counts) == pytest.approx(2.0, abs=0.1)  # Poisson(0.2 x 10)


def test_replay_waste_by_hand():
    # kills at 5 and 12 with saves every 4 steps lose 1 + 0 steps; two jobs of 20 steps take 4 saves each
    assert replay_waste([(5, 12), ()], steps=20, interval=4, step_s=0.5, csbt_s=1.0) == 0.5 + 8.0
    # no checkpoint (interval = the job): a kill at 12 loses 12 steps
    assert replay_waste([(12,)], steps=20, interval=20, step_s=0.5, csbt_s=1.0) == 6.0


def test_plan_checks():
    assert IntervalBenchPlan().steps == 2 * 24_576 // 128
    with pytest.raises(ValueError):
        IntervalBenchPlan(refreshes=0)
