"""The `claim-windows` task: choose the refresh's windows from the model's lineage and claim
them in the warehouse, or end the refresh as skipped.

Two refreshes of one model never train the same windows and never both advance the watermark:
`ett.lineage.claim_windows` reads the watermark and the parent and claims the chosen windows in
one transaction serialized per model, and refuses (`Busy`) while another refresh of the model
holds live claims. This task asks again every `POLL_S` until it gets them or `claim_wait_s`
passed; then the refresh is skipped, with the reason. A question that waited past the
warehouse's lock timeout (another refresh holds the model's lock: it stands still in its
publish) counts as busy too. A holder whose flow heartbeat (in this
refresh's spool) has stopped past its bound is dead: it is archived as crashed at once
(`tasks.reconcile`), which releases its claims (`lineage.settle_ended_run`), and the claim is
asked again; the 24-hour `STALE_AFTER_S` is only for a holder nobody can see. A refresh whose choice is empty (no window
newer than the watermark) is skipped too: it reserves no trainer. A claimed plan gets its
checkpoint interval from the model's history read in the same visit (`plan.with_interval`).

A skipped refresh leaves one event in its spool, so its hooks archive it with status
`skipped` (`skip_reason`): the `scheduling` time from submission to the decision, with
`stage="claim_windows"`, `outcome="skipped"` and the reason; and a SKIPPED lineage record.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from sqlalchemy.exc import OperationalError

from ettflow.ett import lineage
from ettflow.ett.failure_history_db import estimate_from_warehouse
from ettflow.ett.heartbeat import read_heartbeat
from ettflow.ett.lineage import Busy, LineageRecord, Outcome
from ettflow.ett.lineage_pending import clear_pending_lineage, write_pending_lineage
from ettflow.ett.warehouse import Warehouse

from .plan import RefreshPlan, with_interval, with_lineage, with_spares
from .skipped import SKIP_STAGE
from .warehouse_url import error_text, resolve_warehouse_url

POLL_S = 1.0


@dataclass(frozen=True)
class Claim:
    """The plan bound to the model's lineage (its windows claimed), or why the refresh is
    skipped (`skipped`: then nothing is claimed and nothing will be reserved)."""

    plan: RefreshPlan
    skipped: str | None = None


def busy_reason(plan: RefreshPlan, busy: Busy, waited_s: float) -> str:
    span = f"{busy.windows[0]}..{busy.windows[-1]}" if len(busy.windows) > 1 else ", ".join(busy.windows)
    return (f"model {plan.model} is being refreshed by run {busy.holder} (it holds windows {span}); waited "
            f"{waited_s:.0f} s (claim_wait_s={plan.params.data.claim_wait_s:g}) and left those windows to it")


def locked_reason(plan: RefreshPlan, waited_s: float) -> str:
    return (f"another refresh of model {plan.model} held the model's lock past the warehouse's timeout each time "
            f"it was asked (a refresh that stands still in its publish); waited {waited_s:.0f} s "
            f"(claim_wait_s={plan.params.data.claim_wait_s:g}) and claimed nothing")


def take_claim(plan: RefreshPlan, wh: Warehouse, *, poll_s: float = POLL_S, log: Any = None,
               url: str | None = None) -> Claim:
    """Claim the plan's windows in the warehouse `wh` (at `url`, where a dead holder is
    archived), waiting up to `plan.params.data.claim_wait_s`."""
    start = time.monotonic()
    announced = False
    archived: set[str] = set()  # holders archived as dead here: each at most once
    while True:
        try:
            got = lineage.claim_windows(wh, plan.model, plan.run_id, lambda mark, parent: _bound(plan, mark, parent))
        except OperationalError as exc:
            if not lineage.lock_timed_out(exc):
                raise
            got = None  # another refresh held the model's lock past the timeout (it stands still in its publish)
        if got is not None and not isinstance(got, Busy):
            bound: RefreshPlan = got.choice
            if bound.windows_choice.nothing_new:
                return Claim(bound, f"nothing new to train for model {plan.model}: {bound.windows_choice.reason}")
            return Claim(bound)
        if got is not None and got.holder not in archived and _archive_if_dead(plan, got.holder, url, log):
            archived.add(got.holder)
            continue  # its claims are released: ask again now
        waited = time.monotonic() - start
        if waited >= plan.params.data.claim_wait_s:
            return Claim(plan, busy_reason(plan, got, waited) if got is not None else locked_reason(plan, waited))
        if log is not None and not announced:
            log.info("model %s: %s; waiting up to %g s", plan.model,
                     f"run {got.holder} holds its windows" if got is not None else
                     "another refresh holds the model's lock", plan.params.data.claim_wait_s)
            announced = True
        time.sleep(min(poll_s, max(plan.params.data.claim_wait_s - waited, 0.0)))


def _archive_if_dead(plan: RefreshPlan, holder: str, url: str | None, log: Any) -> bool:
    """Archive the holder as crashed when its flow heartbeat in this spool stopped past its
    bound (its claims are released with it); True when that released them."""
    from .reconcile import reconcile  # the archiving path every dead run takes

    beat = read_heartbeat(plan.spool_root, holder)
    if beat is None or not beat.is_orphaned(time.time()):  # alive, or ended (it settles its own claims)
        return False
    try:
        done = reconcile(plan.spool_root, url, run_ids=[holder])
    except Exception as exc:  # noqa: BLE001 - the waiting refresh goes on waiting; the next one retries
        if log is not None:
            log.warning("model %s: could not archive the dead holder %s (%s): waiting", plan.model, holder,
                        error_text(exc, plan.warehouse))
        return False
    released = bool(done) and done[0].action in ("archived", "settled") and done[0].status == "crashed"
    if log is not None:
        log.warning("model %s: run %s holds its windows but its heartbeat stopped %.0f s ago: %s", plan.model,
                    holder, time.time() - beat.last_beat,
                    "archived as crashed, its windows released" if released else f"not archived ({done})")
    return released


def _bound(plan: RefreshPlan, mark: str | None, parent: LineageRecord | None) -> tuple[tuple[str, ...], RefreshPlan]:
    bound = with_lineage(plan, mark, parent)
    return bound.trainer.windows or (), bound


def record_skip(plan: RefreshPlan, reason: str, decided_at: float) -> None:
    """The skipped run's one spool event (its wait, as scheduling)."""
    start = min(plan.submitted_at or decided_at, decided_at)
    plan.recorder.record(plan.recorder.next_attempt(),
                     "scheduling", start, decided_at, stage=SKIP_STAGE, outcome=Outcome.SKIPPED.value,
                     reason=reason[:500])


@task(name="claim-windows", cache_policy=NO_CACHE)
def claim_windows(plan: RefreshPlan) -> Claim:
    """Choose the windows past the model's watermark and claim them, or skip the refresh."""
    logger = get_run_logger()
    url = resolve_warehouse_url(plan.warehouse)
    with Warehouse.open(url) as wh:
        claim = take_claim(plan, wh, log=logger, url=url)
        if claim.skipped is None:  # sized for the claimed windows, from the model's history
            history = estimate_from_warehouse(wh, model=plan.model, now=time.time(), exclude_run=plan.run_id)
            claim = Claim(with_spares(with_interval(claim.plan, history), history))
        if claim.skipped is not None:
            now = time.time()
            lineage.finish_refresh(wh, LineageRecord(model=plan.model, run_id=plan.run_id, outcome=Outcome.SKIPPED,
                                                     reason=claim.skipped, created_at=now, finished_at=now))
    if claim.skipped is not None:
        record_skip(plan, claim.skipped, time.time())
        logger.info("refresh %s skipped: %s", plan.run_id, claim.skipped)
        return claim
    p = claim.plan
    start = f"warm from run {p.parent.run_id} ({p.parent.anchor})" if p.parent else "cold"
    logger.info("model %s: training %s (%s); %s start", p.model, ", ".join(p.trainer.windows),
                p.windows_choice.reason, start)
    logger.info("model %s: %s", p.model, "; ".join(p.interval.lines()))
    return claim


def publication(result: Any) -> tuple[Outcome, str | None, str | None]:
    """(outcome, snapshot, reason) of what the publish task returned: a snapshot folder, or an
    outcome of the publish gate (`.snapshot`, `.gated`, `.reason`)."""
    if result is None or isinstance(result, str | Path):
        return Outcome.PUBLISHED, None if result is None else str(result), None
    gated = bool(getattr(result, "gated", False))
    return (Outcome.GATED if gated else Outcome.PUBLISHED), getattr(result, "snapshot", None), \
        getattr(result, "reason", None)


def lineage_record(plan: RefreshPlan, outcome: Outcome, *, anchor: str | None = None,
                   snapshot: str | None = None, reason: str | None = None) -> LineageRecord:
    """How the refresh ended, as its lineage record (finished now)."""
    parent = plan.parent
    return LineageRecord(
        model=plan.model, run_id=plan.run_id, windows=plan.trainer.windows or (), outcome=outcome,
        parent_run_id=parent.run_id if parent else None, parent_anchor=parent.anchor if parent else None,
        parent_snapshot=parent.snapshot if parent else None, anchor=anchor, snapshot=snapshot,
        reason=None if reason is None else reason[:2000], created_at=plan.submitted_at or time.time(),
        finished_at=time.time())


@task(name="record-lineage", cache_policy=NO_CACHE)
def record_lineage(plan: RefreshPlan, anchor: str, published: Any) -> LineageRecord:
    """The refresh's lineage record: published (the watermark advances) or gated. With the
    warehouse down it waits in the spool (`ett.lineage_pending`) for the next reconciliation."""
    outcome, snapshot, reason = publication(published)
    record = settle_or_keep(plan, outcome, get_run_logger(), anchor=anchor, snapshot=snapshot, reason=reason)
    get_run_logger().info("model %s: refresh %s %s windows %s..%s%s", plan.model, plan.run_id, outcome.value,
                          record.first_window, record.last_window, f" ({reason})" if reason else "")
    return record


def settle_or_keep(plan: RefreshPlan, outcome: Outcome, log: Any, **fields: Any) -> LineageRecord:
    """Record how the refresh ended and settle its claims (`ett.lineage.finish_refresh`); when
    the warehouse is unavailable, keep the record in the run's spool instead (its claims stay
    live until the next reconciliation writes it). Never raises an outage."""
    from ettflow.ett.archive import OUTAGES

    record = lineage_record(plan, outcome, **fields)
    try:
        with Warehouse.open(resolve_warehouse_url(plan.warehouse)) as wh:
            if not lineage.finish_refresh(wh, record):
                log.warning("model %s: refresh %s's lineage (%s) was not written: the warehouse holds a record of "
                            "the run that stands (a later one, another host settled it as ended; or its PUBLISHED "
                            "one: its snapshot is the model's current)", plan.model, plan.run_id, outcome.value)
        clear_pending_lineage(plan.spool_root, plan.run_id)  # an earlier try's, kept in an outage: superseded
        return record
    except OUTAGES as exc:
        try:
            where = write_pending_lineage(plan.spool_root, record)
        except OSError as disk:
            log.error("model %s: the lineage of refresh %s (%s) is lost: the warehouse is unavailable (%s) and the "
                      "spool refused it (%s). Its window claims lapse after %.0f h", plan.model, plan.run_id,
                      outcome.value, error_text(exc, plan.warehouse), disk, lineage.STALE_AFTER_S / 3600)
            return record
        log.warning("model %s: the lineage of refresh %s (%s) waits in %s: the warehouse is unavailable (%s). The "
                    "next refresh on this spool or `ettflow archive --pending` records it; until then its windows "
                    "stay claimed", plan.model, plan.run_id, outcome.value, where, error_text(exc, plan.warehouse))
        return record


def record_failure(plan: RefreshPlan, exc: BaseException, log: Any) -> None:
    """Record a FAILED refresh and release its claims (kept in the spool while the warehouse is
    down); any other error is logged, never raised over the refresh's own error. An anchor the
    run sealed before it stopped is in the record: the next refresh of its windows publishes it
    instead of training them again (`anchor_reuse.py`). A run that lost its claims
    (`ClaimsLost`) has none to release: that is noted in its spool instead, where a flow retry
    of the run reads it and ends at once (Prefect retries a failed run while it has retries; the
    retry, finding the windows held, would be skipped and archive the run's training as a
    skipped run's)."""
    from .trainer import finished_anchor  # the train task's own test of "this run sealed its anchor"

    try:
        anchor = finished_anchor(plan)
        settle_or_keep(plan, Outcome.FAILED, log, anchor=str(anchor) if anchor is not None else None,
                       reason=f"{type(exc).__name__}: {exc}")
    except Exception:  # noqa: BLE001 - the refresh's own error is the one to raise
        log.warning("could not record the failed refresh %s in the lineage", plan.run_id, exc_info=True)
    if isinstance(exc, lineage.ClaimsLost):
        try:
            plan.recorder.mark_claims_lost(str(exc), time.time())
        except OSError:  # a full disk: a retry is skipped, as before
            log.warning("could not note in the spool that run %s lost its claims", plan.run_id)
