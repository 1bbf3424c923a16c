"""The warm pool's key: which runs may take a worker another run prepared (warm_pool.py).
Taking, filling and the bitwise result of a pooled start run on the real stack in
test_trainer_e2e.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ettflow.trainer.config import FailAt, TrainerConfig
from ettflow.trainer.data.schema import criteo_schema
from ettflow.trainer.group.warm_pool import WarmPool, warm_key
from ettflow.trainer.model import ModelConfig

DATA = Path(__file__).parent  # any folder: the key never reads it


def config(**over) -> TrainerConfig:
    base = dict(data_root=str(DATA), schema=criteo_schema(100), work_dir="/work/a", compile_cache_root="/cache",
                world_size=2, batch_size=32, model=ModelConfig(embedding_dim=8, dense_arch=(16, 8), over_arch=(16, 1)))
    base.update(over)
    return TrainerConfig(**base)


def test_the_next_refresh_of_a_model_takes_what_the_last_one_prepared():
    # what changes from refresh to refresh (its windows, work dir, steps, faults, world) keeps the key
    same = [config(work_dir="/work/b"), config(max_steps=7), config(windows=("w1",)), config(world_size=1),
            config(failures=(FailAt(kind="kill", rank=1, step=3),)), config(data_root=str(DATA.parent))]
    assert {warm_key(c) for c in same} == {warm_key(config())}


def test_a_worker_prepared_for_another_shape_is_never_taken():
    base = config()
    other = [config(batch_size=64), config(schema=criteo_schema(200)), config(threads_per_rank=2),
             config(model=replace(base.model, over_arch=(32, 1))), config(compile_cache_root="/elsewhere"),
             base.with_switches(compile=False), base.with_switches(compile_cache=False), config(device="cuda")]
    keys = [warm_key(c) for c in other]
    assert warm_key(base) not in keys and len(set(keys)) == len(keys)


def test_a_pool_that_is_not_kept_starts_nothing_and_a_run_without_the_switch_takes_nothing():
    pool = WarmPool()
    assert pool.fill(config(), 3, "/spool", object) == 0 and pool.workers == []  # not kept: nothing starts
    pool.keep_warm(True)
    assert pool.fill(config().with_switches(warm_pool=False), 3, "/spool", object) == 0
    assert pool.take(config().with_switches(warm_pool=False), [None, None]) == [None, None]


def test_a_spare_prewarms_beside_the_ranks_only_when_its_compile_finds_the_archive(tmp_path):
    # (ray_group.launch: else it prewarms once training started, after rank 0 saved the archive)
    from ettflow.trainer.compile import archive
    from ettflow.trainer.compile.cache import CompileCache
    from ettflow.trainer.compile.process_cache import cache_config, has_archive

    cfg = config(compile_cache_root=str(tmp_path))
    assert not has_archive(cfg)
    path = archive.archive_path(tmp_path, CompileCache(cache_config(cfg)).key, "none")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    assert has_archive(cfg)
    assert not has_archive(cfg.with_switches(compile_cache=False))
    assert not has_archive(config(compile_cache_root=str(tmp_path), batch_size=64))  # another key


def test_a_group_measures_its_start_for_the_pool_only_when_every_rank_started_the_same_way():
    """`RayWorkerGroup.start_sample`: from asking for the ranks to the last one's training loop
    (what the pool's hold rule weighs a prewarm against); none for a mix of pooled and cold
    ranks, a rank that has not finished, or a group a live recovery re-ran."""
    from ettflow.trainer.group.ray_group import RayWorkerGroup
    from ettflow.trainer.protocol import StartSample

    group = RayWorkerGroup(config(), "run", 0, "/spool", actor_cls=object)
    assert group.start_sample() is None  # nothing reserved
    group.asked_at, group.trained_from = 100.0, {0: 130.0, 1: 131.5}
    assert group.start_sample() == StartSample(seconds=31.5, pooled=False)
    group.pooled_ranks = 2
    assert group.start_sample() == StartSample(seconds=31.5, pooled=True)
    group.pooled_ranks = 1
    assert group.start_sample() is None  # a mix measures neither
    group.pooled_ranks, group.trained_from = 0, {0: 130.0}
    assert group.start_sample() is None  # rank 1 has not finished
    group.trained_from, group.asked_at = {0: 130.0, 1: 131.5}, None
    assert group.start_sample() is None  # a live recovery re-ran the loop


def test_a_keeper_take_that_times_out_is_stopped_by_the_pool_at_the_runs_end(monkeypatch):
    """The cluster's pool did not answer `take_keeper` in time (busy): the run starts its own
    keeper and keeps using the pool. The take may still finish in the pool, which then lists a
    keeper as the run's that the run never got: the run's end (`forget`) stops it there, where
    before it was dropped from the pool's watch and outlived every run."""
    from types import SimpleNamespace

    import ray
    from ray.exceptions import GetTimeoutError

    import ettflow.trainer.group.warm_pool as warm_pool
    from ettflow.trainer.group.pool_service import PoolPolicy, PoolService, _Keeper

    class Busy:
        class take_keeper:  # noqa: N801 - an actor method's shape: `.remote(...)` gives a ref
            @staticmethod
            def remote(*args):
                return "ref"

    def get(ref, timeout=None):
        raise GetTimeoutError(f"Get timed out: some object(s) not ready after {timeout} s")

    pool = WarmPool()
    pool.service = busy = Busy()
    monkeypatch.setattr(pool, "_run_owner", lambda: None)
    monkeypatch.setattr(warm_pool.ray, "get", get)
    assert pool.take_keeper("run-1") is None and pool.service is busy

    killed = []
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: killed.append(actor))
    service = PoolService(PoolPolicy(reap_every_s=3600.0))
    keeper, other = SimpleNamespace(name="keeper"), SimpleNamespace(name="keeper-2")
    service.keepers = [_Keeper(keeper, 0.0, "dlrm", "k1"), _Keeper(other, 0.0, "dlrm", "k2")]
    owner = SimpleNamespace()
    assert service.take_keeper(owner, "run-1").actor is keeper  # the take that finished after the timeout
    assert service.take_keeper(owner, "run-2").actor is other
    assert service.forget("run-1") == 1 and killed == [keeper] and [g.run_id for g in service.given] == ["run-2"]
    service.stop()
