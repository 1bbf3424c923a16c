"""Spool -> metrics -> warehouse: the one I/O path every hook and command uses.

`archive_spooled_run` reads a run's spool, computes its ETT and upserts it (idempotent). The
row's tags record what the archive read: ``spool_bytes`` (the size of the spool it was given,
so a later spool that grew is known to need archiving again) and, when lines could not be
used, ``spool_problems`` (their count) and ``spool_problem_lines`` (the first few, each as
``file:line: kind: message``).

`archive_or_defer` does the same but survives a warehouse outage (refused connections, a
wrong URL, a full disk under SQLite): the metrics are still computed, and the run's row waits
as **pending**: a marker file ``<spool>/<run_id>/pending.json`` holds the run's `RunInfo`, why
it waits and which warehouse (its URL with the password masked: never a secret) it waits for.
`read_pending(spool, run_id)` returns it (`PendingRow.message` says how to retry), so a command
can warn and still succeed when the run itself did. The next `ettflow archive --pending` (or the reconciliation at the
start of every refresh) writes the row and removes the marker; the upserts make it exactly
one row however often that runs.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from .events import CHECKPOINT_DAMAGED, CHECKPOINT_FALLBACK, PhaseEvent
from .json_file import replace_json
from .lineage import ENDED_OUTCOME, LineageRecord, settle_ended_run
from .lineage_pending import read_pending_lineage
from .redact import redact_url, scrub, scrub_urls
from .run_metrics import RunMetrics, compute_run_metrics
from .settled import unsettle
from .spool import KEPT_LIMIT, SpoolProblem, SpoolRead, kept_dropped, read_spool, write_kept
from .warehouse import RunInfo, Warehouse, WarehouseError, default_url

PENDING_FILE = "pending.json"
PROBLEMS_KEPT = 5  # problem lines named in the row (all are counted)
# What a warehouse outage raises: the run's row waits as pending instead of failing the run.
OUTAGES: tuple[type[BaseException], ...] = (WarehouseError, OperationalError, InterfaceError, DBAPIError,
                                            PoolTimeoutError, OSError)

log = logging.getLogger("ettflow.ett")


@dataclass(frozen=True)
class Archived:
    metrics: RunMetrics
    problems: tuple[SpoolProblem, ...]  # lines of the spool that could not be used
    events: int


def problem_tags(problems: Sequence[SpoolProblem]) -> dict[str, Any]:
    """The row's record of unusable spool lines (empty when there are none)."""
    if not problems:
        return {}
    return {"spool_problems": len(problems),
            "spool_problem_lines": [str(p)[:300] for p in problems[:PROBLEMS_KEPT]]}


def describe_problems(problems: Sequence[SpoolProblem], limit: int = 3) -> str:
    """`2 spool problems: a.jsonl:3 (corrupt line), b.jsonl:9 (torn last line)`, for log lines."""
    if not problems:
        return "no spool problems"
    named = ", ".join(f"{p.path}:{p.line} ({'torn last line' if p.torn else 'corrupt line'})"
                      for p in problems[:limit])
    more = f" and {len(problems) - limit} more" if len(problems) > limit else ""
    return f"{len(problems)} spool problem{'s' if len(problems) != 1 else ''}: {named}{more}"


def _read(spool_root: Path | str, run_id: str) -> SpoolRead:
    """The run's events; this process's kept ones (a disk that refused them) are written to the
    spool first where it has room again, and read from memory where it still has not."""
    if (still := write_kept(spool_root, run_id)):
        log.warning("run %s: %d event(s) the disk refused are still not in its spool under %s: archived from "
                    "this process's memory (the spool gets them at its next write once the disk has room)",
                    run_id, still, spool_root)
    if (dropped := kept_dropped(spool_root, run_id)):
        log.warning("run %s: %d event(s) could neither be spooled nor kept (over %d per file): lost",
                    run_id, dropped, KEPT_LIMIT)
    read = read_spool(spool_root, run_id)
    if not read.events:
        raise ValueError(
            f"the spool of run {run_id!r} under {spool_root} holds no usable event"
            + (f"; problems: {'; '.join(map(str, read.problems))}" if read.problems else "")
        )
    return read


def fallback_tags(events: Sequence[PhaseEvent]) -> dict[str, Any]:
    """The row's record of checkpoint damage (empty when none): each damaged checkpoint a
    restore skipped, the step it restored instead and the steps the damage cost (trained again
    because the newer checkpoint could not be used)."""
    found: dict[Any, dict[str, Any]] = {}  # by damaged step: a later attempt skipping it again is not new
    for e in sorted(events, key=lambda e: (e.attempt, e.start)):
        if e.phase == CHECKPOINT_FALLBACK and e.info.damaged_step is not None:
            a = e.info
            found.setdefault(a.damaged_step, {
                "attempt": e.attempt, "damaged_step": a.damaged_step, "restored_step": a.restored_step,
                "file": a.file, "steps_lost": a.damaged_step - (a.restored_step or 0)})
    return {"checkpoint_fallbacks": list(found.values())} if found else {}


def damage_tags(events: Sequence[PhaseEvent]) -> dict[str, Any]:
    """The row's record of damaged durable checkpoints found while the memory tier served (empty
    when none): each once, with the step a restart would have restored instead; no step was lost
    to it (the run did not restore it)."""
    found: dict[Any, dict[str, Any]] = {}
    for e in sorted(events, key=lambda e: (e.attempt, e.start)):
        if e.phase == CHECKPOINT_DAMAGED and e.info.damaged_step is not None:
            a = e.info
            found.setdefault(a.damaged_step, {"attempt": e.attempt, "damaged_step": a.damaged_step,
                                              "restored_step": a.restored_step, "file": a.file,
                                              "noticed": a.noticed})
    return {"checkpoint_damaged": list(found.values())} if found else {}


# a compile-cache archive that was there but could not be used (`trainer.compile.cache.RestoreMiss`)
CACHE_DAMAGE = ("untrusted", "unverified", "unreadable")


def cache_refusal_tags(events: Sequence[PhaseEvent]) -> dict[str, Any]:
    """The row's record of compile-cache archives refused (empty when none): each distinct
    refusal once, with the first attempt and rank that met it. A rank compiled cold; a pooled
    worker's prewarm (`pooled`) says what became of it (`repair`: that first rank's worker's; the
    others that met the same refusal are in their own events)."""
    found: dict[str, dict[str, Any]] = {}
    for e in sorted(events, key=lambda e: (e.attempt, e.rank, e.start)):
        if e.phase == "compile_cache_restore" and e.info.miss in CACHE_DAMAGE:
            found.setdefault(str(e.info.reason), {"attempt": e.attempt, "rank": e.rank, "miss": e.info.miss,
                                                  "reason": e.info.reason,
                                                  **({"pooled": True} if e.info.pooled else {}),
                                                  **({"repair": e.info.repair} if e.info.repair else {})})
    return {"compile_cache_refused": list(found.values())} if found else {}


def _with_read_tags(info: RunInfo, read: SpoolRead) -> RunInfo:
    tags = {k: v for k, v in info.tags.items()
            if k not in ("spool_problems", "spool_problem_lines", "checkpoint_fallbacks", "unspooled_events",
                         "spooled_events", "compile_cache_refused", "checkpoint_damaged")}
    # a row archived with events its spool never got (`SpoolRead.kept`) says how many, so a later
    # archiving from that spool alone does not replace it with less (`tasks.reconcile`)
    unspooled = {"unspooled_events": read.kept, "spooled_events": len(read.events) - read.kept} if read.kept else {}
    return replace(info, tags={**tags, "spool_bytes": read.bytes, **problem_tags(read.problems),
                               **fallback_tags(read.events), **damage_tags(read.events),
                               **cache_refusal_tags(read.events), **unspooled})


def archive_spooled_run(warehouse: Warehouse, spool_root: Path | str, info: RunInfo) -> Archived:
    """Compute a run's ETT from its spool and archive it; idempotent (upserts)."""
    read = _read(spool_root, info.run_id)
    metrics = compute_run_metrics(read.events)
    warehouse.archive_run(_with_read_tags(info, read), read.events, metrics)
    unsettle(spool_root, info.run_id)  # a row written from an older read may be the last: read it again
    return Archived(metrics, tuple(read.problems), len(read.events))


# -- pending rows -------------------------------------------------------------------------


def pending_file(spool_root: Path | str, run_id: str) -> Path:
    return Path(spool_root) / run_id / PENDING_FILE


@dataclass(frozen=True, kw_only=True)
class PendingRow:
    """A run whose row could not be written yet: who it is, and why it waits."""

    info: RunInfo
    reason: str  # the warehouse error, one line, password masked
    since: float
    warehouse: str = ""  # the warehouse it waits for, password masked

    @property
    def retry_command(self) -> str:
        return f"ettflow archive --run {self.info.run_id}"

    @property
    def message(self) -> str:
        where = f" at {self.warehouse}" if self.warehouse else ""
        return (f"the ETT row of run {self.info.run_id} is pending: the warehouse{where} is unavailable "
                f"({self.reason}). The spool keeps it; the next `ettflow archive --pending` or refresh "
                f"writes it, or run `{self.retry_command}` (with --url or ETTFLOW_WAREHOUSE_URL naming "
                "that warehouse) once it is back")


def shown_url(url: str | None) -> str:
    """A warehouse URL for messages and files: password masked (None: the default URL)."""
    return redact_url(url if url is not None else default_url())


def outage_reason(exc: BaseException, url: str | None = None) -> str:
    """One line about a warehouse error, without SQL or parameters, and without the password
    of `url` should a driver echo it (WarehouseError messages mask it already)."""
    text = str(getattr(exc, "orig", None) or exc)
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if url:  # every secret the URL holds (its password, a secret query value), as written or encoded
        first = scrub(first, url)
    return f"{type(exc).__name__}: {scrub_urls(first)}"[:500]  # and any other URL's quoted in it


def outage_trace(exc: BaseException, url: str | None = None) -> str:
    """`exc`'s whole traceback, hidden as `outage_reason` hides its first line: the secrets of
    `url`, as written or encoded, and of any other URL it quotes."""
    text = "".join(traceback.format_exception(exc))
    return scrub_urls(scrub(text, url) if url else text)


def write_pending(spool_root: Path | str, info: RunInfo, reason: str, warehouse: str = "") -> PendingRow:
    """Mark the run's row pending (replacing an older mark). A full disk may refuse the mark:
    logged; the run is still found pending, by its missing row."""
    row = PendingRow(info=info, reason=reason, since=time.time(), warehouse=warehouse)
    data = {"run_id": info.run_id, "model": info.model, "mode": info.mode, "flow_run_id": info.flow_run_id,
            "status": info.status, "tags": dict(info.tags), "reason": reason, "since": row.since,
            "warehouse": warehouse}
    path = pending_file(spool_root, info.run_id)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_json(path, data, default=str)
    except OSError as exc:
        log.warning("cannot write the pending mark %s (%s)", path, exc)
    unsettle(spool_root, info.run_id)  # its row waits: never skipped as settled
    return row


def read_pending(spool_root: Path | str, run_id: str) -> PendingRow | None:
    """The run's pending mark, or None (no mark, or unreadable: logged)."""
    path = pending_file(spool_root, run_id)
    try:
        data = json.loads(path.read_text())
        info = RunInfo(run_id=data["run_id"], model=data["model"], mode=data["mode"],
                       flow_run_id=data.get("flow_run_id"), status=data["status"], tags=data.get("tags") or {})
        return PendingRow(info=info, reason=str(data.get("reason", "")), since=float(data.get("since", 0.0)),
                          warehouse=str(data.get("warehouse") or ""))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("pending mark %s is unreadable (%s): ignored", path, exc)
        return None


def clear_pending(spool_root: Path | str, run_id: str) -> None:
    pending_file(spool_root, run_id).unlink(missing_ok=True)


@dataclass(frozen=True)
class ArchiveResult:
    """What archiving a run did: its row is written (`archived`), or it waits (`pending`).
    `metrics` is computed either way (from the spool)."""

    run_id: str
    status: str
    metrics: RunMetrics
    problems: tuple[SpoolProblem, ...]
    events: int
    pending: PendingRow | None = None
    warehouse: str | None = None  # where it was written (password masked)

    @property
    def archived(self) -> bool:
        return self.pending is None


def archive_or_defer(warehouse_url: str | None | Callable[[], str | None], spool_root: Path | str,
                     info: RunInfo) -> ArchiveResult:
    """Archive the run into the warehouse at `warehouse_url` (None: the default; or a callable
    returning the URL, e.g. from a secret store, called inside the outage handling); on an
    outage (`OUTAGES`, or the callable raising) mark its row pending instead of raising. A
    spool without usable events still raises ValueError, and a spool that cannot be read
    raises OSError, before anything else."""
    read = _read(spool_root, info.run_id)
    metrics = compute_run_metrics(read.events)
    info = _with_read_tags(info, read)
    common = (info.run_id, info.status, metrics, tuple(read.problems), len(read.events))
    try:
        url = warehouse_url() if callable(warehouse_url) else warehouse_url
    except Exception as exc:  # noqa: BLE001 - the URL cannot be found now (a secret store down): the row waits
        return ArchiveResult(*common, pending=write_pending(spool_root, info, outage_reason(exc)))
    try:
        with Warehouse.open(url) as wh:
            settled = _settle_lineage(wh, spool_root, info, read.events)
            wh.archive_run(info, read.events, metrics)
            shown = wh.display_url
    except OUTAGES as exc:
        pending = write_pending(spool_root, info, outage_reason(exc, url), shown_url(url))
        return ArchiveResult(*common, pending=pending)
    clear_pending(spool_root, info.run_id)
    unsettle(spool_root, info.run_id)  # a row written from an older read may be the last: read it again
    if settled is not None:
        log.warning("run %s ended %s before recording its refresh: lineage %s, windows %s released for the next "
                    "refresh of model %s", info.run_id, info.status, settled.outcome.value,
                    ", ".join(settled.windows), info.model)
    return ArchiveResult(*common, warehouse=shown)


def settles_lineage(spool_root: Path | str, run_id: str, status: str) -> bool:
    """Whether a run that ended `status` has its lineage settled from outside it
    (`lineage.settle_ended_run`): it ended crashed, failed or cancelled, and its own record does
    not wait in the spool (`lineage_pending`: the next reconciliation writes that one)."""
    return status in ENDED_OUTCOME and read_pending_lineage(spool_root, run_id) is None


def _settle_lineage(wh: Warehouse, spool_root: Path | str, info: RunInfo,
                    events: Sequence[PhaseEvent]) -> LineageRecord | None:
    """A run archived as crashed, failed or cancelled that never recorded its refresh's end:
    its lineage record (with the anchor its events say it sealed) and its claims released
    (`lineage.settle_ended_run`), in the same visit as its row (an outage leaves both for the
    next archiving); see `settles_lineage`."""
    if not settles_lineage(spool_root, info.run_id, info.status):
        return None
    return settle_ended_run(wh, info.model, info.run_id, info.status, anchor=sealed_anchor(events),
                            reason=f"its run ended {info.status} before recording how its refresh ended")


def sealed_anchor(events: Sequence[PhaseEvent]) -> str | None:
    """The anchor checkpoint the run's events say it wrote last: the driver's `anchor_seal` (the
    devices released first; a seal that failed names no path) or a rank's `anchor_checkpoint`
    written in place. A rank's event that handed its state off to the driver names the folder
    the driver was to seal, not one it wrote: it does not count. Not checked here: a refresh
    reusing it verifies every file first (`tasks/anchor_reuse.py`). Without it, a run killed
    while it published had its windows trained again, and its anchor pruned as nobody's."""
    written = [e for e in events if (e.phase == "anchor_seal" or (
        e.phase == "anchor_checkpoint" and not e.info.handed_off)) and e.info.path]
    return max(written, key=lambda e: e.end).info.path if written else None
