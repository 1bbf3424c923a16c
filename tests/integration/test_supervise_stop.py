"""Stopping a process tree that ignores SIGTERM (`ettflow.flows.supervise.stop_processes`)."""

from __future__ import annotations

import subprocess
import sys
import time

from helpers.processes import alive


def test_stop_processes_ends_a_tree_that_ignores_sigterm():
    from ettflow.flows.supervise import descendants, stop_processes

    code = "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
           "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", code])
    started = {parent.pid}
    # only the tree this test started: `descendants()` of the pytest process also lists the
    # session's Ray and the Prefect harness's server, which stopping them would take down for
    # every later test (what once made the refresh-process tests need a pytest session of their own)
    while len(tree := [p for p in descendants() if p.pid in started or p.ppid() in started]) < 2:
        time.sleep(0.05)
    assert {p.pid for p in descendants(but=[parent.pid])}.isdisjoint({parent.pid})
    stop_processes(tree, stop_s=1.0)
    parent.wait(timeout=10)
    assert not alive(tree)  # the parent ignored SIGTERM: it got SIGKILL after stop_s
