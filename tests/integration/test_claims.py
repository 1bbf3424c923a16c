"""Window claims (`tasks.claims.take_claim` over `ett.lineage`): two refreshes of one model at
once, on SQLite and PostgreSQL, train disjoint windows or one is skipped."""

from __future__ import annotations

import threading
import time

import pytest

from ettflow.ett import lineage
from ettflow.ett.heartbeat import read_heartbeat
from ettflow.ett.lineage import LineageRecord, Outcome
from ettflow.ett.warehouse import Warehouse
from ettflow.tasks.claims import take_claim
from ettflow.tasks.plan import plan_refresh


def plan(data, tmp_path, run_id, **over):
    return plan_refresh({"data_root": str(data), "work_root": str(tmp_path / "work"), "max_embeddings": 100,
                         "spool_root": str(tmp_path / "spool"), "snapshot_root": str(tmp_path / "snap"), **over},
                        run_id=run_id)


def race(url, plans, *, during=None):
    """Each plan claims in its own thread and warehouse connection, started together; `during`
    runs in the first winner's thread right after it got its claim."""
    barrier = threading.Barrier(len(plans))
    claims, errors = {}, []

    def one(p):
        try:
            with Warehouse.open(url) as wh:
                barrier.wait()
                claim = take_claim(p, wh, poll_s=0.05)
                claims[p.run_id] = claim
                if claim.skipped is None and during is not None:
                    during(wh, claim)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(p,)) for p in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    return claims


def test_a_refresh_holding_the_windows_makes_the_other_skip(warehouse_url, flow_data, tmp_path):
    Warehouse.open(warehouse_url).close()  # the schema, before the race
    plans = [plan(flow_data, tmp_path, r, claim_wait_s=0.3) for r in ("ra", "rb")]
    claims = race(warehouse_url, plans)
    won = [c for c in claims.values() if c.skipped is None]
    lost = [c for c in claims.values() if c.skipped is not None]
    assert len(won) == 1 and len(lost) == 1
    assert len(won[0].plan.trainer.windows) == 2
    reason = lost[0].skipped
    assert f"is being refreshed by run {won[0].plan.run_id}" in reason and "claim_wait_s=0.3" in reason


def test_the_second_refresh_waits_then_trains_only_what_is_new(warehouse_url, flow_data, tmp_path):
    Warehouse.open(warehouse_url).close()
    plans = [plan(flow_data, tmp_path, r, claim_wait_s=60, max_windows=1) for r in ("ra", "rb")]

    def publish(wh, claim):  # the winner finishes while the other waits
        p = claim.plan
        lineage.finish_refresh(wh, LineageRecord(model=p.model, run_id=p.run_id, windows=p.trainer.windows,
                                                 outcome=Outcome.PUBLISHED, anchor=f"/anchors/{p.run_id}"))

    claims = race(warehouse_url, plans, during=publish)
    first, second = sorted(claims.values(), key=lambda c: c.plan.watermark or "")
    assert first.skipped is None and second.skipped is None
    assert set(first.plan.trainer.windows).isdisjoint(second.plan.trainer.windows)
    assert second.plan.watermark == first.plan.trainer.windows[-1]
    assert second.plan.trainer.warm_start_from == f"/anchors/{first.plan.run_id}"
    assert second.plan.parent.run_id == first.plan.run_id


def test_nothing_new_is_skipped_and_claims_nothing(warehouse_url, flow_data, tmp_path):
    p = plan(flow_data, tmp_path, "r1")
    with Warehouse.open(warehouse_url) as wh:
        wh.record_lineage(LineageRecord(model="dlrm", run_id="r0", windows=p.trainer.windows,  # a refresh long done
                                        outcome=Outcome.PUBLISHED, anchor="/a0"))
        claim = take_claim(p, wh)
        assert claim.skipped == (f"nothing new to train for model dlrm: watermark {p.trainer.windows[-1]} is the "
                                 f"newest window before the held-out {p.trainer.eval_windows[0]}")
        assert claim.plan.trainer.windows == ()
        again = take_claim(plan(flow_data, tmp_path, "r2", claim_wait_s=0), wh)  # r1 holds nothing
        assert again.skipped is not None and again.skipped.startswith("nothing new")


# ---- a dead run's claims: released when it is archived, or when its heartbeat stopped ----------

def dead_holder(spool, run_id: str, model: str = "dlrm", *, every_s: float = 0.05, mode: str = "optimized",
                sealed: str | None = None) -> None:
    """A run whose process died inside its heartbeat (a SIGKILL leaves the record without an end),
    with one spooled event (and the anchor it `sealed`, by the driver), as a killed refresh leaves
    its spool."""
    import json

    from ettflow.ett.heartbeat import RunHeartbeat, heartbeat_file
    from ettflow.ett.spool import SpoolWriter

    with SpoolWriter(spool, run_id, 0, -1) as rec:
        rec.record("scheduling", time.time() - 5, time.time() - 4)
        if sealed is not None:
            rec.record("anchor_seal", time.time() - 3, time.time() - 2, step=8, path=sealed, bytes=10)
    with RunHeartbeat(spool, run_id, every_s=every_s, labels={"model": model, "mode": mode}):
        pass
    path = heartbeat_file(spool, run_id)
    data = json.loads(path.read_text())
    del data["ended_at"], data["outcome"]
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("status, outcome", [("crashed", Outcome.CRASHED), ("failed", Outcome.FAILED),
                                             ("cancelled", Outcome.FAILED)])
def test_archiving_a_dead_run_releases_its_claims_and_records_it_in_the_lineage(warehouse_url, flow_data, tmp_path,
                                                                                status, outcome):
    from ettflow.ett.archive import archive_or_defer
    from ettflow.ett.warehouse import RunInfo

    spool = tmp_path / "spool"
    first = plan(flow_data, tmp_path, "r-dead")
    with Warehouse.open(warehouse_url) as wh:
        assert take_claim(first, wh).skipped is None
        dead_holder(spool, "r-dead", sealed="/w/runs/r-dead/checkpoints/step_8")  # killed while it published
        result = archive_or_defer(warehouse_url, spool, RunInfo(run_id="r-dead", model="dlrm", mode="optimized",
                                                                 status=status))
        assert result.archived
        (record,) = lineage.lineage(wh, "dlrm")
        assert (record.run_id, record.outcome, record.windows) == ("r-dead", outcome, first.trainer.windows)
        assert record.anchor == "/w/runs/r-dead/checkpoints/step_8"  # the next refresh may publish it
        assert f"ended {status}" in record.reason
        again = take_claim(plan(flow_data, tmp_path, "r-next", claim_wait_s=0), wh)  # no wait: nothing holds them
        assert again.skipped is None and again.plan.trainer.windows == first.trainer.windows
        # archived again (a second hook, `archive --pending`): nothing more, the lineage record stays
        archive_or_defer(warehouse_url, spool, RunInfo(run_id="r-dead", model="dlrm", mode="optimized", status=status))
        assert [r.run_id for r in lineage.lineage(wh, "dlrm")] == ["r-dead"]


def test_a_finished_or_claimless_run_is_left_as_it_recorded_itself(warehouse_url, flow_data, tmp_path):
    with Warehouse.open(warehouse_url) as wh:
        p = plan(flow_data, tmp_path, "r-own")
        assert take_claim(p, wh).skipped is None
        lineage.finish_refresh(wh, LineageRecord(model="dlrm", run_id="r-own", windows=p.trainer.windows,
                                                 outcome=Outcome.FAILED, reason="its own reason"))
        assert lineage.settle_ended_run(wh, "dlrm", "r-own", "crashed", reason="x") is None
        assert lineage.settle_ended_run(wh, "dlrm", "r-never-claimed", "crashed", reason="x") is None
        (record,) = lineage.lineage(wh, "dlrm")
        assert (record.outcome, record.reason) == (Outcome.FAILED, "its own reason")
        # a flow retry of the same run claims again, then dies: those later claims are released, the
        # record it wrote itself stays
        assert take_claim(p, wh).skipped is None
        assert lineage.settle_ended_run(wh, "dlrm", "r-own", "crashed", reason="x") is None
        assert take_claim(plan(flow_data, tmp_path, "r-next", claim_wait_s=0), wh).skipped is None
        (record,) = [r for r in lineage.lineage(wh, "dlrm") if r.run_id == "r-own"]
        assert (record.outcome, record.reason) == (Outcome.FAILED, "its own reason")
        with pytest.raises(ValueError, match="status must be one of"):
            lineage.settle_ended_run(wh, "dlrm", "r-own", "completed", reason="x")


def test_a_holder_whose_heartbeat_ended_is_not_archived_by_a_waiting_refresh(warehouse_url, flow_data, tmp_path):
    """An ended heartbeat is a run past its heartbeat block, recording its own end (or between
    the tries of a flow retry): not dead. The waiting refresh waits, and is skipped."""
    from ettflow.ett.heartbeat import RunHeartbeat

    spool = tmp_path / "spool"
    with Warehouse.open(warehouse_url) as wh:
        assert take_claim(plan(flow_data, tmp_path, "r-ending"), wh).skipped is None
        with RunHeartbeat(spool, "r-ending", every_s=0.05):
            pass
        time.sleep(0.5)
        claim = take_claim(plan(flow_data, tmp_path, "r-waiting", claim_wait_s=0.3), wh, poll_s=0.05,
                           url=warehouse_url)
        assert claim.skipped is not None and "is being refreshed by run r-ending" in claim.skipped
        assert wh.runs_frame(run_id="r-ending").empty  # not archived


def test_a_claim_whose_holder_stopped_heartbeating_is_released_at_the_orphan_bound(warehouse_url, flow_data,
                                                                                  tmp_path):
    spool = tmp_path / "spool"
    with Warehouse.open(warehouse_url) as wh:
        assert take_claim(plan(flow_data, tmp_path, "r-killed"), wh).skipped is None
        dead_holder(spool, "r-killed")  # its bound: 3 beats of 0.05 s plus slack
        time.sleep(read_heartbeat(spool, "r-killed").bound_s + 0.2)
        started = time.monotonic()
        claim = take_claim(plan(flow_data, tmp_path, "r-waiting", claim_wait_s=120), wh, poll_s=0.05,
                           url=warehouse_url)
        assert claim.skipped is None and time.monotonic() - started < 30  # not claim_wait_s, not 24 h
        (record,) = [r for r in lineage.lineage(wh, "dlrm") if r.run_id == "r-killed"]
        assert record.outcome is Outcome.CRASHED
        row = wh.runs_frame(run_id="r-killed").iloc[0]
        assert row["status"] == "crashed"


def test_a_run_that_died_before_it_spooled_anything_has_its_claims_released_by_its_crash_hook(
        warehouse_url, flow_data, tmp_path):
    """A deployed run killed between its claim and its trainer's reservation (its input checks,
    the search for a reusable anchor, publishing a reused one) has nothing in its spool: Prefect's
    crash hook (`archive_run`) archives no row, and released nothing, so the model's next refreshes
    waited for the claims to go stale (a day). Now the hook releases them and records the run
    crashed; a completed run, or one that recorded its own end, is left as it is."""
    from ettflow.ett.heartbeat import RunHeartbeat
    from ettflow.tasks.archive import archive_run

    params = {"data_root": str(flow_data), "spool_root": str(tmp_path / "spool"), "warehouse_url": warehouse_url}
    with Warehouse.open(warehouse_url) as wh:
        assert take_claim(plan(flow_data, tmp_path, "early", warehouse_url=warehouse_url), wh).skipped is None
    assert archive_run("early", params, status="crashed") is None  # no heartbeat: taken as never claimed
    with Warehouse.open(warehouse_url) as wh:
        assert lineage.release_claims(wh, "dlrm", "early") > 0  # it held them, untouched: let go by hand
    beat = RunHeartbeat(tmp_path / "spool", "dead")
    beat.__enter__()  # the flow's heartbeat, begun before its claim; the process then dies (no exit)
    beat._stop.set()
    with Warehouse.open(warehouse_url) as wh:
        won = take_claim(plan(flow_data, tmp_path, "dead", warehouse_url=warehouse_url), wh)
    assert won.skipped is None and won.plan.trainer.windows
    assert archive_run("dead", params, status="completed") is None  # not an end that releases
    with Warehouse.open(warehouse_url) as wh:
        assert take_claim(plan(flow_data, tmp_path, "next", warehouse_url=warehouse_url, claim_wait_s=0), wh).skipped
    assert archive_run("dead", params, status="crashed") is None  # no row: nothing was spooled
    with Warehouse.open(warehouse_url) as wh:
        [record] = [r for r in wh.lineage("dlrm") if r.run_id == "dead"]
        assert record.outcome is Outcome.CRASHED and record.windows == won.plan.trainer.windows
        nxt = take_claim(plan(flow_data, tmp_path, "next", warehouse_url=warehouse_url, claim_wait_s=0), wh)
    assert nxt.skipped is None and nxt.plan.trainer.windows == won.plan.trainer.windows
    assert archive_run("dead", params, status="crashed") is None  # twice: its record stands, nothing more
    with Warehouse.open(warehouse_url) as wh:
        assert take_claim(plan(flow_data, tmp_path, "third", warehouse_url=warehouse_url, claim_wait_s=0), wh).skipped


def test_a_holder_whose_heartbeat_went_silent_before_it_spooled_anything_is_found_dead_by_the_next(
        warehouse_url, flow_data, tmp_path):
    """The CLI's path of the case above (no Prefect crash hook: the process that ran the flow is
    the one that died): the run's heartbeat, begun before its claim, went silent with nothing
    spooled. The next refresh that waits on its claims finds it dead and releases them (no row:
    nothing was spooled), instead of waiting for them to go stale (a day)."""
    import os

    from ettflow.ett.heartbeat import RunHeartbeat, heartbeat_file

    beat = RunHeartbeat(tmp_path / "spool", "dead", labels={"model": "dlrm"})
    beat.__enter__()  # begun before its claim; then the process dies
    beat._stop.set()
    with Warehouse.open(warehouse_url) as wh:
        won = take_claim(plan(flow_data, tmp_path, "dead", warehouse_url=warehouse_url), wh)
    assert won.skipped is None
    long_ago = time.time() - 600
    os.utime(heartbeat_file(tmp_path / "spool", "dead"), (long_ago, long_ago))
    with Warehouse.open(warehouse_url) as wh:
        nxt = take_claim(plan(flow_data, tmp_path, "next", warehouse_url=warehouse_url, claim_wait_s=5), wh,
                         url=warehouse_url, poll_s=0.05)
        [record] = [r for r in wh.lineage("dlrm") if r.run_id == "dead"]
    assert nxt.skipped is None and nxt.plan.trainer.windows == won.plan.trainer.windows
    assert record.outcome is Outcome.CRASHED and "before it spooled anything" in record.reason


def test_a_run_that_failed_after_its_claim_with_nothing_spooled_has_its_claims_released_by_its_hook(
        warehouse_url, flow_data, tmp_path, monkeypatch):
    """The failed neighbour: the run raised after its claim and before its trainer (the claim's own
    sizing reads, a warehouse error while looking for a reusable anchor). Its heartbeat ended
    failed, nothing was spooled, and the failure hook archives no row (refused-like); it now
    releases the claims all the same."""
    from types import SimpleNamespace

    from ettflow.ett.heartbeat import RunHeartbeat
    from ettflow.tasks import archive

    monkeypatch.setenv("ETTFLOW_HOME", str(tmp_path / "home"))
    params = {"data_root": str(flow_data), "spool_root": str(tmp_path / "spool"), "warehouse_url": warehouse_url}
    with pytest.raises(RuntimeError), RunHeartbeat(tmp_path / "spool", "failed-run"):
        with Warehouse.open(warehouse_url) as wh:
            won = take_claim(plan(flow_data, tmp_path, "failed-run", warehouse_url=warehouse_url), wh)
        raise RuntimeError("the warehouse went away while looking for a reusable anchor")
    assert won.skipped is None
    flow_run = SimpleNamespace(id="failed-run", parameters=params, deployment_id=None, run_count=1)
    archive.archive_on_flow_state(SimpleNamespace(name="refresh-model"), flow_run,
                                  SimpleNamespace(type=SimpleNamespace(value="FAILED"), message="RuntimeError"))
    with Warehouse.open(warehouse_url) as wh:
        [record] = [r for r in wh.lineage("dlrm") if r.run_id == "failed-run"]
        nxt = take_claim(plan(flow_data, tmp_path, "next", warehouse_url=warehouse_url, claim_wait_s=0), wh)
    assert record.outcome is Outcome.FAILED and nxt.skipped is None
    assert nxt.plan.trainer.windows == won.plan.trainer.windows


def test_a_holder_that_stood_still_past_its_bound_cannot_publish_the_windows_it_lost_when_it_resumes(
        warehouse_url, flow_data, tmp_path):
    """A run whose process stood still (SIGSTOP, a paused VM, swapping) past its heartbeat's
    bound looks dead: the refresh waiting on its windows archives it as crashed and claims them.
    Then the run resumes and goes on. Neither step that would make it the model's refresh may
    follow (`lineage.ClaimsLost`, naming the refresh that holds the windows now): the move of
    `current` (the publish task's guard) and its PUBLISHED record (written by its task, or
    replayed from the spool after an outage, where it is written FAILED). Its failure is
    recorded without touching the other refresh's claims, and that refresh publishes."""
    import logging
    import os

    from ettflow.ett.heartbeat import RunHeartbeat, heartbeat_file
    from ettflow.ett.lineage import ClaimsLost
    from ettflow.ett.lineage_pending import write_pending_lineage
    from ettflow.tasks.claims import lineage_record, record_failure, settle_or_keep
    from ettflow.tasks.publish import claims_guard, may_retry
    from ettflow.tasks.reconcile import settle_pending_lineage

    spool, log = tmp_path / "spool", logging.getLogger("test_claims")
    beat = RunHeartbeat(spool, "stood", labels={"model": "dlrm"})
    beat.__enter__()  # the flow's heartbeat, begun before its claim
    with Warehouse.open(warehouse_url) as wh:
        stood = take_claim(plan(flow_data, tmp_path, "stood", warehouse_url=warehouse_url), wh).plan
    beat._stop.set()  # the process stands still: no beat, and no end
    beat._thread.join()
    long_ago = time.time() - 600
    os.utime(heartbeat_file(spool, "stood"), (long_ago, long_ago))
    with Warehouse.open(warehouse_url) as wh:
        nxt = take_claim(plan(flow_data, tmp_path, "next", warehouse_url=warehouse_url, claim_wait_s=5), wh,
                         url=warehouse_url, poll_s=0.05)
    assert nxt.skipped is None and nxt.plan.trainer.windows == stood.trainer.windows

    # it resumes, trains on and publishes: `current` may not move, its lineage may not say PUBLISHED
    moved = []
    published = lineage_record(stood, Outcome.PUBLISHED, anchor="/a/stood", snapshot="/s/stood")
    with pytest.raises(ClaimsLost) as lost, claims_guard(stood, log, published):
        moved.append("stood")
    text = str(lost.value)
    assert moved == [] and lost.value.holder == "next" and not may_retry(lost.value)
    assert text.startswith("run stood no longer holds its claims on model dlrm's windows") and \
        "the lineage records it crashed" in text and "run next holds windows" in text
    with pytest.raises(ClaimsLost):
        settle_or_keep(stood, Outcome.PUBLISHED, log, anchor="/a/stood", snapshot="/s/stood")
    # its PUBLISHED record kept in the spool (an outage) is written FAILED when it is replayed
    write_pending_lineage(spool, lineage_record(stood, Outcome.PUBLISHED, anchor="/a/stood", snapshot="/s/stood"))
    [replayed] = settle_pending_lineage(spool, warehouse_url)
    assert replayed.action == "archived" and "recorded: failed" in replayed.note
    with Warehouse.open(warehouse_url) as wh:
        [record] = [r for r in wh.lineage("dlrm") if r.run_id == "stood"]
    assert record.outcome is Outcome.FAILED and record.reason.startswith("run stood no longer holds its claims")
    record_failure(stood, lost.value, log)  # how the flow ends it
    with Warehouse.open(warehouse_url) as wh:
        [record] = [r for r in wh.lineage("dlrm") if r.run_id == "stood"]
        assert record.outcome is Outcome.FAILED and record.reason.startswith("ClaimsLost: run stood no longer")

        # the refresh that holds the windows moves `current` and is recorded PUBLISHED with the move
        # (the record-lineage task writes it again); the watermark follows it
        with claims_guard(nxt.plan, log, lineage_record(nxt.plan, Outcome.PUBLISHED, anchor="/a/next")):
            moved.append("next")
        assert moved == ["next"] and lineage.watermark(wh, "dlrm") == nxt.plan.trainer.windows[-1]
        assert lineage.last_published(wh, "dlrm").run_id == "next"
        assert lineage.finish_refresh(wh, lineage_record(nxt.plan, Outcome.PUBLISHED, anchor="/a/next"))


STOOD_STILL = """
import json, logging, sys, time
from ettflow.ett.heartbeat import RunHeartbeat
from ettflow.tasks.claims_fence import fence_for
from ettflow.tasks.plan import plan_refresh
from ettflow.trainer.group.stop_request import RunWithdrawn

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
plan = plan_refresh(json.loads(sys.argv[1]), run_id="stood")
with RunHeartbeat(plan.spool_root, "stood", every_s=0.2, labels={"model": "dlrm"}) as beat:
    fence = fence_for(plan, beat, logging.getLogger("stood"), retry_s=0.5, settle_s=2.0)
    print("ready", flush=True)
    seen = None
    while True:  # the driver's polls
        seen = beat.lapse or seen
        try:
            fence.check()
        except RunWithdrawn as withdrawn:
            print("withdrawn", withdrawn.cause.holder, round(seen.seconds), flush=True)
            break
        if seen is not None and beat.lapse is None:
            print("cleared", round(seen.seconds), flush=True)
            seen = None
        time.sleep(0.05)
"""


def test_a_training_run_that_stood_still_stops_once_its_claims_are_found_taken_and_goes_on_when_not(
        flow_data, tmp_path):
    """The claims fence on a real process that stands still (SIGSTOP) past its heartbeat's
    bound: the first time nobody took its windows, so its fence finds them still its own (asked
    until its settle time, shortened here) and it goes on; the second time the refresh waiting
    on them found it dead and claimed them, so soon after SIGCONT it is withdrawn, naming that
    refresh (the driver then stops its ranks: `tests/unit/test_driver.py`). One database: the
    question is one read of the claims."""
    import json
    import signal
    import subprocess
    import sys

    url = f"sqlite:///{tmp_path / 'warehouse.db'}"
    params = {"data_root": str(flow_data), "work_root": str(tmp_path / "work"), "max_embeddings": 100,
              "spool_root": str(tmp_path / "spool"), "snapshot_root": str(tmp_path / "snap"), "warehouse_url": url}
    with Warehouse.open(url) as wh:
        stood = take_claim(plan(flow_data, tmp_path, "stood", warehouse_url=url), wh).plan
    proc = subprocess.Popen([sys.executable, "-c", STOOD_STILL, json.dumps(params)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGSTOP)  # past the bound (0.2 s beats: 2.6 s); nobody is waiting
        time.sleep(3.5)
        proc.send_signal(signal.SIGCONT)
        said, lapsed = proc.stdout.readline().split()
        assert said == "cleared" and 3 <= int(lapsed) <= 5

        proc.send_signal(signal.SIGSTOP)  # again, and now the next refresh finds it dead
        beat = read_heartbeat(tmp_path / "spool", "stood")
        while not beat.is_orphaned():
            time.sleep(0.1)
            beat = read_heartbeat(tmp_path / "spool", "stood")
        with Warehouse.open(url) as wh:
            nxt = take_claim(plan(flow_data, tmp_path, "next", warehouse_url=url, claim_wait_s=5), wh, url=url,
                             poll_s=0.05)
        assert nxt.skipped is None and nxt.plan.trainer.windows == stood.trainer.windows
        proc.send_signal(signal.SIGCONT)
        said, holder, _ = proc.stdout.readline().split()
        assert (said, holder) == ("withdrawn", "next")
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
    with Warehouse.open(url) as wh:  # the other refresh's claims are untouched
        assert lineage.release_claims(wh, "dlrm", "next") == len(stood.trainer.windows)


def test_a_refresh_standing_still_in_its_publish_makes_the_other_skip_not_hang(warehouse_url, flow_data, tmp_path,
                                                                              monkeypatch):
    """A refresh holds the model's lock while it moves `current`; stopped there, the next refresh's
    claim used to wait for as long on PostgreSQL (and fail on SQLite's busy timeout). Now each
    question waits the lock timeout, counts as busy, and the refresh is skipped after
    `claim_wait_s`, saying why, having claimed nothing."""
    from ettflow.ett import lineage, warehouse_db
    from ettflow.ett.lineage import LineageRecord, Outcome

    monkeypatch.setattr(warehouse_db, "BUSY_TIMEOUT_S", 0.5)
    with Warehouse.open(warehouse_url) as holder_wh, Warehouse.open(warehouse_url) as wh:
        first = take_claim(plan(flow_data, tmp_path, "r1"), holder_wh)
        assert first.skipped is None
        windows = first.plan.trainer.windows
        record = LineageRecord(model=first.plan.model, run_id="r1", windows=windows, outcome=Outcome.PUBLISHED,
                               anchor="/a1")
        with lineage.publishing(holder_wh, record):  # the holder stands still here
            waiting = take_claim(plan(flow_data, tmp_path, "r2", claim_wait_s=0.8), wh, poll_s=0.05)
        assert waiting.skipped is not None and "held the model's lock past the warehouse's timeout" in waiting.skipped
        assert "claim_wait_s=0.8" in waiting.skipped
        assert lineage.claims_lost(wh, first.plan.model, "r2") is not None  # it claimed nothing
