"""`ettflow refresh` killed with SIGKILL leaves nothing running and no RUNNING flow run.

The real command (`.venv/bin/ettflow refresh`) runs as a subprocess with its own ETTFLOW_HOME
and PREFECT_HOME (so this test owns its Prefect database), tiny sizes, no compile, and a hang
at step 3 so that it is surely mid-training when the kill comes. Once the spool shows a
`train_step`, one process gets SIGKILL:

- the supervisor (the `ettflow refresh` process): its worker notices, the run ends through
  Prefect's crash handling (CRASHED, the crash hook archives the row as ``crashed``) and the
  worker stops Ray and the ephemeral server before it exits;
- the worker (the child that runs the flow): the supervisor stops Ray's processes, marks the
  run CRASHED through the worker's still running server, stops it, and exits 137.

Either way, within `BOUND_S` of the kill, no process whose environment names this
ETTFLOW_HOME (every process the command starts inherits it) or that was below the command at
the kill is alive. The measured time is printed (`pytest -s`).

The first tests are quick ones of the pieces (no Ray, no Prefect server).

`scripts/test.sh` runs this file (and tests/test_console.py, which also starts the real
command) in a pytest session of its own: in one full-suite run the session that also held the
shared Ray (`ray_session`) and Prefect harness exited with status 1 and no summary right after
these tests, while each file passes alone and with tests/test_secrets.py after it. The cause
is not found yet (a Ray driver exits with status 1 when its raylet dies); keeping the real
command's kills away from the shared session removes the exposure.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from processes import alive, describe, processes_of

ETTFLOW = Path(sys.executable).parent / "ettflow"
BOUND_S = 30.0  # the worker's orderly crash may take SupervisorConfig.grace_s (20 s), then the stops
START_S = 240.0  # cold start on a busy 2-core machine: Prefect server, Ray, the trainer's init


# ---- the pieces ------------------------------------------------------------------------------


def test_config_is_validated():
    from ettflow.flows.supervise import SupervisorConfig

    with pytest.raises(ValueError, match="grace_s must be > 0"):
        SupervisorConfig(grace_s=0)


def test_report_round_trip(tmp_path):
    from ettflow.flows.supervise import WorkerReport

    report = WorkerReport(api_url="http://127.0.0.1:1/api", server_pid=12, tag="refresh-process:ab")
    report.write(tmp_path / "worker.json")
    assert WorkerReport.read(tmp_path / "worker.json") == report
    assert WorkerReport.read(tmp_path / "absent.json") is None


def test_only_the_command_itself_supervises(monkeypatch):
    import argparse

    from ettflow.flows.supervise import SUPERVISOR_ENV, should_supervise

    monkeypatch.delenv(SUPERVISOR_ENV, raising=False)
    assert should_supervise(argparse.Namespace(argv=["refresh"]))
    assert not should_supervise(argparse.Namespace())  # called in-process (tests, other code)
    monkeypatch.setenv(SUPERVISOR_ENV, "1")
    assert not should_supervise(argparse.Namespace(argv=["refresh"]))  # the worker


def test_stop_processes_ends_a_tree_that_ignores_sigterm():
    from ettflow.flows.supervise import descendants, stop_processes

    code = "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
           "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    subprocess.Popen([sys.executable, "-c", code])
    while len(descendants()) < 2:
        time.sleep(0.05)
    tree = descendants()
    stop_processes(tree, stop_s=1.0)
    assert not alive(tree)  # the parent ignored SIGTERM: it got SIGKILL after stop_s


def test_zombie_automation_expects_the_next_heartbeat():
    from ettflow.flows.zombies import zombie_automation

    automation = zombie_automation(heartbeat_s=60)
    assert automation.trigger.after == {"prefect.flow-run.heartbeat"}
    assert "prefect.flow-run.heartbeat" in automation.trigger.expect
    assert automation.trigger.within.total_seconds() == 150
    assert automation.actions[0].state.value == "CRASHED"
    with pytest.raises(ValueError, match="at most every 30 s"):
        zombie_automation(heartbeat_s=10)


# ---- the real command ----------------------------------------------------------------------


def training_started(spool: Path) -> bool:
    for path in spool.glob("*/*.jsonl"):
        try:
            if '"train_step"' in path.read_text():
                return True
        except OSError:
            continue
    return False


def flow_runs(prefect_home: Path) -> list[tuple[str, str, str]]:
    """(id, state type, state message) of every flow run in the test's Prefect database."""
    with sqlite3.connect(prefect_home / "prefect.db") as db:
        return db.execute("SELECT fr.id, fr.state_type, s.message FROM flow_run fr "
                          "LEFT JOIN flow_run_state s ON s.id = fr.state_id").fetchall()


def start_refresh(tmp_path: Path, flow_data: Path) -> tuple[subprocess.Popen, Path, Path]:
    home, prefect_home = tmp_path / "home", tmp_path / "prefect"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_API", "RAY_ADDRESS", "ETTFLOW_", "PREFECT__"))}
    env.update(ETTFLOW_HOME=str(home), PREFECT_HOME=str(prefect_home), RAY_USAGE_STATS_ENABLED="0",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180")
    log = open(tmp_path / "refresh.log", "wb")  # noqa: SIM115 - closed with the test's tmp_path
    proc = subprocess.Popen(
        [str(ETTFLOW), "refresh", "--data-root", str(flow_data), "--batch-size", "32", "--switch", "compile=false",
         "--fail-at", "hang:rank=0:step=3", "--param", "max_embeddings=100"],
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + START_S
    while not training_started(home / "spool"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"`ettflow refresh` did not start training (exit {proc.poll()}):\n"
                        + (tmp_path / "refresh.log").read_text()[-4000:])
        time.sleep(0.3)
    return proc, home, prefect_home


def kill_and_wait(proc: subprocess.Popen, target: int, home: Path, tmp_path: Path) -> float:
    """SIGKILL `target`; seconds until nothing of the run is left (fails after BOUND_S)."""
    snapshot = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    assert any("raylet" in " ".join(p.cmdline()) for p in snapshot), describe(snapshot)
    killed_at = time.monotonic()
    os.kill(target, signal.SIGKILL)
    while True:
        proc.poll()  # reap the supervisor once it exits
        left = alive(snapshot) + processes_of(home)
        if not left:
            return time.monotonic() - killed_at
        if time.monotonic() - killed_at > BOUND_S:
            for p in left:
                p.kill()
            pytest.fail(f"{len(left)} process(es) outlived the killed `ettflow refresh` by {BOUND_S:g} s:\n"
                        + "\n".join(describe(left)) + "\n" + (tmp_path / "refresh.log").read_text()[-4000:])
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_of_the_refresh_process_leaves_nothing_running(tmp_path, flow_data):
    proc, home, prefect_home = start_refresh(tmp_path, flow_data)
    took = kill_and_wait(proc, proc.pid, home, tmp_path)
    print(f"\nSIGKILL of `ettflow refresh`: no process left after {took:.1f} s")
    ((run_id, state, message),) = flow_runs(prefect_home)
    assert state == "CRASHED", (state, message)
    assert f"the `ettflow refresh` process (pid {proc.pid}) was killed" in message
    from ettflow.ett.warehouse import Warehouse

    with Warehouse.open(f"sqlite:///{home / 'warehouse.db'}") as wh:  # the crash hook archived it
        runs = wh.runs_frame(run_id=run_id)
    assert len(runs) == 1 and runs.iloc[0]["status"] == "crashed"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_of_the_worker_leaves_nothing_running(tmp_path, flow_data):
    proc, home, prefect_home = start_refresh(tmp_path, flow_data)
    (worker,) = [p for p in psutil.Process(proc.pid).children() if "ettflow.flows.supervise" in p.cmdline()]
    took = kill_and_wait(proc, worker.pid, home, tmp_path)
    print(f"\nSIGKILL of the refresh worker: no process left after {took:.1f} s")
    assert proc.wait(timeout=5) == 128 + signal.SIGKILL
    ((_, state, message),) = flow_runs(prefect_home)
    assert state == "CRASHED", (state, message)
    assert f"the refresh worker process (pid {worker.pid}) was killed by SIGKILL" in message
    assert "nothing it started is left running" in (tmp_path / "refresh.log").read_text()
