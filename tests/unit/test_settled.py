"""The spool's settled index (`ett.settled`): entries, and every writer that takes a run out of it.
File-only."""

from __future__ import annotations

import os
import time

from ettflow.ett.archive import write_pending
from ettflow.ett.heartbeat import RunHeartbeat
from ettflow.ett.lineage import LineageRecord, Outcome
from ettflow.ett.lineage_pending import pending_lineage_runs, write_pending_lineage
from ettflow.ett.settled import SETTLED_DIR, fingerprint, settle, settled_runs, unsettle
from ettflow.ett.spool import SpoolWriter, spooled_runs
from ettflow.ett.warehouse import RunInfo


def spooled(root, run_id: str) -> None:
    with SpoolWriter(root, run_id, 0, -1) as w:
        w.mark("submitted", time.time())


def settled_both(root, run_id: str) -> None:
    """`run_id` settled for two warehouses (`a` and `b`)."""
    for key in ("a", "b"):
        assert settle(root, run_id, key, fingerprint(root, run_id))
    assert run_id in settled_runs(root, "a") and run_id in settled_runs(root, "b")


def out_of_both(root, run_id: str) -> bool:
    return run_id not in settled_runs(root, "a") and run_id not in settled_runs(root, "b")


def test_settle_unsettle_and_an_index_that_is_missing(tmp_path):
    assert settled_runs(tmp_path, "a") == frozenset()  # no index yet: every run is read
    unsettle(tmp_path, "r1")  # nothing to remove: no error
    spooled(tmp_path, "r1")
    spooled(tmp_path, "r2")
    settled_both(tmp_path, "r1")
    assert settled_runs(tmp_path, "a") == {"r1"}
    unsettle(tmp_path, "r1")
    assert out_of_both(tmp_path, "r1")
    # the index is no run: the spool's listings never see it
    assert (tmp_path / SETTLED_DIR).is_dir() and spooled_runs(tmp_path) == ["r1", "r2"]
    assert spooled_runs(tmp_path, skip={"r1"}) == ["r2"]


def test_an_entry_is_taken_back_when_the_run_changed_after_it_was_judged(tmp_path):
    """A writer that came between the caller's judgement and the entry (its own `unsettle` ran
    before the entry existed) is never hidden: the folder differs, and the entry goes."""
    spooled(tmp_path, "r")
    judged = fingerprint(tmp_path, "r")
    with SpoolWriter(tmp_path, "r", 1, 0) as w:  # a flow retry's rank, before the entry is written
        w.record("train_step", 1.0, 2.0, step=0, cursor_start=0, cursor_end=1)
    assert fingerprint(tmp_path, "r") != judged
    assert not settle(tmp_path, "r", "a", judged)
    assert "r" not in settled_runs(tmp_path, "a")
    # and a change the check sees only after the entry was written
    assert not settle(tmp_path, "r", "a", fingerprint(tmp_path, "r"), now_print=lambda: (("x", 1, 1),))
    assert "r" not in settled_runs(tmp_path, "a")


def test_a_spool_writer_takes_its_run_out_of_the_index_when_it_opens_and_when_it_closes(tmp_path):
    spooled(tmp_path, "r")
    settled_both(tmp_path, "r")
    w = SpoolWriter(tmp_path, "r", 1, 0)  # a retry's rank opens its file
    assert out_of_both(tmp_path, "r")
    settled_both(tmp_path, "r")  # settled meanwhile (a writer open since before its end)
    w.record("train_step", 1.0, 2.0, step=0, cursor_start=0, cursor_end=1)
    w.close()  # its late lines count: out again
    assert out_of_both(tmp_path, "r")


def test_the_heartbeat_takes_its_run_out_when_it_starts_and_when_it_ends(tmp_path):
    spooled(tmp_path, "r")
    settled_both(tmp_path, "r")
    beat = RunHeartbeat(tmp_path, "r", every_s=5.0)
    beat.__enter__()  # a flow retry reopens the run
    assert out_of_both(tmp_path, "r")
    settled_both(tmp_path, "r")
    beat.__exit__(None, None, None)  # its end changes its status
    assert out_of_both(tmp_path, "r")


def test_a_lapse_takes_its_run_out(tmp_path):
    """A process that stood still (it may have been taken for dead and archived crashed, then
    settled) takes its run out at its next beat: what it does from there changes its row."""
    spooled(tmp_path, "r")
    with RunHeartbeat(tmp_path, "r", every_s=0.05) as beat:
        settled_both(tmp_path, "r")
        beat._written -= 60.0  # the beat before was written a minute ago: a lapse at the next beat
        deadline = time.monotonic() + 10
        while not out_of_both(tmp_path, "r") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert out_of_both(tmp_path, "r") and beat.lapse is not None


def test_marks_that_wait_for_the_warehouse_take_their_run_out(tmp_path):
    spooled(tmp_path, "r")
    settled_both(tmp_path, "r")
    write_pending(tmp_path, RunInfo(run_id="r", model="m", mode="optimized", status="completed"), "down")
    assert out_of_both(tmp_path, "r")
    settled_both(tmp_path, "r")
    write_pending_lineage(tmp_path, LineageRecord(model="m", run_id="r", windows=("w1",), outcome=Outcome.PUBLISHED,
                                                  created_at=time.time()))
    assert out_of_both(tmp_path, "r")
    assert pending_lineage_runs(tmp_path) == ["r"]
    assert pending_lineage_runs(tmp_path, skip={"r"}) == []


def test_an_entry_that_cannot_be_written_leaves_the_run_to_be_read(tmp_path):
    spooled(tmp_path, "r")
    (tmp_path / SETTLED_DIR).write_text("not a folder")
    assert not settle(tmp_path, "r", "a", fingerprint(tmp_path, "r"))
    assert settled_runs(tmp_path, "a") == frozenset()
    unsettle(tmp_path, "r")  # never raises


def test_fingerprint_names_every_file_with_its_size_and_mtime(tmp_path):
    spooled(tmp_path, "r")
    before = fingerprint(tmp_path, "r")
    assert [name for name, *_ in before] == ["attempt-000.driver.jsonl"]
    os.utime(tmp_path / "r" / "attempt-000.driver.jsonl", ns=(1, 1))
    assert fingerprint(tmp_path, "r") != before
    assert fingerprint(tmp_path, "missing") == ()
