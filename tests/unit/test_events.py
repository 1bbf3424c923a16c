"""Bad input is rejected with the field and the event named."""

import pytest

from ettflow.ett.events import EventError, PhaseEvent


def record(**over):
    base = {"run_id": "r1", "attempt": 0, "rank": 1, "phase": "device_init", "start": 1.0, "end": 2.0}
    base.update(over)
    return base


def test_end_before_start_names_field_and_event():
    pattern = r"field 'end' \(1.0\) is before 'start' \(2.0\).*run='r1'.*rank=1.*device_init"
    with pytest.raises(EventError, match=pattern):
        PhaseEvent.from_dict(record(start=2.0, end=1.0))


def test_unknown_phase_names_it():
    with pytest.raises(EventError, match=r"field 'phase' has unknown phase 'warp_drive'.*run='r1'"):
        PhaseEvent.from_dict(record(phase="warp_drive"))


def test_missing_field_names_it_and_the_event():
    rec = record()
    del rec["start"]
    with pytest.raises(EventError, match=r"field 'start' is missing in event .*'run_id': 'r1'.* at spool:7"):
        PhaseEvent.from_dict(rec, where="at spool:7")


def test_training_step_needs_its_cursors():
    with pytest.raises(EventError, match=r"field 'attrs.cursor_end' is missing"):
        PhaseEvent.from_dict(record(phase="train_step", attrs={"cursor_start": 0}))
    with pytest.raises(EventError, match=r"cursor_end' is before"):
        PhaseEvent.from_dict(record(phase="train_step", attrs={"cursor_start": [0, 2], "cursor_end": [0, 1]}))
    with pytest.raises(EventError, match=r"sequence of ints"):
        PhaseEvent.from_dict(record(phase="train_step", attrs={"cursor_start": "a", "cursor_end": 1}))


@pytest.mark.parametrize(
    "over, field",
    [({"attempt": "0"}, "attempt"), ({"start": float("nan")}, "start"), ({"run_id": ""}, "run_id"),
     ({"phase": "failure", "end": 3.0}, "end"), ({"attrs": [1]}, "attrs"),
     ({"phase": "failure", "end": 1.0, "attrs": {"failure_class": "cosmic"}}, "attrs.failure_class")],
)
def test_other_bad_fields(over, field):
    with pytest.raises(EventError, match=f"field '{field}'"):
        PhaseEvent.from_dict(record(**over))


def test_round_trip():
    attrs = {"cursor_start": [0, 1, 2], "cursor_end": [0, 1, 66]}
    ev = PhaseEvent.from_dict(record(phase="train_step", attrs=attrs, seq=4))
    assert PhaseEvent.from_dict(ev.to_dict()) == ev
    assert ev.cursor_end == (0, 1, 66) and ev.component is None and ev.duration == 1.0


def test_a_damaged_checkpoint_skipped_by_several_attempts_is_reported_once():
    from ettflow.ett.archive import fallback_tags
    from ettflow.ett.events import PhaseEvent

    def marker(attempt: int, start: float) -> PhaseEvent:
        return PhaseEvent(run_id="r", phase="checkpoint_fallback", start=start, end=start, attempt=attempt, rank=0,
                          attrs={"damaged_step": 15, "restored_step": 10, "file": "__0_0.distcp"})

    tags = fallback_tags([marker(2, 30.0), marker(1, 10.0)])
    assert tags == {"checkpoint_fallbacks": [{"attempt": 1, "damaged_step": 15, "restored_step": 10,
                                              "file": "__0_0.distcp", "steps_lost": 5}]}
    assert fallback_tags([]) == {}


def test_a_refused_compile_cache_archive_is_reported_once_at_the_runs_level():
    """Issue 26 #6: a damaged compile-cache archive was said only in forwarded Ray lines; the
    row's tags and the train task's log now carry each distinct refusal once."""
    from ettflow.ett.archive import cache_refusal_tags
    from ettflow.ett.events import PhaseEvent

    def restore(attempt: int, rank: int, miss: str | None, reason: str) -> PhaseEvent:
        return PhaseEvent(run_id="r", phase="compile_cache_restore", start=attempt + rank, end=attempt + rank + 0.5,
                          attempt=attempt, rank=rank, attrs={"hit": miss is None, "miss": miss, "reason": reason})

    bad = "archive dlrm.tar: sha256 does not match its manifest"
    tags = cache_refusal_tags([restore(1, 1, "unverified", bad), restore(0, 0, "no_archive", "no archive yet"),
                               restore(1, 0, "unverified", bad), restore(2, 0, None, "")])
    assert tags == {"compile_cache_refused": [{"attempt": 1, "rank": 0, "miss": "unverified", "reason": bad}]}
    assert cache_refusal_tags([restore(0, 0, "no_archive", "no archive yet")]) == {}
    # a pooled worker's prewarm refused it before the run (issue 42 #4): the rank it became reports it
    pooled = PhaseEvent(run_id="r", phase="compile_cache_restore", start=5.0, end=5.0, attempt=0, rank=1, attrs={
        "hit": False, "miss": "unreadable", "reason": "archive x.tar is unreadable", "pooled": True})
    assert cache_refusal_tags([pooled]) == {"compile_cache_refused": [
        {"attempt": 0, "rank": 1, "miss": "unreadable", "reason": "archive x.tar is unreadable", "pooled": True}]}
    # ... with what became of it: here another worker replaced it, and this one restored that
    restored = PhaseEvent(run_id="r", phase="compile_cache_restore", start=5.0, end=5.0, attempt=0, rank=1, attrs={
        **pooled.attrs, "repair": "restored_replacement"})
    assert cache_refusal_tags([restored])["compile_cache_refused"][0]["repair"] == "restored_replacement"


def test_the_run_says_what_became_of_a_damaged_archive_its_pooled_worker_met():
    """Each outcome of a pooled worker's repair has the train task's words, a record from before
    the outcome was kept reads as the one outcome there was then (replaced), and a value this
    version does not know is shown as it is."""
    from ettflow.tasks.trainer import POOLED_REPAIR, pooled_repair
    from ettflow.trainer.protocol import Repair

    assert set(POOLED_REPAIR) == {r.value for r in Repair}
    assert pooled_repair(None) == pooled_repair("replaced")
    assert pooled_repair("replaced").endswith("compiled cold before the run and replaced it")
    assert pooled_repair("restored_replacement").endswith("restored that before the run and compiled warm")
    assert pooled_repair("mended_by_elves") == "its pooled worker's repair: mended_by_elves"


def test_a_claims_lost_marker_is_read_back_and_moves_no_clock(tmp_path):
    """The marker a try that lost its claims leaves (`RunRecorder.mark_claims_lost`): a flow retry
    reads it (`run_spool.claims_lost`); it is off the clock, so the run's ETT is the same with it."""
    from ettflow.ett.run_metrics import compute_run_metrics
    from ettflow.ett.sample import write_sample_run
    from ettflow.ett.spool import read_spool
    from ettflow.tasks import run_spool

    write_sample_run(tmp_path, "r", seed=2, fail_at_step=None)
    recorder = run_spool.RunRecorder(tmp_path, "r")
    before = compute_run_metrics(read_spool(tmp_path, "r").events)
    assert run_spool.claims_lost(recorder.events()) is None
    recorder.mark_claims_lost("run r no longer holds its claims on model m's windows: ...", before.wall_end + 600)
    after = compute_run_metrics(read_spool(tmp_path, "r").events)
    assert (after.wall_s, after.ett_pct, after.nof) == (before.wall_s, before.ett_pct, before.nof)
    assert run_spool.claims_lost(recorder.events()).startswith("run r no longer holds its claims")
