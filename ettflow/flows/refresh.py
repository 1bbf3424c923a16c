"""`refresh_model`: one refresh of a recommendation model, end to end.

    check the warehouse (fail fast, before anything is reserved)
    -> reserve the trainer (Ray placement; the queueing is the scheduling phase)
    -> train (the driver: restarts within its failure budget) -> anchor checkpoint
    -> [baseline: publish while the trainer holds its devices] -> release the devices
    -> publish on the CPU (optimized)

Every state hook archives the run's ETT to the warehouse and attaches the artifacts (ETT
table, timeline picture, snapshot link) to the flow run; the train task shows a progress
artifact while it runs. The run's id in the spool and the warehouse is the flow run id.
"""

from __future__ import annotations

from typing import Any, Literal

from prefect import flow
from prefect.context import FlowRunContext

from ettflow.ett.heartbeat import RunHeartbeat
from ettflow.tasks.archive import archive_on_flow_state
from ettflow.tasks.plan import RefreshParams, RefreshPlan, plan_refresh
from ettflow.tasks.publish import publish
from ettflow.tasks.reconcile import reconcile_task
from ettflow.tasks.trainer import anchor_checkpoint, release_trainer, reserve_trainer, train
from ettflow.tasks.warehouse_url import check_warehouse, refusal, resolve_warehouse_url

HOOKS = [archive_on_flow_state]


def _plan(params: RefreshParams) -> RefreshPlan:
    ctx = FlowRunContext.get()
    fr = ctx.flow_run if ctx is not None else None
    from prefect.runtime import deployment

    expected = getattr(fr, "expected_start_time", None) if fr is not None else None
    return plan_refresh(params, run_id=str(fr.id) if fr is not None else "local",
                        submitted_at=expected.timestamp() if expected is not None else None,
                        artifact_slug=deployment.name or (ctx.flow.name if ctx is not None else "refresh-model"))


@flow(name="refresh-model", flow_run_name="{model}-{mode}", on_completion=HOOKS, on_failure=HOOKS,
      on_crashed=HOOKS, on_cancellation=HOOKS)
def refresh_model(
    model: str = "dlrm",
    mode: Literal["baseline", "optimized"] = "optimized",
    switches: dict[str, bool] | None = None,
    architecture: dict[str, Any] | None = None,
    data_root: str | None = None,
    windows: list[str] | None = None,
    eval_windows: list[str] | None = None,
    max_embeddings: int | None = 10_000,
    world_size: int = 2,
    batch_size: int = 128,
    max_steps: int | None = None,
    checkpoint_every_steps: int | None = None,
    eval_batches: int = 8,
    device: Literal["auto", "cpu", "cuda"] = "auto",
    fail_at: list[str] | None = None,
    work_root: str | None = None,
    snapshot_root: str | None = None,
    spool_root: str | None = None,
    warehouse_url: str | None = None,
    warehouse_secret: str | None = None,
    tags: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Refresh `model` on the data windows and publish a validated inference snapshot.

    mode: baseline or optimized; `switches` sets single switches on top (parallel_init,
    fast_batch, compile, compile_cache, async_checkpoint, publish_in_trainer).
    architecture: ModelConfig fields (embedding_dim, dense_arch, over_arch, learning rates);
    max_embeddings caps every embedding table (null: the data schema's sizes).
    fail_at: injected failures, e.g. ["kill:rank=1:step=16"], ["publish:times=1"].
    Paths default to the per-user ettflow folder; `data_root` defaults to tiny synthetic data.
    Warehouse: `warehouse_secret` names a Prefect Secret block holding the URL; else
    `warehouse_url` (without a password: parameters are stored in clear); else the worker's
    ETTFLOW_WAREHOUSE_URL, else the per-user SQLite file.
    """
    plan = _plan(RefreshParams(
        model=model, mode=mode, switches=switches, architecture=architecture, data_root=data_root, windows=windows,
        eval_windows=eval_windows, max_embeddings=max_embeddings, world_size=world_size, batch_size=batch_size,
        max_steps=max_steps, checkpoint_every_steps=checkpoint_every_steps, eval_batches=eval_batches,
        device=device, fail_at=fail_at, work_root=work_root, snapshot_root=snapshot_root, spool_root=spool_root,
        warehouse_url=warehouse_url, warehouse_secret=warehouse_secret, tags=tags))
    checked = check_warehouse(plan, return_state=True)
    if checked.is_failed():
        return refusal(checked)  # the warehouse cannot be written: fail now, nothing reserved or trained
    reconcile_task()(str(plan.spool_root), resolve_warehouse_url(plan.warehouse), plan.run_id)
    with RunHeartbeat(plan.spool_root, plan.run_id, labels=plan.labels):
        anchor, snapshot = _train_and_publish(plan)
    return {"run_id": plan.run_id, "model": plan.model, "mode": plan.mode, "anchor": anchor, "snapshot": snapshot}


def _train_and_publish(plan: RefreshPlan) -> tuple[str, str]:
    """reserve -> train -> anchor -> [publish on the devices] -> release -> publish on the CPU."""
    lease = reserve_trainer(plan)
    try:
        anchor = anchor_checkpoint(plan, train(plan, lease))
        held = publish(plan, anchor, on_devices=True) if plan.publish_in_trainer else None
    finally:
        release_trainer(plan, lease)
    return anchor, held or publish(plan, anchor)
