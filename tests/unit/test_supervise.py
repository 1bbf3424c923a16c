"""`ettflow refresh`'s supervision, pure: its config, the worker's report, who supervises, and the
zombie automation (the real command killed: e2e/test_refresh_process.py; stopping a process
tree: integration/test_supervise_stop.py)."""

from __future__ import annotations

import pytest


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


def test_zombie_automation_expects_the_next_heartbeat():
    from ettflow.flows.zombies import zombie_automation

    automation = zombie_automation(heartbeat_s=60)
    assert automation.trigger.after == {"prefect.flow-run.heartbeat"}
    assert "prefect.flow-run.heartbeat" in automation.trigger.expect
    assert automation.trigger.within.total_seconds() == 150
    # a refresh's final-state hook sends this after its last heartbeat: a heartbeat that reached the
    # server after Prefect's own Completed event no longer leaves the automation waiting (issue 27)
    assert {"prefect.flow-run.Completed", "ettflow.flow-run.finished"} <= automation.trigger.expect
    assert automation.actions[0].state.value == "CRASHED"
    with pytest.raises(ValueError, match="at most every 30 s"):
        zombie_automation(heartbeat_s=10)
