"""`down` finds what a service left to init by the service's session (`records.session_processes`):
a process whose parent exited is no longer in the service's tree, and one that retitles itself
(Ray's agents) hides its environment, but it keeps its session."""

import os
import subprocess

import psutil

from ettflow.flows.supervise import stop_processes
from ettflow.stack.records import session_processes

from helpers.waiting import wait_for


def test_a_process_left_to_init_is_still_found_by_its_services_session(tmp_path):
    pid_file = tmp_path / "orphan.pid"
    # the service: a session of its own (as `up` starts each); its child starts a grandchild and
    # exits at once, so the grandchild is re-parented to init, out of the service's tree
    leader = subprocess.Popen(["bash", "-c", f"(sleep 300 & echo $! > {pid_file}); exec sleep 300"],
                              start_new_session=True)
    try:
        wait_for(lambda: pid_file.is_file() and pid_file.read_text().strip(), 10, "the grandchild to start")
        orphan = psutil.Process(int(pid_file.read_text()))
        service = psutil.Process(leader.pid)
        # its parent, the subshell, exits: the grandchild goes to init, out of the service's tree
        wait_for(lambda: orphan not in service.children(recursive=True), 10, "the grandchild to leave the tree")
        assert {p.pid for p in session_processes(leader.pid)} == {leader.pid, orphan.pid}
        stop_processes([service], 5)  # the service alone, as its tree was
        leader.wait(5)
        assert [p.pid for p in session_processes(leader.pid)] == [orphan.pid]  # it outlived its service
        stop_processes(session_processes(leader.pid), 5)
        assert not orphan.is_running() or orphan.status() == psutil.STATUS_ZOMBIE
        assert session_processes(leader.pid) == []
    finally:
        leader.kill()
        if pid_file.is_file():
            try:
                os.kill(int(pid_file.read_text()), 9)
            except (ProcessLookupError, ValueError):
                pass
