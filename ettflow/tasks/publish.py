"""The publish task: anchor checkpoint -> validated inference snapshot (`ettflow.publish`).

Thin: one call to `publish_snapshot`, retried by Prefect for failures that may pass on a retry
(`is_retryable`); a retry publishes again from the same anchor and never retrains. Each try is
recorded on the run's spool: `publish` when the trainer still holds its devices (baseline:
counted in shutdown), `publish_standalone` on the CPU after the release (off the device
clock), with `outcome` published or failed (then `failure_class="publish"` and the error).
A snapshot this run already published from this anchor is kept (a flow retry).

Then the publish gate (`ettflow.publish.gate`): the new snapshot is compared with the model's
current one on the held-out window; only a snapshot that is not worse beyond the plan's
`gate_max_auc_drop` / `gate_max_logloss_increase` moves the model's `current` pointer. The
task returns a `PublishOutcome` (published or gated, and why); a gated try is recorded with
`outcome="gated"` and its reason. The snapshot's manifest names its parent (the current
snapshot it follows, and the anchor its training started from) and its windows.

`current` moves only while the run still holds its windows' claims, and the refresh is recorded
PUBLISHED in the move's transaction (`claims_guard`, `ett.lineage.publishing`; the record-lineage
task writes it again): a run taken for dead while it stood still, whose windows another refresh
may be training, fails with `ClaimsLost` and is not retried (its try is recorded with
`outcome="withdrawn"`: no failure of its own, the stand-still that cost it the claims is the
run's one failure, recorded by whoever took them). With the warehouse unreachable the
move goes on, with a warning: claims are only taken from a run whose heartbeat stopped, and the
run's lineage waits in the spool as any run's does in an outage.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from . import run_spool
from .archive import archive_on_task_state
from .plan import RefreshPlan

if TYPE_CHECKING:
    from ettflow.ett.lineage import LineageRecord
    from ettflow.publish.gate import PublishOutcome

# The held-out examples the publish validation and the gate score (up to the held-out window's
# size). The gate compares AUCs against a 0.01 limit: on 256 examples an AUC's standard error
# is about 0.03, so the gate kept snapshots out on noise (measured on MovieLens: a 0.028 drop on
# 256 examples was 0.0006 on the whole window); on 8,192 it is about 0.005.
VALIDATION_EXAMPLES = 8192


class InjectedPublishFailure(RuntimeError):
    """A scripted publish failure (`fail_at=["publish:times=N"]`), for demos and tests."""


def _retryable(task, task_run, state) -> bool:
    try:
        state.result()
    except Exception as exc:  # noqa: BLE001
        return may_retry(exc)
    return False


def may_retry(exc: BaseException) -> bool:
    """Whether another try of the publish may succeed (never for a run that lost its claims:
    another try cannot win its windows back)."""
    from ettflow.ett.lineage import ClaimsLost
    from ettflow.publish import is_retryable

    return isinstance(exc, Exception) and not isinstance(exc, ClaimsLost) and is_retryable(exc)


@contextlib.contextmanager
def claims_guard(plan: RefreshPlan, log: Any, record: LineageRecord) -> Iterator[None]:
    """The block (the move of the model's `current`) runs while the run holds its claims, and
    the PUBLISHED `record` is written with it (`ett.lineage.publishing`); with the warehouse
    unreachable, unfenced and unrecorded (logged: the record-lineage task keeps it in the spool)."""
    from ettflow.ett import lineage
    from ettflow.ett.archive import OUTAGES
    from ettflow.ett.warehouse import Warehouse

    from .warehouse_url import error_text, resolve_warehouse_url

    with contextlib.ExitStack() as fence:
        try:
            wh = fence.enter_context(Warehouse.open(resolve_warehouse_url(plan.warehouse)))
            fence.enter_context(lineage.publishing(wh, record))
        except OUTAGES as exc:
            log.warning("model %s: cannot check that run %s still holds its windows (%s): moving the current "
                        "snapshot anyway", plan.model, plan.run_id, error_text(exc, plan.warehouse))
        yield


def already_published(plan: RefreshPlan, anchor: str) -> str | None:
    from ettflow.publish import PublishError, verify_snapshot

    folder = plan.snapshot_root / plan.run_id
    if not folder.is_dir():
        return None
    try:
        manifest = verify_snapshot(folder)
    except PublishError:
        return None
    same = Path(manifest.source.get("checkpoint", "")) == Path(anchor).resolve()
    return manifest.path if same and manifest.validation.get("passed") else None


def _outcome_of(plan: RefreshPlan, anchor: str, manifest, config, log: Any) -> PublishOutcome:
    """The gate's decision for an installed snapshot (moves `current` when it passes, while the
    run holds its claims, and records the refresh PUBLISHED with it)."""
    from ettflow.ett.lineage import Outcome
    from ettflow.publish.gate import GateConfig, gate_snapshot

    from .claims import lineage_record

    gate = GateConfig(max_auc_drop=plan.params.gate.gate_max_auc_drop,
                      max_logloss_increase=plan.params.gate.gate_max_logloss_increase)
    return gate_snapshot(manifest, config, gate, guard=lambda outcome: claims_guard(
        plan, log, lineage_record(plan, Outcome.PUBLISHED, anchor=anchor, snapshot=outcome.snapshot,
                                  reason=outcome.reason)))


@task(name="publish-snapshot", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2,
      retry_condition_fn=_retryable, on_failure=[archive_on_task_state])
def publish(plan: RefreshPlan, anchor: str, on_devices: bool = False) -> PublishOutcome:
    """Publish the anchor as `<snapshot_root>/<run_id>/` and gate it against the model's
    current snapshot; returns the `PublishOutcome` (published: `current` moved to it; gated:
    `current` stayed, `reason` says why)."""
    from ettflow.publish import PublishConfig, publish_snapshot, read_current, read_manifest

    logger = get_run_logger()
    current = read_current(plan.snapshot_root)
    config = PublishConfig(
        anchor=anchor, output_root=plan.snapshot_root, data_root=plan.trainer.data_root,
        windows=plan.trainer.eval_windows, batch_size=(batch := min(plan.trainer.batch_size, 512)),
        validation_batches=-(-VALIDATION_EXAMPLES // batch), run_id=plan.run_id,
        parent_snapshot=(parent := current.path if current is not None and Path(current.path).name != plan.run_id
                         else None),
        delta_on=parent if plan.delta_snapshot else None)  # switch delta_snapshot: the rows changed since it
    done = already_published(plan, anchor)
    if done is not None:
        logger.info("run %s already published %s from this anchor", plan.run_id, done)
        return _outcome_of(plan, anchor, read_manifest(done), config, logger)
    phase = "publish" if on_devices else "publish_standalone"
    attempt = plan.recorder.last_attempt()
    injected = sum(1 for e in run_spool.publish_records(plan.recorder.events())
                   if e.info.injected)
    start = time.time()
    logger.info("publishing %s %s", anchor, "while the trainer holds its devices" if on_devices else "on the CPU")
    try:
        faults = plan.publish_faults
        if faults.slow_s > 0:  # a stop (cancel, `ettflow down`) can land here, the anchor sealed
            logger.info("injected slow publish: waiting %.1f s before the try", faults.slow_s)
            time.sleep(faults.slow_s)
        if injected < faults.times:
            raise InjectedPublishFailure(f"injected publish failure {injected + 1} of {faults.times}")
        manifest = publish_snapshot(config)
        outcome = _outcome_of(plan, anchor, manifest, config, logger)
    except BaseException as exc:
        from ettflow.ett.lineage import ClaimsLost

        ended = {"outcome": "withdrawn"} if isinstance(exc, ClaimsLost) else {"outcome": "failed",
                                                                               "failure_class": "publish"}
        plan.recorder.record(attempt, phase, start, time.time(), **ended, error=f"{type(exc).__name__}: {exc}"[:500],
                             retryable=may_retry(exc), injected=isinstance(exc, InjectedPublishFailure))
        raise
    plan.recorder.record(attempt, phase, start, time.time(), outcome=outcome.outcome.value,
                     snapshot=manifest.path, step=manifest.step, max_abs_diff=manifest.metrics.get("max_abs_diff"),
                     reason=outcome.reason, current=outcome.current)
    logger.info("%s %s (step %d) in %.1f s: %s", outcome.outcome.value, manifest.path, manifest.step,
                time.time() - start, outcome.reason)
    stored = stored_as(manifest.delta)
    if stored:
        (logger.warning if stored.startswith("stored full, not") else logger.info)("snapshot %s", stored)
    return outcome


def stored_as(delta: dict) -> str | None:
    """How a snapshot asked to be a delta was stored, in words (None: a full snapshot as asked):
    the delta's base and size, or why it is full (a new chain's base as planned; a warning when
    its base could not be used)."""
    if delta.get("base"):
        return (f"stored as a delta on {delta.get('base_run_id')}: {delta.get('changed_rows')} of {delta.get('rows')} "
                f"rows changed, {delta.get('bytes')} bytes against {delta.get('full_bytes')} for the full module")
    if "refused" in delta:
        return (f"stored full: {delta['refused']}" if delta.get("new_base")
                else f"stored full, not as a delta: {delta['refused']}")
    return None
