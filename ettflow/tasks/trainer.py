"""The trainer's tasks, in flow order: reserve -> train -> anchor checkpoint -> release.

Idempotent on the anchor: a run whose checkpoint folder already holds an anchor written by
this run (a flow retry after training finished) reserves nothing and trains nothing; `train`
returns that anchor. Attempt numbers continue where the run's spool stops, so a task retry
or a flow retry never appends to an earlier attempt's files.

One failure budget per run: the driver's restarts and the train task's own retry ask the same
`FailurePolicy` (`failure_policy`), and a retry counts the failures already in the spool.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from ettflow.ett.archive import cache_refusal_tags, damage_tags, fallback_tags
from ettflow.ett.failures import Failure
from ettflow.ett.spool import SpoolWriteError
from ettflow.tasks.plan import RefreshPlan
from ettflow.trainer.checkpoint.anchor import read_anchor
from ettflow.trainer.checkpoint.latest import latest_checkpoint
from ettflow.trainer.classify import stop_signal
from ettflow.trainer.group.driver import TrainingDriver, TrainingFailed
from ettflow.trainer.group.failure_policy import DefaultFailurePolicy, FailureDecision
from ettflow.trainer.group.stop_request import DeferredStop, RunWithdrawn, StopRequested, note_stop
from ettflow.trainer.protocol import RankResult, Repair

from . import run_spool
from .archive import archive_on_task_state
from .claims_fence import ClaimsFence
from .lease import TrainerLease
from .progress import ProgressReporter

if TYPE_CHECKING:  # ray is imported when a trainer is reserved, not with the flow
    from ettflow.trainer.group.ray_group import RayConnection

# the run's warning on a damaged compile-cache archive its pooled worker met before the run, by
# what became of it (`pooled_repair`)
POOLED_REPAIR = {
    Repair.REPLACED.value: "its pooled worker compiled cold before the run and replaced it",
    Repair.REPLACED_BY_ANOTHER.value: "its pooled worker compiled cold before the run; another process had "
                                      "replaced it",
    Repair.RESTORED_REPLACEMENT.value: "another process saved the archive since; its pooled worker restored that "
                                       "before the run and compiled warm",
    Repair.NOT_REPLACED.value: "its pooled worker compiled cold before the run; the archive could not be replaced",
}


def pooled_repair(repair: str | None) -> str:
    """The warning's words for a pooled worker's `repair`. A record without one (spooled before it
    was kept) had one outcome then: replaced."""
    if repair is None:
        return POOLED_REPAIR[Repair.REPLACED.value]
    return POOLED_REPAIR.get(repair, f"its pooled worker's repair: {repair}")


@dataclass(frozen=True)
class Trained:
    run_id: str
    anchor: str | None  # the anchor checkpoint folder rank 0 wrote (None: it wrote none)
    attempts: int  # attempts this task ran (0: the anchor was already there)
    reused: bool  # training had finished before (flow retry): nothing was trained now
    failures: list[Failure] = field(default_factory=list)  # this try's, in order
    rank0: RankResult | None = None  # what rank 0 returned (None: reused)


def cancelled_by(flow_run_id: str) -> str | None:
    """Who stopped this flow run's process, when it was an operator: Prefect puts a run it is
    cancelling (the UI's or CLI's Cancel) in CANCELLING before its worker stops the process, so
    that state then says so (a sentence); None otherwise (a preemption) or with no API to ask."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        return None
    with get_client(sync_client=True, httpx_settings={"timeout": 5.0}) as client:
        state = client.read_flow_run(UUID(flow_run_id)).state
    if state is not None and (state.is_cancelling() or state.is_cancelled()):
        said = (state.message or "").splitlines()[0][:120] if state.message else ""
        return f"cancelled by an operator (Prefect state {state.name}{': ' + said if said else ''})"
    return None


def finished_anchor(plan: RefreshPlan) -> Path | None:
    """The anchor checkpoint this run already wrote, if training finished."""
    latest = latest_checkpoint(plan.trainer)
    if latest is None:
        return None
    info = read_anchor(latest.path)
    return Path(latest.path) if info and info.get("run_id") == plan.run_id else None


def record_queueing(plan: RefreshPlan, attempt: int, until: float, **attrs: Any) -> None:
    """The wait before an attempt that no driver measured: from submission (attempt 0) or
    from the end of the run's last recorded activity (a retry) to `until`."""
    last = run_spool.on_clock_end(plan.recorder.events())  # off-clock events do not count
    start = min(last or plan.submitted_at or until, until)
    plan.recorder.record(attempt, "scheduling", start, until, **attrs)


def record_ray_connection(plan: RefreshPlan, attempt: int, conn: RayConnection, t0: float,
                          logger: Any) -> dict[str, Any]:
    """Say how the run came to Ray; a local Ray started for it is its own `ray_start` phase
    (scheduling: the run pays for it) and says so. Returns the scheduling event's attributes."""
    if conn.started:
        from prefect.runtime import deployment

        plan.recorder.record(attempt, "ray_start", t0, t0 + conn.seconds,
                         address=conn.address)
        # a deployment's run should have joined a Ray that outlives it: say so where its user looks
        # (`ettflow refresh` starts one by design: its report's phases show it, the console stays short)
        say = logger.warning if deployment.id else logger.debug
        say("no Ray cluster to join (RAY_ADDRESS is not set): started a local Ray on this run's clock (%.1f s); "
            "`ettflow up` keeps one running for every run", conn.seconds)
    elif conn.how == "joined":
        logger.info("joined the Ray cluster at %s (%.2f s)", conn.address, conn.seconds)
    return {"ray": conn.how, "ray_address": conn.address, "ray_s": round(conn.seconds, 3)}


def new_lease(plan: RefreshPlan, first_attempt: int) -> TrainerLease:
    from ettflow.trainer.group.ray_group import RayWorkerGroup, end_run
    from ettflow.trainer.group.warm_pool import POOL
    from ettflow.trainer.rank.actor import TrainerActor

    from .schedule import next_scheduled_run

    def make_group(attempt: int) -> RayWorkerGroup:
        # the process's pool (the cluster's, once this process joined one: `ensure_ray`); the
        # deployment's next scheduled run, asked when the run ends, times the pool's prewarm
        return RayWorkerGroup(plan.trainer, plan.run_id, attempt, plan.spool_root, actor_cls=TrainerActor,
                              pool=POOL, next_run_at=lambda: next_scheduled_run(plan.run_id),
                              spare_share=plan.spare_share)

    def end() -> None:  # the run's parts of its model's shared spares go to its last attempt
        end_run(plan.run_id, POOL, spool_root=plan.spool_root, attempt=plan.recorder.last_attempt())

    return TrainerLease(run_id=plan.run_id, spool_root=plan.spool_root, world_size=plan.trainer.world_size,
                        make_group=make_group, first_attempt=first_attempt, end_run=end,
                        hold_after_training=plan.publish_in_trainer)


@task(name="reserve-trainer", cache_policy=NO_CACHE)
def reserve_trainer(plan: RefreshPlan) -> TrainerLease | None:
    """Start (or join) Ray and reserve the placement for the next attempt; the wait from
    submission to a ready group is recorded as scheduling."""
    logger = get_run_logger()
    anchor = finished_anchor(plan)
    if anchor is not None:
        logger.info("run %s already trained (anchor %s): nothing to reserve", plan.run_id, anchor)
        return None
    from ettflow.trainer.group.ray_group import ensure_ray

    attempt = plan.recorder.next_attempt()
    lease = new_lease(plan, attempt)
    t0 = time.time()
    logger.info("reserving %d trainer slots on Ray for attempt %d", plan.trainer.world_size, attempt)
    ray_attrs: dict[str, Any] = {}
    queued = False
    try:
        ray_attrs = record_ray_connection(plan, attempt, ensure_ray(), t0, logger)
        lease.reserve()
        ready = time.time()
        queued = True  # recorded, or kept by this process when the disk refuses it (`ett.spool`)
        record_queueing(plan, attempt, ready, stage="reserve_trainer", reserved=True, placement_s=ready - t0,
                        **ray_attrs)
    except BaseException as exc:
        # the failure is recorded and the reservation released whatever the spool's disk says:
        # a refused event is kept by this process and archived from there
        with contextlib.suppress(SpoolWriteError):
            if not queued:
                record_queueing(plan, attempt, time.time(), stage="reserve_trainer", reserved=False, **ray_attrs)
        with contextlib.suppress(SpoolWriteError):
            plan.recorder.record_task_failure(attempt, exc, task="reserve-trainer", at=time.time(),
                                              stop_cause=lambda: cancelled_by(plan.run_id))
        lease.release()
        raise
    logger.info("trainer reserved in %.1f s", ready - t0)
    return lease


def failure_policy(plan: RefreshPlan) -> DefaultFailurePolicy:
    """The run's failure policy: the driver's restarts and the task's retries ask the same one."""
    return DefaultFailurePolicy(max_failures=plan.trainer.max_failures)


def _retry_training(task, task_run, state) -> bool:
    """Retry the train task when the failure policy said RESTART for the failure that ended
    this try (`TrainingFailed.decision`); the budget is the run's, counted from the spool."""
    try:
        state.result()
    except TrainingFailed as exc:
        return exc.decision is FailureDecision.RESTART
    except BaseException:  # noqa: BLE001 - not a training failure (cancelled, interrupted): never retried
        return False
    return False


@task(name="train", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2, retry_condition_fn=_retry_training,
      on_failure=[archive_on_task_state])
def train(plan: RefreshPlan, lease: TrainerLease | None, fence: ClaimsFence | None = None) -> Trained:
    """Run the training driver (restarts as the failure policy says); a task retry goes on
    with the next attempt, and the failures of earlier tries count against the same budget.
    Every error of a try leaves as `TrainingFailed`, with the policy's decision on it, except
    `ClaimsLost`: `fence` (`claims_fence`), asked at each of the driver's polls, found the run
    taken for dead while it stood still; its ranks were stopped. Returns with the devices still
    held (see `release_trainer`)."""
    logger = get_run_logger()
    anchor = finished_anchor(plan)
    if anchor is not None:
        logger.info("run %s already has its anchor checkpoint %s: not training again", plan.run_id, anchor)
        return Trained(plan.run_id, str(anchor), attempts=0, reused=True)
    if lease is not None and lease.has_reserved:
        first = lease.first_attempt
    else:  # a task retry (or nothing reserved): the driver reserves; the wait so far is queueing
        first = plan.recorder.next_attempt()
        record_queueing(plan, first, time.time(), stage="train_retry")
        lease = lease or new_lease(plan, first)
    evs = plan.recorder.events()
    submitted_at = plan.submitted_at if first == 0 and not run_spool.submitted(evs) else None
    if submitted_at is not None and plan.prestarted_at is not None:
        plan.recorder.record_prestart(first, plan.prestarted_at, submitted_at)
    if plan.interval is not None:  # stored with the run: its warehouse tag and the ETT artifact show it
        plan.recorder.record_interval(first, plan.interval, time.time())
    if plan.spares is not None:  # the ETT artifact shows it (the cluster pool's, where it holds the model's spares)
        shared = lease.shared_spares()
        plan.recorder.record_spare_plan(first, plan.spares if shared is None else shared.beside(plan.spares),
                                        time.time())
    policy = failure_policy(plan)
    prior = plan.recorder.failures()
    if prior:
        logger.info("run %s had %d failure(s) before this try; they count against its budget of %d",
                    plan.run_id, len(prior), plan.trainer.max_failures)
    stop = DeferredStop()  # a SIGTERM is taken at the driver's next poll, never inside Ray's wait

    def stop_check() -> None:
        stop.check()
        if fence is not None:
            fence.check()

    driver = TrainingDriver(plan.trainer, plan.run_id, plan.spool_root, group_factory=lease.group_for,
                            failure_policy=policy, stop_check=stop_check, stop_cause=lambda: cancelled_by(plan.run_id))
    try:
        with ProgressReporter(plan, logger), stop:
            result = driver.run(first_attempt=first, submitted_at=submitted_at, prior_failures=prior)
    except TrainingFailed:
        lease.release()
        raise  # every failure is in the spool already, with its class
    except RunWithdrawn as withdrawn:  # taken for dead while it stood still: no failure of its own, no retry
        lease.release()
        if withdrawn.cause is not None:
            raise withdrawn.cause from withdrawn
        raise
    except BaseException as exc:
        if stop_signal(exc):
            note_stop()
        last = plan.recorder.last_attempt()
        with contextlib.suppress(SpoolWriteError):  # refused: kept by this process (`ett.spool`)
            plan.recorder.record_task_failure(last, exc, task="train", at=time.time(),
                                              stop_cause=lambda: cancelled_by(plan.run_id))
        lease.release()
        if isinstance(exc, Exception):  # an error outside the driver's loop: the policy decides, as for any
            history = plan.recorder.failures()
            failure, earlier = history[-1], history[:-1]
            raise TrainingFailed(plan.run_id, history, policy.decide(failure, earlier),
                                 policy.explain(failure, earlier)) from exc
        if isinstance(exc, StopRequested):  # Prefect's own stop from here on: the run crashes, the process exits
            from prefect.exceptions import TerminationSignal

            raise TerminationSignal(signal=exc.signal) from exc
        raise
    if fence is not None:
        fence.after_training()  # raises the ClaimsLost of ranks that finished while the process stood still
    rank0 = result.rank0
    logger.info("trained to step %s in %d attempt(s); anchor %s", rank0.final_step, result.attempts, rank0.anchor)
    evs = plan.recorder.events()
    for refused in cache_refusal_tags(evs).get("compile_cache_refused", []):
        what = (pooled_repair(refused.get("repair")) if refused.get("pooled")
                else "compiled cold; the run's end saves a new one")
        logger.warning("attempt %d, rank %d: the compile cache's archive was refused (%s: %s): %s", refused["attempt"],
                       refused["rank"], refused["miss"], refused["reason"], what)
    for damage in fallback_tags(evs).get("checkpoint_fallbacks", []):
        logger.warning("attempt %d: checkpoint step %s was damaged (%s): restored step %s instead, %d step(s) "
                       "trained again", damage["attempt"], damage["damaged_step"], damage["file"] or "its folder",
                       damage["restored_step"] if damage["restored_step"] is not None else "none (from scratch)",
                       damage["steps_lost"])
    for damage in damage_tags(evs).get("checkpoint_damaged", []):
        logger.warning("attempt %d: durable checkpoint step %s is damaged (%s), found while the memory tier served a "
                       "recovery: nothing was restored from it; a restart would have restored step %s",
                       damage["attempt"], damage["damaged_step"], damage["file"] or "its folder",
                       damage["restored_step"] if damage["restored_step"] is not None else "none (from scratch)")
    if result.unfired:  # a scripted fault the run never reached: the run is not the one that was asked for
        logger.warning("%d scripted fault(s) never fired (the run trained to step %s): %s", len(result.unfired),
                       rank0.final_step, ", ".join(f.spec for f in result.unfired))
    return Trained(plan.run_id, rank0.anchor, attempts=result.attempts, reused=False, failures=result.failures,
                   rank0=rank0)


@task(name="anchor-checkpoint", cache_policy=NO_CACHE)
def anchor_checkpoint(plan: RefreshPlan, trained: Trained) -> str:
    """The run's anchor checkpoint, checked: committed, and written by this run."""
    path = Path(trained.anchor) if trained.anchor else None
    if path is None or not path.is_dir():
        path = finished_anchor(plan)
    info = read_anchor(path) if path is not None else None
    if path is None or info is None or info.get("run_id") != plan.run_id:
        raise RuntimeError(f"run {plan.run_id} has no anchor checkpoint of its own under "
                           f"{plan.trainer.checkpoint_dir} (found {info!r} at {path})")
    get_run_logger().info("anchor checkpoint %s (step %s)", path, info.get("step"))
    return str(path)


@task(name="release-trainer", cache_policy=NO_CACHE)
def release_trainer(plan: RefreshPlan, lease: TrainerLease | None) -> float:
    """Tear the trainer down and free its devices; the time they were held after training
    is recorded as shutdown. Idempotent; nothing to do when nothing was reserved."""
    if lease is None:
        return 0.0
    held = lease.release()
    get_run_logger().info("trainer released (devices held %.2f s after training)", held)
    record_pool_ledger(plan)
    return held


def record_pool_ledger(plan: RefreshPlan) -> int:
    """What the cluster's pool released unclaimed since the last run (idle, reshaped, failed)
    into the run's warehouse ledger; a failure is logged and the lines wait in the pool."""
    import ray

    from ettflow.trainer.group.ray_group import local_ray_going

    if not ray.is_initialized() or local_ray_going():  # no pool to ask (a local Ray going with this process)
        return 0
    from ettflow.ett.warehouse import Warehouse
    from ettflow.tasks.warehouse_url import error_text, resolve_warehouse_url
    from ettflow.trainer.group.pool_service import drain_ledger, service

    def write(lines):
        with Warehouse.open(resolve_warehouse_url(plan.warehouse)) as wh:
            wh.record_holdings(lines)

    try:
        pool = service(create=False)
        moved = drain_ledger(pool, write) if pool is not None else 0
    except Exception as exc:  # noqa: BLE001 - the ledger waits in the pool; the run is not affected
        get_run_logger().warning("the cluster pool's ledger was not recorded (%s); it waits for the next run "
                                 "or `ettflow pool stop`", error_text(exc, plan.warehouse))
        return 0
    if moved:
        get_run_logger().info("held capacity: %d line(s) the cluster pool released unclaimed, recorded", moved)
    return moved
