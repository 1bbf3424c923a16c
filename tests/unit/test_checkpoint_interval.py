import math

import pytest

from ettflow.ett.checkpoint_interval import (
    WasteModel,
    daly_interval,
    optimal_interval,
    young_interval,
)


def test_model_by_hand():
    m = WasteModel(job_s=100, save_blocking_s=1, failures=2)
    # tau = 10: 9 saves; each failure loses 5 s on average
    assert m.saves(10) == 9 and m.unsaved_s(10) == pytest.approx(10) and m.wasted_s(10) == pytest.approx(19)
    # tau = 30: 3 saves; segments 30, 30, 30, 10 -> E[loss] = (3*900 + 100) / 200 = 14 per failure
    assert m.wasted_s(30) == pytest.approx(28 + 3)


def test_optimum_and_closed_forms():
    m = WasteModel(job_s=100, save_blocking_s=1, failures=2)
    choice = optimal_interval(m)
    assert choice.interval_s == pytest.approx(10, abs=0.05)
    assert choice.expected_wasted_s == pytest.approx(19, abs=1e-6)
    assert choice.young_s == pytest.approx(10) and young_interval(1, 50) == pytest.approx(10)
    assert choice.daly_s == pytest.approx(10 * (1 + 0.1 / 3 + 0.01 / 9) - 1)
    assert choice.no_checkpoint_wasted_s == pytest.approx(100)  # half the job per failure
    for tau in (5, 8, 9.5, 10.5, 12, 20):
        assert m.wasted_s(tau) >= choice.expected_wasted_s - 1e-9


def test_long_job_numeric_optimum_meets_young():
    m = WasteModel(job_s=86_400, save_blocking_s=30, failure_rate_per_s=1 / 7200)
    choice = optimal_interval(m)
    assert m.expected_failures == pytest.approx(12)
    assert choice.interval_s == pytest.approx(young_interval(30, 7200), rel=0.05)


def test_degenerate_and_bad_input():
    assert optimal_interval(WasteModel(job_s=100, save_blocking_s=1, failures=0)).interval_s == 100
    assert daly_interval(10, 4) == 4
    assert math.isinf(optimal_interval(WasteModel(job_s=100, save_blocking_s=1, failures=0)).young_s)
    with pytest.raises(ValueError, match="exactly one"):
        WasteModel(job_s=100, save_blocking_s=1)
    with pytest.raises(ValueError, match="job_s"):
        WasteModel(job_s=-1, save_blocking_s=1, failures=1)
    with pytest.raises(ValueError, match="interval_s"):
        WasteModel(job_s=10, save_blocking_s=1, failures=1).wasted_s(0)
