"""`ettflow refresh` killed with SIGKILL leaves nothing running and no RUNNING flow run.

The real command (`.venv/bin/ettflow refresh`) runs as a subprocess with its own ETTFLOW_HOME
and PREFECT_HOME (so it owns its Prefect database), tiny sizes, no compile, and windows of 625
steps, so that it is surely mid-training when the kill comes (a scripted hang made the
supervisor's case wait out the driver's `STOP_WAIT_S` for the hung rank's emergency checkpoint).
Two such commands run one after the other; once its spool shows a `train_step`, one process of
each gets SIGKILL:

- the supervisor (the `ettflow refresh` process): its worker notices, the run ends through
  Prefect's crash handling (CRASHED, the crash hook archives the row as ``crashed``) and the
  worker stops Ray and the ephemeral server before it exits;
- the worker (the child that runs the flow; this command runs with `--verbose`, which must
  show the third-party lines the default drops): the supervisor stops Ray's processes, marks
  the run CRASHED through the worker's still running server, stops it, and exits 137.

Either way, within `BOUND_S` of the kill, no process whose environment names that
ETTFLOW_HOME (every process the command starts inherits it) or that was below the command at
the kill is alive. The measured times are printed (`pytest -s`). These tests run in the same
pytest session as every other (what once took the session's Ray and Prefect harness down was
a test that stopped every descendant of pytest: integration/test_supervise_stop.py says so).
The pieces, pure: unit/test_supervise.py.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers.processes import alive, describe, processes_of
from helpers.spool import training_started
from helpers.waiting import wait_for

ETTFLOW = Path(sys.executable).parent / "ettflow"
BOUND_S = 30.0  # the worker's orderly crash may take SupervisorConfig.grace_s (20 s), then the stops
START_S = 240.0  # cold start on a busy 2-core machine: Prefect server, Ray, the trainer's init
# what `--verbose` shows and the default drops (TorchRec's planner, printed by the ranks before training)
THIRD_PARTY = re.compile(r"topology was constructed directly|is_fx_tracing")


def flow_runs(prefect_home: Path) -> list[tuple[str, str, str]]:
    """(id, state type, state message) of every flow run in the test's Prefect database."""
    with sqlite3.connect(prefect_home / "prefect.db") as db:
        return db.execute("SELECT fr.id, fr.state_type, s.message FROM flow_run fr "
                          "LEFT JOIN flow_run_state s ON s.id = fr.state_id").fetchall()


class Refresh:
    """One `ettflow refresh` process of its own ETTFLOW_HOME and PREFECT_HOME under `folder`,
    started at once; `kill` SIGKILLs one of its processes."""

    def __init__(self, folder: Path, data: Path, *extra: str, fail_at: str = "") -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.home, self.prefect_home = folder, folder / "home", folder / "prefect"
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PREFECT_API", "RAY_ADDRESS", "ETTFLOW_", "PREFECT__"))}
        env.update(ETTFLOW_HOME=str(self.home), PREFECT_HOME=str(self.prefect_home), RAY_USAGE_STATS_ENABLED="0",
                   PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180")
        self.log_path = folder / "refresh.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen(
            [str(ETTFLOW), "refresh", "--data-root", str(data), "--batch-size", "32", "--switch", "compile=false",
             *(["--fail-at", fail_at] if fail_at else ["--no-failure"]), "--param", "max_embeddings=100", *extra],
            env=env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.snapshot: list[psutil.Process] = []
        self.killed_at = 0.0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def training(self, *, shows: re.Pattern | None = None) -> bool:
        """Whether it trains (and its console shows `shows`); fails the test if it ended."""
        if self.proc.poll() is not None:
            pytest.fail(f"`ettflow refresh` exited ({self.proc.returncode}) before training:\n{self.log()[-4000:]}")
        return training_started(self.home / "spool") is not None and (shows is None or bool(shows.search(self.log())))

    def kill(self, target: int, signum: int = signal.SIGKILL) -> None:
        """Send `signum` to `target` (a process of this command's tree), noting the tree as it was."""
        self.snapshot = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        assert any("raylet" in " ".join(p.cmdline()) for p in self.snapshot), describe(self.snapshot)
        self.killed_at = time.monotonic()
        os.kill(target, signum)

    def left(self) -> list[psutil.Process]:
        self.proc.poll()  # reap the supervisor once it exits
        return alive(self.snapshot) + processes_of(self.home)


def wait_until_nothing_is_left(refreshes: list[Refresh]) -> list[float]:
    """Per refresh, the seconds from its kill until nothing of it was left (fails after BOUND_S)."""
    took: dict[int, float] = {}
    while len(took) < len(refreshes):
        for i, r in enumerate(refreshes):
            if i in took:
                continue
            left = r.left()
            if not left:
                took[i] = time.monotonic() - r.killed_at
            elif time.monotonic() - r.killed_at > BOUND_S:
                for p in left:
                    p.kill()
                pytest.fail(f"{len(left)} process(es) outlived the killed `ettflow refresh` by {BOUND_S:g} s:\n"
                            + "\n".join(describe(left)) + "\n" + r.log()[-4000:])
        time.sleep(0.1)
    for r in refreshes:
        r._log.close()
    return [took[i] for i in range(len(refreshes))]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_of_the_refresh_process_or_of_its_worker_leaves_nothing_running(tmp_path, long_data):
    # one command at a time: each kill's cleanup bound must hold on two busy cores
    command = Refresh(tmp_path / "command", long_data)
    wait_for(command.training, START_S, "`ettflow refresh` to start training", poll_s=0.3)
    command.kill(command.proc.pid)
    took = wait_until_nothing_is_left([command])
    worker_killed = Refresh(tmp_path / "worker", long_data, "--verbose")
    wait_for(lambda: worker_killed.training(shows=THIRD_PARTY), START_S,
             "`ettflow refresh --verbose` to start training and show TorchRec's planner lines", poll_s=0.3)
    (worker,) = [p for p in psutil.Process(worker_killed.proc.pid).children()
                 if p.cmdline()[1:3] == ["-m", "ettflow"]]  # the worker (flows/supervise.py)
    worker_killed.kill(worker.pid)
    took += wait_until_nothing_is_left([worker_killed])
    print(f"\nSIGKILL of `ettflow refresh`: no process left after {took[0]:.1f} s; "
          f"of its worker: {took[1]:.1f} s")

    # the command killed: its worker crashed the run and the crash hook archived it
    ((run_id, state, message),) = flow_runs(command.prefect_home)
    assert state == "CRASHED", (state, message)
    assert f"the `ettflow refresh` process (pid {command.proc.pid}) was killed" in message
    from ettflow.ett import lineage
    from ettflow.ett.warehouse import Warehouse
    from ettflow.tasks.claims import take_claim
    from ettflow.tasks.plan import plan_refresh

    with Warehouse.open(f"sqlite:///{command.home / 'warehouse.db'}") as wh:
        runs = wh.runs_frame(run_id=run_id)
        assert len(runs) == 1 and runs.iloc[0]["status"] == "crashed"
        # the very next refresh trains the same windows at once (issue 26 #1): archiving the crashed
        # run recorded it in the lineage and released its claims, no stale claim to wait out
        # (the flow records its refresh's end itself when the stop reaches it: failed; archiving, when it
        # never could: crashed)
        (record,) = lineage.lineage(wh, "dlrm")
        assert record.run_id == run_id and record.outcome.value in ("failed", "crashed") and record.windows
        following = plan_refresh({"data_root": str(long_data), "work_root": str(tmp_path / "next-work"),
                                  "spool_root": str(tmp_path / "next-spool"), "max_embeddings": 100,
                                  "snapshot_root": str(tmp_path / "next-snap"), "claim_wait_s": 0}, run_id="next")
        claim = take_claim(following, wh)
        assert claim.skipped is None and claim.plan.trainer.windows == record.windows, claim
    assert not THIRD_PARTY.search(command.log())  # the default console drops them

    # the worker killed: the command crashed the run through the worker's server and exited 137
    assert worker_killed.proc.wait(timeout=5) == 128 + signal.SIGKILL
    ((_, state, message),) = flow_runs(worker_killed.prefect_home)
    assert state == "CRASHED", (state, message)
    assert f"the refresh worker process (pid {worker.pid}) was killed by SIGKILL" in message
    assert "nothing it started is left running" in worker_killed.log()


@pytest.fixture(scope="module")
def long_data(tmp_path_factory):
    """Windows long enough (625 steps of 2 ranks x 32) that a stop lands mid-training."""
    from ettflow.trainer.data.synthetic import SyntheticConfig, generate_windows

    root = tmp_path_factory.mktemp("long-data")
    generate_windows(root, SyntheticConfig(windows=3, rows_per_window=20000, files_per_window=2, seed=3))
    return root


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_of_the_refresh_process_preempts_its_run_with_an_emergency_checkpoint(tmp_path, long_data):
    """Issue 26 #4: SIGTERM to `ettflow refresh` (a preempted CLI, a CI runner's timeout) is a
    preemption of its run: every rank takes an emergency checkpoint, the run's one failure is a
    `preemption` (before: NoF 2 with a bogus `user` failure "train raised SystemExit: 1", or a
    `SystemError` out of Ray's wait that restarted the run), the command exits 143 (before: its
    worker died by SIGABRT, 134) and nothing it started is left."""
    from ettflow.ett.warehouse import Warehouse
    from ettflow.trainer.checkpoint.delta import verify_delta
    from ettflow.trainer.checkpoint.layout import delta_dir, final_dir
    from ettflow.trainer.checkpoint.verify import verify

    from helpers.spool import events

    command = Refresh(tmp_path / "term", long_data)
    spool = command.home / "spool"
    wait_for(lambda: command.training() and training_started(spool, min_step=20) is not None, START_S,
             "`ettflow refresh` to train 20 steps", poll_s=0.2)
    command.kill(command.proc.pid, signal.SIGTERM)
    (took,) = wait_until_nothing_is_left([command])
    assert command.proc.wait(timeout=5) == 128 + signal.SIGTERM, command.log()[-4000:]
    print(f"\nSIGTERM of `ettflow refresh`: no process left after {took:.1f} s")
    ((run_id, state, message),) = flow_runs(command.prefect_home)
    assert state == "CRASHED", (state, message)
    # every rank preempted with an emergency checkpoint, committed and whole
    marks = events(spool, run_id, "failure", attempt=0)
    assert sorted(e.rank for e in marks) == [0, 1], marks
    assert all(e.attrs["failure_class"] == "preemption" and e.attrs.get("emergency_checkpoint") for e in marks), marks
    steps = {e.attrs.get("step") for e in marks}
    assert len(steps) == 1 and (step := steps.pop()) < 625, marks
    # the emergency save of that step, committed and whole: a full folder, or (delta checkpoints are in
    # the optimized preset since issue 44) a delta on the chain, whichever that save was
    root = next((command.home / "checkpoints").glob(f"*/runs/{run_id}/checkpoints"))
    found = [f for f in (final_dir(root, step), delta_dir(root, step)) if f.is_dir()]
    assert len(found) == 1, sorted(f.name for f in root.iterdir())
    (verify if found[0] == final_dir(root, step) else verify_delta)(found[0])
    # one failure, a preemption, the command's own stop
    with Warehouse.open(f"sqlite:///{command.home / 'warehouse.db'}") as wh:
        runs, failures = wh.runs_frame(run_id=run_id), wh.table_frame("failures", run_id)
    assert len(runs) == 1 and runs.iloc[0]["status"] == "crashed" and runs.iloc[0]["nof"] == 1
    assert list(failures["failure_class"]) == ["preemption"], failures[["failure_class", "reason"]]
    assert "preempted (SIGTERM)" in failures["reason"].iloc[0]  # the ranks' own words: they took the SIGTERM
    assert "SIGABRT" not in command.log() and "SystemError" not in command.log()
