"""Trainer processes kept warm between runs, so that a refresh's ranks start without a process start.

A process that drives refresh after refresh (`ettflow refresh --refreshes N`, the continuous
refresh bench, any long-lived driver) opens the pool (`keep_warm(True)`). When a run that has
the `warm_pool` switch trains to the end and its group is torn down, the pool starts what the
next run of the same shape needs: one trainer actor per rank, plus the run's spare when live
recovery is on, each prewarmed as a spare is (spare.py: imports, dense modules and optimizer,
the dense step compiled from the compile-cache archive), and the run's in-memory checkpoint
keeper when it has one (its process start would otherwise fall on the run's first in-memory
copy, the ranks being up sooner than it). That happens after the devices were
released, off every run's clock. The next run takes them (`take`): a pooled rank skips the
process start, its imports and its compile (`TrainerSession` with `warm`), and the group's
spare comes from the pool too (spare_pool.py). A run finds nothing to take when no earlier run
of this process filled the pool, when the pool's workers were prepared for another shape
(`warm_key`: they are then stopped), or when they are not prewarmed yet; its ranks then start
the usual way.

What a pooled worker prepared is recorded in the run that takes it, off the clock, as
`spare_start` with `pooled` set (from its request to prewarmed; that is before the run began).

A pooled worker asks Ray for no CPU (`num_cpus=0`): it idles until taken, and then runs in the
bundle the run's placement reserved on its node (a worker on another node is not taken for
that bundle). It holds no accelerator, so the pool is used on CPU placements only, like the
spare.

Where the pool lives: in a process that started its own Ray, here (Ray ends the actors with
the process that owns them). In a process that joined a cluster that outlives it (`ettflow
up`'s Ray head, a team's cluster: `attach_cluster`), in the cluster: the named, detached
service of `pool_service.py` starts and owns the workers and keepers, so what one run's release
prepared serves the next run, whichever process drives it (a Prefect worker's flow-run process
included).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError, RayTaskError

from ettflow.ett.run_summary import short_reason
from ettflow.trainer.config import TrainerConfig
from ettflow.trainer.group.pooled_worker import (
    POOL_RUN_ID,
    STAGE_MAX_BYTES,
    PooledWorker,
    model_name,
    prewarm_for_next_run,
    probe,
    ranks_first,
    record_start,
    stage_request,
    start_worker,
    stop,
    take_for_nodes,
    warm_key,
)
from ettflow.trainer.protocol import PrewarmTimings, StartSample

if TYPE_CHECKING:
    from ettflow.ett.spare_sizing import SpareDecision, SpareShare
    from ettflow.trainer.checkpoint.state_keeper import NamedKeeper
    from ettflow.trainer.group.pool_service import LeftSharing, OwnerHandle, PoolHandle

__all__ = ["POOL", "POOL_RUN_ID", "PooledWorker", "WarmPool", "record_start", "start_worker", "warm_key"]

log = logging.getLogger("ettflow.trainer")
# the longest a rank's loss waits to hear whether the cluster's pool still answers (a busy one
# answers within it: the service runs 8 calls at once)
SERVICE_PING_S = 5.0
OWNER_END_S = 5.0  # the longest a process's exit waits for its RunOwner to end (`WarmPool._end_owner`)


class WarmPool:
    def __init__(self) -> None:
        self.keeping = False
        self.workers: list[PooledWorker] = []
        self.keeper: NamedKeeper | None = None  # an in-memory checkpoint keeper for the next run
        self.service: PoolHandle | None = None  # the cluster's pool (pool_service.py) once attached
        self._owner: OwnerHandle | None = None
        self._owner_ends_at_exit = False  # `_end_owner` registered with atexit
        self._owner_session: str | None = None  # the Ray cluster, node and job `_owner` was made in

    def attach_cluster(self) -> None:
        """Use the cluster's pool from now on (this process joined a cluster that outlives it):
        runs that end fill it, runs that start take from it."""
        from ettflow.paths import data_home
        from ettflow.trainer.group.pool_service import service

        if self.service is None:
            self.close()
            # a service started by this process journals what it holds in this home: the next
            # one finds there what a killed one held (pool_journal.py)
            self.service = service(journal=str(data_home() / "pool" / "journal.json"))
        self.keeping = True

    # ---- the process's choice ------------------------------------------------------------
    def keep_warm(self, on: bool) -> None:
        """Whether runs that end fill the pool for the next one (off: the pool's workers stay
        until taken or `close`d, and no new ones start)."""
        self.keeping = on

    # ---- filling -------------------------------------------------------------------------
    def give(self, worker: PooledWorker) -> None:
        """Keep `worker` (a spare its run did not need) for the next run, when the pool is kept
        here (a worker this process owns dies with it: the cluster's pool starts its own)."""
        if self.keeping and ray.is_initialized() and self.service is None:
            self.workers.append(worker)
        else:
            stop(worker)

    def fill(self, config: TrainerConfig, count: int, spool_root: Path | str, actor_cls: type, *,
             next_run_at: float | None = None, start: StartSample | None = None, anchor: str | None = None) -> int:
        """Start workers (of `actor_cls`, the rank's actor class) until the pool holds `count`
        for `config` (workers for another shape are stopped); returns how many started.
        Nothing when the pool is not kept. `next_run_at`: when the run's deployment runs next
        (Prefect's schedule): the cluster's pool prewarms ahead of it rather than holding
        workers till then. `start`: the releasing run's measured start, which the cluster's
        pool weighs against what a prewarm holds (`hold_rule.py`). `anchor`: the releasing run's,
        staged in memory by the workers for the next run's ranks, for its warm start (`staged_anchor.py`)."""
        if not self.keeping or not config.switches.warm_pool or not ray.is_initialized():
            return 0
        if self.service is not None:  # the cluster's pool starts them (the call returns at once)
            self.service.fill.remote(config, count, str(spool_root), next_run_at, actor_cls=actor_cls, start=start,
                                     anchor=anchor)
            return 0
        key = warm_key(config)
        self._drop(lambda w: w.key != key)
        started = max(count - len(self.workers), 0)
        stage = stage_request(anchor, STAGE_MAX_BYTES)
        new = [start_worker(config, POOL_RUN_ID, spool_root, actor_cls=actor_cls) for _ in range(started)]
        prewarm_for_next_run(self.workers, new, stage, config)
        self.workers += new
        if config.switches.memory_checkpoint and self.keeper is None:
            from ettflow.trainer.checkpoint.state_keeper import NamedKeeper, pooled_keeper_name, start_keeper

            name = pooled_keeper_name(model_name(config))
            self.keeper = NamedKeeper(start_keeper(None, wait=False, name=name), name)
        if started:
            log.info("warm pool: %d worker(s) starting for the next run", started)
        return started

    def wait_ready(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for every pooled worker to be prewarmed; returns how many are
        (a worker whose start failed is dropped)."""
        if self.service is not None:
            return int(ray.get(self.service.wait_ready.remote(timeout_s)))
        refs = [w.prewarmed for w in self.workers]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        return len(self._ready())

    # ---- taking --------------------------------------------------------------------------
    def take(self, config: TrainerConfig, nodes: list[str | None],
             run_id: str = "", *, spare: bool = False) -> list[tuple[PooledWorker, PrewarmTimings | None] | None]:
        """For each wanted node (None: any node), a prewarmed worker of `config`'s shape on it
        and its prewarm timings, or None (that rank starts the usual way). Taken workers are
        the caller's; workers for another shape are stopped. `spare`: for a lost rank (the
        cluster's pool may give a shared spare still prewarming: timings None)."""
        if self.service is not None and config.switches.warm_pool:
            return self._take_from_cluster(config, nodes, run_id, spare=spare)
        if not config.switches.warm_pool or not self.workers:
            return [None] * len(nodes)
        key = warm_key(config)
        self._drop(lambda w: w.key != key)
        taken = take_for_nodes(sorted(self._ready(), key=ranks_first(spare)), nodes)
        for worker in filter(None, taken):
            self.workers.remove(worker)
        return [None if w is None else (w, w.timings) for w in taken]

    def _take_from_cluster(self, config: TrainerConfig, nodes: list[str | None], run_id: str, *,
                           spare: bool = False) -> list[tuple[PooledWorker, PrewarmTimings | None] | None]:
        try:
            found = ray.get(self.service.take.remote(config, nodes, self._run_owner(), run_id, spare=spare),
                            timeout=30)
        except (GetTimeoutError, RayActorError, RayTaskError) as exc:  # the pool is gone or busy: start as usual
            # Ray's message of a dead actor runs to a dozen lines (its name, class, pid...): the first says it
            log.warning("cluster pool: could not take workers (%s: %s); the ranks start the usual way",
                        type(exc).__name__, short_reason(str(exc)))
            self.service = None
            return [None] * len(nodes)
        if not any(found):  # nothing prewarmed: say so when it is because the pool was lost
            with contextlib.suppress(GetTimeoutError, RayActorError, RayTaskError):
                note = ray.get(self.service.cold_note.remote(model_name(config)), timeout=10)
                if note:
                    log.warning("%s", note)
        return [None if w is None else (w, w.timings) for w in found]

    def take_keeper(self, run_id: str = "") -> NamedKeeper | None:
        """The keeper started for the next run (its process up or starting), and its name, or None."""
        if self.service is not None:
            try:
                return ray.get(self.service.take_keeper.remote(self._run_owner(), run_id), timeout=30)
            except (GetTimeoutError, RayActorError, RayTaskError) as exc:
                # a take that timed out may still finish in the pool, which then holds a keeper as
                # this run's that the run never got: the pool stops it at the run's end (`forget`)
                log.warning("cluster pool: could not take the in-memory keeper (%s: %s); the run starts its own",
                            type(exc).__name__, short_reason(str(exc)))
                return None
        keeper, self.keeper = self.keeper, None
        return keeper

    def share_spares(self, share: SpareShare, config: TrainerConfig, spool_root: Path | str,
                     actor_cls: type) -> SpareDecision | None:
        """The run trains from now and shares its model's spares held by the cluster's pool
        (`PoolService.share_spares`); the model's decision, or None: no cluster pool (or it did
        not answer), the run holds its own as decided."""
        if self.service is None or not config.switches.warm_pool:
            return None
        try:
            return ray.get(self.service.share_spares.remote(share, config, str(spool_root), actor_cls=actor_cls,
                                                            owner=self._run_owner()), timeout=30)
        except (GetTimeoutError, RayActorError, RayTaskError) as exc:
            log.warning("cluster pool: could not share its spares (%s: %s); the run holds its own as decided",
                        type(exc).__name__, short_reason(str(exc)))
            return None

    def unshare(self, run_id: str) -> LeftSharing | None:
        """The run stopped training: its parts of the shared spares' holds (`PoolService.unshare`),
        or None (it shared nothing, or the pool did not answer: then `forget` puts them in the
        pool's ledger as the run's lines)."""
        if self.service is None:
            return None
        try:
            return ray.get(self.service.unshare.remote(run_id), timeout=30)
        except (GetTimeoutError, RayActorError, RayTaskError) as exc:
            log.warning("cluster pool: could not end the run's share of its spares (%s: %s)", type(exc).__name__,
                        short_reason(str(exc)))
            return None

    def forget(self, run_id: str) -> None:
        """The run stopped what it took from the cluster's pool (its normal end)."""
        if self.service is not None:
            with contextlib.suppress(Exception):
                self.service.forget.remote(run_id)

    def _run_owner(self) -> OwnerHandle:
        """This process's `RunOwner` (made once per Ray session it joins): the cluster's pool
        stops what this process took from it if the process dies without doing so. A handle
        made in an earlier session is never passed on: Ray aborts the process that serializes
        an actor handle its current session does not know (CI: a test's owner outlived its Ray
        into the next test's cluster, and the worker process died)."""
        ctx = ray.get_runtime_context()
        session = f"{ctx.gcs_address}/{ctx.get_node_id()}/{ctx.get_job_id()}"  # job ids repeat across clusters
        if self._owner is None or self._owner_session != session:
            from ettflow.trainer.group.pool_service import RunOwner

            self._owner = ray.remote(RunOwner).options(num_cpus=0, max_concurrency=4).remote()
            self._owner_session = session
            if not self._owner_ends_at_exit:
                # after `ray.init`'s own exit hook, so it runs before it (atexit is LIFO): see `_end_owner`
                atexit.register(self._end_owner)
                self._owner_ends_at_exit = True
        return self._owner

    def _end_owner(self) -> None:
        """Stop this process's `RunOwner` while Ray is still up. Left to Ray's shutdown, the
        owner is ended because its last reference went, and in Ray 2.60 that exit aborts its
        process (SIGABRT in `~CoreWorker`: 40 lines of C++ stack in the worker's log after
        every deployed run); `ray.kill` ends it at once. The kill is only sent, so this waits
        (at most `OWNER_END_S`) until the owner stops answering: a process that exited first left
        the owner to the abort again (CI: one run of two). The pool sees it gone either way."""
        owner, self._owner, self._owner_session = self._owner, None, None
        if owner is None or not ray.is_initialized():
            return
        with contextlib.suppress(Exception):  # RayActorError and kin: it is gone, as asked
            ray.kill(owner, no_restart=True)
            deadline = time.monotonic() + OWNER_END_S
            while time.monotonic() < deadline:
                ray.get(owner.ping.remote(), timeout=1.0)  # still answering: not yet ended
                time.sleep(0.05)

    def _ready(self) -> list[PooledWorker]:
        """The prewarmed workers (timings and node read); a failed one is dropped."""
        failed = probe(self.workers, "warm pool")
        self._drop(lambda w: any(w is f for f in failed))
        return [w for w in self.workers if w.timings is not None]

    def _drop(self, which) -> None:
        for worker in [w for w in self.workers if which(w)]:
            self.workers.remove(worker)
            stop(worker)

    def close(self) -> None:
        """Stop every pooled worker this process owns; the pool is no longer kept (the cluster's
        pool goes on serving the cluster's other runs)."""
        self.keeping = False
        self.service = None
        if ray.is_initialized():
            self._drop(lambda w: True)
            if self.keeper is not None:
                with contextlib.suppress(Exception):
                    ray.kill(self.keeper.actor, no_restart=True)
        self.workers, self.keeper = [], None
        self._owner, self._owner_session = None, None  # Ray ends it with this process, or with its session




POOL = WarmPool()


def service_lost(service: PoolHandle) -> bool:
    """Whether the cluster's pool `service` (a handle kept from when it gave workers: the pool
    forgets one that failed a call) has died: Ray ends what it owned, the workers it gave a run
    included. One busy or unreachable for a moment is not lost: only Ray's verdict that the
    actor died says so."""
    if not ray.is_initialized():
        return False
    try:
        ray.get(service.ping.remote(), timeout=SERVICE_PING_S)
    except ActorDiedError:
        return True
    except (GetTimeoutError, RayActorError, RayTaskError):
        return False
    return False
atexit.register(POOL.close)
