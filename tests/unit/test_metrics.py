"""L1 and L2 on hand-built timelines; every expected number is worked out by hand."""

import pytest

from ettflow.ett.events import COMPONENTS, UNATTRIBUTED
from ettflow.ett.run_metrics import compute_run_metrics

from helpers import timelines


def l2(m):
    return {c: pytest.approx(m.components[c], abs=1e-9) for c in (*COMPONENTS, UNATTRIBUTED)}


def expect(**parts):
    return {c: pytest.approx(parts.get(c, 0.0), abs=1e-9) for c in (*COMPONENTS, UNATTRIBUTED)}


def test_sequential_init():
    m = compute_run_metrics(timelines.sequential_init().events)
    m.check_partition()
    assert m.wall_s == 60
    assert l2(m) == expect(effective_training=10, wasted_training=2, pt2_compile=10,
                           trainer_init=20, scheduling=10, shutdown=8)
    assert m.tts_s == 40 and m.nof == 0 and m.ttr_total_s == 0
    assert m.ett_pct == pytest.approx(100 * 10 / 60)
    assert m.checkpoint_saves == 1 and m.checkpoint_blocking_s == 2
    # background write claims no wall time but its raw duration is kept
    assert m.raw("checkpoint_save_background") == 8 and m.exposed("checkpoint_save_background") == 0
    assert m.exposed("process_group_init") == 3 and m.raw("get_first_batch_data") == 8


def test_fast_batch_overlaps_compile_with_data_warmup():
    m = compute_run_metrics(timelines.fast_batch().events)
    m.check_partition()
    assert l2(m) == expect(effective_training=10, pt2_compile=10, trainer_init=8,
                           scheduling=10, shutdown=2)
    assert m.tts_s == 28
    # DPP warm-up ran entirely under compilation: raw 8 s, exposed 0 s
    assert m.raw("get_first_batch_data") == 8 and m.exposed("get_first_batch_data") == 0
    # concurrent init stages share the instants they overlap
    assert m.exposed("device_init") == pytest.approx(1 / 3 + 1 / 2)
    assert m.exposed("process_group_init") == pytest.approx(1 / 3 + 1 / 2 + 1 / 2)
    assert m.exposed("preproc_creation") == pytest.approx(1 / 3)
    assert m.exposed("train_module_creation") == pytest.approx(3.5)
    assert m.raw("process_group_init") == 3
    # raw component time counts what the sweep hid: init ran on under compilation until 26
    assert m.components_raw["trainer_init"] == 16 and m.components_raw["pt2_compile"] == 10


def test_two_failures_with_replay():
    m = compute_run_metrics(timelines.two_failures().events)
    m.check_partition()
    assert m.wall_s == 100
    assert l2(m) == expect(effective_training=30, wasted_training=12, pt2_compile=22,
                           trainer_init=17, scheduling=11, shutdown=8)
    assert m.tts_s == 20 and m.nof == 2
    assert [f.ttr_s for f in m.failures] == pytest.approx([27, 13])
    assert [f.failure_class for f in m.failures] == ["infrastructure", "user"]
    assert all(f.recovered and not f.cascaded for f in m.failures)
    assert m.ett_pct == pytest.approx(30)
    assert m.ett_l1_pct == pytest.approx(40)  # upper bound: 1 - (20 + 27 + 13) / 100
    assert m.exposed("train_step_replay") == 7 and m.replayed_steps == 7
    assert m.exposed("lost_in_flight") == 3  # 36 -> 38 and 73 -> 74
    assert [a.failed for a in m.attempts] == [True, True, False]


def test_recovery_that_dies_before_its_first_step():
    m = compute_run_metrics(timelines.cascade().events)
    m.check_partition()
    assert m.wall_s == 72
    assert l2(m) == expect(effective_training=22, wasted_training=6, pt2_compile=9,
                           trainer_init=21, scheduling=10, shutdown=4)
    assert m.nof == 2 and m.tts_s == 15
    first, second = m.failures
    # TTRs never overlap: the first ends where the second is detected
    assert (first.ttr_s, first.cascaded) == (16, True)
    assert (second.ttr_s, second.cascaded) == (15, False)
    assert m.ttr_total_s == 62 - 31
    assert m.exposed("failed_startup") == 5  # init in flight 42 -> detection 47


def test_long_shutdown():
    m = compute_run_metrics(timelines.long_shutdown().events)
    m.check_partition()
    assert l2(m) == expect(effective_training=10, pt2_compile=2, trainer_init=2,
                           scheduling=2, shutdown=34)
    assert m.ett_pct == pytest.approx(20)
    assert m.exposed("publish") == 30


def test_queueing_before_start_and_unattributed_gap():
    m = compute_run_metrics(timelines.queued().events)
    m.check_partition()
    # nothing covers 0 -> 2: reported, not folded into scheduling
    assert l2(m) == expect(effective_training=10, pt2_compile=2, trainer_init=2,
                           scheduling=28, shutdown=1, unattributed=2)
    assert m.tts_s == 34


def test_standalone_publish_is_off_the_device_clock():
    t = timelines.long_shutdown()
    t.events = [e for e in t.events if e.phase != "publish"]
    t.ev("publish_standalone", 50, 80, rank=-1)
    m = compute_run_metrics(t.events)
    assert m.wall_s == 50 and m.raw("publish_standalone") == 30
    assert m.components[UNATTRIBUTED] == 30  # the gap the in-trainer publish used to fill


def test_replay_is_per_rank_and_two_ranks_share_the_clock():
    t = timelines.Timeline("ranks")
    t.mark("submitted", 0).ev("device_init", 0, 1, rank=0).ev("device_init", 0, 2, rank=1)
    t.steps(2, 0, 3, rank=0).steps(2, 100, 3, rank=1)
    t.steps(5, 1, 2, rank=0)  # rank 0 replays batch 1..3, rank 1 trains new data meanwhile
    t.steps(5, 103, 2, rank=1)
    m = compute_run_metrics(t.events)
    m.check_partition()
    assert l2(m) == expect(effective_training=5, trainer_init=2)
    assert m.replayed_steps == 2 and m.raw("train_step_replay") == 2
    assert m.exposed("train_step_replay") == 0  # rank 1 was training new data


def test_partial_replay_splits_a_step_by_cursor():
    t = timelines.Timeline("partial")
    t.ev("train_step", 0, 1, cursor_start=[0, 0, 0], cursor_end=[0, 0, 100])
    t.ev("train_step", 1, 2, cursor_start=[0, 0, 50], cursor_end=[0, 0, 150])
    m = compute_run_metrics(t.events)
    assert l2(m) == expect(effective_training=1.5, wasted_training=0.5)


def test_events_of_two_runs_are_refused():
    a, b = timelines.queued().events, timelines.fast_batch().events
    with pytest.raises(ValueError, match="several runs"):
        compute_run_metrics(a + b)


def test_a_local_ray_started_for_the_run_is_scheduling_on_its_clock_and_named_in_its_ett_table():
    from ettflow.ett.run_metrics import compute_run_metrics
    from ettflow.tasks.artifacts import table_rows

    from helpers.timelines import Timeline

    t = Timeline("ray")  # submitted at 0; the reservation 0-10 s, of which 0-4 s started a local Ray
    t.mark("submitted", 0).ev("scheduling", 0, 10, rank=-1, ray="started").ev("ray_start", 0, 4, rank=-1)
    t.ev("pt2_compile", 10, 12).steps(12, 0, 8)
    m = compute_run_metrics(t.events)
    assert m.components["scheduling"] == 10.0 and m.tts_s == 12.0
    assert (m.phases["ray_start"].raw_s, m.phases["ray_start"].exposed_s) == (4.0, 2.0)  # shares 0-4 s
    rows = {r["metric"]: r for r in table_rows(m)}
    ray = rows["scheduling: ray_start (a Ray of its own)"]
    assert (ray["exposed"], ray["raw"], ray["owner"]) == (2.0, 4.0, "scheduler")
    joined = Timeline("joined")
    joined.mark("submitted", 0).ev("scheduling", 0, 10, rank=-1, ray="joined").ev("pt2_compile", 10, 12)
    assert not [r for r in table_rows(compute_run_metrics(joined.steps(12, 0, 8).events)) if "ray_start" in r["metric"]]


def test_the_ett_table_labels_every_value_and_never_shows_a_bare_dash():
    """Issue 27: the L1 form was an unlabelled 'raw' of the ETT % row, and an owner of '-' is
    drawn as a list bullet by the Prefect UI."""
    from ettflow.tasks.artifacts import NO_OWNER, table_rows

    m = compute_run_metrics(timelines.two_failures().events)
    rows = {r["metric"]: r for r in table_rows(m)}
    assert rows["ETT %"]["raw"] is None and rows["ETT %"]["exposed"] == round(m.ett_pct, 1)
    (l1,) = [r for name, r in rows.items() if name.startswith("L1 form %")]
    assert l1["exposed"] == round(m.ett_l1_pct, 1)
    assert rows["TTR s (total; raw: mean per failure)"]["raw"] == round(m.ttr_mean_s, 2)
    assert all(r["owner"] not in ("-", "", None, "none") for r in rows.values())
    assert rows["NoF"]["owner"] == NO_OWNER == "the whole run" and rows["pt2_compile"]["owner"] == "compiler"
    # issue 43: the owner beside the metric (the table fits a page), one rounding rule: % to 1
    # decimal, seconds to 2, slot-seconds whole
    assert list(rows["ETT %"]) == ["level", "metric", "owner", "exposed", "raw", "% of wall"]
    cap = rows["capETT % (raw: slot-s held for the run)"]
    assert isinstance(cap["raw"], int) and rows["wall s"]["exposed"] == round(m.wall_s, 2)
    assert all(r["% of wall"] is None or r["% of wall"] == round(r["% of wall"], 1) for r in rows.values())
