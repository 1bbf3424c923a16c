"""Issue 42 #1 on the deployed path: the cluster's pool dies, under deployment runs a process
worker executes on a Ray head of their own (as `ettflow up` runs them).

- Mid-run: the pool prewarmed a run's ranks, its spare and its keeper; its service is killed
  while the run trains, and what it owned dies with it. The run restarts on fresh ranks (no
  handle of a dead actor passed on) and finishes.
- Between runs: the pool holds prewarmed workers for the model's next run and its service is
  killed. The next run starts cold and says why (the pool was lost), and what the dead service
  held reaches the warehouse's ledger (from its journal) with the time it was held.
"""

from __future__ import annotations

import json
import re
import shutil
import time

import httpx
import pytest

from ettflow.ett.spool import read_spool
from ettflow.tasks.parameters import RefreshParameters

from helpers import cluster_pool
from helpers.flows import TINY, assert_components_sum_to_wall, warehouse_row
from helpers.prefect_cli import REPO, prefect
from helpers.spool import training_started
from helpers.stack import deployed_worker
from helpers.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

START_S = 240.0  # a cold start on a busy 2-core machine (worker, flow process, trainer init)
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


def _state(api: str, flow_run_id: str) -> dict:
    return httpx.get(f"{api}/flow_runs/{flow_run_id}", timeout=10).json()


def _run(env: dict, params: dict) -> str:
    out = prefect(env, "deployment", "run", "refresh-model/refresh-adhoc", "--params",
                  json.dumps(RefreshParameters.parse(params).to_json()))
    return re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)


def _ended(api: str, flow_run_id: str) -> dict:
    wait_for(lambda: _state(api, flow_run_id)["state_type"] in FINAL, START_S + 240, "the run to end")
    return _state(api, flow_run_id)


def test_the_cluster_pool_killed_mid_run_and_between_runs_costs_no_run_its_correctness(
        prefect_server, tmp_path, flow_data, flow_work_root):
    from ettflow.ett.warehouse import Warehouse

    env, api = prefect_server
    shutil.copy(REPO / "prefect.yaml", tmp_path / "prefect.yaml")
    prefect(env, "--no-prompt", "deploy", "--all", "--prefect-file", str(tmp_path / "prefect.yaml"))
    warehouse, spool, home = f"sqlite:///{tmp_path / 'warehouse.db'}", tmp_path / "spool", tmp_path / "home"
    # the optimized preset (pooled ranks, a spare, an in-memory keeper) without the compile: the
    # prewarms and restarts stay short on two cores. 240 steps of batch 4 (the window's 1,920 rows):
    # the kill, asked at step 6 from a process that must first join Ray, lands mid-run (with 30
    # steps of 32 a run once ended before it, with no failure to see)
    params = {"data_root": str(flow_data), "architecture": TINY, "max_embeddings": 100, "world_size": 2,
              "batch_size": 4, "max_steps": 240, "checkpoint_every_steps": 40, "eval_batches": 2,
              "switches": {"compile": False}, "windows": ["window=2024010100"], "work_root": str(flow_work_root),
              "snapshot_root": str(tmp_path / "snapshots"), "spool_root": str(spool), "warehouse_url": warehouse}
    spec = json.dumps(params)
    with deployed_worker(env, home, tmp_path / "worker.log") as (worker_env, _):
        # mid-run: 2 ranks and a spare prewarmed (and a keeper), the service killed at step 6
        seeded = json.loads(cluster_pool.run(worker_env, "fill", spec, str(home), str(spool), "3"))
        assert seeded == {"started": 3, "ready": 3}, seeded
        hit = _run(env, params)
        wait_for(lambda: training_started(spool, hit, min_step=6), START_S, "the run to train step 6")
        cluster_pool.run(worker_env, "kill")
        state = _ended(api, hit)
        assert state["state_type"] == "COMPLETED", (state["state"], (tmp_path / "worker.log").read_text()[-4000:])

        # between runs: the pool holds 2 prewarmed workers for the next run; its service is killed
        seeded = json.loads(cluster_pool.run(worker_env, "fill", spec, str(home), str(spool), "2"))
        assert seeded["ready"] >= 2, seeded
        killed_at = time.time()
        cluster_pool.run(worker_env, "kill")
        after = _run(env, params)
        state = _ended(api, after)
        assert state["state_type"] == "COMPLETED", (state["state"], (tmp_path / "worker.log").read_text()[-4000:])
    worker_log = (tmp_path / "worker.log").read_text()

    events = read_spool(spool, hit).events
    pooled = [e for e in events if e.phase == "spare_start" and e.attrs.get("for_rank") is not None]
    assert sorted(e.attrs["for_rank"] for e in pooled) == [0, 1] and {e.attempt for e in pooled} == {0}, pooled
    row, _, failures = warehouse_row(warehouse, hit)
    clean, _, _ = warehouse_row(warehouse, after)  # the same window trained with no failure
    assert row["status"] == "completed" and row["nof"] >= 1, row.to_dict()
    # its ranks ended with their owner: the pool's loss, whatever the ranks made of Ray's signal
    assert set(failures["failure_class"]) == {"infrastructure"}, failures.to_dict("records")
    assert all(r.endswith("its process was ended with its owner, the cluster's pool, which was lost")
               for r in failures["reason"]), failures.to_dict("records")
    assert row["effective_steps"] == clean["effective_steps"] > 0, (row.to_dict(), clean.to_dict())
    last = max(e.attempt for e in events)
    assert last >= 1  # the kill took the pooled ranks: a later attempt of fresh ones finished
    assert not [e for e in pooled if e.attempt == last]
    assert re.search(r"keeper \(actor ettflow-keeper-pool-\S+\) died: a new one starts", worker_log), worker_log[-4000:]
    taking = [line for line in worker_log.splitlines() if "could not take workers" in line]
    assert all(line.endswith("the ranks start the usual way") for line in taking), taking  # one line each
    assert "RaySystemError" not in worker_log and "NoneType" not in worker_log  # no dead actor's handle passed on
    assert_components_sum_to_wall(row)

    # the next run after the kill between runs: cold, and why; the dead service's holdings in the ledger
    assert re.search(r"the cluster's pool was lost \(its service last answered at [^)]*, holding [2-9] worker",
                     worker_log), worker_log[-4000:]
    assert not [e for e in read_spool(spool, after).events
                if e.phase == "spare_start" and e.attrs.get("for_rank") is not None]
    with Warehouse.open(warehouse) as wh:
        lost = [h for h in wh.holdings("dlrm") if h.reason == "pool_lost"]
    workers = [h for h in lost if h.kind == "unclaimed_worker"]
    assert len(workers) >= 2 and all(h.run_id is None and not h.used for h in workers), lost
    assert all(h.requested_at < h.released_at <= killed_at + 5 for h in lost), lost  # held until the service died


def test_a_damaged_compile_cache_archive_met_by_a_pooled_worker_is_reported_by_its_run_and_replaced_once(
        prefect_server, tmp_path, flow_data, compile_cache):
    """Issue 42 #4 on the deployed path: the model's compile-cache archive is truncated; the
    pool's prewarmed worker refuses it, compiles cold and replaces it; the deployment run that
    takes that worker says so (the train task's warning, the row's `compile_cache_refused` tag
    with `pooled`), and the archive is not replaced again (its other rank restores the new one)."""
    import hashlib

    from ettflow.trainer.compile.archive import verify

    env, api = prefect_server
    shutil.copy(REPO / "prefect.yaml", tmp_path / "prefect.yaml")
    prefect(env, "--no-prompt", "deploy", "--all", "--prefect-file", str(tmp_path / "prefect.yaml"))
    work = tmp_path / "work"  # the session's archive, copied: the damage stays this test's
    shutil.copytree(compile_cache, work / "dlrm" / "compile-cache")
    [archive] = (work / "dlrm" / "compile-cache").rglob("*.tar")
    archive.write_bytes(archive.read_bytes()[:-100])  # truncated after its manifest was written
    warehouse, spool, home = f"sqlite:///{tmp_path / 'warehouse.db'}", tmp_path / "spool", tmp_path / "home"
    params = {"data_root": str(flow_data), "architecture": TINY, "max_embeddings": 100, "world_size": 2,
              "batch_size": 32, "max_steps": 10, "checkpoint_every_steps": 10, "eval_batches": 2,
              "switches": {"live_recovery": False, "memory_checkpoint": False}, "windows": ["window=2024010100"],
              "work_root": str(work), "snapshot_root": str(tmp_path / "snapshots"), "spool_root": str(spool),
              "warehouse_url": warehouse}
    with deployed_worker(env, home, tmp_path / "worker.log") as (worker_env, _):
        seeded = json.loads(cluster_pool.run(worker_env, "fill", json.dumps(params), str(home), str(spool), "1"))
        assert seeded == {"started": 1, "ready": 1}, seeded
        assert verify(archive)  # replaced by the worker that compiled cold
        replaced = hashlib.sha256(archive.read_bytes()).hexdigest()
        run_id = _run(env, params)
        state = _ended(api, run_id)
        assert state["state_type"] == "COMPLETED", (state["state"], (tmp_path / "worker.log").read_text()[-4000:])
    worker_log = (tmp_path / "worker.log").read_text()
    assert re.search(r"rank 0: the compile cache's archive was refused \([^)]*\): its pooled worker compiled cold "
                     r"before the run and replaced it", worker_log), worker_log[-4000:]
    row, _, _ = warehouse_row(warehouse, run_id)
    [refused] = row["tags"]["compile_cache_refused"]
    assert refused["pooled"] and refused["rank"] == 0 and refused["repair"] == "replaced", refused
    assert hashlib.sha256(archive.read_bytes()).hexdigest() == replaced  # once: the run's other rank restored it
