"""A run whose driver died: the heartbeat that tells it, the orchestrator failure its spool gets
(placed once), and the metric of a failure after which nothing restarts. Pure or file-only."""

from __future__ import annotations

import time

import pytest

from ettflow.ett.events import COMPONENTS, UNATTRIBUTED
from ettflow.ett.failures import Failure, FailureClass
from ettflow.ett.heartbeat import Lapse, RunHeartbeat, heartbeat_file, lapse_after, read_heartbeat, stale_bound_s
from ettflow.ett.orphans import place_orphan_failure, record_orchestrator_failure
from ettflow.ett.run_metrics import compute_run_metrics
from ettflow.ett.spool import SpoolWriter, read_spool

from helpers.timelines import Timeline


def trained_then_silent() -> Timeline:
    """Submitted at 0, init 0-10, 20 steps 10-30, then the driver died (no more events)."""
    t = Timeline("orphan")
    t.mark("submitted", 0).ev("scheduling", 0, 2, rank=-1).ev("device_init", 2, 10)
    return t.steps(10, 0, 20)


def test_an_orchestrator_failure_with_no_restart_after_it():
    t = trained_then_silent()
    t.fail(31.0, 38.6, failure_class="orchestrator", failed_rank=-1, reason="driver died")
    m = compute_run_metrics(t.events)
    (f,) = m.failures
    assert m.nof == 1 and f.failure_class == "orchestrator" and not f.recovered and not f.cascaded
    assert m.wall_end == 38.6 and f.detected_at == 38.6 and f.failed_at == 31.0
    assert f.ttr_s == 0.0  # TTR runs to the wall end, which is the detection
    assert m.effective_s == 20.0
    assert m.phases["lost_in_flight"].exposed_s == pytest.approx(8.6)  # last step end -> detection
    m.check_partition()
    assert sum(m.components[c] for c in (*COMPONENTS, UNATTRIBUTED)) == pytest.approx(m.wall_s)


def test_orphan_failure_goes_on_the_last_attempt_or_the_next_when_that_one_failed():
    t = trained_then_silent()
    placed = place_orphan_failure(t.events, last_alive=31.0, detected_at=38.6)
    assert (placed.attempt, placed.failed_at, placed.detected_at) == (0, 31.0, 38.6)
    # never failed nor detected before the last spooled work (issue 27: a crashed run's timeline
    # showed effective training after its failure mark)
    early = place_orphan_failure(t.events, last_alive=5.0, detected_at=12.0)
    assert (early.failed_at, early.detected_at) == (30.0, 30.0)
    # no heartbeat: the last on-clock event's end is the last sign of life
    assert place_orphan_failure(t.events, last_alive=None, detected_at=40.0).failed_at == 30.0
    t.fail(30.5, 31.0, failure_class="infrastructure", failed_rank=1)  # attempt 0 failed, then the driver died
    assert place_orphan_failure(t.events, last_alive=32.0, detected_at=40.0).attempt == 1
    t.next_attempt().fail(32.0, 40.0, failure_class="orchestrator")
    assert place_orphan_failure(t.events, last_alive=32.0, detected_at=40.0) is None  # already there


def test_a_run_an_operator_stopped_gets_no_orchestrator_failure():
    """Issue 42 #6: a cancelled run's process ends as Prefect's CRASHED (the stop's termination
    signal) before its worker marks it CANCELLED; the crash hook adds nothing: the operator's
    stop is no failure."""
    t = trained_then_silent()
    t.mark("operator_stop", 30.2, reason="cancelled by an operator (Prefect state Cancelling) (SIGTERM)")
    t.ev("failure", 30.4, 30.4, rank=1, failure_class="preemption", reason="rank 1 preempted (SIGTERM)")
    assert place_orphan_failure(t.events, last_alive=31.0, detected_at=38.6) is None
    assert compute_run_metrics(t.events).nof == 0  # the rank's preemption after the stop is the stop's
    # the worker signals the whole process group: a rank may mark its preemption before the driver's
    # next poll records the stop; that is the stop too, an error just before it is not
    t.ev("failure", 29.9, 29.9, rank=0, failure_class="preemption", reason="rank 0 preempted (SIGTERM)")
    assert compute_run_metrics(t.events).nof == 0
    t.ev("failure", 29.8, 29.8, rank=0, failure_class="user", reason="ValueError")
    assert [f.failure_class for f in compute_run_metrics(t.events).failures] == ["user"]


def test_a_run_whose_task_recorded_its_process_being_stopped_gets_no_orchestrator_failure_on_top():
    """Issue 26 #4: a SIGTERM of `ettflow refresh` is recorded by the driver (`process_stopped`) or,
    outside it, by the train task (`task`) as one `preemption`; the CRASHED hook that follows adds
    no orchestrator failure: one failure, with its real class. Its neighbours do get one: a rank's
    own preemption (the cluster took its node; the flow's process then died unrecorded), and a
    stop recorded on an earlier attempt than the last."""
    for said in ({"process_stopped": True}, {"task": "train"}):
        t = trained_then_silent()
        t.fail(30.2, 30.4, failure_class="preemption", failed_rank=-1, reason="stopped (SIGTERM): preempted", **said)
        assert place_orphan_failure(t.events, last_alive=31.0, detected_at=38.6) is None, said
        (only,) = compute_run_metrics(t.events).failures
        assert only.failure_class == "preemption", said
    rank_preempted = trained_then_silent().fail(30.2, 30.4, failure_class="preemption", failed_rank=1,
                                                reason="rank 1 preempted (SIGTERM)")
    assert place_orphan_failure(rank_preempted.events, last_alive=31.0, detected_at=38.6).attempt == 1
    earlier = trained_then_silent().fail(30.2, 30.4, failure_class="preemption", failed_rank=-1, process_stopped=True)
    earlier.next_attempt().steps(31, 20, 5)  # the restart trained on, then its process died unrecorded
    placed = place_orphan_failure(earlier.events, last_alive=36.5, detected_at=44.0)
    assert (placed.attempt, placed.failed_at, placed.detected_at) == (1, 36.5, 44.0)


def three_steps_then_silent(root) -> dict:
    """Spool run "r": submitted at 0, rank 0 trains 3 steps 1-4, then nothing; returns the
    arguments of its orchestrator failure (last alive 4.5, detected 12.5, by heartbeat)."""
    with SpoolWriter(root, "r", 0, -1) as d:
        d.mark("submitted", 0.0)
    with SpoolWriter(root, "r", 0, 0) as w:
        for i in range(3):
            w.record("train_step", 1 + i, 2 + i, cursor_start=i, cursor_end=i + 1)
    return dict(last_alive=4.5, detected_at=12.5, reason="driver died", detection="heartbeat")


def test_recording_the_orchestrator_failure_is_idempotent(tmp_path):
    kw = three_steps_then_silent(tmp_path)
    placed = record_orchestrator_failure(tmp_path, "r", **kw)
    assert (placed.attempt, placed.failed_at, placed.detected_at) == (0, 4.5, 12.5)
    assert record_orchestrator_failure(tmp_path, "r", **kw) is None
    events = read_spool(tmp_path, "r").events
    marks = [e for e in events if e.phase in ("failure", "failure_detected")]
    assert [(e.phase, e.start, e.rank) for e in marks] == [("failure", 4.5, -1), ("failure_detected", 12.5, -1)]
    assert all(e.attrs["failure_class"] == FailureClass.ORCHESTRATOR.value and e.attrs["detection"] == "heartbeat"
               for e in marks)
    m = compute_run_metrics(events)
    assert m.nof == 1 and m.wall_end == 12.5
    m.check_partition()


def test_an_orchestrator_failure_half_written_gets_its_detection(tmp_path):
    """The writer died (or the disk refused) between the `failure` marker and its
    `failure_detected`: the next reconcile adds the missing marker alone, at the detection the
    whole pair would have had, so the row's wall ends there (it ended at the failure: ETT too high,
    nothing lost in flight); a complete pair is left as it is."""
    kw = three_steps_then_silent(tmp_path)
    failure = Failure(failure_class=FailureClass.ORCHESTRATOR, rank=-1, attempt=0, reason="injected kill of the driver",
                      injected=True)
    with SpoolWriter(tmp_path, "r", 0, -1) as d:  # the first of the two marks, then the kill
        d.mark("failure", 4.5, **failure.to_attrs(), detection="heartbeat")
    assert compute_run_metrics(read_spool(tmp_path, "r").events).wall_end == 4.5
    placed = record_orchestrator_failure(tmp_path, "r", **kw)
    assert (placed.attempt, placed.failed_at, placed.detected_at, placed.missing) == (0, 4.5, 12.5,
                                                                                       ("failure_detected",))
    assert record_orchestrator_failure(tmp_path, "r", **kw) is None  # whole now
    events = read_spool(tmp_path, "r").events
    assert [(e.phase, e.start) for e in events if e.phase.startswith("failure")] == [("failure", 4.5),
                                                                                      ("failure_detected", 12.5)]
    detected = next(e for e in events if e.phase == "failure_detected")  # the failure as it was written
    assert (detected.info.reason, detected.info.injected) == ("injected kill of the driver", True)
    m = compute_run_metrics(events)
    assert m.nof == 1 and m.wall_end == 12.5 and m.phases["lost_in_flight"].exposed_s == pytest.approx(8.5)
    m.check_partition()


def _wait_for(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_heartbeat_beats_and_records_how_the_block_ended(tmp_path):
    with RunHeartbeat(tmp_path, "hb", every_s=0.05, labels={"model": "m", "mode": "baseline"}):
        first = read_heartbeat(tmp_path, "hb")
        assert first is not None and not first.ended and first.labels["model"] == "m"
        assert first.bound_s == stale_bound_s(0.05) and first.is_live(first.last_beat)
        assert _wait_for(lambda: heartbeat_file(tmp_path, "hb").stat().st_mtime > first.last_beat)
    done = read_heartbeat(tmp_path, "hb")
    assert done.ended and done.outcome == "completed" and not done.is_orphaned(done.last_beat + 1e6)
    with pytest.raises(ValueError), RunHeartbeat(tmp_path, "hb2", every_s=0.05):
        raise ValueError("the body failed")
    assert read_heartbeat(tmp_path, "hb2").outcome == "failed"
    with pytest.raises(KeyboardInterrupt), RunHeartbeat(tmp_path, "hb3", every_s=0.05):
        raise KeyboardInterrupt
    assert read_heartbeat(tmp_path, "hb3").outcome == "crashed"
    assert read_heartbeat(tmp_path, "never") is None
    with pytest.raises(ValueError, match="every_s"):
        RunHeartbeat(tmp_path, "x", every_s=0)
    # what the refresh flow does with it: the labels its claim settled, a failure it handled, a run
    # that archives no row (refused, skipped, a reused anchor's publish) leaving no record
    with RunHeartbeat(tmp_path, "hb4", every_s=0.05, labels={"model": "m", "world_size": 2}) as beat:
        beat.relabel({"model": "m", "world_size": 4})
        assert read_heartbeat(tmp_path, "hb4").labels["world_size"] == 4
        beat.end_as("failed")
    assert read_heartbeat(tmp_path, "hb4").outcome == "failed"
    with RunHeartbeat(tmp_path, "hb5", every_s=0.05) as beat:
        beat.forget()
    assert read_heartbeat(tmp_path, "hb5") is None and not (tmp_path / "hb5").exists()
    with pytest.raises(KeyboardInterrupt), RunHeartbeat(tmp_path, "hb6", every_s=0.05) as beat:
        beat.forget()
        raise KeyboardInterrupt  # a run that dies anyway keeps its record: it is to reconcile
    assert read_heartbeat(tmp_path, "hb6").outcome == "crashed"
    with pytest.raises(ValueError, match="outcome must be one of"):
        RunHeartbeat(tmp_path, "hb7").end_as("done")


def test_a_stale_heartbeat_is_an_orphan_detected_at_last_beat_plus_the_bound(tmp_path):
    with RunHeartbeat(tmp_path, "dead", every_s=1.0):
        pass
    path = heartbeat_file(tmp_path, "dead")
    data = path.read_text().replace('"ended_at"', '"_ended_at"').replace('"outcome"', '"_outcome"')
    path.write_text(data)  # as if the process died inside the block
    beat = read_heartbeat(tmp_path, "dead")
    assert not beat.ended and beat.detection_at == beat.last_beat + 3 * 1.0 + 2.0
    assert beat.is_live(beat.last_beat + 4.9) and beat.is_orphaned(beat.last_beat + 5.1)


def test_a_gap_between_two_beats_past_the_bound_is_a_lapse_that_extends_until_cleared():
    """The beat thread's rule (`lapse_after`): a beat written more than the bound after the one
    before ends a lapse, in which anyone could have taken the run for dead; a later gap extends
    a lapse its owner has not cleared, so a clear never hides a newer one."""
    assert lapse_after(None, 100.0, 105.0, 5.0) is None  # exactly the bound: an observer never saw it stale
    first = lapse_after(None, 100.0, 121.5, 5.0)
    assert first == Lapse(100.0, 121.5) and first.seconds == 21.5
    assert lapse_after(first, 121.5, 123.5, 5.0) is first  # beats on time keep it for its owner
    assert lapse_after(first, 123.5, 140.0, 5.0) == Lapse(100.0, 140.0)


def test_a_heartbeat_whose_clock_jumps_past_its_bound_reports_one_lapse_its_owner_clears(tmp_path, monkeypatch):
    """The thread measures the gap on the clock a stopped process finds moved on when it resumes
    (here the module's clock jumps 20 s: a SIGSTOP; tests/integration/test_claims.py stops a
    real process)."""
    import ettflow.ett.heartbeat as heartbeat

    jump = [0.0]
    real = time.time
    monkeypatch.setattr(heartbeat, "time", type("Clock", (), {"time": staticmethod(lambda: real() + jump[0])}))
    with RunHeartbeat(tmp_path, "hb", every_s=0.05) as beat:
        assert beat.bound_s == stale_bound_s(0.05)
        time.sleep(0.2)
        assert beat.lapse is None
        jump[0] = 20.0
        assert _wait_for(lambda: beat.lapse is not None)
        lapse = beat.lapse
        assert 20.0 <= lapse.seconds < 20.0 + 1.0
        time.sleep(0.2)
        assert beat.lapse == lapse  # beats on time after it: kept for its owner
        beat.clear(Lapse(0.0, 1.0))  # not the lapse it has: nothing cleared
        assert beat.lapse == lapse
        beat.clear(lapse)
        assert beat.lapse is None


def test_a_heartbeat_file_stamped_past_the_bound_by_its_file_system_reports_a_lapse(tmp_path, monkeypatch):
    """On a shared file system the server stamps the mtime that other hosts compare with their
    clocks: a gap there (a paused VM's guest clock lags after it resumes) is a lapse too, though
    the process's own clock saw none."""
    import os

    import ettflow.ett.heartbeat as heartbeat

    jump = [0.0]
    real_utime = os.utime

    def stamped(path, times=None):  # the server's clock, ahead by `jump`
        now = time.time() + jump[0]
        real_utime(path, (now, now))

    monkeypatch.setattr(heartbeat.os, "utime", stamped)
    with RunHeartbeat(tmp_path, "hb", every_s=0.05) as beat:
        time.sleep(0.2)
        assert beat.lapse is None
        jump[0] = 20.0
        assert _wait_for(lambda: beat.lapse is not None)
        assert 20.0 <= beat.lapse.seconds < 21.0
