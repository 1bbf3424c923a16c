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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ettflow.trainer.config import TrainerConfig
from ettflow.trainer.protocol import PrewarmTimings

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
    state: str  # "prewarming", "ready" or "failed"
    requested_at: float
    ready_at: float | None
    node: str | None


@dataclass
class _Entry:
    actor: Any
    prewarmed: Any  # the ObjectRef of its prewarm (PrewarmTimings)
    requested_at: float
    key: str
    model: str
    timings: PrewarmTimings | None = None
    node: str | None = None
    failed: bool = False


@dataclass
class _Keeper:
    actor: Any
    requested_at: float
    extra: dict = field(default_factory=dict)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:10]


def model_name(config: TrainerConfig) -> str:
    return getattr(config, "model_name", None) or Path(str(config.compile_cache_dir)).parent.name or "model"


class PoolService:
    """The pool's actor (start it with `service()`); every method runs in the cluster."""

    def __init__(self, policy: PoolPolicy = PoolPolicy()) -> None:
        self.policy = policy
        self.entries: list[_Entry] = []
        self.keepers: list[_Keeper] = []
        self._lock = threading.RLock()
        self._stop = threading.Event()
        threading.Thread(target=self._reap_loop, name="ettflow-pool-reaper", daemon=True).start()

    # ---- filling -------------------------------------------------------------------------
    def fill(self, config: TrainerConfig, count: int, spool_root: str) -> int:
        """Start workers until the pool holds `count` (at most the policy's bound) of `config`'s
        shape; the model's workers of another shape are stopped. Returns how many started."""
        from ettflow.trainer.group.pooled_worker import POOL_RUN_ID, start_worker, warm_key

        key, model = warm_key(config), model_name(config)
        with self._lock:
            self._drop(lambda e: e.model == model and e.key != key)
            have = len([e for e in self.entries if e.key == key])
            started = max(min(count, self.policy.max_workers) - have, 0)
            for _ in range(started):
                worker = start_worker(config, POOL_RUN_ID, spool_root)
                self.entries.append(_Entry(worker.actor, worker.actor.prewarm.remote(), worker.requested_at, key,
                                           model))
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
    def take(self, config: TrainerConfig, nodes: list[str | None]) -> list[tuple[Any, PrewarmTimings, float] | None]:
        """For each wanted node (None: any), a prewarmed worker of `config`'s shape there:
        (its actor, its prewarm's timings, when it was requested), or None. Taken workers are
        the caller's."""
        from ettflow.trainer.group.pooled_worker import warm_key

        key = warm_key(config)
        out: list[tuple[Any, PrewarmTimings, float] | None] = [None] * len(nodes)
        with self._lock:
            ready = [e for e in self._ready() if e.key == key]
            for i, node in enumerate(nodes):
                match = next((e for e in ready if node is None or e.node == node), None)
                if match is not None:
                    ready.remove(match)
                    self.entries.remove(match)
                    out[i] = (match.actor, match.timings, match.requested_at)
        return out

    def take_keeper(self) -> Any:
        with self._lock:
            return self.keepers.pop(0).actor if self.keepers else None

    # ---- what it holds -------------------------------------------------------------------
    def status(self) -> list[PooledInfo]:
        with self._lock:
            self._ready()
            workers = [PooledInfo("worker", e.model, digest(e.key), "failed" if e.failed else
                                  ("ready" if e.timings is not None else "prewarming"), e.requested_at,
                                  e.timings.ready_at if e.timings is not None else None, e.node)
                       for e in self.entries]
            return workers + [PooledInfo("keeper", "-", "-", "ready", k.requested_at, None, None)
                              for k in self.keepers]

    def stop(self) -> int:
        """Stop everything the pool holds; returns how many actors were stopped."""
        import ray

        self._stop.set()
        with self._lock:
            n = len(self.entries) + len(self.keepers)
            self._drop(lambda e: True)
            for k in self.keepers:
                with contextlib.suppress(Exception):
                    ray.kill(k.actor, no_restart=True)
            self.keepers = []
        return n

    # ---- internals -----------------------------------------------------------------------
    def _ready(self) -> list[_Entry]:
        """The prewarmed entries, their timings and node read once; a failed one is dropped."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        pending = [e for e in self.entries if e.timings is None]
        if pending:
            done, _ = ray.wait([e.prewarmed for e in pending], num_returns=len(pending), timeout=0)
            for e in [e for e in pending if e.prewarmed in done]:
                try:
                    e.timings = ray.get(e.prewarmed)
                    e.node = ray.get(e.actor.ready.remote(), timeout=10).node_id
                except (GetTimeoutError, RayActorError, RayTaskError) as exc:
                    log.warning("cluster pool: a worker failed to prepare (%s: %s); dropped", type(exc).__name__, exc)
                    e.failed = True
            self._drop(lambda e: e.failed)
        return [e for e in self.entries if e.timings is not None]

    def _drop(self, which) -> None:
        import ray

        for e in [e for e in self.entries if which(e)]:
            self.entries.remove(e)
            with contextlib.suppress(Exception):
                ray.kill(e.actor, no_restart=True)

    def _reap_loop(self) -> None:
        while not self._stop.wait(self.policy.reap_every_s):
            self.reap(time.time())

    def reap(self, now: float) -> int:
        """Release what nobody took within the policy's idle time; how many were released."""
        import ray

        with self._lock:
            old = [e for e in self.entries if now - (e.timings.ready_at if e.timings else e.requested_at)
                   > self.policy.idle_s]
            self._drop(lambda e: e in old)
            stale = [k for k in self.keepers if now - k.requested_at > self.policy.idle_s]
            for k in stale:
                self.keepers.remove(k)
                with contextlib.suppress(Exception):
                    ray.kill(k.actor, no_restart=True)
        if old or stale:
            log.info("cluster pool: released %d worker(s) and %d keeper(s) nobody took within %.0f s",
                     len(old), len(stale), self.policy.idle_s)
        return len(old) + len(stale)


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
