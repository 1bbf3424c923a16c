"""Fault-matrix case 3 on the deployed path: a deployment run whose flow process is SIGKILLed
mid-training (a real `prefect server`, a process worker, the flow process's own local Ray):
Prefect marks it CRASHED, `on_crashed` records an `orchestrator` failure in the row, closes the
task runs it left open, and the trainer actors and the flow process's Ray die with their owner.

It asserts the outcome and its message, that every spooled event is in the warehouse, the row
(status, NoF, failure class, components summing to wall), and that no process of the run is
left. Measured times are printed (`pytest -s`). (Case 4, the warehouse lost mid-run:
e2e/test_warehouse_outage.py.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time

import httpx
import psutil
import pytest

from ettflow.ett.spool import read_spool
from ettflow.tasks.parameters import RefreshParameters

from helpers.flows import PLAIN, TINY, assert_components_sum_to_wall, warehouse_row
from helpers.prefect_cli import POOL, PREFECT, REPO, prefect
from helpers.processes import alive, describe, processes_of, trainer_actors
from helpers.spool import training_started
from helpers.stack import deployed_worker
from helpers.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

START_S = 240.0  # a cold start on a busy 2-core machine (worker, flow process, trainer init)
BOUND_S = 60.0  # kill -> CRASHED, the row, the actors gone
# the flow process's Ray gone: Ray's agents see their raylet die at once, but an unexpected death
# (the SIGKILL's) is first reported to the GCS, which died with it, and Ray 2.60 waits a hard-coded
# 60 s on that call (`process_watcher.report_raylet_error_logs` -> `publish_error_to_driver(..., 60)`)
# before the agent exits: CI saw both agents exit 61 s after their raylet
RAY_AGENTS_S = 60.0 + 30.0


# ---- case 3: a crashed deployed run ------------------------------------------------------------


def flow_run_process(worker: psutil.Process, flow_run_id: str) -> psutil.Process | None:
    """The worker's child that runs the flow run: the topmost descendant whose environment
    names the flow run (Prefect passes PREFECT__FLOW_RUN_ID to it)."""
    runs = []
    for p in worker.children(recursive=True):
        try:
            if p.environ().get("PREFECT__FLOW_RUN_ID") == flow_run_id:
                runs.append(p)
        except psutil.Error:
            continue
    pids = {p.pid for p in runs}
    top = [p for p in runs if p.ppid() not in pids]
    return top[0] if top else None


def left_of_run(started: list[psutil.Process], home, worker: subprocess.Popen) -> list[psutil.Process]:
    """The killed flow process's own (the processes it started: its Ray), still running. The
    worker's live descendants are not: the flow process is dead, so what is below the worker now
    is its crash handling, which `worker.wait` waits for next."""
    try:
        handling = {p.pid for p in psutil.Process(worker.pid).children(recursive=True)} | {worker.pid}
    except psutil.Error:
        handling = {worker.pid}
    seen, left = set(), []
    for p in alive(started) + processes_of(home):
        if p.pid not in handling and p.pid not in seen:
            seen.add(p.pid)
            left.append(p)
    return left


def api_state(api: str, flow_run_id: str) -> dict:
    return httpx.get(f"{api}/flow_runs/{flow_run_id}", timeout=10).json()


def task_runs(api: str, flow_run_id: str) -> list[dict]:
    body = {"task_runs": {"flow_run_id": {"any_": [flow_run_id]}}}
    return httpx.post(f"{api}/task_runs/filter", json=body, timeout=10).json()


def test_a_killed_deployed_flow_run_is_crashed_with_an_orchestrator_failure(
        prefect_server, tmp_path, flow_data, flow_work_root):
    env, api = prefect_server  # conftest: the server, with prefect.yaml's work pool created
    shutil.copy(REPO / "prefect.yaml", tmp_path / "prefect.yaml")
    prefect(env, "--no-prompt", "deploy", "--all", "--prefect-file", str(tmp_path / "prefect.yaml"))
    warehouse, spool = f"sqlite:///{tmp_path / 'warehouse.db'}", tmp_path / "spool"
    params = {"data_root": str(flow_data), "architecture": TINY, "max_embeddings": 100, "world_size": 2,
              "batch_size": 32, "max_steps": 60, "checkpoint_every_steps": 10, "eval_batches": 2,
              "switches": PLAIN, "work_root": str(flow_work_root),
              "snapshot_root": str(tmp_path / "snapshots"), "spool_root": str(spool), "warehouse_url": warehouse}
    nested = RefreshParameters.parse(params).to_json()  # the flow's sections, as the run form sends them
    out = prefect(env, "deployment", "run", "refresh-model/refresh-adhoc", "--params", json.dumps(nested))
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)
    # the flow process starts (and owns) its own local Ray, as on a worker without RAY_ADDRESS;
    # every process it starts inherits ETTFLOW_HOME, which finds them afterwards
    home = tmp_path / "home"
    worker_env = {**{k: v for k, v in env.items() if k != "RAY_ADDRESS"}, "ETTFLOW_HOME": str(home)}
    log = open(tmp_path / "worker.log", "wb")  # noqa: SIM115 - closed below
    worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", POOL, "--type", "process",
                               "--run-once", "--limit", "1"], env=worker_env, cwd=REPO, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: training_started(spool, flow_run_id) or worker.poll() is not None, START_S,
                 "the deployed run to start training")
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-4000:]
        target = wait_for(lambda: flow_run_process(psutil.Process(worker.pid), flow_run_id), 10,
                          "the worker's flow-run process")
        actors = wait_for(lambda: trainer_actors(home), 30, "the trainer actors")
        started = [p for p in processes_of(home) if p.pid != worker.pid]  # the flow process, its Ray
        assert any("raylet" in " ".join(p.cmdline()) for p in started), describe(started)
        assert api_state(api, flow_run_id)["state_type"] == "RUNNING"

        killed = time.monotonic()
        os.kill(target.pid, signal.SIGKILL)
        crashed = wait_for(lambda: api_state(api, flow_run_id)["state_type"] == "CRASHED" and time.monotonic(),
                           BOUND_S, "the flow run to be CRASHED", poll_s=0.05)
        actors_gone = wait_for(lambda: not alive(actors) and time.monotonic(), BOUND_S,
                               "the trainer actors to die with their flow process")
        ray_gone = wait_for(lambda: not left_of_run(started, home, worker) and time.monotonic(), RAY_AGENTS_S,
                            "the flow process's Ray to stop",
                            detail=lambda: describe(left_of_run(started, home, worker)))
        worker.wait(timeout=BOUND_S)  # --run-once: it exits once the crash is handled (hooks included)
        archived = time.monotonic()
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
        log.close()
    print(f"\ncase 3: kill -> CRASHED {crashed - killed:.1f} s; trainer actors gone {actors_gone - killed:.1f} s; "
          f"its Ray gone {ray_gone - killed:.1f} s; "
          f"worker done (row written) {archived - killed:.1f} s")
    worker_log = (tmp_path / "worker.log").read_text()

    # the outcome and its message, through the API
    state = api_state(api, flow_run_id)["state"]
    assert state["type"] == "CRASHED", state
    assert "-9" in state["message"] or "SIGKILL" in state["message"], state["message"]
    # the crashed state tells the ETT (the hook set it again with the message), the numbers first, then
    # the crash's reason once (the orchestrator failure repeats it, so it is not named again: issue 27)
    crashed_message = r"ETT \d+\.\d% · NoF \d+ · TTS \d+\.\d s · crashed: "
    assert re.match(crashed_message, state["message"]), state["message"]
    # the train task does not stay Running: the hook closed the task runs the dead process left open
    tasks = task_runs(api, flow_run_id)
    assert not [t["name"] for t in tasks if t["state_type"] in ("RUNNING", "PENDING", "SCHEDULED")], tasks
    (train,) = [t for t in tasks if t["name"].startswith("train-")]
    assert train["state_type"] == "CRASHED"

    # the row: crashed, the orchestrator failure counted, nothing spooled missing, the partition exact
    row, events, failures = warehouse_row(warehouse, flow_run_id)
    assert row is not None, worker_log[-4000:]
    assert row["status"] == "crashed" and row["nof"] >= 1, row.to_dict()
    assert "orchestrator" in set(failures["failure_class"]), failures
    marks = events[events["phase"].isin(["failure", "failure_detected"])]
    assert any(a.get("detection") == "prefect_crashed" for a in marks["attrs"])  # the timeline has it
    assert len(events) == len(read_spool(spool, flow_run_id).events)
    assert row["effective_steps"] >= 1
    assert_components_sum_to_wall(row)
    assert f"run {flow_run_id} crashed: orchestrator failure recorded" in worker_log
    found = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}).json()
    assert "ett-timeline-refresh-adhoc" in {a["key"] for a in found}
    # nothing of the run is left: its trainer actors are gone, and so are their placement groups
    assert not alive(actors) and not trainer_actors(home)
    assert not processes_of(home), describe(processes_of(home))


# ---- issue 42 #6: a deployed run cancelled by its operator ------------------------------------


def test_a_cancelled_deployed_run_is_the_operators_stop_not_a_failure(prefect_server, tmp_path, flow_work_root):
    """Cancel (the UI's or CLI's: the run set CANCELLING) while a deployment run trains: its
    ranks take their emergency checkpoints as for a preemption, but the stop is the operator's:
    an `operator_stop` marker, no failure (NoF 0, nothing in the failure history), the run's
    row archived as cancelled, Prefect's state final. Then, on the same worker, a stop while a
    run publishes (`_stopped_while_publishing`), and a kill (`_killed_while_publishing`)."""
    from ettflow.trainer.data.synthetic import SyntheticConfig, generate_windows

    env, api = prefect_server
    shutil.copy(REPO / "prefect.yaml", tmp_path / "prefect.yaml")
    prefect(env, "--no-prompt", "deploy", "--all", "--prefect-file", str(tmp_path / "prefect.yaml"))
    warehouse, spool = f"sqlite:///{tmp_path / 'warehouse.db'}", tmp_path / "spool"
    data = tmp_path / "data"  # 2 x 3,000 steps of 2 ranks x 32: still training when the cancel comes
    generate_windows(data, SyntheticConfig(windows=3, rows_per_window=192_000, files_per_window=2, seed=3))
    params = {"data_root": str(data), "architecture": TINY, "max_embeddings": 100, "world_size": 2,
              "batch_size": 32, "max_steps": 100_000, "checkpoint_every_steps": 50, "eval_batches": 2,
              "switches": PLAIN, "work_root": str(flow_work_root),
              "snapshot_root": str(tmp_path / "snapshots"), "spool_root": str(spool), "warehouse_url": warehouse}
    nested = RefreshParameters.parse(params).to_json()
    out = prefect(env, "deployment", "run", "refresh-model/refresh-adhoc", "--params", json.dumps(nested))
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)
    home = tmp_path / "home"
    # the deployed path: a Ray of its own (as `ettflow up` runs it), outside the flow's process
    # group. A flow process's own local Ray is in that group, and a cancel's SIGTERM of the group
    # stops its raylet, which kills the ranks before they can mark their stop (CI saw no markers)
    with deployed_worker(env, home, tmp_path / "worker.log") as (_, worker):
        wait_for(lambda: training_started(spool, flow_run_id) or worker.poll() is not None, START_S,
                 "the deployed run to start training")
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-4000:]
        asked = time.monotonic()
        prefect(env, "flow-run", "cancel", flow_run_id)  # what the UI's Cancel does: the run set CANCELLING
        wait_for(lambda: api_state(api, flow_run_id)["state_type"] == "CANCELLED", BOUND_S + 60,
                 "the flow run to be CANCELLED", poll_s=0.2)
        wait_for(lambda: warehouse_row(warehouse, flow_run_id)[0] is not None, BOUND_S, "the run's row")
        done = time.monotonic()
        # the final state keeps the run's ETT message (NoF 0), set again over the runner's own
        wait_for(lambda: re.match(r"ETT \d+\.\d% · NoF 0 · ",
                                  api_state(api, flow_run_id)["state"]["message"] or ""),
                 30, "the cancelled state to carry the run's ETT message", poll_s=0.5)
        _stopped_while_publishing(env, api, params, warehouse, spool)
        worker_log = (tmp_path / "worker.log").read_text()  # before the kill below, which the worker reports
        _killed_while_publishing(env, api, params, warehouse, spool, worker)
    print(f"\ncancel -> CANCELLED and the row: {done - asked:.1f} s")
    row, events, failures = warehouse_row(warehouse, flow_run_id)
    assert row["status"] == "cancelled", row.to_dict()
    assert row["nof"] == 0 and failures.empty, failures.to_dict("records")  # no failure: the budget, the history
    stops = events[events["phase"] == "operator_stop"]
    assert len(stops) == 1 and "cancelled by an operator" in stops["attrs"].iloc[0]["reason"], worker_log[-4000:]
    # the ranks were still preempted as by a scheduler, after the operator's stop (their markers are
    # the stop's, not failures); a rank that named an emergency checkpoint saved it (whether one is
    # taken depends on where the SIGTERM finds the step: e2e/test_refresh_process.py covers it)
    marks = events[events["phase"] == "failure"]
    assert sorted(a["failure_class"] for a in marks["attrs"]) == ["preemption", "preemption"], marks
    emergency = {int(a["emergency_checkpoint"]) for a in marks["attrs"] if a.get("emergency_checkpoint")}
    saved = events[events["phase"] == "checkpoint_save_blocking"]
    assert all(len(saved[[a.get("step") == step for a in saved["attrs"]]]) == 2 for step in emergency), marks
    assert api_state(api, flow_run_id)["state_type"] == "CANCELLED"
    assert "exited due to a SIGKILL" not in worker_log, worker_log[-3000:]  # it ended on its SIGTERM
    assert row["effective_steps"] >= 1
    assert_components_sum_to_wall(row)
    _the_cancelled_run_in_the_browser(api, flow_run_id, tmp_path)


def _deployment_run(env: dict, params: dict) -> str:
    out = prefect(env, "deployment", "run", "refresh-model/refresh-adhoc", "--params",
                  json.dumps(RefreshParameters.parse(params).to_json()))
    return re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)


def _stopped_while_publishing(env: dict, api: str, params: dict, warehouse: str, spool) -> None:
    """Issue 42 #2 on the deployed path: `ettflow down` (its first step, `cancel_running`, on the
    worker's pool) stops a run while it publishes, its anchor sealed: the run is cancelled, its
    row archived with its training, its lineage names the anchor; the next refresh of the same
    windows publishes that anchor instead of training them again (no reservation, no step)."""
    from ettflow.ett.lineage import Outcome
    from ettflow.ett.warehouse import Warehouse
    from ettflow.stack.deployed_runs import cancel_running

    short = {**params, "max_steps": 20, "checkpoint_every_steps": 10, "max_windows": 1}  # the next window: its own
    stopped = _deployment_run(env, {**short, "fail_at": ["publish:slow_s=300"]})

    def publishing() -> bool:
        return any(t["name"].startswith("publish-snapshot") and t["state_type"] == "RUNNING"
                   for t in task_runs(api, stopped))

    wait_for(publishing, START_S, "the run to publish (a slow snapshot store: 300 s a try)")
    said: list[str] = []
    [ended] = cancel_running(api, POOL, say=said.append)  # what `ettflow down` does first
    assert (ended.run_id, ended.state) == (stopped, "CANCELLED"), (ended, said)
    assert ended.seconds < 120, ended  # not the slow publish's 300 s
    wait_for(lambda: warehouse_row(warehouse, stopped)[0] is not None, BOUND_S, "the stopped run's row")
    row, _, failures = warehouse_row(warehouse, stopped)
    # cancelled with its whole training (2 ranks x 20 steps), no failure
    assert row["status"] == "cancelled" and row["effective_steps"] == 40 and failures.empty, row.to_dict()
    with Warehouse.open(warehouse) as wh:
        [record] = [r for r in wh.lineage("dlrm") if r.run_id == stopped]
    assert record.outcome is Outcome.FAILED and record.anchor and os.path.isdir(record.anchor), record

    following = _deployment_run(env, short)  # the next refresh of the same windows, from the same parent
    wait_for(lambda: api_state(api, following)["state_type"] in ("COMPLETED", "FAILED", "CRASHED"), START_S,
             "the next refresh to end")
    state = api_state(api, following)
    assert state["state_type"] == "COMPLETED", state["state"]
    assert state["state"]["message"].startswith(f"published the anchor of run {stopped}"), state["state"]
    phases = {e.phase for e in read_spool(spool, following).events}
    assert not phases & {"submitted", "scheduling", "train_step"}, phases  # nothing reserved or trained
    with Warehouse.open(warehouse) as wh:
        [reused] = [r for r in wh.lineage("dlrm") if r.run_id == following]
        assert wh.runs_frame(run_id=following).empty  # its training is the stopped run's row
    assert (reused.outcome, reused.anchor, reused.windows) == (Outcome.PUBLISHED, record.anchor, record.windows)


def _killed_while_publishing(env: dict, api: str, params: dict, warehouse: str, spool, worker) -> None:
    """The neighbour of `_stopped_while_publishing`: the run's flow process SIGKILLed while it
    publishes (an OOM, a lost host), its anchor sealed. Nothing in the run records its end: the
    crash hook, in the worker, settles its lineage from its spool (`ett.archive.sealed_anchor`),
    and the next refresh of the same windows publishes that anchor instead of training again.
    (Before, the record named no anchor: the windows were trained again and the anchor pruned.)"""
    from ettflow.ett.lineage import Outcome
    from ettflow.ett.warehouse import Warehouse

    short = {**params, "max_steps": 20, "checkpoint_every_steps": 10, "max_windows": 1}  # the window after the last
    killed = _deployment_run(env, {**short, "fail_at": ["publish:slow_s=300"]})
    wait_for(lambda: any(t["name"].startswith("publish-snapshot") and t["state_type"] == "RUNNING"
                         for t in task_runs(api, killed)), START_S, "the run to publish")
    target = wait_for(lambda: flow_run_process(psutil.Process(worker.pid), killed), 10, "its flow-run process")
    os.kill(target.pid, signal.SIGKILL)
    wait_for(lambda: api_state(api, killed)["state_type"] == "CRASHED", BOUND_S, "the run to be CRASHED")
    wait_for(lambda: warehouse_row(warehouse, killed)[0] is not None, BOUND_S, "the killed run's row")
    with Warehouse.open(warehouse) as wh:
        [record] = [r for r in wh.lineage("dlrm") if r.run_id == killed]
    assert record.outcome is Outcome.CRASHED and record.anchor and os.path.isdir(record.anchor), record

    following = _deployment_run(env, short)
    wait_for(lambda: api_state(api, following)["state_type"] in ("COMPLETED", "FAILED", "CRASHED"), START_S,
             "the next refresh to end")
    state = api_state(api, following)
    assert state["state"]["message"].startswith(f"published the anchor of run {killed}"), state["state"]
    assert not {e.phase for e in read_spool(spool, following).events} & {"scheduling", "train_step"}
    with Warehouse.open(warehouse) as wh:
        [reused] = [r for r in wh.lineage("dlrm") if r.run_id == following]
    assert (reused.outcome, reused.anchor, reused.windows) == (Outcome.PUBLISHED, record.anchor, record.windows)


def _the_cancelled_run_in_the_browser(api: str, run_id: str, tmp_path) -> None:
    """Issue 43: the cancelled run's page as its operator reads it in Chromium: its name with
    its ETT, the Cancelled state, and in Details the run's ETT message (numbers first), not
    Prefect's "Flow run was cancelled successfully."."""
    from playwright.sync_api import expect

    from helpers.browser import browse, save, tab

    run = httpx.get(f"{api}/flow_runs/{run_id}").json()
    assert " · ETT " in run["name"], run["name"]
    ui = api.removesuffix("/api")

    def check(page) -> None:
        page.goto(f"{ui}/runs/flow-run/{run_id}")
        expect(page.get_by_text(run["name"]).first).to_be_visible()
        expect(page.get_by_text("Cancelled").first).to_be_visible()
        tab(page, "Details").click()
        expect(page.get_by_text(re.compile(r"ETT \d+\.\d% · NoF 0 · ")).first).to_be_visible()
        assert page.get_by_text("cancelled successfully").count() == 0
        save(page, "run-cancelled.png", tmp_path)

    print(f"browser part: {browse(tmp_path, check):.1f} s")
