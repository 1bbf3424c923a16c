"""The spool keeps everything recorded across a SIGKILL of the process writing it."""

import os
import signal
import subprocess
import sys
import textwrap

from ettflow.ett.spool import read_spool

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
