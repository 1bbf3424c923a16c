"""The cluster pool's shared spares (`PoolService.share_spares`, `ett.spare_sizing.size_shared_spares`):
a model's training runs share the spares their summed saving pays for; stepped without Ray (a
fake start), exact numbers."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from ettflow.ett.capacity import SPARE
from ettflow.ett.spare_sizing import SHARED, SpareInputs, SpareShare, split_shared_hold
from ettflow.trainer.config import TrainerConfig
from ettflow.trainer.data.schema import criteo_schema
from ettflow.trainer.group.hold_rule import MAX_EXPLORATIONS
from ettflow.trainer.group.pool_service import PoolPolicy, PoolService
from ettflow.trainer.group.pooled_worker import POOL_RUN_ID, PooledWorker, model_name, warm_key
from ettflow.trainer.protocol import PrewarmTimings, StartSample

# each run alone: 2 failures expected over 60 s x 8 s saved x 2 slots = 32 slot-s < 60 held: no
# spare of its own; per second 0.533 slot-s each: two runs pay one shared spare, three pay two
# (the second: a failure while the first is replaced, p = 1 - exp(-3/30 x 10) = 0.632)
ALONE = SpareInputs(world_size=2, wall_s=60.0, rate_per_s=1 / 30)


class RankActor:
    pass


def pool_and_config(tmp_path, monkeypatch):
    """A pool whose workers are fakes (started ready at `clock[0]`; a stopped one is listed)."""
    from ettflow.trainer.group import pool_service

    started, stopped, clock = [], [], [100.0]
    monkeypatch.setattr(pool_service, "stop", stopped.append)

    def start(config, run_id, spool_root, *, actor_cls):
        assert actor_cls is RankActor and run_id == POOL_RUN_ID
        worker = PooledWorker(SimpleNamespace(prewarm=SimpleNamespace(remote=lambda: None)), None, clock[0],
                              warm_key(config), model_name(config), cpus=1.0)
        worker.timings = PrewarmTimings(build_s=0, compile_s=0, cache_hit=True, footers_s=0, ready_at=clock[0])
        started.append(worker)
        return worker

    cfg = TrainerConfig(data_root=str(tmp_path), schema=criteo_schema(10), work_dir=str(tmp_path / "w"),
                        compile_cache_root=str(tmp_path / "dlrm" / "compile-cache")).with_switches(
                            memory_checkpoint=False)
    return PoolService(PoolPolicy(reap_every_s=3600.0), start=start), cfg, started, stopped, clock


def shared(pool: PoolService) -> list[PooledWorker]:
    return [e for e in pool.entries if e.rule == SHARED]


def parts(left) -> list[tuple]:
    return sorted((h.start, h.end, round(h.slots, 4), h.used) for h in left.holds)


def test_runs_share_the_spares_their_summed_saving_pays_and_each_records_its_part_of_their_hold(
        tmp_path, monkeypatch):
    pool, cfg, started, stopped, clock = pool_and_config(tmp_path, monkeypatch)

    def join(run: str, now: float):
        clock[0] = now
        return pool.share_spares(SpareShare.of(run, ALONE), cfg, str(tmp_path), actor_cls=RankActor, now=now)

    assert join("a", 100.0).spares == 0 and pool.entries == []  # alone, a spare does not pay
    assert join("b", 101.0).spares == 1 and len(shared(pool)) == 1
    third = join("c", 102.0)
    assert third.spares == 2 and len(shared(pool)) == 2 and third.rule == SHARED
    assert third.reason == "3 run(s) training: 1.6 slot-s saved per s held against 1 slot(s): 2 shared spare(s) pay"
    [status] = {(s.rule, s.why) for s in pool.status() if s.kind == "worker"}
    assert status == (SHARED, third.reason)

    # a run's starting rank never takes them (their hold is their sharers')
    assert pool.take(cfg, [None], run_id="d") == [None]
    # at 110 run b loses a rank: it takes the oldest shared spare, and the pool prepares its replacement at once
    clock[0] = 110.0
    with monkeypatch.context() as m:
        m.setattr(time, "time", lambda: 110.0)
        [taken] = pool.take(cfg, [None], run_id="b", spare=True)
    assert taken is started[0] and taken.rule == SHARED and len(shared(pool)) == 2 and len(started) == 3

    # the next run's hold never releases them: nothing held for it (a run hours ahead), no expiry
    pool.explored[model_name(cfg)] = MAX_EXPLORATIONS
    assert pool.fill(cfg, 2, str(tmp_path), next_run_at=200_000.0, now=110.0, actor_cls=RankActor,
                     start=StartSample(seconds=60.0, pooled=False)) == 0
    assert pool.reap(now=100_000.0) == 0 and len(shared(pool)) == 2
    # ... and a lost rank takes the next run's workers before them
    pool._fill_now(cfg, 1, str(tmp_path), RankActor)
    [own] = pool.take(cfg, [None], run_id="d", spare=True)
    assert own.rule != SHARED and len(shared(pool)) == 2

    # c leaves at 150, b at 160, a at 170: one spare no longer pays, then none
    third_left = pool.unshare("c", now=150.0)
    assert third_left.decision.spares == 1 and len(shared(pool)) == 1
    second_left = pool.unshare("b", now=160.0)
    assert second_left.decision.spares == 0 and shared(pool) == []
    assert stopped == [started[2], started[1]]  # the newest first; the one b took is b's to stop
    # b's parts: the spare it took (101-110: half, then a third; used), the replacement (110-150: a
    # third) and the other (102-150: a third, then half until it left)
    third = round(1 / 3, 4)
    assert parts(second_left) == [(101.0, 102.0, 0.5, True), (102.0, 110.0, third, True),
                                  (102.0, 150.0, third, False), (110.0, 150.0, third, False),
                                  (150.0, 160.0, 0.5, False)]
    first_left = pool.unshare("a", now=170.0)
    assert pool.unshare("a") is None and pool.sharing == {}
    # each spare's hold counted once, split among the runs that shared it: 9 + 58 + 40 slot-s
    total = sum(h.slots * (h.end - h.start) for left in (first_left, second_left, third_left) for h in left.holds)
    assert total == pytest.approx((110 - 101) + (160 - 102) + (150 - 110))
    assert pool.drain() == []  # nothing for nobody: every part is a run's
    # as a run records them (end_run): its spare_start attributes, fractional slots
    assert first_left.holds[0].to_attrs() == {"pooled": True, "used": True, "taken_at": 102.0, "slots": 0.5,
                                              "rule": SHARED, "cpus": 0.5, "gpus": 0.0}


def test_a_sharing_run_whose_process_died_leaves_the_sharing_and_its_part_is_in_the_ledger(tmp_path, monkeypatch):
    import ray

    pool, cfg, started, stopped, clock = pool_and_config(tmp_path, monkeypatch)
    alive, dead = object(), object()  # what each owner's ping returns, as the ref `ray.get` reads
    owners = {run: SimpleNamespace(ping=SimpleNamespace(remote=lambda ref=ref: ref))
              for run, ref in (("a", alive), ("b", dead))}
    for run, owner in owners.items():
        pool.share_spares(SpareShare.of(run, ALONE), cfg, str(tmp_path), actor_cls=RankActor, owner=owner, now=100.0)
    assert len(shared(pool)) == 1

    def get(ref, timeout=None):
        if ref is dead:
            raise RuntimeError("its process is gone")  # RayActorError and kin
        return True

    monkeypatch.setattr(ray, "get", get)
    assert pool.reap_orphans(now=200.0) == 0  # nothing it took to stop
    assert list(pool.sharing[model_name(cfg)].shares) == ["a"] and shared(pool) == [] and stopped == started
    [line] = pool.drain()
    assert (line.kind, line.run_id, line.used, line.rule, line.reason, line.slots, line.held_s) == (
        SPARE, "b", False, SHARED, "owner_died", 0.5, 100.0)
    assert parts(pool.unshare("a", now=300.0)) == [(100.0, 200.0, 0.5, False)]


def test_a_hold_is_split_by_the_runs_savings_and_counted_once():
    log = [(0.0, {"a": 3.0}), (10.0, {"a": 3.0, "b": 1.0}), (20.0, {"b": 1.0}), (30.0, {})]
    assert split_shared_hold(log, 5.0, 25.0) == {"a": [(5.0, 10.0, 1.0), (10.0, 20.0, 0.75)],
                                                 "b": [(10.0, 20.0, 0.25), (20.0, 25.0, 1.0)]}
    assert split_shared_hold(log, 5.0, 25.0, skip={"a"}) == {"b": [(10.0, 20.0, 0.25), (20.0, 25.0, 1.0)]}
    assert split_shared_hold([(0.0, {"a": 0.0, "b": 0.0})], 0.0, 4.0) == {"a": [(0.0, 4.0, 0.5)],
                                                                         "b": [(0.0, 4.0, 0.5)]}


def test_a_lost_rank_may_take_a_shared_spare_still_prewarming(tmp_path, monkeypatch):
    pool, cfg, started, _, _ = pool_and_config(tmp_path, monkeypatch)
    for run in ("a", "b"):
        pool.share_spares(SpareShare.of(run, ALONE), cfg, str(tmp_path), actor_cls=RankActor, now=100.0)
    [spare] = shared(pool)
    spare.timings = None  # its prewarm still runs
    assert pool.take(cfg, [None], run_id="c") == [None]  # never a starting rank's
    assert pool.take(cfg, [None], run_id="a", spare=True) == [spare]  # a loss waits for it instead


def test_a_stopped_pool_starts_nothing_again(tmp_path, monkeypatch):
    """`ettflow pool stop` stops what the pool holds and its reaper; when the ledger cannot be
    written, the pool stays alive to keep it. A run that then releases, or shares its spares, must
    not make it start workers: with no reaper, nothing would ever release them."""
    pool, cfg, started, stopped, clock = pool_and_config(tmp_path, monkeypatch)
    pool.share_spares(SpareShare.of("a", ALONE), cfg, str(tmp_path), actor_cls=RankActor, now=100.0)
    pool.share_spares(SpareShare.of("b", ALONE), cfg, str(tmp_path), actor_cls=RankActor, now=101.0)
    assert len(started) == 1 and pool.stop() == 1 and stopped == started and pool.entries == []
    assert pool.fill(cfg, 2, str(tmp_path), actor_cls=RankActor, now=102.0) == 0
    pool.share_spares(SpareShare.of("c", ALONE), cfg, str(tmp_path), actor_cls=RankActor, now=103.0)
    assert len(started) == 1 and pool.entries == [] and pool.keepers == []
