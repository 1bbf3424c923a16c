"""Reconciliation: every run in the spool gets its right row, whatever died.

`reconcile(spool_root, warehouse_url)` looks at the runs of one spool and archives those whose
row is missing or wrong. It runs at the start of every refresh (`reconcile_before_refresh`, on
the refresh's own spool and warehouse, skipping the run that starts) and as
`ettflow archive --pending`; `ettflow archive --run ID` runs it for named runs. Both first write
the lineage records that wait in the spool (`settle_pending_lineage`, `ett.lineage_pending`).

Which runs (`--pending`): those the flow started, i.e. with a heartbeat record
(`ett.heartbeat`), and those with a pending mark (`ett.archive`). Spools without either (bench
jobs, sample runs, an older ettflow) are archived only when named (`--run`). A refresh skips
the runs settled for its warehouse (`ett.settled`: their row was found right, their end is
`SETTLE_AFTER_S` old, and nothing wrote to them since), so its cost grows with the runs not yet
settled; `ettflow archive --pending` reads them all.

For each run, from what its spool says:

- live (heartbeat within its bound, no end): left alone (named: archived as ``running``);
- orphaned (no end, heartbeat older than its bound, no final status anywhere): an
  `orchestrator` failure is added to its spool at the last heartbeat, detected at the last
  heartbeat + the bound (`ett.orphans`), and it is archived as ``crashed``; a record that
  ended ``crashed`` (the body died of a BaseException) gets the same, at its end;
- a skipped refresh (its spool's one skip event, `tasks.skipped`) is ``skipped`` whatever its
  heartbeat says (killed before it was forgotten): it reserved, trained and claimed nothing;
- otherwise its status is, first match wins: a final status (completed, failed, crashed,
  cancelled: what a flow hook records) in its pending mark or its row, the heartbeat's
  outcome, ``running`` (live, named), the pending mark's status, the row's status, ``unknown``.

A run is archived when it has a pending mark, no row, a row with another status, or a row
that read a different spool (`spool_bytes` differs: the spool grew). Archiving is idempotent,
so reconciling twice, or from two refreshes at once, writes one row. A run whose row is found
right, ended (or found dead) `SETTLE_AFTER_S` ago with no file of it written since and nothing
of it pending, is settled for that warehouse (`SETTLE_PER_REFRESH` at most per refresh).
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from ettflow.ett.archive import (
    OUTAGES,
    PENDING_FILE,
    ArchiveResult,
    PendingRow,
    archive_or_defer,
    outage_reason,
    outage_trace,
    pending_file,
    read_pending,
    settles_lineage,
    shown_url,
)
from ettflow.ett.events import PhaseEvent
from ettflow.ett.heartbeat import HeartbeatRecord, heartbeat_file, read_heartbeat
from ettflow.ett.lineage import ClaimsLost, Outcome, finish_refresh, settle_ended_run
from ettflow.ett.lineage_pending import (
    LINEAGE_PENDING_FILE,
    clear_pending_lineage,
    pending_lineage_runs,
    read_pending_lineage,
)
from ettflow.ett.orphans import record_orchestrator_failure
from ettflow.ett.settled import SETTLE_AFTER_S, Fingerprint, fingerprint, settle, settled_runs, unsettle
from ettflow.ett.spool import spool_bytes, spooled_runs
from ettflow.ett.warehouse import RunInfo, Warehouse, default_url
from ettflow.ett.warehouse_models import Run
from ettflow.tasks.run_spool import RunRecorder
from ettflow.tasks.skipped import skip_reason

from . import run_spool
from .archive import log_result, run_info

if TYPE_CHECKING:
    from .parameters import WarehouseParams

log = logging.getLogger("ettflow.tasks")

FINAL_STATUSES = frozenset({"completed", "failed", "crashed", "cancelled"})  # Prefect's final state types
SKIPPED = "skipped"  # a refresh that reserved, trained and claimed nothing (`tasks.skipped`)
_IN_CHUNK = 500
# runs a refresh settles at most (`ett.settled`): settling costs a file each (0.1-0.8 ms here), so a
# spool that never had the index (an upgrade) is settled over a few refreshes, none of them paying
# more than this on top of what it paid before; `ettflow archive --pending` settles them all
SETTLE_PER_REFRESH = 100
# settled runs a refresh reads again, drawn at random: what the settled index's invariant cannot see
# (a writer killed between a line and its close, a shared file system's cached attributes) is
# found within a few hundred refreshes instead of never (the 20 cost about 0.01 s a refresh here)
RECHECK_PER_REFRESH = 20


@dataclass(frozen=True)
class Reconciled:
    """What reconciling one run did. action: archived, pending (the warehouse is down: the row
    waits), skipped (live, or its row is right), settled (it ended before spooling anything: no
    row, its claims released), or error (the run cannot be archived)."""

    run_id: str
    action: str
    note: str
    status: str | None = None
    result: ArchiveResult | None = None
    indexed: bool = False  # entered into the settled index (`ett.settled`) for the warehouse


@dataclass(frozen=True)
class _Row:
    status: str
    info: RunInfo
    spool_bytes: Any


def _rows(url: str | None, run_ids: list[str]) -> dict[str, _Row]:
    t = Run.__table__
    out: dict[str, _Row] = {}
    with Warehouse.open(url) as wh, wh.engine.connect() as conn:
        for i in range(0, len(run_ids), _IN_CHUNK):
            stmt = select(t.c.run_id, t.c.model, t.c.mode, t.c.flow_run_id, t.c.status, t.c.tags).where(
                t.c.run_id.in_(run_ids[i : i + _IN_CHUNK]))
            for r in conn.execute(stmt):
                tags = dict(r.tags or {})
                info = RunInfo(run_id=r.run_id, model=r.model, mode=r.mode, flow_run_id=r.flow_run_id,
                               status=r.status, tags=tags)
                out[r.run_id] = _Row(r.status, info, tags.get("spool_bytes"))
    return out


def candidates(spool_root: Path | str, settled: Collection[str] = frozenset()) -> list[str]:
    """The runs `--pending` looks at: spooled, with a heartbeat record or a pending mark, and
    not among `settled` (read first: a settled run costs no file of its)."""
    return [r for r in spooled_runs(spool_root, skip=settled)
            if heartbeat_file(spool_root, r).is_file() or pending_file(spool_root, r).is_file()]


def warehouse_key(url: str | None) -> str:
    """The settled index's name for a warehouse: a digest of its URL, password masked."""
    return hashlib.sha256(shown_url(url).encode()).hexdigest()[:16]


def _settles(beat: HeartbeatRecord | None, status: str, judged: Fingerprint, now: float) -> bool:
    """Whether a run whose row is right may be settled (`ett.settled`): it ended (or was found
    dead) `SETTLE_AFTER_S` ago, as its final status, no file of it was written since, and nothing
    of it waits for the warehouse."""
    if beat is None or status not in FINAL_STATUSES | {SKIPPED} or not judged:
        return False
    ended = beat.ended_at if beat.ended else beat.detection_at
    written = max(mtime_ns for _name, _size, mtime_ns in judged) / 1e9
    waiting = {PENDING_FILE, LINEAGE_PENDING_FILE} & {name for name, *_ in judged}
    return now - max(ended, written) >= SETTLE_AFTER_S and not waiting


def _status(beat: HeartbeatRecord | None, mark: PendingRow | None, row: _Row | None, now: float) -> str:
    ended = FINAL_STATUSES | {SKIPPED}  # a skipped run's own row or mark (`archive_run` read its spool) stands
    if mark is not None and mark.info.status in ended:
        return mark.info.status
    if row is not None and row.status in ended:  # a hook archived the run's end
        return row.status
    if beat is not None and beat.ended and beat.outcome:
        return beat.outcome
    if beat is not None and beat.is_live(now):
        return "running"
    if mark is not None:
        return mark.info.status
    return row.status if row is not None else "unknown"


def _crash_to_record(beat: HeartbeatRecord | None, mark: PendingRow | None, row: _Row | None,
                     now: float) -> tuple[float, float, str] | None:
    """(last alive, detected at, how) of the orchestrator failure the run needs, else None."""
    final = {s for s in (mark.info.status if mark else None, row.status if row else None) if s in FINAL_STATUSES}
    if beat is None or not final <= {"crashed"}:  # a hook recorded another end (e.g. cancelled): it stands
        return None
    if beat.ended:
        return (beat.ended_at, beat.ended_at, "process_exit") if beat.outcome == "crashed" else None
    if beat.is_orphaned(now):
        return beat.last_beat, beat.detection_at, "heartbeat"
    return None


def _info(run_id: str, beat: HeartbeatRecord | None, mark: PendingRow | None, row: _Row | None) -> RunInfo:
    if mark is not None:
        return mark.info
    if row is not None:
        return row.info
    labels = dict(beat.labels) if beat is not None else {}
    return run_info(run_id, labels, status="unknown",
                    flow_run_id=labels.get("flow_run_id", run_id) if beat is not None else None)


def reconcile_run(spool_root: Path | str, url: str | None, run_id: str, row: _Row | None, *,
                  now: float, named: bool, key: str | None = None) -> Reconciled:
    """`key`: settle the run for that warehouse when its row is found right (`ett.settled`)."""
    # judged before anything the decision reads but its row (read before, and read again once settled)
    may_settle = key is not None and not named and row is not None and row.status in FINAL_STATUSES | {SKIPPED}
    judged = fingerprint(spool_root, run_id) if may_settle else ()
    beat = read_heartbeat(spool_root, run_id)
    mark = read_pending(spool_root, run_id)
    if beat is not None and beat.is_live(now) and not named:
        return Reconciled(run_id, "skipped", f"live: last heartbeat {now - beat.last_beat:.1f} s ago")
    crash = _crash_to_record(beat, mark, row, now)
    evs: list[PhaseEvent] | None = None  # read only where needed: every refresh reconciles every finished run
    skipped = None
    if crash is not None:
        evs = RunRecorder(spool_root, run_id).events()
        # a skipped refresh reserved and trained nothing and holds no claim: killed before its
        # heartbeat was forgotten, it is still skipped, never a crash
        skipped = skip_reason(evs)
        crash = None if skipped is not None else crash
    if crash is not None:
        last_alive, detected_at, how = crash
        try:
            record_orchestrator_failure(
                spool_root, run_id, last_alive=last_alive, detected_at=detected_at, detection=how,
                reason=(f"the flow's process stopped heartbeating at {last_alive:.3f} (bound {beat.bound_s:.1f} s)"
                        if how == "heartbeat" else "the flow's process died (it ended crashed)"))
        except OSError as exc:  # SpoolWriteError: a full disk; the run stays orphaned until it has room
            return Reconciled(run_id, "error", f"cannot record its crash in the spool: {exc}", "crashed")
        status = "crashed"
        evs = RunRecorder(spool_root, run_id).events()  # with its failure
    else:
        status = SKIPPED if skipped is not None else _status(beat, mark, row, now)
    current = spool_bytes(spool_root, run_id)
    if not named and mark is None and row is not None and row.status == status and row.spool_bytes == current:
        if key is not None and _settles(beat, status, judged, now) and settle(spool_root, run_id, key, judged):
            return Reconciled(run_id, "skipped", "its row is up to date (settled)", status, indexed=True)
        return Reconciled(run_id, "skipped", "its row is up to date", status)
    if evs is None:
        evs = RunRecorder(spool_root, run_id).events()
        skipped = skip_reason(evs)
        status = SKIPPED if skipped is not None else status
    # it died before spooling anything (between its claim and its trainer), or spooled only work off
    # the clock (a stopped run's anchor published): no row, its claims released
    if not run_spool.measurable(evs) and row is None:
        return _settle_unspooled(url, spool_root, run_id, _info(run_id, beat, mark, row).model, status)
    if row is not None and (unspooled := int(row.info.tags.get("unspooled_events") or 0)):
        total = int(row.info.tags.get("spooled_events") or 0) + unspooled
        if len(evs) < total:  # archived by its own process with events the disk refused: more than the spool has
            return Reconciled(run_id, "skipped", (
                f"its row was archived by its own process with {unspooled} event(s) the disk refused; the spool "
                f"holds {len(evs)} of its {total}: the row stands"), row.status)
    base = _info(run_id, beat, mark, row)
    info = replace(base, status=status, tags={**base.tags, **run_spool.publish_summary(evs),
                                              **({"skip_reason": skipped} if skipped is not None else {})})
    try:
        result = archive_or_defer(url, spool_root, info)
    except (ValueError, OSError) as exc:
        return Reconciled(run_id, "error", str(exc), status)
    log_result(result)
    if result.pending is not None:
        return Reconciled(run_id, "pending", result.pending.message, status, result)
    why = "orphaned" if crash is not None else ("pending row" if mark is not None else "row missing or stale")
    return Reconciled(run_id, "archived", why, status, result)


def _settle_unspooled(url: str | None, spool_root: Path | str, run_id: str, model: str,
                      status: str) -> Reconciled:
    """A run with a heartbeat and nothing spooled that ended (crashed: its heartbeat went
    silent): its live claims released, its lineage recorded (`lineage.settle_ended_run`)."""
    if not settles_lineage(spool_root, run_id, status):
        return Reconciled(run_id, "skipped", f"nothing spooled ({status})", status)
    with Warehouse.open(url) as wh:
        settled = settle_ended_run(wh, model, run_id, status,
                                   reason=f"its run ended {status} before it spooled anything")
    note = (f"nothing on its clock spooled: no row; windows {', '.join(settled.windows)} of model {model} released"
            if settled is not None else "nothing on its clock spooled and no claims held: no row")
    return Reconciled(run_id, "settled", note, status)


def reconcile(spool_root: Path | str, warehouse_url: str | None = None, *, run_ids: Iterable[str] | None = None,
              skip: Collection[str] = (), now: float | None = None,
              settled: Collection[str] = frozenset(), settle_limit: int | None = None,
              rechecked: Collection[str] = frozenset()) -> list[Reconciled]:
    """Reconcile the named runs (archived whatever their state), or every candidate run of the
    spool (`candidates`: live ones left alone, and `settled` ones never read); `skip` is never
    touched. A run found right long after its end is settled for this warehouse, `settle_limit`
    of them at most (None: no limit); `rechecked` ones are settled already (their entry stays
    unless their row is written). Raises `OUTAGES` (e.g. `WarehouseError`) when the
    warehouse cannot be read to compare rows."""
    now = time.time() if now is None else now
    named = run_ids is not None
    key = warehouse_key(warehouse_url)
    runs = [r for r in (list(run_ids) if named else candidates(spool_root, settled)) if r not in skip]
    for gone in set(rechecked) - set(runs):  # an entry whose run folder was removed
        if not (Path(spool_root) / gone).exists():
            unsettle(spool_root, gone)
    if not runs:
        return []
    rows = _rows(warehouse_url, runs)
    out: list[Reconciled] = []
    room = settle_limit
    try:
        for run_id in runs:
            if not (Path(spool_root) / run_id).is_dir():
                out.append(Reconciled(run_id, "error", f"no spool for run {run_id!r} under {spool_root}"))
                continue
            settles = (room is None or room > 0) and run_id not in rechecked
            out.append(reconcile_run(spool_root, warehouse_url, run_id, rows.get(run_id), now=now, named=named,
                                     key=key if settles else None))
            room = room - out[-1].indexed if room is not None else None
        return _rows_unchanged(spool_root, warehouse_url, rows, out)
    except BaseException:  # the rows of what this call settled were not read again: take the entries back
        for r in out:
            if r.indexed:
                unsettle(spool_root, r.run_id)
        raise


def _rows_unchanged(spool_root: Path | str, url: str | None, rows: Mapping[str, _Row],
                    out: list[Reconciled]) -> list[Reconciled]:
    """Take back the entries of runs whose row changed since it was judged (another process
    archived them meanwhile, perhaps from an older read of the spool: `ett.settled`)."""
    indexed = [r.run_id for r in out if r.indexed]
    if not indexed:
        return out
    now_rows = _rows(url, indexed)

    def same(run_id: str) -> bool:
        a, b = rows.get(run_id), now_rows.get(run_id)
        return a is not None and b is not None and (a.status, a.spool_bytes) == (b.status, b.spool_bytes)

    changed = {r for r in indexed if not same(r)}
    for run_id in changed:
        unsettle(spool_root, run_id)
    return [replace(r, indexed=False, note="its row changed meanwhile") if r.run_id in changed else r for r in out]


def settle_pending_lineage(spool_root: Path | str, warehouse_url: str | None, *,
                           skip: Collection[str] = (), settled: Collection[str] = frozenset()) -> list[Reconciled]:
    """Write the lineage records that wait in the spool (`ett.lineage_pending`: their refresh
    ended while the warehouse was down), settling their window claims; each is removed once
    written. A PUBLISHED record whose run lost its claims meanwhile (taken for dead while it
    stood still: `lineage.ClaimsLost`) is written FAILED, with why. Raises `OUTAGES` when the
    warehouse is still down (the records stay). `settled` runs are not looked at."""
    runs = [r for r in pending_lineage_runs(spool_root, skip=settled) if r not in skip]
    if not runs:
        return []
    out = []
    with Warehouse.open(warehouse_url) as wh:
        for run_id in runs:
            record = read_pending_lineage(spool_root, run_id)
            if record is None:
                out.append(Reconciled(run_id, "error", "its pending lineage record is unreadable (left in place)"))
                continue
            try:
                written = finish_refresh(wh, record)
            except ClaimsLost as lost:  # taken for dead while it stood still: not the model's refresh
                record = replace(record, outcome=Outcome.FAILED, reason=str(lost)[:2000])
                written = finish_refresh(wh, record)
            clear_pending_lineage(spool_root, run_id)
            if not written:  # a later try of the run recorded its end since: that one stands
                out.append(Reconciled(run_id, "skipped", f"its pending lineage record ({record.outcome.value}) was "
                                      "older than the run's recorded end (a later try's): removed, not written"))
                continue
            out.append(Reconciled(run_id, "archived", f"lineage of model {record.model} recorded: "
                                  f"{record.outcome.value}, windows {', '.join(record.windows) or '-'}"))
    return out


def reconcile_before_refresh(spool_root: Path | str, warehouse_url: str | None, run_id: str,
                             logger: logging.Logger | logging.LoggerAdapter | None = None, *,
                             recheck: int = RECHECK_PER_REFRESH) -> list[Reconciled]:
    """The start of every refresh: archive the spool's pending and orphaned runs (not `run_id`,
    the one starting), but those settled for its warehouse (`ett.settled`), which it never reads:
    its cost on the refresh's clock grows with the runs not yet settled, not with the spool;
    `recheck` settled runs, drawn at random, are read again. Never raises: a warehouse that is
    down leaves them for the next time."""
    logger = logger or log
    try:
        settled = settled_runs(spool_root, warehouse_key(warehouse_url))
        rechecked = frozenset(random.sample(list(settled), min(max(recheck, 0), len(settled))))
        done = settle_pending_lineage(spool_root, warehouse_url, skip={run_id}, settled=settled - rechecked)
        done += reconcile(spool_root, warehouse_url, skip={run_id}, settled=settled - rechecked,
                          settle_limit=SETTLE_PER_REFRESH, rechecked=rechecked)
    except OUTAGES as exc:
        logger.warning("reconciliation skipped: the warehouse is unavailable (%s); pending runs wait for the "
                       "next refresh or `ettflow archive --pending`", outage_reason(exc, warehouse_url))
        return []
    except Exception as exc:  # noqa: BLE001 - reconciling other runs never fails this one
        logger.warning("reconciliation of %s failed: %s", spool_root,  # a driver's message may quote the URL
                       outage_trace(exc, warehouse_url or default_url()))
        return []
    for r in done:
        if r.action != "skipped":
            logger.info("reconciled run %s: %s (%s)", r.run_id, r.action, r.note)
    return done


def summary(done: Iterable[Reconciled]) -> Mapping[str, int]:
    counts: dict[str, int] = {}
    for r in done:
        counts[r.action] = counts.get(r.action, 0) + 1
    return counts


def reconcile_task():
    """`reconcile-pending`, the Prefect task the refresh flow runs first (built lazily so this
    module stays importable without Prefect's task machinery)."""
    from prefect import get_run_logger, task
    from prefect.cache_policies import NO_CACHE

    @task(name="reconcile-pending", cache_policy=NO_CACHE)
    def reconcile_pending(spool_root: str, warehouse: WarehouseParams, run_id: str) -> dict[str, int]:
        """Archive this spool's pending and orphaned runs before the refresh starts. `warehouse`:
        the run's `WarehouseParams`, resolved here, so no URL (a Secret block's holds its
        password) travels as a task argument."""
        from .warehouse_url import resolve_warehouse_url

        url = resolve_warehouse_url(warehouse)
        return dict(summary(reconcile_before_refresh(spool_root, url, run_id, get_run_logger())))

    return reconcile_pending
