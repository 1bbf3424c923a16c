"""The warm pool as a service of the Ray cluster: one named, detached actor per cluster.

A flow run that a Prefect worker starts is a process of its own, and Ray ends the actors a
process owns when it exits: a pool kept by that process would die with each run. So on a
cluster that outlives its runs (`ettflow up`'s head, a team's cluster: the run *joined* it),
the pool is the actor `ettflow-pool` in the namespace `ettflow`, started on first use
(`get_if_exists`), detached: it survives every flow process and ends with the cluster, or on
`ettflow pool stop`. It starts and owns the prewarmed trainer workers and in-memory checkpoint
keepers (their owner is the service, so they outlive the run that asked for them), keyed as
`warm_pool.warm_key` keys them; any run connected to the cluster takes them for its placement.

Its policy (`PoolPolicy`): at most `max_workers` per model (a fill for another shape of the
same model stops the old ones), and a worker nobody took within `idle_s` is released (a
reaper thread checks every `reap_every_s`). What the pool holds, and since when, is what
`status()` lists; a run records what it took in its spool (`spare_start`, `pooled`, with the
time it was taken), off its clock.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from ettflow.trainer.config import TrainerConfig
from ettflow.trainer.group.pooled_worker import (
    POOL_RUN_ID,
    PooledWorker,
    model_name,
    probe,
    start_worker,
    stop,
    take_for_nodes,
    warm_key,
)

log = logging.getLogger("ettflow.trainer")
NAME = "ettflow-pool"
NAMESPACE = "ettflow"


@dataclass(frozen=True, kw_only=True)
class PoolPolicy:
    """max_workers: prewarmed workers kept per model (ranks and spares of its next run).
    idle_s: a worker or keeper nobody took in this long is released (a deployment that runs
    every 6 hours keeps its next run's). reap_every_s: how often that is checked."""

    max_workers: int = 8
    idle_s: float = 6 * 3600 + 900
    reap_every_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_workers < 0:
            raise ValueError(f"max_workers must be 0 or more, got {self.max_workers}")
        if self.idle_s <= 0 or self.reap_every_s <= 0:
            raise ValueError(f"idle_s and reap_every_s must be positive, got {self.idle_s}, {self.reap_every_s}")


@dataclass(frozen=True)
class PooledInfo:
    """One thing the pool holds, as `ettflow pool status` lists it."""

    kind: str  # "worker" or "keeper"
    model: str  # the model's name in the config (its shape is the key's digest)
    key: str  # a short digest of the warm key
    state: str  # "prewarming" or "ready" (a failed worker is dropped)
    requested_at: float
    ready_at: float | None
    node: str | None


@dataclass
class _Keeper:
    actor: Any
    requested_at: float


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:10]


class PoolService:
    """The pool's actor (start it with `service()`); every method runs in the cluster."""

    def __init__(self, policy: PoolPolicy = PoolPolicy()) -> None:
        self.policy = policy
        self.entries: list[PooledWorker] = []
        self.keepers: list[_Keeper] = []
        self._lock = threading.RLock()
        self._stop = threading.Event()
        threading.Thread(target=self._reap_loop, name="ettflow-pool-reaper", daemon=True).start()

    # ---- filling -------------------------------------------------------------------------
    def fill(self, config: TrainerConfig, count: int, spool_root: str) -> int:
        """Start workers until the pool holds `count` (at most the policy's bound) of `config`'s
        shape; the model's workers of another shape are stopped. Returns how many started."""
        key, model = warm_key(config), model_name(config)
        with self._lock:
            self._drop(lambda e: e.model == model and e.key != key)
            have = len([e for e in self.entries if e.key == key])
            started = max(min(count, self.policy.max_workers) - have, 0)
            for _ in range(started):
                worker = start_worker(config, POOL_RUN_ID, spool_root)
                worker.prewarmed = worker.actor.prewarm.remote()
                self.entries.append(worker)
            if config.switches.memory_checkpoint and not self.keepers:
                from ettflow.trainer.checkpoint.state_keeper import start_keeper

                self.keepers.append(_Keeper(start_keeper(None, wait=False), time.time()))
        if started:
            log.info("cluster pool: %d worker(s) of model %s starting for its next run", started, model)
        return started

    def wait_ready(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for every worker to be prewarmed; how many are."""
        import ray

        refs = [e.prewarmed for e in self.entries]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        with self._lock:
            return len(self._ready())

    # ---- taking --------------------------------------------------------------------------
    def take(self, config: TrainerConfig, nodes: list[str | None]) -> list[PooledWorker | None]:
        """For each wanted node (None: any), a prewarmed worker of `config`'s shape there (its
        `timings` read), or None. Taken workers are the caller's."""
        key = warm_key(config)
        with self._lock:
            taken = take_for_nodes([e for e in self._ready() if e.key == key], nodes)
            for worker in filter(None, taken):
                self.entries.remove(worker)
        return taken

    def take_keeper(self) -> Any:
        with self._lock:
            return self.keepers.pop(0).actor if self.keepers else None

    # ---- what it holds -------------------------------------------------------------------
    def status(self) -> list[PooledInfo]:
        with self._lock:
            self._ready()
            workers = [PooledInfo("worker", e.model, digest(e.key), "ready" if e.timings is not None else "prewarming",
                                  e.requested_at, e.timings.ready_at if e.timings is not None else None, e.node)
                       for e in self.entries]
            return workers + [PooledInfo("keeper", "-", "-", "ready", k.requested_at, None, None)
                              for k in self.keepers]

    def stop(self) -> int:
        """Stop everything the pool holds; returns how many actors were stopped."""
        self._stop.set()
        with self._lock:
            n = len(self.entries) + len(self.keepers)
            self._drop(lambda e: True)
            self._drop_keepers(lambda k: True)
        return n

    # ---- internals -----------------------------------------------------------------------
    def _ready(self) -> list[PooledWorker]:
        """The prewarmed workers (timings and node read once); a failed one is dropped."""
        failed = probe(self.entries, "cluster pool")
        self._drop(lambda e: any(e is f for f in failed))
        return [e for e in self.entries if e.timings is not None]

    def _drop(self, which) -> None:
        for e in [e for e in self.entries if which(e)]:
            self.entries.remove(e)
            stop(e)

    def _drop_keepers(self, which) -> int:
        import ray

        gone = [k for k in self.keepers if which(k)]
        for k in gone:
            self.keepers.remove(k)
            with contextlib.suppress(Exception):
                ray.kill(k.actor, no_restart=True)
        return len(gone)

    def _reap_loop(self) -> None:
        while not self._stop.wait(self.policy.reap_every_s):
            self.reap(time.time())

    def reap(self, now: float) -> int:
        """Release what nobody took within the policy's idle time; how many were released."""
        with self._lock:
            old = [e for e in self.entries if now - (e.timings.ready_at if e.timings else e.requested_at)
                   > self.policy.idle_s]
            self._drop(lambda e: any(e is o for o in old))
            stale = self._drop_keepers(lambda k: now - k.requested_at > self.policy.idle_s)
        if old or stale:
            log.info("cluster pool: released %d worker(s) and %d keeper(s) nobody took within %.0f s",
                     len(old), stale, self.policy.idle_s)
        return len(old) + stale


def service(*, create: bool = True, policy: PoolPolicy = PoolPolicy()) -> Any:
    """The cluster's pool actor (started when `create` and there is none), or None."""
    import ray

    try:
        return ray.get_actor(NAME, namespace=NAMESPACE)
    except ValueError:
        if not create:
            return None
    return ray.remote(PoolService).options(
        name=NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0, max_restarts=0,
        max_concurrency=8).remote(policy)
