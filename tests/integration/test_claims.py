"""Window claims (`tasks.claims.take_claim` over `ett.lineage`): two refreshes of one model at
once, on SQLite and PostgreSQL, train disjoint windows or one is skipped."""

from __future__ import annotations

import threading

from ettflow.ett import lineage
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
        lineage.finish_refresh(wh, LineageRecord(model="dlrm", run_id="r0", windows=p.trainer.windows,
                                                 outcome=Outcome.PUBLISHED, anchor="/a0"))
        claim = take_claim(p, wh)
        assert claim.skipped == (f"nothing new to train for model dlrm: watermark {p.trainer.windows[-1]} is the "
                                 f"newest window before the held-out {p.trainer.eval_windows[0]}")
        assert claim.plan.trainer.windows == ()
        again = take_claim(plan(flow_data, tmp_path, "r2", claim_wait_s=0), wh)  # r1 holds nothing
        assert again.skipped is not None and again.skipped.startswith("nothing new")
