"""The deployments against a real Prefect server: `prefect server start`, a process work
pool, `prefect deploy --all` from prefect.yaml, a deployment run picked up by a process
worker, the run's ETT row in the warehouse, and what the API shows of it: the state message
with its ETT, the name with its windows, the tags, the artifacts' descriptions, the run form's
parameter help, and `ettflow report`'s status, deployment and run link. Slow (a server, a worker and a flow run in
subprocesses), and it runs in CI."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import httpx
import pytest

from ettflow.cli import main
from ettflow.ett.warehouse import Warehouse
from ettflow.trainer.data.windows import list_windows

from helpers.flows import TINY
from helpers.prefect_cli import POOL, REPO, prefect

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_deploy_run_and_archive_through_a_worker(prefect_server, tmp_path, flow_data, flow_work_root, compile_cache,
                                                 monkeypatch, capsys):
    env, api = prefect_server  # conftest: the server, with the work pool POOL created
    shutil.copy(REPO / "prefect.yaml", tmp_path / "prefect.yaml")
    out = prefect(env, "--no-prompt", "deploy", "--all", "--prefect-file", str(tmp_path / "prefect.yaml"))
    assert "refresh-model/refresh-scheduled" in out and "refresh-model/refresh-adhoc" in out
    warehouse = f"sqlite:///{tmp_path / 'warehouse.db'}"
    params = {"data_root": str(flow_data), "architecture": TINY, "max_embeddings": 100, "world_size": 2,
              "batch_size": 32, "max_steps": 20, "checkpoint_every_steps": 10, "eval_batches": 2,
              "work_root": str(flow_work_root), "snapshot_root": str(tmp_path / "snapshots"),
              "spool_root": str(tmp_path / "spool"), "warehouse_url": warehouse}
    out = prefect(env, "deployment", "run", "refresh-model/refresh-adhoc", "--params", json.dumps(params))
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)
    # the worker's flow run starts its own local Ray (joining this session's by its gcs_address
    # fails here: Ray advertises a node IP the flow process cannot reach)
    worker_env = {**env, "ETTFLOW_HOME": str(tmp_path / "home")}
    prefect(worker_env, "worker", "start", "--pool", POOL, "--type", "process", "--run-once", "--limit", "1",
            timeout=600)
    flow_run = httpx.get(f"{api}/flow_runs/{flow_run_id}").json()
    assert flow_run["state_type"] == "COMPLETED", flow_run["state"]
    # the run tells its ETT through the API: state message, name (model, mode, windows), tags
    assert re.fullmatch(r"ETT \d+\.\d% · NoF 0 · TTS \d+\.\d s", flow_run["state"]["message"]), flow_run["state"]
    first, last = (w.removeprefix("window=") for w in list_windows(flow_data)[:2])
    assert flow_run["name"] == f"dlrm-optimized {first}..{last} (2)"
    assert {"ettflow", "adhoc", "model:dlrm", "mode:optimized", "failures:0", "outcome:published"} <= set(
        flow_run["tags"]), flow_run["tags"]
    with Warehouse.open(warehouse) as wh:
        runs = wh.runs_frame(run_id=flow_run_id)
    assert len(runs) == 1
    row = runs.iloc[0]
    assert row["flow_run_id"] == flow_run_id and row["status"] == "completed" and row["effective_steps"] == 40
    assert row["tags"]["snapshot"] and Path(row["tags"]["snapshot"]).is_dir()
    found = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}).json()
    keys = [a["key"] for a in found]
    assert {"ett-refresh-adhoc", "ett-timeline-refresh-adhoc", "snapshot-refresh-adhoc"} <= set(keys)
    assert keys.count("training-progress-refresh-adhoc") == 1
    for a in found:  # the progress artifact ends at the final state and its message
        progress = a["type"] == "progress"
        head = r"Completed · ETT \d+\.\d% · NoF 0 · TTS" if progress else r"ETT \d+\.\d% · NoF 0 · Completed"
        assert re.match(head, a["description"]), a
    # the run form describes every parameter
    deployment = httpx.get(f"{api}/deployments/name/refresh-model/refresh-adhoc").json()
    props = deployment["parameter_openapi_schema"]["properties"]
    assert props and all(p.get("description") for p in props.values())
    assert "KIND[:FIELD=VALUE]" in props["fail_at"]["description"]
    # the report: status, deployment and the link to the flow run
    monkeypatch.setenv("PREFECT_UI_URL", "http://127.0.0.1:4200")
    assert main(["report", "--url", warehouse, "--run", flow_run_id, "--format", "json"]) == 0
    (shown,), _ = json.JSONDecoder().raw_decode(capsys.readouterr().out)  # the run table, then its components
    assert (shown["status"], shown["deployment"]) == ("completed", "refresh-adhoc")
    assert shown["prefect_run"] == f"http://127.0.0.1:4200/runs/flow-run/{flow_run_id}"
