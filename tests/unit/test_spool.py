"""The spool keeps everything recorded, reports bad lines, and on a full disk raises a typed
storage error without ever truncating what it had. (Across a SIGKILL of the writing process:
tests/integration/test_spool_kill.py.)"""

import errno
import json
import os
import pickle
import threading

import pytest

from ettflow.ett import spool as spool_mod
from ettflow.ett.failures import FailureClass, FailureError
from ettflow.ett.spool import (
    SpoolWriteError,
    SpoolWriter,
    kept_events,
    read_spool,
    spool_bytes,
    spool_file,
    spooled_runs,
    write_kept,
)


def test_write_and_read_back(tmp_path):
    with SpoolWriter(tmp_path, "r1", 0, 0) as w:
        w.record("device_init", 1.0, 2.0)
        with w.span("pt2_compile", fast_batch=True) as attrs:
            attrs["recompiles"] = 0
        w.mark("failure", 5.0, failure_class="user")
    with SpoolWriter(tmp_path, "r1", 0, -1) as d:
        d.record("scheduling", 0.0, 1.0)
    got = read_spool(tmp_path, "r1")
    assert got.problems == []
    # ordered by start time; the span started at the wall clock's now, after the others
    assert [e.phase for e in got.events] == ["scheduling", "device_init", "failure", "pt2_compile"]
    compile_ev = next(e for e in got.events if e.phase == "pt2_compile")
    assert compile_ev.attrs == {"fast_batch": True, "recompiles": 0} and compile_ev.seq == 1
    assert spooled_runs(tmp_path) == ["r1"]


def test_reading_only_some_phases_skips_the_rest_but_never_one_of_them(tmp_path):
    with SpoolWriter(tmp_path, "r1", 0, 0) as w:
        for step in range(50):  # (the note names a wanted phase: decoded, then dropped)
            w.record("data_stall", step, step + 1, step=step, note="failure")
        w.mark("failure", 20.5, failure_class="infrastructure")
        w.mark("fault_injected", 3.0, fault_index=0)
    with open(tmp_path / "r1" / "attempt-001.driver.jsonl", "w") as f:  # another writer's spacing
        f.write(json.dumps({"run_id": "r1", "attempt": 1, "rank": -1, "phase": "failure", "start": 30.0,
                            "end": 30.0, "attrs": {}}, indent=None, separators=(", ", ": ")) + "\n")
    got = read_spool(tmp_path, "r1", phases=frozenset({"failure", "fault_injected"}))
    assert [(e.phase, e.start) for e in got.events] == [("fault_injected", 3.0), ("failure", 20.5), ("failure", 30.0)]
    assert got.problems == [] and len(read_spool(tmp_path, "r1").events) == 53


def test_torn_last_line_and_corrupt_line_are_reported_rest_kept(tmp_path):
    with SpoolWriter(tmp_path, "r2", 1, 0) as w:
        for i in range(4):
            w.record("device_init", i, i + 0.5)
    path = spool_file(tmp_path, "r2", 1, 0)
    lines = path.read_bytes().split(b"\n")
    lines[1] = b'{"run_id": "r2", "attempt": 1, "ra'  # corrupt in the middle
    data = b"\n".join(lines[:4]) + b"\n" + lines[3][:20]  # torn tail: a write cut short
    path.write_bytes(data)
    got = read_spool(tmp_path, "r2")
    assert [e.start for e in got.events] == [0, 2, 3]
    assert [(p.line, p.torn) for p in got.problems] == [(2, False), (5, True)]
    assert str(got.problems[0]).startswith(f"{path}:2: corrupt line: not valid JSON")
    # appending after a torn line keeps both the new line and the sequence numbers intact
    with SpoolWriter(tmp_path, "r2", 1, 0) as w:
        ev = w.record("pre_train", 9, 10)
    assert ev.seq == 5
    again = read_spool(tmp_path, "r2")
    assert [e.start for e in again.events] == [0, 2, 3, 9] and len(again.problems) == 2


def test_invalid_event_line_names_file_line_and_field(tmp_path):
    path = spool_file(tmp_path, "r3", 0, 0)
    path.parent.mkdir(parents=True)
    good = {"run_id": "r3", "attempt": 0, "rank": 0, "phase": "device_init", "start": 1, "end": 2, "seq": 0}
    bad = dict(good, phase="teleport", seq=1)
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    got = read_spool(tmp_path, "r3")
    assert len(got.events) == 1
    (problem,) = got.problems
    assert problem.line == 2 and "unknown phase 'teleport'" in problem.message and str(path) in problem.message


# -- a full disk: typed storage errors, nothing truncated -------------------------------------

def _full_disk_after(monkeypatch, nbytes: int):
    """os.write writes `nbytes` more bytes in all, then fails with ENOSPC (a short write first)."""
    real = os.write
    left = {"n": nbytes}

    def write(fd, data):
        if left["n"] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = real(fd, bytes(data)[: left["n"]])
        left["n"] -= n
        return n

    monkeypatch.setattr(spool_mod.os, "write", write)


def test_enospc_is_a_typed_storage_error_and_never_truncates(tmp_path, monkeypatch):
    with SpoolWriter(tmp_path, "full", 0, 0) as w:
        for i in range(3):
            w.record("device_init", i, i + 0.5)
    path = spool_file(tmp_path, "full", 0, 0)
    before = path.read_bytes()
    _full_disk_after(monkeypatch, 10)  # the next line is cut after 10 bytes
    w = SpoolWriter(tmp_path, "full", 0, 0)  # reopening an existing file keeps it whole
    with pytest.raises(SpoolWriteError) as err:
        w.record("device_init", 3, 3.5)
    exc = err.value
    assert isinstance(exc, OSError) and isinstance(exc, FailureError)
    assert exc.errno == errno.ENOSPC and exc.filename == str(path)
    assert exc.failure.failure_class is FailureClass.STORAGE and exc.failure.path == str(path)
    assert str(path) in str(exc) and "No space left" in str(exc)
    back = pickle.loads(pickle.dumps(exc))  # crosses Ray with its errno, path and failure
    assert (back.errno, back.filename, back.failure) == (exc.errno, exc.filename, exc.failure)
    with pytest.raises(SpoolWriteError):  # still full
        w.record("device_init", 4, 4.5)
    # the refused events are kept by this process: its readers see them, under the sequence
    # numbers they will have (the cut line is ended and counted first)
    kept = kept_events(tmp_path, "full")
    assert [(e.start, e.seq) for e in kept] == [(3, 4), (4, 5)]
    assert read_spool(tmp_path, "full").kept == 2
    monkeypatch.undo()  # space is back: the next write writes the kept ones first, in order
    w.record("device_init", 5, 5.5)
    w.close()
    assert kept_events(tmp_path, "full") == []
    data = path.read_bytes()
    assert data.startswith(before) and len(data) > len(before)  # what it had is all there
    got = read_spool(tmp_path, "full")
    assert [e.start for e in got.events] == [0, 1, 2, 3, 4, 5] and got.kept == 0
    assert [e.seq for e in got.events if e.start in (3, 4)] == [4, 5]  # as promised while kept
    assert [(p.line, p.torn) for p in got.problems] == [(4, False)]  # the cut line, named
    assert got.bytes == spool_bytes(tmp_path, "full") == len(data)


def test_events_refused_from_the_first_are_kept_read_and_written_once_there_is_room(tmp_path, monkeypatch):
    """A run whose very first events found the disk full (its file could not even be created):
    its process still reads them, `write_kept` writes them once there is room, and a writer of
    another file of the run is not affected."""
    def no_room(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(spool_mod.os, "open", no_room)
    w = SpoolWriter(tmp_path, "first", 0, -1)  # the file cannot be created: the first record says so
    for t in (1.0, 2.0):
        with pytest.raises(SpoolWriteError) as err:
            w.mark("submitted", t)
        assert err.value.errno == errno.ENOSPC and err.value.filename.endswith("attempt-000.driver.jsonl")
    got = read_spool(tmp_path, "first")
    assert [(e.phase, e.start, e.seq) for e in got.events] == [("submitted", 1.0, 0), ("submitted", 2.0, 1)]
    assert write_kept(tmp_path, "first") == 2  # still no room: still kept
    monkeypatch.undo()
    assert write_kept(tmp_path, "first") == 0
    w.close()
    on_disk = read_spool(tmp_path, "first")
    assert [(e.start, e.seq) for e in on_disk.events] == [(1.0, 0), (2.0, 1)] and on_disk.kept == 0
    assert write_kept(tmp_path, "first") == 0  # nothing twice
    assert len(read_spool(tmp_path, "first").events) == 2


def test_a_new_file_on_a_full_disk_raises_a_storage_error(tmp_path, monkeypatch):
    def no_inode(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(spool_mod.os, "open", no_inode)
    w = SpoolWriter(tmp_path, "r", 1, 0)
    with pytest.raises(SpoolWriteError) as err:
        w.record("device_init", 0, 1)
    assert err.value.errno == errno.ENOSPC and err.value.filename.endswith("attempt-001.rank-0.jsonl")
    monkeypatch.undo()
    w.close()
    assert write_kept(tmp_path, "r") == 0


def test_group_commit_fsync_error_surfaces_on_the_next_record(tmp_path, monkeypatch):
    w = SpoolWriter(tmp_path, "eio", 0, 0, lazy_fsync_s=0.01)
    w.record("device_init", 0, 1)  # fsynced at once
    failed = threading.Event()

    def fsync(fd):
        failed.set()
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(spool_mod.os, "fsync", fsync)
    w.record("train_step", 1, 2, sync=False, cursor_start=0, cursor_end=1)  # the thread fsyncs it
    assert failed.wait(30)
    w._flusher.join(30)  # the thread stopped on the error
    with pytest.raises(SpoolWriteError) as err:
        w.record("train_step", 2, 3, sync=False, cursor_start=1, cursor_end=2)
    assert err.value.errno == errno.EIO and err.value.failure.failure_class is FailureClass.STORAGE
    monkeypatch.undo()
    w.close()
    assert [e.start for e in read_spool(tmp_path, "eio").events] == [0, 1]
