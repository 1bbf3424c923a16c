"""The refresh on a Ray cluster of two nodes on this machine, and a whole node lost mid-training.

A run of `refresh_model` (Prefect test harness, TorchRec, the SQLite warehouse; tiny sizes, no
compile) on a `ray.cluster_utils.Cluster` of a head and a worker node of 2 CPUs each (logical
resources, so each node holds exactly two ranks), the flow joining it through RAY_ADDRESS as a
worker would: 4 ranks spread 2 + 2, the worker node lost mid-training, the restart on the head
alone. Then a restart that may not shrink waits for capacity, and a GPU placement (a node that
declares GPUs) keeps its spare in a bundle of its own and recovers a killed rank live. Checkpoints go to `work_root`,
the storage both nodes share (here a local folder). The pieces, pure: unit/test_placement.py.

The session's shared Ray (`ray_session`, tests/conftest.py) cannot live beside the cluster in
one process (one Ray connection per driver): the module's fixture shuts it down, and at its
end shuts the cluster down and starts the shared Ray again if it was up, so the tests that use
it after this module still find it (conftest's ordering runs this module last).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from ettflow.ett.failures import FailureClass
from ettflow.ett.spool import read_spool
from ettflow.trainer.config import TrainerConfig
from ettflow.trainer.data.schema import criteo_schema
from ettflow.trainer.placement import Placement, PlacementStrategy

from helpers.flows import PLAIN, flow_env, run

pytestmark = [pytest.mark.slow]

NODE_CPUS = 2  # each node holds two ranks of one CPU


# ---- the refresh on two nodes ----------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(prefect_harness):
    """A head and a worker node of NODE_CPUS each; RAY_ADDRESS names the head. Node death is
    detected in about a second (fast GCS health checks, instead of Ray's ~15 s default)."""
    import ray
    from ray.cluster_utils import Cluster

    from ettflow.trainer.group.ray_group import ensure_ray

    shared_was_up = ray.is_initialized()
    ray.shutdown()
    health = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_timeout_ms": 500,
              "health_check_failure_threshold": 3}
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": NODE_CPUS, "include_dashboard": False, "object_store_memory": 200 << 20,
        "_system_config": health})
    cluster.add_node(num_cpus=NODE_CPUS, object_store_memory=200 << 20)
    cluster.wait_for_nodes()
    before = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = cluster.address  # the flow's `ensure_ray` joins it, as a worker would
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if before is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = before
        if shared_was_up:
            ensure_ray(num_cpus=4)  # the session's shared Ray, as `ray_session` made it


def worker_node(cluster):
    """The cluster's live worker node (one is added when an earlier test removed it)."""
    if cluster.worker_nodes:  # `remove_node` takes a node out of this list
        return next(iter(cluster.worker_nodes))
    node = cluster.add_node(num_cpus=NODE_CPUS, object_store_memory=200 << 20)
    cluster.wait_for_nodes()
    return node


@pytest.fixture(scope="module")
def env(tmp_path_factory, flow_data):
    from ettflow.trainer.data.windows import list_windows

    root = tmp_path_factory.mktemp("multinode")
    return flow_env(root, flow_data, root / "shared-storage",  # every node's checkpoints
                    world_size=4, placement_strategy="SPREAD", batch_size=8, checkpoint_every_steps=5,
                    eval_batches=1, switches={**PLAIN, "async_checkpoint": False},
                    windows=list_windows(flow_data)[:2], warm_start=False)


def ett_row(env, run_id):
    """The run's ETT row, its failures and its events, as the warehouse holds them."""
    from ettflow.ett.warehouse import COMPONENT_COLUMNS, Warehouse

    with Warehouse.open(env["warehouse_url"]) as wh:
        runs = wh.runs_frame(run_id=run_id)
        failures = wh.table_frame("failures", run_id)
        events = wh.table_frame("events", run_id)
    assert len(runs) == 1, runs
    row = runs.iloc[0]
    assert abs(sum(row[c] for c in COMPONENT_COLUMNS) - row["wall_s"]) < 1e-3  # the partition holds
    return row, failures, events


def placements(events) -> dict[int, dict]:
    """Each attempt's layout from the driver's scheduling record: {attempt: attrs}."""
    return {int(a): attrs for a, r, p, attrs in zip(events["attempt"], events["rank"], events["phase"],
                                                     events["attrs"]) if p == "scheduling" and int(r) == -1
            and "nodes" in attrs}


def wait_for_step(spool_root: Path, step: int, timeout_s: float = 240.0) -> str:
    """The run id once a rank of its first attempt recorded training step `step`."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for folder in (p for p in spool_root.iterdir() if p.is_dir()) if spool_root.is_dir() else ():
            evs = read_spool(spool_root, folder.name).events
            if any(e.phase == "train_step" and e.attempt == 0 and e.attrs.get("step", -1) >= step for e in evs):
                return folder.name
        time.sleep(0.1)
    raise AssertionError(f"no rank reached step {step} within {timeout_s} s")


MAX_STEPS = 80  # a step takes tens of ms: the node dies some 20 steps after the test sees step 6


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_four_ranks_spread_over_two_nodes_and_a_lost_node_restarts_on_the_other(cluster, env, tmp_path):
    """4 ranks SPREAD over both nodes (2 + 2); the worker node's raylet is killed (SIGKILL,
    with its ranks) once they trained step 6; the restart runs 2 ranks on the head
    (min_world_size=2), restoring the 4-rank checkpoint from the shared storage."""
    head, worker = cluster.head_node.node_id, worker_node(cluster)
    killed_node = worker.node_id
    params = {**env, "spool_root": str(tmp_path / "spool"), "min_world_size": 2, "capacity_wait_s": 120,
              "max_steps": MAX_STEPS}
    out: dict = {}
    flow = threading.Thread(target=lambda: out.update(zip(("state", "run_id"), run(params))))
    flow.start()
    try:
        run_id = wait_for_step(Path(params["spool_root"]), 6)
        cluster.remove_node(worker, allow_graceful=False)
    finally:
        flow.join(timeout=480)
    assert not flow.is_alive() and out["run_id"] == run_id
    assert out["state"].is_completed(), out["state"].message
    row, failures, events = ett_row(params, run_id)
    assert row["status"] == "completed" and row["nof"] == 1
    # the failure: infrastructure, a rank of the lost node, the node named
    layout = placements(events)
    assert Counter(layout[0]["nodes"]) == {head: 2, killed_node: 2}
    (failure,) = failures.itertuples()
    assert failure.failure_class == "infrastructure" and failure.recovered
    assert layout[0]["nodes"][failure.rank] == killed_node
    assert failure.reason == f"rank {failure.rank}: node {killed_node} ({worker.node_ip_address}) lost"
    (detected,) = [a for p, a in zip(events["phase"], events["attrs"]) if p == "failure_detected"]
    assert detected["node"] == killed_node
    # the restart: two ranks on the head, from the 4-rank checkpoint resharded
    assert layout[1] == {"world_size": 2, "nodes": [head, head]}
    spooled = read_spool(params["spool_root"], run_id).events
    (restore,) = [e for e in spooled if e.phase == "checkpoint_restore" and e.attempt == 1 and e.rank == 0]
    trained = max(e.attrs["step"] for e in spooled if e.phase == "train_step" and e.attempt == 0)
    assert restore.attrs["source"] == "own" and restore.attrs["resharded_from"] == 4
    # the 4-rank checkpoint it restored is in the shared storage, written by the ranks of both nodes
    assert Path(restore.attrs["path"]).is_relative_to(env["work_root"])
    # the latest checkpoint (every 5 steps) before the node was lost; a step's index starts at 0
    assert restore.attrs["world_size"] == 2 and restore.attrs["step"] % 5 == 0
    assert 5 <= restore.attrs["step"] <= trained + 1
    assert {e.rank for e in spooled if e.phase == "train_step" and e.attempt == 1} == {0, 1}
    from ettflow.trainer.checkpoint.anchor import read_anchor

    anchor = read_anchor(out["state"].result()["anchor"])
    assert anchor["world_size"] == 2 and anchor["step"] == MAX_STEPS


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_restart_that_may_not_shrink_waits_for_capacity_within_its_bound(cluster, flow_data, tmp_path):
    """Only the head is left (two ranks' worth). A restart of a 4-rank run without
    min_world_size fails as infrastructure past capacity_wait_s; with a longer bound it waits
    until a node joins (3 s later) and then places all four ranks over both nodes."""
    from ettflow.ett.failures import FailureError
    from ettflow.trainer.group.ray_group import RayWorkerGroup, ensure_ray, live_nodes
    from ettflow.trainer.rank.actor import TrainerActor

    ensure_ray()  # joins RAY_ADDRESS, the cluster
    for node in list(cluster.worker_nodes):
        cluster.remove_node(node, allow_graceful=False)
    end = time.monotonic() + 30
    while len(live_nodes()) > 1 and time.monotonic() < end:
        time.sleep(0.2)
    assert list(live_nodes()) == [cluster.head_node.node_id]
    cfg = TrainerConfig(data_root=str(flow_data), schema=criteo_schema(10), work_dir=str(tmp_path), world_size=4,
                        placement=Placement(strategy=PlacementStrategy.SPREAD, capacity_wait_s=1.5))
    short = RayWorkerGroup(cfg, "wait", 1, tmp_path, actor_cls=TrainerActor)
    with pytest.raises(FailureError) as refused:
        short.reserve()
    assert refused.value.failure.failure_class is FailureClass.INFRASTRUCTURE
    assert "could not reserve 4 x {'CPU': 1} (SPREAD) within 1.5 s" in refused.value.failure.reason
    assert short.pg is None and short.actors == []  # nothing left waiting
    # the reserve waits in a thread; the node joins from this one (Ray's Node needs the main
    # thread: it installs signal handlers)
    group = RayWorkerGroup(cfg, "wait", 1, tmp_path, actor_cls=TrainerActor, reserve_timeout_s=120)
    waited: list = []

    def reserve():
        t0 = time.monotonic()
        try:
            group.reserve()
        finally:
            waited.append(time.monotonic() - t0)

    reserving = threading.Thread(target=reserve)
    reserving.start()
    try:
        time.sleep(3.0)
        assert reserving.is_alive() and group.world_size == 4  # waiting for 4 ranks, not shrinking
        joined = cluster.add_node(num_cpus=NODE_CPUS, object_store_memory=200 << 20)
        reserving.join(timeout=120)
        assert not reserving.is_alive() and waited[0] >= 3.0 and group.world_size == 4
        assert Counter(group.placement) == {cluster.head_node.node_id: 2, joined.node_id: 2}
    finally:
        reserving.join(timeout=120)
        group.teardown()


# ---- a GPU placement's live recovery (issue 25), on a node that declares GPUs ---------------------

def test_a_gpu_placement_keeps_its_spare_in_a_bundle_of_its_own_and_recovers_live(cluster, flow_data, tmp_path):
    """A node that declares 3 GPUs joins (Ray's logical resources: this machine has none, so the
    ranks run on the CPU with gloo, `device="auto"`): a 2-rank run's placement is a GPU one, so
    it reserves a third bundle ({CPU: 1, GPU: 1}) whose spare holds its device from the start.
    Rank 1 is SIGKILLed at step 8: the spare takes its place live (restored from the in-memory
    tier, which runs because a spare has a place), and every spare's hold is in the ledger with
    its GPU."""
    from ettflow.ett.capacity import held_by_model, holdings_of_run
    from ettflow.trainer.config import FailAt
    from ettflow.trainer.group.ray_group import ensure_ray

    from helpers.trainer_runs import by, config, drive

    ensure_ray()  # joins RAY_ADDRESS, the cluster
    gpu_node = cluster.add_node(num_cpus=3, num_gpus=3, object_store_memory=200 << 20)
    cluster.wait_for_nodes()
    try:
        cfg = config(tmp_path, "gpu-shaped", tmp_path / "compile-cache", data_root=str(flow_data), device="auto",
                     max_steps=20, eval_batches=0, failures=(FailAt(kind="kill", rank=1, step=8),)
                     ).with_switches(compile=False, warm_pool=False)
        result, events, m = drive(tmp_path, cfg, "gpu-shaped")
    finally:
        cluster.remove_node(gpu_node)
    assert result.attempts == 2 and m.nof == 1 and m.failures[0].failure_class == "infrastructure"
    (placed,) = by(events, "scheduling", attempt=0)
    assert placed.attrs["nodes"] == [gpu_node.node_id] * 2  # PACK, on the one node with GPUs
    (handoff,) = by(events, "spare_handoff")
    assert handoff.attrs["handed"] and handoff.attrs["rank"] == 1
    for rank in (0, 1):
        (restore,) = by(events, "checkpoint_restore", rank=rank, attempt=1)
        assert restore.attrs["source"] == "memory"
    spares = by(events, "spare_start")
    assert len(spares) == 2 and all(e.attrs["gpus"] == 1.0 for e in spares)  # the used one, the next one
    assert sorted(e.attrs["used"] for e in spares) == [False, True]
    holdings = holdings_of_run("gpu-shaped", "dlrm", events, m.wall_start, m.wall_end)
    (by_model,) = held_by_model(holdings)
    assert by_model.gpu_s == pytest.approx(sum(h.held_s for h in holdings)) and by_model.gpu_s > 0
