"""Issue 12 part 5: steps tile the training time, a data stall is its own phase (owned by data).
Every expected number is worked out by hand."""

from __future__ import annotations

import threading
import time

import pandas as pd
import pytest

from ettflow.ett import report
from ettflow.ett.events import COMPONENTS, DATA_STALL, UNATTRIBUTED, component_of, owner_of
from ettflow.ett.run_metrics import compute_run_metrics
from ettflow.ett.spool import SpoolWriter
from ettflow.trainer.data.prefetch import Prefetcher, found_ready
from ettflow.trainer.rank.step_clock import STALL_THRESHOLD_S, Fetch, resume_after

from helpers import timelines


def expect(**parts):
    return {c: pytest.approx(parts.get(c, 0.0), abs=1e-9) for c in (*COMPONENTS, UNATTRIBUTED)}


def test_data_stall_is_wasted_training_owned_by_data():
    assert component_of(DATA_STALL) == "wasted_training"
    assert owner_of(DATA_STALL) == "data"
    assert owner_of("wasted_training") == "storage"  # the component's owner is unchanged


def test_a_quick_fetch_stays_inside_the_step():
    assert STALL_THRESHOLD_S == 0.001
    f = Fetch(since=100.0, fetch_start=100.25, ready=100.2505)
    assert f.wait_s == pytest.approx(0.0005) and not f.stalled
    assert f.stall is None and f.step_start == 100.0  # the fetch, heartbeat and agreement are the step's


def test_a_fetch_that_waited_is_a_stall_from_the_previous_interval_end_to_batch_ready():
    f = Fetch(since=100.0, fetch_start=100.25, ready=100.75)
    assert f.stalled and f.wait_s == 0.5
    assert f.stall == (100.0, 100.75) and f.step_start == 100.75
    assert Fetch(since=1.0, fetch_start=1.0, ready=1.5, threshold_s=0.5).stall is None  # not above it


def test_a_slow_fetch_of_a_batch_that_was_ready_stays_inside_the_step():
    # the training thread got the CPU back late: not the data pipeline's wait
    f = Fetch(since=100.0, fetch_start=100.25, ready=100.75, batch_was_ready=True)
    assert f.wait_s == 0.5 and not f.stalled and f.stall is None and f.step_start == 100.0
    with pytest.raises(ValueError, match="batch_was_ready must be a bool"):
        Fetch(since=1.0, fetch_start=1.0, ready=1.0, batch_was_ready=1)


def test_a_prefetcher_tells_whether_the_batch_was_waiting():
    gate = threading.Event()

    def source():
        yield "a"
        gate.wait(5)
        yield "b"

    pf = Prefetcher(source(), depth=2)
    deadline = time.time() + 5
    while pf._queue.qsize() < 1 and time.time() < deadline:
        time.sleep(0.005)
    assert next(pf) == "a" and pf.found_ready and found_ready(pf)
    threading.Timer(0.05, gate.set).start()
    assert next(pf) == "b" and not pf.found_ready and not found_ready(pf)  # it waited for the source
    pf.close()
    assert not found_ready(iter(["x"]))  # batches made in the training thread: the fetch is the pipeline's work


@pytest.mark.parametrize("times", [(2.0, 1.0, 3.0), (1.0, 3.0, 2.0)])
def test_fetch_times_out_of_order_are_refused(times):
    since, fetch_start, ready = times
    with pytest.raises(ValueError, match="since <= fetch_start <= ready"):
        Fetch(since=since, fetch_start=fetch_start, ready=ready)


def test_after_a_save_the_next_step_starts_at_the_saves_end():
    assert resume_after(50.0, None) == 50.0  # nothing recorded since
    assert resume_after(50.0, 52.5) == 52.5  # the save's blocking part ended later
    assert resume_after(50.0, 49.0) == 50.0  # an earlier interval never moves the start back


def test_spool_writer_knows_where_its_last_on_clock_interval_ended(tmp_path):
    with SpoolWriter(tmp_path, "r", 0, 0) as rec:
        assert rec.recorded_until is None
        rec.record("train_step", 1.0, 2.0, sync=False, cursor_start=0, cursor_end=1)
        assert rec.recorded_until == 2.0
        rec.record("checkpoint_save_blocking", 2.0, 2.5, step=1)
        assert rec.recorded_until == 2.5
        rec.record("checkpoint_save_background", 2.5, 9.0, step=1)  # off the clock
        rec.mark("failure", 7.0)  # a marker is an instant, no interval
        assert rec.recorded_until == 2.5
        rec.record("pt2_compile", 0.5, 1.5)  # an earlier interval does not move it back
        assert rec.recorded_until == 2.5


def stalled_training() -> timelines.Timeline:
    """One rank, the loop's rule: step 0 from the training start (10) to 11; a save 11 -> 11.5;
    step 1 starts at the save's end; step 2's fetch stalled 13.5 -> 14.25 (the stall starts at
    step 1's end), then step 2 runs 14.25 -> 15.25; shutdown 15.25 -> 16."""
    t = timelines.Timeline("stall")
    t.mark("submitted", 0).ev("scheduling", 0, 2).ev("device_init", 2, 6).ev("pt2_compile", 6, 10)
    t.steps(10, 0, 1).ev("checkpoint_save_blocking", 11, 11.5, step=1)
    t.ev("train_step", 11.5, 13.5, cursor_start=1, cursor_end=2)
    t.ev(DATA_STALL, 13.5, 14.25, step=2, wait_s=0.7)
    t.ev("train_step", 14.25, 15.25, cursor_start=2, cursor_end=3)
    return t.ev("shutdown", 15.25, 16)


def test_stall_and_steps_tile_training_without_unattributed_time():
    m = compute_run_metrics(stalled_training().events)
    m.check_partition()
    assert m.wall_s == 16
    assert m.components == expect(effective_training=4, wasted_training=1.25, pt2_compile=4,
                                  trainer_init=4, scheduling=2, shutdown=0.75)
    assert m.exposed(DATA_STALL) == 0.75 and m.exposed("checkpoint_save_blocking") == 0.5
    assert m.effective_steps == 3 and m.tts_s == 10


def test_realized_checkpoint_waste_leaves_data_stalls_out():
    runs = pd.DataFrame([{"run_id": "r1", "tags": {"checkpoint_interval": {"expected_wasted_s": 1.0}},
                          "wall_s": 100.0, "wall_start": 0.0, "status": "completed", "nof": 0,
                          "checkpoint_saves": 4, "wasted_training_s": 3.5}])
    phases = {("r1", "checkpoint_save_blocking"): 2.0, ("r1", DATA_STALL): 1.5}
    assert DATA_STALL in report.INTERVAL_PHASES
    (row,) = report.interval_table(runs, phases).to_dict("records")
    assert row["wasted_s"] == 2.0 and row["save_blocking_s"] == 2.0 and row["realized/expected"] == 2.0
    assert row["wasted%"] == 2.0
