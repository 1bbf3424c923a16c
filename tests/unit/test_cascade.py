import pytest

from ettflow.ett.cascade import attribute
from ettflow.ett.run_metrics import compute_run_metrics

from helpers import timelines


def test_sequential_baseline_vs_fast_batch():
    base = compute_run_metrics(timelines.sequential_init().events)
    opt = compute_run_metrics(timelines.fast_batch().events)
    a = attribute(base, opt)
    assert a.saved_startup_s == 12 and a.startup_cascade_bound_s == 12 and a.nof_matches
    assert a.saved_by_component == pytest.approx({"wasted_training": 2, "pt2_compile": 0, "trainer_init": 12,
                                                  "scheduling": 0, "shutdown": 6, "unattributed": 0})
    assert a.saved_checkpointing_s == 2 and a.saved_shutdown_s == 6 and a.saved_recovery_s == 0
    assert a.fast_batch_saving_per_startup_s == 8  # min(DPP warm-up 8, compile 10)
    assert a.saved_lost_s == (60 - 10) - (40 - 10)
    assert a.ett_gain_pts == pytest.approx(25 - 100 / 6)
    assert a.ttr_to_tts_ratio == 0


def test_cascade_bound_counts_every_startup():
    base = compute_run_metrics(timelines.two_failures().events)
    opt = compute_run_metrics(timelines.cascade().events)
    a = attribute(base, opt)
    assert a.nof == 2 and a.saved_startup_s == 5 and a.startup_cascade_bound_s == 15
    assert a.saved_recovery_s == (27 + 13) - 31
    assert a.ttr_to_tts_ratio == pytest.approx(9 / 5)
    assert a.fast_batch_saving_bound_s == 0  # the baseline recorded no DPP warm-up
