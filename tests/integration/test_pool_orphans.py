"""The cluster pool stops what a run took when the run's process dies without stopping it.

The pool owns every worker and keeper it starts (Ray cannot pass an actor's ownership on), so
a flow process killed by SIGKILL would leave the ranks it took from the pool running, holding
their slots (on a GPU cluster, their devices). The run's `RunOwner`, an actor that process
owns, dies with it; the pool's `reap_orphans` then stops what that run took and records the
time as an `orphaned` ledger line. On the session's Ray: the pool's methods called here, real
actors as the taken worker and as the owners."""

from __future__ import annotations

import time

import pytest
import ray

from ettflow.ett.capacity import ORPHANED
from ettflow.trainer.group.pool_service import PoolPolicy, PoolService, RunOwner, _Given


@ray.remote(num_cpus=0)
class Sleeper:
    def ready(self) -> bool:
        return True


def _alive(actor) -> bool:
    try:
        return ray.get(actor.ready.remote(), timeout=20)
    except ray.exceptions.RayActorError:
        return False


def _answers(owner) -> bool:
    try:
        ray.get(owner.ping.remote(), timeout=5)
        return True
    except ray.exceptions.GetTimeoutError:
        return True
    except ray.exceptions.RayError:
        return False


@pytest.mark.timeout(120)
def test_what_a_dead_run_took_is_stopped_and_recorded_and_a_finished_run_is_forgotten(ray_session):
    pool = PoolService(PoolPolicy(reap_every_s=3600.0))
    dead_owner, live_owner = (ray.remote(RunOwner).options(num_cpus=0).remote() for _ in range(2))
    orphan, kept = Sleeper.remote(), Sleeper.remote()
    assert _alive(orphan) and _alive(kept)
    t0 = time.time()
    pool.given = [_Given(orphan, dead_owner, "run-dead", "dlrm", "worker", t0, gpus=1.0, cpus=2.0),
                  _Given(kept, live_owner, "run-live", "dlrm", "worker", t0)]
    assert pool.reap_orphans(now=t0 + 1) == 0  # both owners answer: nothing is stopped
    ray.kill(dead_owner)  # as when the run's flow process is SIGKILLed: Ray ends the actors it owned
    # `ray.kill` returns before the actor is gone: a ping sent at once could still be answered (seen
    # once in CI); the reap is about an owner that no longer answers
    deadline = time.monotonic() + 30
    while _answers(dead_owner) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pool.reap_orphans(now=t0 + 31) == 1
    # the reap's `ray.kill` of the orphan returns before it is gone, as the owner's did (seen in CI at
    # 5ac17b1: a ping at once was answered): it must stop answering within the same 30 s
    deadline = time.monotonic() + 30
    while _alive(orphan) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(orphan) and _alive(kept)
    [line] = pool.drain()
    assert (line.kind, line.run_id, line.used, line.reason) == (ORPHANED, "run-dead", False, "owner_died")
    assert (line.requested_at, line.released_at, line.gpus, line.slots) == (t0 + 1, t0 + 31, 1.0, 1.0)
    assert [g.run_id for g in pool.given] == ["run-live"]
    assert pool.forget("run-live") == 1 and pool.given == []  # its normal end: it stopped its own
    ray.kill(live_owner)
    assert pool.reap_orphans(now=t0 + 61) == 0 and _alive(kept)  # nothing of a forgotten run is stopped
    pool.stop()
    ray.kill(kept)


@ray.remote(num_cpus=0, max_concurrency=2)
class StagingWorker:
    """A pooled worker's answers on its staging: one that stages, one that stages nothing, one
    whose process is gone, one too busy to answer in time."""

    def __init__(self, answer: str) -> None:
        self.answer = answer

    def staging_status(self):
        from ettflow.trainer.protocol import StagingState, StagingStatus

        if self.answer == "slow":
            time.sleep(30)
        return (StagingStatus(path="/c/step_0000000020", state=StagingState.READING)
                if self.answer == "reading" else None)


def test_the_pools_status_says_how_each_workers_staging_stands_or_that_it_did_not_answer(ray_session):
    from ettflow.trainer.group.pool_service import staging_answers

    workers = {f"w{n}": StagingWorker.remote(answer)
               for n, answer in enumerate(("reading", "nothing", "gone", "slow"))}
    ray.get([w.__ray_ready__.remote() for w in workers.values()], timeout=120)  # started: a slow start is no answer
    ray.kill(workers["w2"], no_restart=True)
    t0 = time.monotonic()
    assert staging_answers(workers, timeout_s=3.0) == {
        "w0": "stages /c/step_0000000020: reading", "w1": "stages nothing",
        "w2": "no answer on its staging (ActorDiedError)", "w3": "no answer on its staging within 3 s"}
    assert time.monotonic() - t0 < 20  # the slow worker's 30 s is not waited out
    assert staging_answers({}) == {}
    for worker in workers.values():
        ray.kill(worker, no_restart=True)
