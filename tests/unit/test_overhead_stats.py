"""The recording-overhead statistic of the bench (interleaved pairs), on numbers worked by hand."""

import pytest

from ettflow.bench.suite import overhead_stats, t975


def test_t_quantiles_of_the_table_and_between_its_entries():
    assert t975(1) == 12.706 and t975(7) == 2.365
    assert t975(11) == 2.228  # between 10 and 12: the df-10 value, the larger one
    assert t975(25) == 2.086 and t975(500) == 1.980
    with pytest.raises(ValueError, match="df >= 1"):
        t975(0)


def test_two_pairs():
    s = overhead_stats([90.0, 96.0], [100.0, 100.0])
    assert s.pairs == 2 and s.per_pair_pct == (10.0, 4.0) and s.mean_pct == 7.0
    # sample stdev sqrt(3^2 + 3^2) = 3 sqrt(2); standard error 3; t(1 df) = 12.706
    assert s.half_width_pct == pytest.approx(38.118) and s.upper_pct == pytest.approx(45.118)


def test_recording_faster_than_not_is_a_negative_overhead():
    s = overhead_stats([101.0, 100.0, 102.0], [100.0, 100.0, 100.0])
    assert s.per_pair_pct == (-1.0, 0.0, -2.0) and s.mean_pct == -1.0
    assert s.half_width_pct == pytest.approx(4.303 / 3 ** 0.5) and s.upper_pct < 2.0


def test_one_pair_has_no_spread_and_pairs_must_match():
    s = overhead_stats([98.0], [100.0])
    assert s.mean_pct == 2.0 and s.half_width_pct == 0.0 and s.upper_pct == 2.0
    with pytest.raises(ValueError, match="as many runs"):
        overhead_stats([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="as many runs"):
        overhead_stats([], [])
