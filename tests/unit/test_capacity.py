"""Capacity held for a run outside its slots (`ett.capacity`), with exact numbers: a pooled
worker that became rank 0 (held before the run began), a spare never used (pure cost), a spare
that replaced a rank (held until it was taken)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from ettflow.ett.capacity import HeldCapacity, capacity_ett_pct, held_capacity
from ettflow.ett.run_metrics import compute_run_metrics

from helpers.timelines import Timeline


@pytest.fixture(autouse=True)
def no_ray_kill(monkeypatch):
    """The pools here hold fake actors: stopping one is nothing (`ray.kill` would start a local Ray)."""
    from ettflow.trainer.group import pool_service

    monkeypatch.setattr(pool_service, "stop", lambda worker: None)


def _run(*, spare: dict | None) -> Timeline:
    t = Timeline("held")  # submitted at 10; 2 ranks train 12-22: effective 10 s of a 12 s wall
    t.ev("spare_start", 0, 5, rank=-1, pooled=True, for_rank=0, taken_at=11)  # prewarmed 0-5, taken at 11
    t.mark("submitted", 10).ev("scheduling", 10, 12, rank=-1, world_size=2)
    if spare is not None:
        t.ev("spare_start", 12, 14, rank=-1, **spare)
    t.steps(12, 0, 10, rank=0)
    return t.steps(12, 0, 10, rank=1)


def test_a_spare_never_used_is_cost_and_a_pooled_rank_counts_until_the_run_began():
    m = compute_run_metrics(_run(spare={"pooled": False, "used": False, "released_at": 22}).events)
    assert (m.wall_s, m.effective_s) == (12.0, 10.0)
    assert m.held == HeldCapacity(slots=2, pooled_s=10.0, spare_s=10.0, unused_spare_s=10.0)
    assert m.ett_pct == pytest.approx(100 * 10 / 12)  # the study's per-run ETT is unchanged
    assert m.capacity_ett_pct == pytest.approx(100 * 10 * 2 / (12 * 2 + 20))  # 45.45%


def test_a_used_spare_counts_until_it_was_taken_and_nothing_held_leaves_the_ett():
    used = compute_run_metrics(_run(spare={"pooled": True, "used": True, "taken_at": 17}).events)
    assert used.held == HeldCapacity(slots=2, pooled_s=10.0, spare_s=5.0, unused_spare_s=0.0)
    bare = Timeline("bare")
    bare.mark("submitted", 10).ev("scheduling", 10, 12, rank=-1, world_size=2).steps(12, 0, 10, rank=0)
    m = compute_run_metrics(bare.steps(12, 0, 10, rank=1).events)
    assert m.held.held_s == 0.0 and m.capacity_ett_pct == pytest.approx(m.ett_pct)


def test_capacity_ett_is_never_above_the_ett():
    held = held_capacity([], 0.0, 1.0)
    assert held.slots == 1 and capacity_ett_pct(5.0, 10.0, held) == 50.0
    assert capacity_ett_pct(5.0, 10.0, HeldCapacity(2, 1.0, 2.0, 2.0)) < 50.0
    assert capacity_ett_pct(0.0, 0.0, held) == 0.0


def test_a_prefetched_flow_process_is_held_beside_the_slots_not_in_them():
    t = _run(spare=None)
    t.ev("flow_prestart", 4, 10, rank=-1, pid=1)  # the worker started the run's process 6 s early
    m = compute_run_metrics(t.events)
    assert m.held == HeldCapacity(slots=2, pooled_s=10.0, spare_s=0.0, unused_spare_s=0.0, prestart_s=6.0)
    assert (m.wall_s, m.tts_s) == (12.0, 2.0)  # off the clock: the run began at its submission


def test_the_ledger_lists_each_holding_with_what_it_held_and_whether_it_was_used():
    from ettflow.ett.capacity import FLOW_PROCESS, POOLED_RANK, SPARE, held_by_model, holdings_of_run

    t = _run(spare={"pooled": False, "used": False, "released_at": 22, "gpus": 1.0, "cpus": 2.0,
                    "rss_bytes": 2 * 2**30})
    t.ev("flow_prestart", 4, 10, rank=-1, pid=1)
    m = compute_run_metrics(t.events)
    lines = {h.kind: h for h in holdings_of_run("held", "dlrm", t.events, m.wall_start, m.wall_end)}
    assert set(lines) == {POOLED_RANK, SPARE, FLOW_PROCESS}
    assert (lines[POOLED_RANK].held_s, lines[POOLED_RANK].used, lines[POOLED_RANK].reason) == (10.0, True, "taken")
    assert (lines[POOLED_RANK].for_rank, lines[SPARE].for_rank) == (0, None)  # the rank the pooled worker became
    spare = lines[SPARE]
    assert (spare.held_s, spare.used, spare.gpus, spare.memory_bytes) == (10.0, False, 1.0, 2 * 2**30)
    assert (lines[FLOW_PROCESS].held_s, lines[FLOW_PROCESS].slots, lines[FLOW_PROCESS].cpus) == (6.0, 0.0, 1.0)
    # the ledger's slot-seconds are the run's held_s; what nobody used is the unused spare
    [by_model] = held_by_model(list(lines.values()))
    assert (by_model.slot_s, by_model.unused_slot_s, by_model.gpu_s, by_model.gib_s) == (20.0, 10.0, 10.0, 20.0)
    assert by_model.slot_s == m.held.held_s and by_model.unused_slot_s == m.held.unused_spare_s


def test_the_ledger_sums_what_each_rule_held_and_whether_a_run_used_it():
    from ettflow.ett.capacity import (
        FLOW_PROCESS,
        POOLED_RANK,
        SPARE,
        UNCLAIMED_WORKER,
        HeldByRule,
        Holding,
        held_by_rule,
    )
    from ettflow.tasks.artifacts import holding_rows

    def line(hid: str, kind: str, used: bool, start: float, end: float, rule: str = "", slots: float = 1.0):
        return Holding(holding_id=hid, model="dlrm", kind=kind, run_id=None if kind == UNCLAIMED_WORKER else "r",
                       used=used, requested_at=start, released_at=end, reason="x", rule=rule, slots=slots)

    ledger = [line("a", POOLED_RANK, True, 0, 4, "just-in-time"), line("b", POOLED_RANK, True, 0, 6, "just-in-time"),
              line("c", UNCLAIMED_WORKER, False, 0, 20, "just-in-time"), line("d", SPARE, True, 5, 8, "spare-at-loss"),
              line("e", SPARE, False, 5, 30, "spare-by-saving"), line("f", FLOW_PROCESS, True, 0, 3, slots=0.0),
              line("g", SPARE, False, 1, 2)]  # a line written before rules existed
    assert held_by_rule(ledger) == [
        HeldByRule("dlrm", FLOW_PROCESS, "worker-prefetch", "used", holdings=1, held_s=3.0, slot_s=0.0),
        HeldByRule("dlrm", POOLED_RANK, "just-in-time", "used", holdings=2, held_s=10.0, slot_s=10.0),
        HeldByRule("dlrm", SPARE, "spare-at-loss", "used", holdings=1, held_s=3.0, slot_s=3.0),
        HeldByRule("dlrm", SPARE, "spare-by-saving", "released unused", holdings=1, held_s=25.0, slot_s=25.0),
        HeldByRule("dlrm", SPARE, "unrecorded", "released unused", holdings=1, held_s=1.0, slot_s=1.0),
        HeldByRule("dlrm", UNCLAIMED_WORKER, "just-in-time", "released unused", holdings=1, held_s=20.0,
                   slot_s=20.0),
    ]
    # the run's ETT artifact: one row per holding, its rule and outcome in the metric's name
    [row] = holding_rows([ledger[4]])
    assert (row["metric"], row["exposed"], row["raw"]) == (
        "spare: spare-by-saving, released unused (slot-s; raw: s)", 25.0, 25.0)
    # a pooled worker is named by the rank it became
    [row] = holding_rows([replace(ledger[1], for_rank=1)])
    assert row["metric"] == "pooled_rank 1 (from the pool): just-in-time, used (slot-s; raw: s)"


def test_what_the_cluster_pool_releases_unclaimed_waits_in_its_ledger_until_acknowledged():
    from ettflow.ett.capacity import UNCLAIMED_WORKER
    from ettflow.trainer.group.hold_rule import PrewarmEstimate, StartSaving, decide_hold
    from ettflow.trainer.group.pool_service import PoolPolicy, PoolService
    from ettflow.trainer.group.pooled_worker import PooledWorker
    from ettflow.trainer.protocol import PrewarmTimings

    pool = PoolService(PoolPolicy(reap_every_s=3600.0))
    # no schedule: each ready worker is kept for the break-even keep-alive, the start it saves
    # (a run's rank starts in 100 s cold, 45 s pooled: 55 s), which pays its 50 s prewarm
    pool.holds["dlrm"] = decide_hold(0.0, None, PrewarmEstimate.of([50.0]), margin_s=10.0, max_keep_alive_s=600.0,
                                     saving=StartSaving.of([100.0], [45.0]))
    assert pool.holds["dlrm"].keep_alive_s == 55.0
    ready = PrewarmTimings(build_s=1.0, compile_s=1.0, cache_hit=True, footers_s=0.0, ready_at=10.0)
    pool.entries = [PooledWorker(None, None, 2.0, "k", "dlrm", timings=ready, cpus=1.0, rss_bytes=100,
                                 rule="keep-alive"),
                    PooledWorker(None, None, 40.0, "k", "dlrm", timings=replace(ready, ready_at=45.0),
                                 rule="keep-alive")]
    assert pool.reap(now=70.0) == 1  # ready since 10, 60 s > 55: released; the other kept
    assert pool.prewarm_s == {"dlrm": [8.0, 5.0]}  # each worker's prewarm measured once, for the model's rule
    [line] = pool.drain()
    assert (line.kind, line.run_id, line.used, line.reason, line.rule) == (
        UNCLAIMED_WORKER, None, False, "expired", "keep-alive")
    assert (line.requested_at, line.released_at, line.held_s, line.memory_bytes) == (2.0, 70.0, 68.0, 100)
    assert pool.drain() == [line]  # not acknowledged: still there for the next writer
    assert pool.ack([line.holding_id]) == 1 and pool.drain() == []
    assert pool.stop() == 1 and [h.reason for h in pool.drain()] == ["stopped"]


def test_the_pool_holds_nothing_until_just_before_the_deployments_next_scheduled_run_and_only_what_pays(tmp_path):
    """A release with the deployment's next run 6 h ahead starts nothing and drops what the
    model held; the model's measured prewarm (default until measured), twice its spread and
    the margin before the run it prewarms; an unclaimed worker goes `margin_s` after the
    scheduled time. With no schedule it fills at once under the keep-alive (a fake start: no Ray).
    Each release brings its run's measured start, and nothing is prewarmed until the start it
    would save (2 ranks) exceeds what the workers would hold (3 x the lead) (the pool's
    prewarms to measure a pooled start spent: the next test)."""
    from types import SimpleNamespace

    from ettflow.trainer.config import TrainerConfig
    from ettflow.trainer.data.schema import criteo_schema
    from ettflow.trainer.group.hold_rule import DEFAULT_PREWARM_S, MAX_EXPLORATIONS
    from ettflow.trainer.group.pool_service import PoolPolicy, PoolService
    from ettflow.trainer.group.pooled_worker import PooledWorker, model_name, warm_key
    from ettflow.trainer.protocol import PrewarmTimings, StartSample

    class RankActor:  # what the caller names as the rank's actor class: every start, planned ones too, gets it
        pass

    def start(config, run_id, spool_root, *, actor_cls):
        assert actor_cls is RankActor
        worker = PooledWorker(SimpleNamespace(prewarm=SimpleNamespace(remote=lambda: None)), None, clock[0],
                              warm_key(config), model_name(config))
        worker.timings = PrewarmTimings(build_s=0, compile_s=0, cache_hit=True, footers_s=0,
                                        ready_at=clock[0] + 12.0)
        return worker

    t0 = time.time()  # the pool's reaper thread runs on the real clock: the plan lies hours ahead of it
    clock = [t0]
    run_at = t0 + 6 * 3600
    cfg = TrainerConfig(data_root=str(tmp_path), schema=criteo_schema(10), work_dir=str(tmp_path / "w"),
                        compile_cache_root=str(tmp_path / "dlrm" / "compile-cache")).with_switches(
                            memory_checkpoint=False)
    assert cfg.world_size == 2
    pool = PoolService(PoolPolicy(margin_s=10.0, reap_every_s=3600.0), start=start)
    # (the prewarms that measure a pooled start, spent here: `..._to_measure_a_pooled_start`)
    pool.explored["dlrm"] = MAX_EXPLORATIONS
    # a cold run started in 60 s: a pooled one would save at most the (default) 20 s prewarm,
    # 2 x 20 = 40 slot-s against 3 workers x 30 s of lead: nothing, and status says why
    cold = StartSample(seconds=60.0, pooled=False)
    assert pool.fill(cfg, 3, str(tmp_path), next_run_at=run_at, now=t0, actor_cls=RankActor, start=cold) == 0
    assert pool.planned == {} and pool.holds["dlrm"].rule.value == "none"
    [decided] = [h for h in pool.status() if h.kind == "decided"]
    assert (decided.model, decided.rule, decided.state) == ("dlrm", "none", "nothing held")
    assert "= 90 slot-s to save 2 rank(s) x start saved 20.0 s" in decided.why, decided.why
    # a pooled run started in 10 s: 2 x 50 = 100 slot-s saved against 90 held: just in time pays
    warm = StartSample(seconds=10.0, pooled=True)
    assert pool.fill(cfg, 3, str(tmp_path), next_run_at=t0 - 1, now=t0, actor_cls=RankActor, start=warm) == 3
    assert pool.starts == {("dlrm", False): [60.0], ("dlrm", True): [10.0]}
    assert pool.fill(cfg, 3, str(tmp_path), next_run_at=run_at, now=t0, actor_cls=RankActor) == 0
    assert pool.entries == [] and [h.reason for h in pool.drain()] == ["until_scheduled"] * 3
    [planned] = [h for h in pool.status() if h.kind == "planned"]
    assert (planned.model, planned.requested_at, planned.rule) == ("dlrm", run_at - DEFAULT_PREWARM_S - 10.0,
                                                                   "just-in-time")
    assert "next scheduled run in 21600 s" in planned.why and "default" in planned.why
    assert not [h for h in pool.status() if h.kind == "decided"]
    assert pool.start_planned(now=t0 + 1000) == 0 and pool.entries == []
    clock[0] = run_at - DEFAULT_PREWARM_S - 10.0
    assert pool.start_planned(now=clock[0]) == 3 and pool.planned == {}
    assert {e.rule for e in pool.entries} == {"just-in-time"}
    assert pool.reap(now=run_at + 10.0) == 0 and pool.prewarm_s == {"dlrm": [12.0] * 3}
    assert pool.reap(now=run_at + 10.5) == 3  # the run did not come: released
    assert {(h.reason, h.rule) for h in pool.drain()} >= {("expired", "just-in-time")}
    # no schedule: keep-alive, each ready worker held for its share of the 100 slot-s saved
    assert pool.fill(cfg, 3, str(tmp_path), now=clock[0], actor_cls=RankActor) == 3
    assert {e.rule for e in pool.entries} == {"keep-alive"}
    assert pool.holds["dlrm"].keep_alive_s == pytest.approx(100 / 3)
    # the next run asks for workers: the gap since the release is the model's arrival history
    pool.released_at["dlrm"] = time.time() - 500.0
    pool.take(cfg, [None])
    assert pool.gaps["dlrm"] == [pytest.approx(500.0, abs=5.0)] and "dlrm" not in pool.released_at
    # its runs come later than a prewarmed worker is kept (12 s + 33.3 s): the next release prewarms nothing
    assert pool.fill(cfg, 3, str(tmp_path), now=clock[0], actor_cls=RankActor) == 0
    assert pool.holds["dlrm"].rule.value == "none" and pool.entries == []
    assert {h.reason for h in pool.drain()} >= {"not_worth_holding"}
    pool.stop()


def test_a_models_scheduled_runs_are_prewarmed_to_measure_a_pooled_start_as_often_as_the_pool_grants(tmp_path):
    """No pooled start measured: where the whole cold start saved (2 x 60 = 120 slot-s) would pay
    3 workers x 30 s of lead, the pool plans a just-in-time prewarm to measure one, for each
    release until it granted `MAX_EXPLORATIONS`; then the unmeasured rule (nothing) again, and
    status says which."""
    from ettflow.trainer.config import TrainerConfig
    from ettflow.trainer.data.schema import criteo_schema
    from ettflow.trainer.group.hold_rule import MAX_EXPLORATIONS
    from ettflow.trainer.group.pool_service import PoolPolicy, PoolService
    from ettflow.trainer.protocol import StartSample

    def start(*args, **kwargs):
        raise AssertionError("nothing starts: every plan lies hours ahead")

    t0 = time.time()
    run_at = t0 + 6 * 3600
    cfg = TrainerConfig(data_root=str(tmp_path), schema=criteo_schema(10), work_dir=str(tmp_path / "w"),
                        compile_cache_root=str(tmp_path / "dlrm" / "compile-cache")).with_switches(
                            memory_checkpoint=False)
    pool = PoolService(PoolPolicy(margin_s=10.0, reap_every_s=3600.0), start=start)
    try:
        cold = StartSample(seconds=60.0, pooled=False)
        for granted in range(1, MAX_EXPLORATIONS + 1):
            assert pool.fill(cfg, 3, str(tmp_path), next_run_at=run_at, now=t0, actor_cls=object,
                             start=cold if granted == 1 else None) == 0
            assert pool.holds["dlrm"].explore and pool.explored == {"dlrm": granted}
            [planned] = [h for h in pool.status() if h.kind == "planned"]
            assert (planned.rule, planned.requested_at) == ("just-in-time", run_at - 30.0)
            assert "no pooled start measured yet: prewarmed to measure one" in planned.why, planned.why
        assert pool.fill(cfg, 3, str(tmp_path), next_run_at=run_at, now=t0, actor_cls=object) == 0
        assert not pool.holds["dlrm"].explore and pool.holds["dlrm"].rule.value == "none" and pool.planned == {}
        assert pool.explored == {"dlrm": MAX_EXPLORATIONS}
    finally:
        pool.stop()


def test_a_pool_service_that_dies_leaves_what_it_held_to_the_next_one_through_its_journal(tmp_path, caplog):
    """Issue 42 #1: killed, the pool's service takes its workers and keepers with it; the next
    service of the home closes each at the dead one's last beat (`pool_lost`), adopts its
    unacknowledged lines, and tells the model's next run why it starts cold. A clean stop, or
    lines a warehouse acknowledged, give the next one nothing twice."""
    import json

    from ettflow.ett.capacity import UNCLAIMED_KEEPER, UNCLAIMED_WORKER, Holding
    from ettflow.trainer.group.pool_journal import POOL_LOST
    from ettflow.trainer.group.pool_service import PoolPolicy, PoolService, _Keeper
    from ettflow.trainer.group.pooled_worker import PooledWorker

    journal = str(tmp_path / "pool" / "journal.json")
    first = PoolService(PoolPolicy(reap_every_s=3600.0), journal=journal)
    assert first.lost is None and first.cold_note("dlrm") is None  # no earlier service
    worker = PooledWorker(None, None, 2.0, "k", "dlrm", cpus=1.0, rss_bytes=100, rule="keep-alive")
    keeper = _Keeper(None, 3.0, "dlrm")
    expired = Holding(holding_id="expired-1", model="dlrm", kind=UNCLAIMED_WORKER, run_id=None, used=False,
                      requested_at=1.0, released_at=1.5, reason="expired")
    first.entries, first.keepers, first.ledger = [worker], [keeper], {"expired-1": expired}
    first._journal()  # as its reaper's tick does; then it is killed (no `stop`)
    beat = json.loads(Path(journal).read_text())["beat"]

    with caplog.at_level("WARNING", logger="ettflow"):
        second = PoolService(PoolPolicy(reap_every_s=3600.0), journal=journal)
    assert "the previous pool service was lost" in caplog.text and "holding 2 worker(s) and keeper(s)" in caplog.text
    lines = {h.holding_id: h for h in second.drain()}
    assert lines.keys() == {"expired-1", worker.holding_id, keeper.holding_id}
    assert lines["expired-1"] == expired  # adopted as it was
    w, k = lines[worker.holding_id], lines[keeper.holding_id]
    assert (w.kind, w.reason, w.requested_at, w.released_at, w.slots, w.rule, w.memory_bytes, w.run_id) == (
        UNCLAIMED_WORKER, POOL_LOST, 2.0, beat, 1.0, "keep-alive", 100, None)
    assert (k.kind, k.reason, k.requested_at, k.released_at, k.slots) == (UNCLAIMED_KEEPER, POOL_LOST, 3.0, beat, 0.0)
    note = second.cold_note("dlrm")
    assert note is not None and "the cluster's pool was lost" in note and "start cold" in note
    assert second.cold_note("dlrm") is None  # said once, to the model's next run
    [lost] = [h for h in second.status() if h.kind == "lost"]  # `ettflow pool status` says it too
    assert (lost.state, lost.requested_at) == ("2 closed", beat)
    assert not any(h.holds_actor for h in second.status())  # the status header counts no process held
    assert second.ack(list(lines)) == 3
    assert second.stop() == 0
    third = PoolService(PoolPolicy(reap_every_s=3600.0), journal=journal)
    assert third.drain() == [] and third.lost is None and third.cold_note("dlrm") is None


def test_a_pool_journal_that_does_not_parse_is_said_and_left_for_a_person(tmp_path, caplog):
    from ettflow.trainer.group.pool_journal import PoolJournal

    path = tmp_path / "journal.json"
    path.write_text("{not json")
    with caplog.at_level("WARNING", logger="ettflow"):
        assert PoolJournal(path).recover() is None
    assert "could not be read" in caplog.text and path.read_text() == "{not json"
