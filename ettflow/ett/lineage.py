"""A model's lineage: which refresh trained which windows, from which parent, and how it ended.

    rec = LineageRecord(model="dlrm", run_id=..., windows=("w1", "w2"), outcome=Outcome.PUBLISHED,
                        anchor=".../anchor", snapshot=".../snapshot", parent_run_id=None)
    wh.record_lineage(rec)          # upsert by run_id
    wh.watermark("dlrm")            # "w2": the last window of the last PUBLISHED refresh
    wh.last_published("dlrm")       # rec: the next refresh's parent (its anchor and snapshot)

The watermark advances only on success: it is the last window of the model's most recently
finished refresh whose outcome is PUBLISHED. A GATED refresh (its snapshot lost to the current
one on the held-out window) does not advance it, nor does a FAILED or SKIPPED one: their windows
are trained again by the next refresh, from the same parent.

Window claims (item 7 of issue 10): `claim_windows` reads the watermark and claims the windows
a refresh will train in ONE write transaction, serialized per model (PostgreSQL: a transaction
advisory lock on the model; SQLite: BEGIN IMMEDIATE), so two refreshes of one model never hold
claims at once: while another run holds live claims of the model, the call returns `Busy` and
claims nothing (the caller waits and asks again, `tasks.claims`). A run asking again gets its
own claims back (a flow retry). `finish_refresh` records the outcome and, in the same
transaction, marks the run's claims `done` (PUBLISHED) or releases them (any other outcome), so
a later refresh trains those windows again. A run archived as crashed, failed or cancelled
that never recorded how its refresh ended (its process died) is settled when it is archived
(`settle_ended_run`: a CRASHED or FAILED record with the windows it had claimed, its claims
released), so its model is not blocked; a claim older than `stale_after_s` (its refresh died
and nobody archived it) is not live either, and the model's next claim releases it.

Claims are a lease the run can lose: a run whose process stood still (SIGSTOP, a paused VM,
swapping) past its heartbeat's bound is taken for dead and its claims released, though it may
go on when it resumes. What it did while it held them stands; what it would do after must not
undo the refresh that took its windows. So the two steps that make a refresh the model's are
fenced by its claims, under the model's lock: the move of the model's `current` snapshot runs
inside `publishing`, which records the refresh PUBLISHED in the same transaction, and
`finish_refresh` writes PUBLISHED only for a run that still holds its claims. Either raises
`ClaimsLost` otherwise: the run ends failed, nothing of it published.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Table, delete, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import OperationalError

from . import warehouse_db
from .redact import scrub_urls
from .warehouse_db import WRITE, OpenWarehouse
from .warehouse_models import RefreshLineage, WindowClaim

__all__ = ["Busy", "Claimed", "ClaimsLost", "LineageRecord", "Outcome", "claim_windows", "finish_refresh",
           "last_published", "lineage", "publishing", "record_lineage", "release_claims", "settle_ended_run",
           "watermark"]

_LINEAGE: Table = RefreshLineage.__table__
_CLAIMS: Table = WindowClaim.__table__
_INSERT = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}
CLAIMED, DONE = "claimed", "done"
STALE_AFTER_S = 24 * 3600.0  # a claim this old belongs to a refresh that died without finishing


class Outcome(str, enum.Enum):
    """How a refresh ended. Only PUBLISHED advances the model's watermark."""

    PUBLISHED = "published"  # its snapshot became the model's current one
    GATED = "gated"  # trained and published, but kept out: it regressed on the held-out window
    SKIPPED = "skipped"  # nothing new to train, or another refresh held the model's windows
    FAILED = "failed"  # training or publishing failed
    CRASHED = "crashed"  # its process died before it recorded how it ended (`settle_ended_run`)


@dataclass(frozen=True, kw_only=True)
class LineageRecord:
    """One refresh of `model`: the windows it trained (in order), its parent (the refresh it
    started from: None for a cold start), its own anchor checkpoint and snapshot (the next
    refresh's parent), and its outcome with the reason (gated, skipped, failed). Times are
    epoch seconds."""

    model: str
    run_id: str
    windows: tuple[str, ...] = ()
    outcome: Outcome
    parent_run_id: str | None = None
    parent_anchor: str | None = None
    parent_snapshot: str | None = None
    anchor: str | None = None
    snapshot: str | None = None
    reason: str | None = None
    created_at: float = field(default_factory=time.time)
    finished_at: float | None = None

    def __post_init__(self) -> None:
        for name in ("model", "run_id"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"LineageRecord.{name} must be a non-empty string, got {getattr(self, name)!r}")
        object.__setattr__(self, "outcome", Outcome(self.outcome))
        object.__setattr__(self, "windows", tuple(self.windows))

    @property
    def first_window(self) -> str | None:
        return self.windows[0] if self.windows else None

    @property
    def last_window(self) -> str | None:
        return self.windows[-1] if self.windows else None

    def row(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "model": self.model, "windows": list(self.windows),
                "first_window": self.first_window, "last_window": self.last_window,
                "parent_run_id": self.parent_run_id, "parent_anchor": self.parent_anchor,
                "parent_snapshot": self.parent_snapshot, "anchor": self.anchor, "snapshot": self.snapshot,
                "outcome": self.outcome.value, "reason": self.reason, "created_at": self.created_at,
                "finished_at": self.finished_at}

    @classmethod
    def from_row(cls, row: Any) -> LineageRecord:
        return cls(model=row.model, run_id=row.run_id, windows=tuple(row.windows or ()), outcome=Outcome(row.outcome),
                   parent_run_id=row.parent_run_id, parent_anchor=row.parent_anchor,
                   parent_snapshot=row.parent_snapshot, anchor=row.anchor, snapshot=row.snapshot, reason=row.reason,
                   created_at=row.created_at, finished_at=row.finished_at)


@dataclass(frozen=True)
class Claimed:
    """The run holds these windows of the model; `watermark` and `parent` were read in the
    same transaction, and `choice` is what the caller's `choose` returned for them."""

    windows: tuple[str, ...]
    watermark: str | None
    parent: LineageRecord | None
    choice: Any


@dataclass(frozen=True)
class Busy:
    """Another refresh of the model holds live claims: nothing was claimed."""

    holder: str  # its run id
    windows: tuple[str, ...]
    since: float


class ClaimsLost(RuntimeError):
    """The run no longer holds its claims on the model's windows: they were released as a dead
    run's are (its heartbeat stopped past its bound while it stood still: `settle_ended_run`; or
    they went stale), and maybe claimed by another refresh (`holder`, holding `windows`). Its
    snapshot must not become the model's, nor its refresh PUBLISHED."""

    def __init__(self, model: str, run_id: str, *, recorded: LineageRecord | None, holder: str | None,
                 windows: tuple[str, ...]) -> None:
        self.model, self.run_id, self.recorded, self.holder, self.windows = model, run_id, recorded, holder, windows
        span = f"{windows[0]}..{windows[-1]}" if len(windows) > 1 else ", ".join(windows)
        why = f" ({scrub_urls(recorded.reason)})" if recorded is not None and recorded.reason else ""
        said = (f"the lineage records it {recorded.outcome.value}{why}" if recorded
                else "the lineage has no record of it")
        now = f"run {holder} holds windows {span} now" if holder else "no refresh holds them now"
        super().__init__(
            f"run {run_id} no longer holds its claims on model {model}'s windows: they were released, as a run's are "
            "when it is taken for dead (its heartbeat stopped past its bound while it stood still, or its claims went "
            f"stale); {said}, and {now}. Nothing of this run is published; the model's lineage goes on from the "
            "refresh that holds them")

    def __reduce__(self):  # survives pickling (a Prefect state's data) with its attributes
        return (_claims_lost_again, (self.model, self.run_id, self.recorded, self.holder, self.windows))


def _claims_lost_again(model: str, run_id: str, recorded: LineageRecord | None, holder: str | None,
                       windows: tuple[str, ...]) -> ClaimsLost:
    return ClaimsLost(model, run_id, recorded=recorded, holder=holder, windows=windows)


# -- reading ------------------------------------------------------------------------------


def _published(model: str):
    return (select(_LINEAGE).where(_LINEAGE.c.model == model, _LINEAGE.c.outcome == Outcome.PUBLISHED.value)
            .order_by(_LINEAGE.c.finished_at.desc(), _LINEAGE.c.created_at.desc()).limit(1))


def _last_published(conn: Connection, model: str) -> LineageRecord | None:
    row = conn.execute(_published(model)).first()
    return LineageRecord.from_row(row) if row is not None else None


def last_published(wh: OpenWarehouse, model: str) -> LineageRecord | None:
    """The model's most recently finished PUBLISHED refresh: the next refresh's parent."""
    with wh.engine.connect() as conn:
        return _last_published(conn, model)


def watermark(wh: OpenWarehouse, model: str) -> str | None:
    """The last window of the model's last PUBLISHED refresh (None: never published)."""
    last = last_published(wh, model)
    return last.last_window if last is not None else None


def lineage(wh: OpenWarehouse, model: str) -> list[LineageRecord]:
    """Every refresh of the model, oldest first."""
    stmt = select(_LINEAGE).where(_LINEAGE.c.model == model).order_by(_LINEAGE.c.created_at, _LINEAGE.c.run_id)
    with wh.engine.connect() as conn:
        return [LineageRecord.from_row(r) for r in conn.execute(stmt)]


# -- writing ------------------------------------------------------------------------------


def _write(wh: OpenWarehouse) -> Connection:
    if wh.engine.dialect.name not in _INSERT:
        from .warehouse_db import WarehouseError

        raise WarehouseError(f"cannot record lineage in {wh.display_url}: the warehouse supports SQLite and "
                             "PostgreSQL; set ETTFLOW_WAREHOUSE_URL to one of them")
    return wh.engine.connect().execution_options(**{WRITE: True})


def _upsert(conn: Connection, table: Table, rows: list[dict[str, Any]]) -> None:
    insert = _INSERT[conn.dialect.name](table)
    conn.execute(insert.on_conflict_do_update(
        index_elements=[c.name for c in table.primary_key.columns],
        set_={c.name: insert.excluded[c.name] for c in table.columns if not c.primary_key}), rows)


def _lock_model(conn: Connection, model: str) -> None:
    """The model's lock, for the transaction. PostgreSQL waits for it `BUSY_TIMEOUT_S` at most, as
    SQLite waits for its write lock: a holder that stands still (a paused VM, a SIGSTOPped flow
    process in its publish) fails the waiter with an `OperationalError` (an outage to its callers)
    instead of hanging it, and its own connection, for as long."""
    if conn.dialect.name == "postgresql":
        conn.execute(text(f"SET LOCAL lock_timeout = '{int(warehouse_db.BUSY_TIMEOUT_S * 1000)}ms'"))
        key = int.from_bytes(hashlib.sha256(f"lineage:{model}".encode()).digest()[:8], "big", signed=True)
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": key})


def lock_timed_out(exc: BaseException) -> bool:
    """Whether `exc` is a wait for the model's lock (PostgreSQL) or for SQLite's write lock that
    ran past its timeout (`_lock_model`): another refresh held it all that time."""
    orig = getattr(exc, "orig", None)
    return isinstance(exc, OperationalError) and (
        getattr(orig, "sqlstate", None) == "55P03" or "database is locked" in str(orig))


def _claims_lost(conn: Connection, model: str, run_id: str) -> ClaimsLost | None:
    """Why the run holds no claim (live or done) on the model's windows, or None when it holds one."""
    mine = conn.execute(select(_CLAIMS.c.window).where(_CLAIMS.c.model == model, _CLAIMS.c.run_id == run_id)
                        .limit(1)).first()
    if mine is not None:
        return None
    own = conn.execute(select(_LINEAGE).where(_LINEAGE.c.run_id == run_id)).first()
    recorded = LineageRecord.from_row(own) if own is not None else None
    ours = recorded.windows if recorded is not None else ()
    taken = conn.execute(select(_CLAIMS.c.run_id).where(
        _CLAIMS.c.model == model, _CLAIMS.c.window.in_(ours) if ours else _CLAIMS.c.state == CLAIMED)
        .order_by(_CLAIMS.c.claimed_at.desc()).limit(1)).first()
    holder = taken.run_id if taken is not None else None
    held = conn.execute(select(_CLAIMS.c.window).where(_CLAIMS.c.model == model, _CLAIMS.c.run_id == holder)
                        .order_by(_CLAIMS.c.window)).scalars().all() if holder else ()
    return ClaimsLost(model, run_id, recorded=recorded, holder=holder, windows=tuple(held))


def claims_lost(wh: OpenWarehouse, model: str, run_id: str) -> ClaimsLost | None:
    """Why the run holds no claim on the model's windows now, or None when it holds one (a
    read: what the fence at the publish decides under the model's lock, asked earlier)."""
    with wh.engine.connect() as conn:
        return _claims_lost(conn, model, run_id)


@contextlib.contextmanager
def publishing(wh: OpenWarehouse, record: LineageRecord) -> Iterator[None]:
    """Run the block (the move of the model's `current` to the record's snapshot), then record
    the PUBLISHED `record` as `finish_refresh` does, in one write transaction under the model's
    lock: no claim of the model is taken or released meanwhile, and the move and the record go
    together. Raises `ClaimsLost`, before the block, when the run holds no claim (the module's
    fence); what the block raises writes nothing."""
    if record.outcome is not Outcome.PUBLISHED:
        raise ValueError(f"publishing: the record must be PUBLISHED, got {record.outcome.value}")
    with _write(wh) as conn, conn.begin():
        _lock_model(conn, record.model)
        lost = _claims_lost(conn, record.model, record.run_id)
        if lost is not None:
            raise lost
        yield
        _finish(conn, record)


def record_lineage(wh: OpenWarehouse, record: LineageRecord) -> None:
    """Write the record (upsert by run id)."""
    with _write(wh) as conn, conn.begin():
        _upsert(conn, _LINEAGE, [record.row()])


def finish_refresh(wh: OpenWarehouse, record: LineageRecord) -> bool:
    """Record how the refresh ended and, in the same transaction, settle its claims: `done`
    when PUBLISHED, released otherwise (a later refresh claims those windows again). A record
    older than the one the run already has (`finished_at`) changes nothing and returns False:
    an earlier try's record that waited in the spool (`ett.lineage_pending`) while a later try
    of the same run (a flow retry) published must not undo it (its watermark, its done claims).
    Nor does any record that is not PUBLISHED over the run's PUBLISHED one: its snapshot became
    the model's `current` with that record (`publishing`), and what fails after it (the release
    of its devices, a cancellation, a retry of the run) does not unpublish it; only the run's
    live claims (a later try's) are released. A PUBLISHED record of a run that no longer holds
    its claims raises `ClaimsLost` and writes nothing (the module's fence)."""
    with _write(wh) as conn, conn.begin():
        _lock_model(conn, record.model)
        return _finish(conn, record)


def _finish(conn: Connection, record: LineageRecord) -> bool:
    """`finish_refresh` in the caller's transaction, the model locked."""
    known = conn.execute(select(_LINEAGE.c.finished_at, _LINEAGE.c.outcome)
                         .where(_LINEAGE.c.run_id == record.run_id)).first()
    if known is not None and known.finished_at is not None and record.finished_at is not None \
            and known.finished_at > record.finished_at:  # a record without its time is written
        return False
    mine = (_CLAIMS.c.model == record.model) & (_CLAIMS.c.run_id == record.run_id)
    if known is not None and known.outcome == Outcome.PUBLISHED.value and record.outcome is not Outcome.PUBLISHED:
        conn.execute(delete(_CLAIMS).where(mine & (_CLAIMS.c.state == CLAIMED)))  # a later try's, if any
        return False
    if record.outcome is Outcome.PUBLISHED:
        lost = _claims_lost(conn, record.model, record.run_id)
        if lost is not None:
            raise lost
    _upsert(conn, _LINEAGE, [record.row()])
    if record.outcome is Outcome.PUBLISHED:
        conn.execute(update(_CLAIMS).where(mine).values(state=DONE))
    else:
        conn.execute(delete(_CLAIMS).where(mine))
    return True


def release_claims(wh: OpenWarehouse, model: str, run_id: str) -> int:
    """Drop the run's live claims (not its done ones); returns how many."""
    with _write(wh) as conn, conn.begin():
        _lock_model(conn, model)
        gone = conn.execute(delete(_CLAIMS).where(_CLAIMS.c.model == model, _CLAIMS.c.run_id == run_id,
                                                  _CLAIMS.c.state == CLAIMED))
        return gone.rowcount or 0


ENDED_OUTCOME = {"crashed": Outcome.CRASHED, "failed": Outcome.FAILED, "cancelled": Outcome.FAILED}


def settle_ended_run(wh: OpenWarehouse, model: str, run_id: str, status: str, *, reason: str,
                     at: float | None = None, anchor: str | None = None) -> LineageRecord | None:
    """A run that ended `status` (crashed, failed or cancelled: `ENDED_OUTCOME`) without
    recording how its refresh ended: in one transaction, its lineage record (CRASHED or FAILED,
    the windows it had claimed, `reason`, the `anchor` its spool says it sealed) and its live
    claims released, so the next refresh of the model trains those windows again at once, or
    publishes that anchor instead (`tasks/anchor_reuse.py`). When it already has a lineage record (it
    settled its own claims), only claims taken after that record (a later try of the same run)
    are released, and the record stays; nothing when it holds no claims (it never got as far as
    claiming). Returns the record written, or None."""
    outcome = ENDED_OUTCOME.get(status)
    if outcome is None:
        raise ValueError(f"settle_ended_run: status must be one of {sorted(ENDED_OUTCOME)}, got {status!r}")
    with _write(wh) as conn, conn.begin():
        _lock_model(conn, model)
        mine = (_CLAIMS.c.model == model) & (_CLAIMS.c.run_id == run_id) & (_CLAIMS.c.state == CLAIMED)
        own = conn.execute(select(_LINEAGE.c.finished_at).where(_LINEAGE.c.run_id == run_id)).first()
        if own is not None:  # it recorded its end; a later try of it (a flow retry) may have claimed again
            conn.execute(delete(_CLAIMS).where(mine & (_CLAIMS.c.claimed_at > (own.finished_at or 0.0))))
            return None
        claims = conn.execute(select(_CLAIMS).where(mine).order_by(_CLAIMS.c.window)).all()
        if not claims:
            return None
        record = LineageRecord(model=model, run_id=run_id, windows=tuple(c.window for c in claims), outcome=outcome,
                               anchor=anchor, reason=reason[:500], created_at=min(c.claimed_at for c in claims),
                               finished_at=time.time() if at is None else at)
        _upsert(conn, _LINEAGE, [record.row()])
        conn.execute(delete(_CLAIMS).where(mine))
        return record


def claim_windows(wh: OpenWarehouse, model: str, run_id: str,
                  choose: Callable[[str | None, LineageRecord | None], tuple[Sequence[str], Any]], *,
                  now: float | None = None, stale_after_s: float = STALE_AFTER_S) -> Claimed | Busy:
    """Claim the windows `choose(watermark, parent)` returns (as `(windows, choice)`) for the
    run, unless another run of the model holds live claims (`Busy`). Serialized per model;
    the run's own earlier claims are replaced by the new choice."""
    now = time.time() if now is None else now
    with _write(wh) as conn, conn.begin():
        _lock_model(conn, model)
        live = conn.execute(select(_CLAIMS).where(
            _CLAIMS.c.model == model, _CLAIMS.c.state == CLAIMED, _CLAIMS.c.run_id != run_id,
            _CLAIMS.c.claimed_at > now - stale_after_s).order_by(_CLAIMS.c.window)).all()
        if live:
            return Busy(holder=live[0].run_id, windows=tuple(r.window for r in live if r.run_id == live[0].run_id),
                        since=min(r.claimed_at for r in live))
        parent = _last_published(conn, model)
        mark = parent.last_window if parent is not None else None
        windows, choice = choose(mark, parent)
        windows = tuple(windows)
        # the run's earlier claims, and a stale holder's whole claims (not only the windows chosen
        # again): a holder keeping part of them would still pass the fence (`publishing`)
        stale = _CLAIMS.c.claimed_at <= now - stale_after_s
        conn.execute(delete(_CLAIMS).where(_CLAIMS.c.model == model, _CLAIMS.c.state == CLAIMED,
                                           (_CLAIMS.c.run_id == run_id) | stale))
        if windows:
            _upsert(conn, _CLAIMS, [{"model": model, "window": w, "run_id": run_id, "state": CLAIMED,
                                     "claimed_at": now} for w in windows])
        return Claimed(windows=windows, watermark=mark, parent=parent, choice=choice)
