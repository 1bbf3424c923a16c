"""Lineage in the warehouse (SQLite and PostgreSQL): records, the watermark, claims settled
by the outcome."""

from __future__ import annotations

import pytest

from ettflow.ett import lineage
from ettflow.ett.lineage import Busy, Claimed, LineageRecord, Outcome
from ettflow.ett.warehouse import Warehouse


@pytest.fixture
def wh(warehouse_url):
    with Warehouse.open(warehouse_url) as w:
        yield w


def rec(run_id, windows, outcome, t, **kw):
    return LineageRecord(model="m", run_id=run_id, windows=windows, outcome=outcome, created_at=t,
                         finished_at=t + 1, **kw)


def test_round_trip_and_upsert(wh):
    r = rec("r1", ("w1", "w2"), Outcome.FAILED, 10.0, parent_run_id="r0", parent_anchor="/a0", parent_snapshot="/s0",
            reason="killed past the budget")
    wh.record_lineage(r)
    assert wh.lineage("m") == [r]
    assert (r.first_window, r.last_window) == ("w1", "w2")
    done = rec("r1", ("w1", "w2"), "published", 10.0, anchor="/a1", snapshot="/s1")
    wh.record_lineage(done)  # the same run again: one row, the latest
    assert wh.lineage("m") == [done] and done.outcome is Outcome.PUBLISHED
    assert wh.lineage("other") == []


def test_the_watermark_advances_only_on_success(wh):
    assert wh.watermark("m") is None and wh.last_published("m") is None
    wh.record_lineage(rec("r1", ("w1", "w2"), Outcome.PUBLISHED, 10.0, anchor="/a1", snapshot="/s1"))
    wh.record_lineage(rec("r2", ("w3",), Outcome.GATED, 20.0, reason="AUC regressed"))
    wh.record_lineage(rec("r3", ("w3",), Outcome.FAILED, 30.0))
    wh.record_lineage(rec("r4", (), Outcome.SKIPPED, 40.0, reason="nothing new"))
    assert wh.watermark("m") == "w2"
    parent = wh.last_published("m")
    assert (parent.run_id, parent.anchor, parent.snapshot) == ("r1", "/a1", "/s1")
    wh.record_lineage(rec("r5", ("w3", "w4"), Outcome.PUBLISHED, 50.0, parent_run_id="r1"))
    assert wh.watermark("m") == "w4"
    assert [r.run_id for r in wh.lineage("m")] == ["r1", "r2", "r3", "r4", "r5"]


def test_a_bad_record_is_refused():
    with pytest.raises(ValueError, match="model"):
        LineageRecord(model="", run_id="r", outcome=Outcome.FAILED)
    with pytest.raises(ValueError, match="'done'"):
        LineageRecord(model="m", run_id="r", outcome="done")


def choose_after(known):
    def choose(mark, parent):
        new = tuple(w for w in known if mark is None or w > mark)
        return new, {"parent": parent.run_id if parent else None}
    return choose


def test_claims_are_held_then_settled_by_the_outcome(wh):
    known = ("w1", "w2", "w3")
    first = lineage.claim_windows(wh, "m", "r1", choose_after(known), now=100.0)
    assert isinstance(first, Claimed) and first.windows == known and first.watermark is None
    busy = lineage.claim_windows(wh, "m", "r2", choose_after(known), now=101.0)
    assert isinstance(busy, Busy) and busy.holder == "r1" and busy.windows == known
    assert isinstance(lineage.claim_windows(wh, "other", "r2", choose_after(known), now=101.0), Claimed)
    again = lineage.claim_windows(wh, "m", "r1", choose_after(known), now=102.0)  # a flow retry
    assert isinstance(again, Claimed) and again.windows == known
    lineage.finish_refresh(wh, rec("r1", known, Outcome.PUBLISHED, 103.0, anchor="/a1"))
    after = lineage.claim_windows(wh, "m", "r2", choose_after(known + ("w4",)), now=104.0)
    assert isinstance(after, Claimed) and after.windows == ("w4",) and after.watermark == "w3"
    assert after.parent.run_id == "r1" and after.choice == {"parent": "r1"}
    lineage.finish_refresh(wh, rec("r2", ("w4",), Outcome.GATED, 105.0))  # released: retried later
    retry = lineage.claim_windows(wh, "m", "r3", choose_after(known + ("w4",)), now=106.0)
    assert isinstance(retry, Claimed) and retry.windows == ("w4",)
    assert lineage.release_claims(wh, "m", "r3") == 1
    assert wh.watermark("m") == "w3"


def test_a_stale_claim_is_not_live(wh):
    lineage.claim_windows(wh, "m", "dead", choose_after(("w1",)), now=0.0)
    late = lineage.claim_windows(wh, "m", "r2", choose_after(("w1",)), now=lineage.STALE_AFTER_S + 1)
    assert isinstance(late, Claimed) and late.windows == ("w1",)


def test_a_stale_holder_loses_every_claim_to_the_refresh_that_takes_some_and_cannot_publish(wh):
    """A holder whose claims went stale (a refresh that died unseen) loses all of them to the next
    refresh that claims, not only the windows chosen again: with the rest it would still pass the
    fence (`publishing`) and record PUBLISHED over the refresh that took its windows. The holder
    that publishes records it with its move, and a move that fails records nothing."""
    old = ("w1", "w2", "w3", "w4")
    lineage.claim_windows(wh, "m", "old", choose_after(old), now=0.0)
    late = lineage.claim_windows(wh, "m", "new", lambda mark, parent: (("w1", "w2"), None),
                                 now=lineage.STALE_AFTER_S + 1)
    assert isinstance(late, Claimed) and late.windows == ("w1", "w2")
    taken = "the lineage has no record of it, and run new holds windows w1..w2 now"
    stale = rec("old", old, Outcome.PUBLISHED, lineage.STALE_AFTER_S + 2)
    with pytest.raises(lineage.ClaimsLost, match=taken), lineage.publishing(wh, stale):
        pass
    with pytest.raises(lineage.ClaimsLost):
        lineage.finish_refresh(wh, stale)
    assert wh.lineage("m") == [] and wh.watermark("m") is None
    new = rec("new", ("w1", "w2"), Outcome.PUBLISHED, lineage.STALE_AFTER_S + 3)
    with pytest.raises(OSError), lineage.publishing(wh, new):
        raise OSError("the pointer's disk is full")  # the move failed: nothing recorded
    assert wh.watermark("m") is None
    with lineage.publishing(wh, new):
        pass
    assert wh.watermark("m") == "w2" and wh.lineage("m") == [new]
    with pytest.raises(ValueError, match="must be PUBLISHED"), lineage.publishing(wh, rec("x", (), Outcome.GATED, 1)):
        pass


def test_report_lineage_shows_the_chain(warehouse_url, capsys, tmp_path, monkeypatch):
    from ettflow.cli import main
    from ettflow.ett.archive import archive_spooled_run
    from ettflow.ett.sample import write_sample_run
    from ettflow.ett.warehouse import RunInfo

    monkeypatch.setenv("ETTFLOW_HOME", str(tmp_path))
    write_sample_run(tmp_path / "spool", "r1", seed=1)
    with Warehouse.open(warehouse_url) as wh:
        archived = archive_spooled_run(wh, tmp_path / "spool", RunInfo(run_id="r1", model="m", mode="optimized"))
        wh.record_lineage(rec("r1", ("w1", "w2"), Outcome.PUBLISHED, 10.0, anchor="/a1"))
        wh.record_lineage(rec("r2", ("w3",), Outcome.GATED, 20.0, parent_run_id="r1", reason="AUC 0.61 < 0.70"))
        wh.record_lineage(rec("r3", (), Outcome.SKIPPED, 30.0, parent_run_id=None, reason="nothing new"))
    assert main(["report", "--url", warehouse_url, "--model", "m", "--lineage"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "Refreshes of m (watermark: w2):"
    r1, r2, r3 = out[2:]
    assert r1.split()[:7] == ["r1", "1970-01-01", "00:00", "UTC", "w1..w2", "(2)", "(cold)"]  # times say their zone
    assert "published" in r1 and f"{archived.metrics.ett_pct:.1f}" in r1
    assert r2.split()[4:7] == ["w3", "r1", "gated"] and r2.split()[7] == "-" and "AUC 0.61 < 0.70" in r2
    assert "skipped" in r3 and "nothing new" in r3
    assert main(["report", "--url", warehouse_url, "--model", "m", "--lineage", "--format", "json"]) == 0
    import json

    rows = json.loads(capsys.readouterr().out)
    assert [r["outcome"] for r in rows] == ["published", "gated", "skipped"]
    assert rows[1]["ETT%"] is None and rows[2]["ETT%"] is None and rows[0]["parent"] == "(cold)"
    assert main(["report", "--url", warehouse_url, "--lineage"]) == 2
    assert main(["report", "--url", warehouse_url, "--model", "none", "--lineage"]) == 1


def test_skipped_runs_show_as_skipped_and_stay_out_of_the_means():
    import pandas as pd

    from ettflow.ett import report
    from ettflow.ett.warehouse import COMPONENT_COLUMNS

    runs = pd.DataFrame({"run_id": ["a", "b", "c"], "model": "m", "mode": "optimized",
                         "status": ["completed", "skipped", "completed"], "wall_start": [0.0, 10.0, 20.0],
                         "wall_s": [100.0, 1.0, 50.0], "ett_pct": [60.0, 0.0, 80.0], "tts_s": [10.0, 0.5, 5.0],
                         "nof": [1, 0, 0], "ttr_mean_s": 0.0, **{c: 1.0 for c in COMPONENT_COLUMNS}})
    table = report.run_table(runs)
    assert list(table["status"]) == ["completed", "skipped", "completed"] and pd.isna(table["ETT%"][1])
    (day,) = report.model_summary(runs).to_dict("records")
    got = (day["runs"], day["skipped"], day["ett_mean"], day["ett_min"], day["wall_mean_s"])
    assert got == (2, 1, 70.0, 60.0, 75.0)


def test_a_lineage_record_kept_during_an_outage_is_settled_by_the_next_reconciliation(warehouse_url, tmp_path):
    from ettflow.ett.lineage_pending import pending_lineage_file, pending_lineage_runs, write_pending_lineage
    from ettflow.tasks.reconcile import reconcile_before_refresh, settle_pending_lineage

    spool = tmp_path / "spool"
    with Warehouse.open(warehouse_url) as w:
        claimed = lineage.claim_windows(w, "m", "r1", choose_after(("w1", "w2")), now=100.0)
    assert isinstance(claimed, Claimed) and claimed.windows == ("w1", "w2")
    done = rec("r1", ("w1", "w2"), Outcome.PUBLISHED, 100.0, anchor="/a1", snapshot="/s1")
    write_pending_lineage(spool, done)  # the refresh published; the warehouse was down
    assert pending_lineage_runs(spool) == ["r1"]

    # the warehouse is still down: the record stays, and the refresh that starts goes on
    down = f"sqlite:///{tmp_path / 'missing' / 'x.db'}"
    with pytest.raises(Exception):  # noqa: B017 - any outage error; the point is that the record stays
        settle_pending_lineage(spool, down)
    assert reconcile_before_refresh(spool, down, "r2") == []
    assert pending_lineage_file(spool, "r1").is_file()
    with Warehouse.open(warehouse_url) as w:  # r1 still holds its windows: another refresh waits
        assert isinstance(lineage.claim_windows(w, "m", "r2", choose_after(("w1", "w2", "w3")), now=200.0), Busy)

    # back: the next refresh writes it first, so it starts from r1 and trains only w3
    (settled,) = reconcile_before_refresh(spool, warehouse_url, "r2")
    assert (settled.run_id, settled.action) == ("r1", "archived") and "published, windows w1, w2" in settled.note
    assert not pending_lineage_file(spool, "r1").exists() and pending_lineage_runs(spool) == []
    with Warehouse.open(warehouse_url) as w:
        assert w.lineage("m") == [done] and w.watermark("m") == "w2"
        nxt = lineage.claim_windows(w, "m", "r2", choose_after(("w1", "w2", "w3")), now=200.0)
    assert isinstance(nxt, Claimed) and nxt.windows == ("w3",) and nxt.parent == done
    assert settle_pending_lineage(spool, warehouse_url) == []  # nothing twice


def test_an_earlier_trys_pending_record_never_undoes_a_later_try_that_published(warehouse_url, tmp_path):
    """Try 1 of a run fails while the warehouse is down: its FAILED record waits in the spool.
    Prefect retries the flow (same run id); try 2 claims again and publishes. The old record,
    settled later by any refresh on the spool or `ettflow archive --pending`, must not move the
    watermark back, mark the run failed or drop its done claims (the windows would be trained
    again): it is removed unwritten. Neighbour: written in the other order (the old one first),
    the newer record still wins."""
    from ettflow.ett.lineage_pending import pending_lineage_file, write_pending_lineage
    from ettflow.tasks.reconcile import settle_pending_lineage

    spool = tmp_path / "spool"
    failed = rec("x", ("w1", "w2"), Outcome.FAILED, 100.0, reason="OperationalError")  # finished at 101
    published = rec("x", ("w1", "w2"), Outcome.PUBLISHED, 200.0, anchor="/runs/x/a")  # finished at 201
    with Warehouse.open(warehouse_url) as w:
        lineage.claim_windows(w, "m", "x", choose_after(("w1", "w2")), now=100.0)
    write_pending_lineage(spool, failed)
    with Warehouse.open(warehouse_url) as w:
        lineage.claim_windows(w, "m", "x", choose_after(("w1", "w2")), now=150.0)  # try 2
        assert lineage.finish_refresh(w, published)
    (settled,) = settle_pending_lineage(spool, warehouse_url, skip={"next-run"})
    assert (settled.run_id, settled.action) == ("x", "skipped") and "older than the run's recorded end" in settled.note
    assert not pending_lineage_file(spool, "x").exists()
    with Warehouse.open(warehouse_url) as w:
        assert w.lineage("m") == [published] and w.watermark("m") == "w2"
        assert lineage.claim_windows(w, "m", "next", choose_after(("w1", "w2", "w3")), now=300.0).windows == ("w3",)
        assert not lineage.finish_refresh(w, failed)  # the other order: the newer record stands
        assert w.lineage("m")[0].outcome is Outcome.PUBLISHED


def test_a_model_lock_held_by_a_process_that_stands_still_fails_the_waiter_instead_of_hanging_it(
        warehouse_url, monkeypatch):
    """A refresh holds the model's lock while it moves `current` (`lineage.publishing`). Stopped
    there (SIGSTOP, a paused VM), it used to hang every other refresh of the model on PostgreSQL,
    each holding a connection, for as long as it stood still; SQLite's busy timeout already
    failed them. Both now fail the waiter with an OperationalError after the timeout."""
    import threading

    from sqlalchemy.exc import OperationalError

    from ettflow.ett import warehouse_db

    monkeypatch.setattr(warehouse_db, "BUSY_TIMEOUT_S", 1.0)
    known = ("w1", "w2")
    with Warehouse.open(warehouse_url) as holder, Warehouse.open(warehouse_url) as waiter:
        assert isinstance(lineage.claim_windows(holder, "m", "r1", choose_after(known), now=100.0), Claimed)
        raised: list[BaseException] = []

        def wait() -> None:
            try:
                lineage.claim_windows(waiter, "m", "r2", choose_after(known + ("w3",)), now=101.0)
            except BaseException as exc:  # noqa: BLE001 - what the waiter got is the test's
                raised.append(exc)

        with lineage.publishing(holder, rec("r1", known, Outcome.PUBLISHED, 102.0, anchor="/a1")):
            t = threading.Thread(target=wait, daemon=True)
            t.start()
            t.join(timeout=60)  # against a hang, not a timing: the holder stands still throughout
            assert not t.is_alive(), "the waiter still waits on the model's lock"
        assert len(raised) == 1 and isinstance(raised[0], OperationalError), raised
        # once the holder is done, the waiter's next try claims what is new
        after = lineage.claim_windows(waiter, "m", "r2", choose_after(known + ("w3",)), now=103.0)
        assert isinstance(after, Claimed) and after.windows == ("w3",)


def test_a_published_refresh_stays_published_whatever_fails_after_it(wh):
    """Its snapshot became the model's `current` with its PUBLISHED record: a failure recorded
    after it (the release of its devices, a cancellation during the teardown, a flow retry of the
    run) used to write FAILED over it, taking the watermark back behind the served model and
    releasing its windows to be trained again. Now the record stands; a later try's live claims
    are released."""
    known = ("w1", "w2")
    assert isinstance(lineage.claim_windows(wh, "m", "r1", choose_after(known), now=9.0), Claimed)
    assert lineage.finish_refresh(wh, rec("r1", known, Outcome.PUBLISHED, 10.0, anchor="/a1", snapshot="/s1"))
    assert not lineage.finish_refresh(wh, rec("r1", known, Outcome.FAILED, 11.0, reason="OSError: release failed"))
    assert [r.outcome for r in wh.lineage("m")] == [Outcome.PUBLISHED] and wh.watermark("m") == "w2"
    # a later try of the same run claimed what came next, then failed: its claim goes, the record stays
    retry = lineage.claim_windows(wh, "m", "r1", choose_after(known + ("w3",)), now=12.0)
    assert isinstance(retry, Claimed) and retry.windows == ("w3",)
    assert not lineage.finish_refresh(wh, rec("r1", ("w3",), Outcome.FAILED, 13.0))
    assert [r.outcome for r in wh.lineage("m")] == [Outcome.PUBLISHED] and wh.watermark("m") == "w2"
    nxt = lineage.claim_windows(wh, "m", "r2", choose_after(known + ("w3",)), now=14.0)
    assert isinstance(nxt, Claimed) and nxt.windows == ("w3",)
