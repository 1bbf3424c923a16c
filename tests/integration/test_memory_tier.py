"""The in-memory checkpoint tier (memory_tier.py, state_keeper.py) with the session's Ray: a
MemoryTier in this process against a real keeper: local and keeper restores, a missing and a
corrupted copy, a dead keeper. (The pure parts: tests/unit/test_memory_copy.py; the project's
sharded DLRM in Ray actors: tests/e2e/test_memory_tier_ranks.py.)"""

from __future__ import annotations

import time

import pytest

from ettflow.trainer.checkpoint.memory_tier import MemoryCopyError, MemoryTier

from helpers.plain_model import plain_state, plain_step
from helpers.state_fingerprint import fingerprint


def test_memory_tier_saves_to_the_keeper_restores_and_refuses_damaged_or_missing_copies(ray_session, caplog):
    import ray

    from ettflow.trainer.checkpoint.state_keeper import find_keeper, start_keeper

    keeper = start_keeper("memtier-unit")
    assert find_keeper("memtier-unit")._actor_id == keeper._actor_id
    done = []
    tier = MemoryTier(keeper, 0, 1, on_done=done.append)
    state = plain_state()
    marks = {}
    for s in range(4):
        plain_step(state, s)
        assert tier.save(s + 1, state) >= 0
        marks[s + 1] = fingerprint(state)
    tier.wait()
    outcomes = [(r.step, r.ok, r.nbytes > 0, r.end >= r.start) for r in done]
    assert outcomes == [(s, True, True, True) for s in range(1, 5)]
    assert ray.get(keeper.inventory.remote()) == {0: [3, 4]} and tier.latest_common() == 4

    plain_step(state, 4)
    restored = tier.restore(state, 4)
    assert (restored["where"], restored["step"], restored["cursor"]) == ("local", 4, {"row": 8})
    assert fingerprint(state) == marks[4]
    assert tier.restore(state, 3)["where"] == "keeper" and fingerprint(state) == marks[3]
    with pytest.raises(MemoryCopyError, match=r"holds no copy of rank 0 at step 2 \(it holds steps \[3, 4\]\)"):
        tier.restore(state, 2)
    ray.get(keeper.corrupt.remote(0, 3))
    with pytest.raises(MemoryCopyError, match="copy of rank 0 at step 3 is damaged"):
        tier.restore(state, 3)
    assert fingerprint(state) == marks[3]  # refused before anything was copied

    ray.kill(keeper, no_restart=True)  # the keeper is gone: saves go on, restores say why
    plain_step(state, 3)
    with caplog.at_level("WARNING", logger="ettflow"):
        tier.save(5, state)
        assert not tier.wait().ok and done[-1].error
    assert "the run's in-memory checkpoint keeper is gone" in caplog.text  # named, with what follows
    with pytest.raises(MemoryCopyError, match="copy of rank 0 at step 3 is unreachable"):
        tier.restore(state, 3)
    assert tier.restore(state, 5)["where"] == "local"  # its own copy needs no keeper
    tier.close()


def test_a_recovery_whose_keeper_is_gone_names_it_and_uses_the_durable_checkpoint(ray_session, tmp_path, caplog):
    """The group's choice of a restore point when the run's keeper died: no memory step (not an
    error that ends the run), and a warning naming the keeper."""
    import ray

    from ettflow.trainer.checkpoint.state_keeper import keeper_name, start_keeper
    from ettflow.trainer.config import TrainerConfig
    from ettflow.trainer.data.schema import criteo_schema
    from ettflow.trainer.group.ray_group import RayWorkerGroup
    from ettflow.trainer.rank.actor import TrainerActor

    (tmp_path / "data").mkdir()
    cfg = TrainerConfig(data_root=str(tmp_path / "data"), schema=criteo_schema(10), work_dir=str(tmp_path / "w"))
    group = RayWorkerGroup(cfg, "keeper-gone", 0, tmp_path / "spool", actor_cls=TrainerActor)
    group.keeper = start_keeper("keeper-gone")
    assert group._memory_step() is None  # alive, holding nothing yet
    ray.kill(group.keeper, no_restart=True)
    # `ray.kill` returns before the actor is gone: until then it still answers (seen once in CI)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(group.keeper.ping.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            break
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.1)
    with caplog.at_level("WARNING", logger="ettflow"):
        assert group._memory_step() is None
    assert f"keeper (actor {keeper_name('keeper-gone')}) is gone or not answering (ActorDiedError)" in caplog.text


def test_a_dead_keeper_is_never_handed_to_a_restart_a_new_one_starts(ray_session, caplog):
    """Issue 42 #1: the keeper died with the pool's service while the run trained; the next
    attempt's ranks get a keeper that answers, not the dead one's cached handle."""
    import ray

    from ettflow.trainer.checkpoint.state_keeper import keeper_name
    from ettflow.trainer.group.ray_group import end_run, run_keeper

    first = run_keeper("keeper-replaced")
    assert ray.get(first.ping.remote(), timeout=60) == "ok"
    assert run_keeper("keeper-replaced") is first  # alive: the run's one keeper across attempts
    _killed(first)
    try:
        with caplog.at_level("WARNING", logger="ettflow"):
            second = run_keeper("keeper-replaced")
        assert second is not first and ray.get(second.ping.remote(), timeout=60) == "ok"
        assert f"keeper (actor {keeper_name('keeper-replaced')}) died: a new one starts" in caplog.text
    finally:
        end_run("keeper-replaced")


def _killed(actor) -> None:
    import ray

    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # `ray.kill` returns before the actor is gone
        try:
            ray.get(actor.ping.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.1)


def test_a_pooled_keeper_is_named_by_its_pool_and_a_warning_about_it_gives_that_name(ray_session, caplog):
    """Issue 42 #8: a keeper the warm pool started ahead of a run has a Ray name (model, id),
    which the run that took it gives when it dies."""
    import ray

    from ettflow.trainer.checkpoint.state_keeper import NamedKeeper, pooled_keeper_name, start_keeper
    from ettflow.trainer.group.ray_group import end_run, run_keeper
    from ettflow.trainer.group.warm_pool import WarmPool

    name = pooled_keeper_name("dlrm")
    pool = WarmPool()
    pool.keeper = NamedKeeper(start_keeper(None, name=name), name)
    taken = run_keeper("keeper-pooled", pool=pool)
    assert pool.keeper is None and ray.get_actor(name)._actor_id == taken._actor_id
    assert name.startswith("ettflow-keeper-pool-dlrm-")
    _killed(taken)
    try:
        with caplog.at_level("WARNING", logger="ettflow"):
            replaced = run_keeper("keeper-pooled", pool=pool)
        assert ray.get(replaced.ping.remote(), timeout=60) == "ok"
        assert f"keeper (actor {name}) died: a new one starts" in caplog.text
    finally:
        end_run("keeper-pooled")
