"""`refresh_model`: one refresh of a recommendation model, end to end.

    check the warehouse (fail fast, before anything is reserved)
    -> on the default synthetic data with nothing new: the next window arrives (`tasks.arrivals`)
    -> [a flow retry of a try that lost its claims (taken for dead while it stood still): ends
       failed at once, its row the earlier try's training]
    -> claim the windows past the model's watermark (none new, or another refresh holds them:
       the run ends Completed as skipped, nothing reserved)
    -> check the inputs (a bad file refuses the run: no ETT row)
    -> a refresh of these windows stopped after sealing its anchor: publish that anchor, train
       nothing (`tasks/anchor_reuse.py`)
    -> reserve the trainer (Ray placement; the queueing is the scheduling phase)
    -> train (the driver: restarts within its failure budget; stops when the run was taken for
       dead while it stood still, `tasks/claims_fence.py`) -> anchor checkpoint
    -> [baseline: publish while the trainer holds its devices] -> release the devices
    -> publish on the CPU (optimized; the gate may keep the current snapshot: gated)
    -> record the lineage (published or gated; failed when anything raised) -> prune checkpoints
    -> prune snapshots (the last `keep_snapshots`, the current one and their delta bases stay)

The body ends by finishing the run (`tasks.archive.finish_run`): it archives the run's ETT to
the warehouse, attaches the artifacts (ETT table, timeline picture, snapshot manifest), tags the
run and returns the final state whose message says the ETT (`ett.run_summary.state_message`).
The hooks finish the runs the body could not: crashed, cancelled, refused before it ran. From
its claim to its end the run's heartbeat beats in the spool (`ett.heartbeat`): a run that dies
holding claims is found dead by the next refresh that waits on them, which releases them. Once
its windows are claimed the run is renamed after them; one progress artifact follows the run
from the claim to its final state. Every parameter is described in the deployment's run form
(`tasks/parameters.py`, through `parameter_help.py`). The run's id in the spool and the warehouse is the flow run id.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import psutil
from prefect import flow, get_run_logger
from prefect.context import FlowRunContext
from prefect.states import Completed, Failed, State

from ettflow.ett.heartbeat import RunHeartbeat
from ettflow.ett.lineage import LineageRecord, Outcome
from ettflow.ett.run_summary import FinalState, run_name, short_reason, state_message
from ettflow.flows.parameter_help import with_parameter_help
from ettflow.tasks import run_spool
from ettflow.tasks.anchor_reuse import find_reusable_anchor
from ettflow.tasks.archive import archive_on_flow_state, finish_run
from ettflow.tasks.arrivals import arrive_windows
from ettflow.tasks.claims import claim_windows, record_failure, record_lineage
from ettflow.tasks.claims_fence import ClaimsFence, fence_for
from ettflow.tasks.input_check import check_inputs
from ettflow.tasks.parameters import (
    ArchitectureParams,
    CheckpointParams,
    DataParams,
    FaultParams,
    GateParams,
    ModeField,
    ModelName,
    PlacementParams,
    RefreshParameters,
    StorageParams,
    SwitchParams,
    Tags,
    TrainingParams,
    WarehouseParams,
)
from ettflow.tasks.plan import RefreshPlan, plan_refresh
from ettflow.tasks.progress import RunProgress
from ettflow.tasks.publish import publish
from ettflow.tasks.reconcile import reconcile_task
from ettflow.tasks.retention import prune_checkpoints, prune_snapshots
from ettflow.tasks.run_labels import name_flow_run
from ettflow.tasks.trainer import anchor_checkpoint, release_trainer, reserve_trainer, train
from ettflow.tasks.warehouse_url import check_warehouse, refusal

if TYPE_CHECKING:
    from ettflow.tasks.lease import TrainerLease

HOOKS = [archive_on_flow_state]
DEFAULTS = RefreshParameters()  # the flow's defaults are the model's


def _plan(params: RefreshParameters) -> RefreshPlan:
    ctx = FlowRunContext.get()
    fr = ctx.flow_run if ctx is not None else None
    from prefect.runtime import deployment

    expected = getattr(fr, "expected_start_time", None) if fr is not None else None
    # the server lets a run start up to half a second before its time (it rounds the wait):
    # its clock starts when it really did
    submitted = min(expected.timestamp(), time.time()) if expected is not None else None
    return plan_refresh(params, run_id=str(fr.id) if fr is not None else "local", submitted_at=submitted,
                        prestarted_at=_process_started_for(fr),
                        artifact_slug=deployment.name or (ctx.flow.name if ctx is not None else "refresh-model"))


def _process_started_for(flow_run: Any) -> float | None:
    """When this process started, if a worker started it for this very run (its
    PREFECT__FLOW_RUN_ID); None in a process that runs flows of its own (`ettflow refresh`)."""
    if flow_run is None or os.environ.get("PREFECT__FLOW_RUN_ID") != str(flow_run.id):
        return None
    return psutil.Process().create_time()


def _finish(plan: RefreshPlan, state: FinalState, outcome: Outcome, *, reason: str | None = None,
            data: Any = None, archive: bool = True) -> State:
    """Archive and announce the finished run (`finish_run`), then its final state, whose
    message says the ETT. A failure's state carries its exception (`data`), so a caller of
    the flow function gets it raised, as from any failed flow. `archive` False: a run refused
    before anything was reserved (its inputs): announced, no ETT row (no training to measure,
    as for a refused parameter)."""
    ctx = FlowRunContext.get()
    try:
        # a skipped run claimed no window: it is named for none (issue 43: it was named for the four
        # its plan had listed)
        windows = () if outcome is Outcome.SKIPPED else tuple(plan.trainer.windows or ())
        summary = finish_run(ctx.flow.name, ctx.flow_run, state=state, outcome=outcome.value, reason=reason,
                             windows=windows, params=plan.params, in_body=True, archive=archive)
        message = state_message(summary)
    except Exception:  # noqa: BLE001 - archiving must not change how the run ended; its hook tries again
        get_run_logger().exception("could not finish run %s (its state hook archives it again)", plan.run_id)
        message = short_reason(reason)
    return Completed(message=message, data=data) if state is FinalState.COMPLETED else Failed(message=message,
                                                                                               data=data)


def _will_retry() -> bool:
    """Whether Prefect will retry the flow after this try fails (it is finished then, not now)."""
    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return False
    retries = ctx.flow_run.empirical_policy.retries
    retries = ctx.flow.retries if retries is None else retries
    return ctx.flow_run.run_count <= (retries or 0)


@flow(name="refresh-model", flow_run_name="{model}-{mode}", on_completion=HOOKS, on_failure=HOOKS,
      on_crashed=HOOKS, on_cancellation=HOOKS)
@with_parameter_help
def refresh_model(
    model: ModelName = DEFAULTS.model,
    mode: ModeField = DEFAULTS.mode,
    data: DataParams = DEFAULTS.data,
    architecture: ArchitectureParams = DEFAULTS.architecture,
    training: TrainingParams = DEFAULTS.training,
    checkpoint: CheckpointParams = DEFAULTS.checkpoint,
    switches: SwitchParams = DEFAULTS.switches,
    placement: PlacementParams = DEFAULTS.placement,
    gate: GateParams = DEFAULTS.gate,
    storage: StorageParams = DEFAULTS.storage,
    warehouse: WarehouseParams = DEFAULTS.warehouse,
    faults: FaultParams = DEFAULTS.faults,
    tags: Tags = DEFAULTS.tags,
) -> dict[str, Any] | State:
    """Refresh `model` on the data windows and publish a validated inference snapshot.

    Windows: the oldest `max_windows` past the model's watermark, the newest held out; the
    first refresh trains `bootstrap_windows`; explicit `windows` win. A refresh starts from its
    parent's anchor unless `warm_start` is false. With nothing new, or another refresh holding
    the windows past `claim_wait_s`, it ends Completed, skipped. The final state's message
    says the run's ETT, NoF (with each failure's class and reason) and TTS.
    On several Ray nodes (README "Running at scale"), `work_root` and `spool_root` must be
    storage every node shares. The parameters are `tasks.parameters.RefreshParameters`, one
    argument per section (a test keeps the signature and the model equal).
    """
    # the arguments, before any other local: exactly the model's fields (`with_parameter_help` checks)
    params = RefreshParameters.parse(locals())
    plan = _plan(params)
    checked = check_warehouse(plan.warehouse, return_state=True)
    if checked.is_failed():
        return refusal(checked)  # the warehouse cannot be written: fail now, nothing reserved or trained
    # first: what earlier runs left pending moves the watermark, so "is there new data?" (the
    # demo's arrival below, the claim) is asked of the watermark as it really is
    reconcile_task()(str(plan.spool_root), plan.warehouse, plan.run_id)
    if arrive_windows(plan):  # the demo's next window arrived (never on a user's data): plan with it
        plan = _plan(params)
    progress = RunProgress(plan.run_id, plan.artifact_slug)
    # the run's heartbeat from before its claim to its lineage: a run that dies holding claims is
    # found dead and they are released (crashed), however far it got; a flow retry's live beat
    # keeps the claims it takes from a reconciliation that read the last try's end
    with RunHeartbeat(plan.spool_root, plan.run_id, labels=plan.labels) as beat:
        return _claim_and_refresh(plan, progress, beat)


def _claim_and_refresh(plan: RefreshPlan, progress: RunProgress, beat: RunHeartbeat) -> dict[str, Any] | State:
    """claim -> check the inputs -> [publish a stopped run's sealed anchor] or train and publish
    -> record the lineage -> prune checkpoints and snapshots; the run's final state."""
    lost = run_spool.claims_lost(plan.recorder.events())
    if lost is not None:  # a flow retry of a try taken for dead: its windows are another refresh's now
        beat.end_as("failed")
        return _finish(plan, FinalState.FAILED, Outcome.FAILED, reason=(
            f"an earlier try of this run lost its window claims ({lost}); not claimed or trained again"))
    progress.show("claiming the windows past the model's watermark")
    claim = claim_windows(plan)
    if claim.skipped is not None:  # nothing reserved or trained; archived as skipped
        beat.forget()  # its row is its end: nothing to reconcile (it would be re-archived as completed)
        return _finish(plan, FinalState.COMPLETED, Outcome.SKIPPED, reason=claim.skipped, data={
            "run_id": plan.run_id, "model": plan.model, "outcome": Outcome.SKIPPED.value, "reason": claim.skipped})
    plan = claim.plan
    beat.relabel(plan.labels)
    name_flow_run(plan.run_id, run_name(plan.model, plan.mode, plan.trainer.windows or ()))
    inputs = check_inputs(plan, return_state=True)  # before anything is reserved
    if inputs.is_failed():
        bad = inputs.result(raise_on_failure=False)
        record_failure(plan, bad, get_run_logger())  # the windows are released
        beat.forget()  # refused like a bad parameter: no ETT row, whatever check refused it (issue 42 #8)
        return _finish(plan, FinalState.FAILED, Outcome.FAILED, reason=inputs.message, data=bad, archive=False)
    reused = find_reusable_anchor(plan)  # a refresh of these windows stopped after sealing its anchor
    if reused is not None:
        beat.forget()  # no row of its own (its training is the stopped run's): nothing to reconcile
        return _publish_reused(plan, progress, reused)
    progress.show(f"reserving {plan.trainer.world_size} trainer slots on Ray")
    try:
        anchor, published = _train_and_publish(plan, progress, fence_for(plan, beat, get_run_logger()))
        record = record_lineage(plan, anchor, published)
    except Exception as exc:
        record_failure(plan, exc, get_run_logger())  # the watermark stays; the windows are released
        if _will_retry():
            raise  # Prefect retries the flow: the run is not finished
        beat.end_as("failed")
        return _finish(plan, FinalState.FAILED, Outcome.FAILED, reason=f"{type(exc).__name__}: {exc}", data=exc)
    except BaseException as exc:  # cancelled, interrupted: the hooks of that state finish the run
        record_failure(plan, exc, get_run_logger())
        raise
    _prune(plan)
    return _finish(plan, FinalState.COMPLETED, record.outcome, reason=record.reason,
                   data=_published(plan, anchor, record))


def _release(plan: RefreshPlan, lease: TrainerLease | None, *, kept: str | None) -> None:
    """Free the trainer's devices (the teardown's own errors are logged: what fails here is the
    spool's disk as it records the shutdown). A failed release raises only while it is the run's
    end; `kept` says why it is not: the run already failed of its own error, or its snapshot was
    decided on the devices (published: `current` moved and the lineage says so; ending the run
    failed would hand its windows to be trained again), and the release's failure is logged."""
    try:
        release_trainer(plan, lease)
    except Exception as exc:
        if kept is None:
            raise
        get_run_logger().warning("releasing run %s's trainer failed (%s: %s): %s", plan.run_id,
                                 type(exc).__name__, exc, kept)


def _prune(plan: RefreshPlan) -> None:
    """Retention, once the lineage is recorded: the model's run checkpoint folders, then its snapshots."""
    prune_checkpoints(plan)
    prune_snapshots(plan)


def _published(plan: RefreshPlan, anchor: str, record: LineageRecord, **extra: Any) -> dict[str, Any]:
    """What the flow returns for a refresh that published (or gated) `anchor`."""
    return {"run_id": plan.run_id, "model": plan.model, "mode": plan.mode, "anchor": anchor,
            "snapshot": record.snapshot, "outcome": record.outcome.value, "windows": list(record.windows),
            "parent": record.parent_run_id, **extra}


def _publish_reused(plan: RefreshPlan, progress: RunProgress, reused: LineageRecord) -> State:
    """Publish the anchor a stopped refresh of the same windows sealed (`tasks/anchor_reuse.py`):
    nothing reserved or trained, so no ETT row (that training's is the stopped run's row)."""
    anchor = str(reused.anchor)
    progress.show(f"publishing the anchor run {reused.run_id} sealed before it stopped: nothing to train again")
    try:
        record = record_lineage(plan, anchor, publish(plan, anchor))
    except Exception as exc:
        record_failure(plan, exc, get_run_logger())  # the stopped run's record keeps the anchor for the next try
        if _will_retry():
            raise
        return _finish(plan, FinalState.FAILED, Outcome.FAILED, reason=f"{type(exc).__name__}: {exc}", data=exc,
                       archive=False)
    _prune(plan)
    why = (f"published the anchor of run {reused.run_id}, which trained these windows and stopped after sealing "
           f"it; not trained again, no ETT row (its training is in run {reused.run_id}'s)")
    return _finish(plan, FinalState.COMPLETED, record.outcome, archive=False,
                   data=_published(plan, anchor, record, reused_from=reused.run_id),
                   reason=f"{why}; {record.reason}" if record.reason else why)  # the gate's word after it


def _train_and_publish(plan: RefreshPlan, progress: RunProgress, fence: ClaimsFence) -> tuple[str, Any]:
    """reserve -> train (stopped when `fence` finds the run taken for dead) -> anchor -> [publish
    on the devices] -> release -> publish on the CPU."""
    lease = reserve_trainer(plan)
    try:
        anchor = anchor_checkpoint(plan, train(plan, lease, fence))
        if plan.publish_in_trainer:
            progress.show("publishing the snapshot while the trainer holds its devices")
        held = publish(plan, anchor, on_devices=True) if plan.publish_in_trainer else None
    except BaseException:
        _release(plan, lease, kept="the run's own error is the one raised")
        raise
    _release(plan, lease, kept=f"its snapshot was {held.outcome.value} on the devices, which stands"
             if held is not None else None)
    if held is None:
        progress.show("publishing the snapshot on the CPU")
    return anchor, held or publish(plan, anchor)
