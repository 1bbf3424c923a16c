"""The spool keeps everything recorded, even across a SIGKILL, and reports bad lines."""

import json
import os
import signal
import subprocess
import sys
import textwrap

from ettflow.ett.spool import SpoolWriter, read_spool, spool_file, spooled_runs


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


WRITER = textwrap.dedent(
    """
    import sys
    from ettflow.ett.spool import SpoolWriter
    w = SpoolWriter(sys.argv[1], "killed", 0, 0)
    i = 0
    while True:
        # odd events are fsynced lazily (group commit): a process kill must lose none either
        w.record("train_step", i, i + 1, sync=i % 2 == 0, cursor_start=i, cursor_end=i + 1, pad="x" * 3000)
        print(i, flush=True)
        i += 1
    """
)


def test_sigkill_loses_nothing_already_recorded(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    acknowledged = -1
    for line in proc.stdout:
        acknowledged = int(line)
        if acknowledged >= 200:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    got = read_spool(tmp_path, "killed")
    starts = [int(e.start) for e in got.events]
    assert starts == list(range(len(starts)))  # in order, no gaps, no duplicates
    assert len(starts) >= acknowledged + 1  # every acknowledged event is there
    assert all(p.torn for p in got.problems) and len(got.problems) <= 1
