"""The cluster pool's shared spares (`PoolService.share_spares`, `ett.spare_sizing.size_shared_spares`):
a model's training runs share the spares their summed saving pays for; stepped without Ray (a
fake start), exact numbers."""

from __future__ import annotations

from types import SimpleNamespace

from ettflow.ett.capacity import UNCLAIMED_WORKER
from ettflow.ett.spare_sizing import SHARED, SpareInputs, SpareShare
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
    """A pool whose workers are fakes (started ready; a stopped one is listed in `stopped`)."""
    from ettflow.trainer.group import pool_service

    started, stopped = [], []
    monkeypatch.setattr(pool_service, "stop", stopped.append)

    def start(config, run_id, spool_root, *, actor_cls):
        assert actor_cls is RankActor and run_id == POOL_RUN_ID
        worker = PooledWorker(SimpleNamespace(prewarm=SimpleNamespace(remote=lambda: None)), None, 100.0 + len(started),
                              warm_key(config), model_name(config), cpus=1.0)
        worker.timings = PrewarmTimings(build_s=0, compile_s=0, cache_hit=True, footers_s=0, ready_at=110.0)
        started.append(worker)
        return worker

    cfg = TrainerConfig(data_root=str(tmp_path), schema=criteo_schema(10), work_dir=str(tmp_path / "w"),
                        compile_cache_root=str(tmp_path / "dlrm" / "compile-cache")).with_switches(
                            memory_checkpoint=False)
    return PoolService(PoolPolicy(reap_every_s=3600.0), start=start), cfg, started, stopped


def shared(pool: PoolService) -> list[PooledWorker]:
    return [e for e in pool.entries if e.rule == SHARED]


def test_runs_share_the_spares_their_summed_saving_pays_and_release_them_as_they_leave(tmp_path, monkeypatch):
    pool, cfg, started, stopped = pool_and_config(tmp_path, monkeypatch)

    def join(run: str, now: float):
        return pool.share_spares(SpareShare.of(run, ALONE), cfg, str(tmp_path), actor_cls=RankActor, now=now)

    assert join("a", 100.0).spares == 0 and pool.entries == []  # alone, a spare does not pay
    assert join("b", 101.0).spares == 1 and len(shared(pool)) == 1
    third = join("c", 102.0)
    assert third.spares == 2 and len(shared(pool)) == 2 and third.rule == SHARED
    assert third.reason == "3 run(s) training: 1.6 slot-s saved per s held against 1 slot(s): 2 shared spare(s) pay"
    [status] = {(s.rule, s.why) for s in pool.status() if s.kind == "worker"}
    assert status == (SHARED, third.reason)

    # run b loses a rank: it takes a shared spare, and the pool prepares its replacement at once
    [taken] = pool.take(cfg, [None], run_id="b")
    assert taken is started[0] and taken.rule == SHARED and len(shared(pool)) == 2 and len(started) == 3

    # the next run's hold never releases them: nothing held for it (a run hours ahead), no expiry
    pool.explored[model_name(cfg)] = MAX_EXPLORATIONS
    assert pool.fill(cfg, 2, str(tmp_path), next_run_at=200_000.0, now=103.0, actor_cls=RankActor,
                     start=StartSample(seconds=60.0, pooled=False)) == 0
    assert pool.reap(now=100_000.0) == 0 and len(shared(pool)) == 2
    # ... and the next run's ranks take its own workers before the spares
    pool._fill_now(cfg, 1, str(tmp_path), RankActor)
    [own] = pool.take(cfg, [None], run_id="d")
    assert own.rule != SHARED and len(shared(pool)) == 2

    # c and b release: one spare no longer pays, then none; each goes to the ledger, for nobody
    assert pool.unshare("c", now=150.0).spares == 1 and len(shared(pool)) == 1
    assert pool.unshare("b", now=160.0).spares == 0 and shared(pool) == []
    assert stopped == [started[2], started[1]]  # the newest first; the one b took is b's to stop
    assert pool.unshare("b") is None  # twice: nothing
    lines = sorted(pool.drain(), key=lambda h: h.released_at)
    assert [(h.kind, h.run_id, h.used, h.rule, h.reason, h.released_at) for h in lines] == [
        (UNCLAIMED_WORKER, None, False, SHARED, "does_not_pay", 150.0),
        (UNCLAIMED_WORKER, None, False, SHARED, "does_not_pay", 160.0)]
    assert pool.unshare("a", now=170.0).spares == 0 and pool.sharing == {}


def test_a_sharing_run_whose_process_died_leaves_the_sharing(tmp_path, monkeypatch):
    import ray

    pool, cfg, started, stopped = pool_and_config(tmp_path, monkeypatch)
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
    assert (line.rule, line.reason, line.released_at) == (SHARED, "does_not_pay", 200.0)
