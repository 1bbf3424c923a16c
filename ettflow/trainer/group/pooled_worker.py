"""A trainer worker started ahead of the run that will use it: a pooled rank or a spare.

What the warm pool (warm_pool.py, in this process), the cluster's pool (pool_service.py) and
the spare pool (spare_pool.py) share: the key a prewarmed worker depends on, how one starts,
and how its start is recorded in the run that takes it (off the clock).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ettflow.trainer.config import TrainerConfig
from ettflow.trainer.protocol import PrewarmTimings, StageRequest

log = logging.getLogger("ettflow.trainer")
POOL_RUN_ID = "warm-pool"  # a pooled worker's run until a run takes it
# the largest anchor a next run's worker stages in memory by default (`PoolPolicy.stage_max_bytes`):
# the whole anchor, in host memory beside the worker's own model, so a bound a CPU host can spare
STAGE_MAX_BYTES = 2 << 30


def warm_key(config: TrainerConfig) -> str:
    """What a prewarmed worker depends on: the model, the batch's shapes, the device, the thread
    count and the compile settings (the compile cache's own key, and where it lives)."""
    sw = config.switches
    return json.dumps({"model": asdict(config.model), "schema": asdict(config.schema),
                       "batch_size": config.batch_size, "device": config.device,
                       "threads": config.threads_per_rank, "compile": sw.compile,
                       "compile_cache": sw.compile_cache, "local_inductor_cache": sw.local_inductor_cache,
                       "cache_dir": str(config.compile_cache_dir)},
                      sort_keys=True, default=str)


def model_name(config: TrainerConfig) -> str:
    """The model a worker is for: its compile cache lives under `<work_root>/<model>/`."""
    return Path(str(config.compile_cache_dir)).parent.name or "model"


@dataclass
class PooledWorker:
    """A trainer actor started ahead of a run: `prewarmed` is its `prewarm()` call (its result
    the prewarm's timings), `requested_at` when it was asked for. `timings` and `node` are
    read once its prewarm finished (`probe`)."""

    actor: Any
    prewarmed: Any
    requested_at: float
    key: str
    model: str = ""
    timings: PrewarmTimings | None = None
    node: str | None = None
    # what it holds, for the held-capacity ledger (`ett.capacity.Holding`): its bundle's GPUs
    # and the CPUs its process computes on, and its resident memory once prewarmed
    gpus: float = 0.0
    cpus: float = 0.0
    rss_bytes: int | None = None
    holding_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # its ledger line, if nobody takes it
    rule: str = ""  # the pool's hold rule it was prewarmed under (`hold_rule.HoldRule`; "": none, a run's spare)
    measured: bool = False  # its prewarm duration was counted in its model's estimate (pool_service.py)
    staging: str | None = None  # the anchor it stages in memory for the next run (`begin_prewarm`)

    def holding_attrs(self) -> dict[str, Any]:
        return {"gpus": self.gpus, "cpus": self.cpus, **({"rss_bytes": self.rss_bytes} if self.rss_bytes else {}),
                **({"rule": self.rule} if self.rule else {})}


def start_worker(config: TrainerConfig, run_id: str, spool_root: Path | str, *, actor_cls: type,
                 bundle: tuple[Any, int] | None = None) -> PooledWorker:
    """A trainer actor with no rank yet (a spare or a pooled worker); its prewarm is not asked
    for. With no `bundle` it asks Ray for no CPU of its own (on a CPU placement it idles until
    it takes the place, and the share, of a rank whose process is gone); with `bundle`
    (placement group, index: a GPU placement's spare) it holds that bundle's GPU and CPUs from
    its start, and its ledger line says so. `actor_cls`: the rank's actor class
    (`trainer.rank.actor.TrainerActor`), given by the code that composes the trainer: this side
    never imports the rank's."""
    requested_at = time.time()
    if bundle is None:
        options: dict[str, Any] = {"num_cpus": 0}
    else:
        pg, index = bundle
        options = {"num_cpus": config.threads_per_rank, "num_gpus": 1, "scheduling_strategy":
                   PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)}
    actor = ray.remote(actor_cls).options(max_restarts=0, max_concurrency=2, **options).remote(
        config, run_id, -1, -1, str(spool_root), requested_at)
    return PooledWorker(actor, None, requested_at, warm_key(config), model_name(config),
                        gpus=float(options.get("num_gpus", 0)), cpus=float(config.threads_per_rank))


def begin_prewarm(worker: PooledWorker, stage: StageRequest | None = None) -> None:
    """Ask `worker` to prewarm (its result: `worker.prewarmed`), staging `stage`'s anchor in
    memory meanwhile (a worker for a model's next run: `checkpoint/staged_anchor.py`)."""
    worker.prewarmed = worker.actor.prewarm.remote(stage) if stage is not None else worker.actor.prewarm.remote()
    worker.staging = stage.path if stage is not None else None


def restage(kept: list[PooledWorker], stage: StageRequest | None, ranks: int) -> int:
    """Workers kept from an earlier release (or a run's spare given back) stage `stage`'s anchor
    instead of what they staged before: the newest release's is the next run's likely parent.
    At most `ranks` of them (the next run's ranks restore its parent; its spares join a live
    recovery and read none), those already staging it first, then those staging an older one;
    the others drop what they stage. Returns how many stage it."""
    if stage is None:
        return 0
    order = sorted(kept, key=lambda w: (w.staging != stage.path, w.staging is None))
    for worker in order[:ranks]:
        if worker.staging != stage.path:
            worker.actor.stage.remote(stage)
            worker.staging = stage.path
    for worker in order[ranks:]:
        if worker.staging is not None:
            worker.actor.unstage.remote()
            worker.staging = None
    return min(len(order), ranks)


def prewarm_for_next_run(kept: list[PooledWorker], new: list[PooledWorker], stage: StageRequest | None,
                         config: TrainerConfig) -> None:
    """Ask the `new` workers for `config`'s next run to prewarm, and `stage`'s anchor staged by as
    many of the pool's workers (`kept` ones first: `restage`) as the run has ranks: its spares
    join a live recovery from their peers' memory and read no parent. On a cluster of several
    nodes every worker stages it (where a worker runs is known only once it does, and a rank
    takes a worker on its own node)."""
    nodes = sum(1 for n in ray.nodes() if n.get("Alive")) if ray.is_initialized() else 1
    ranks = config.world_size if nodes <= 1 else len(kept) + len(new)
    staged = restage(kept, stage, ranks)
    for worker in new:
        begin_prewarm(worker, stage if staged < ranks else None)
        staged += worker.staging is not None


def ranks_first(spare: bool) -> Callable[[PooledWorker], bool]:
    """The order a take prefers its ready workers in: a starting rank takes a worker that
    stages its likely parent (its warm start reads that copy), a lost rank's spare one that
    does not (it joins from its peers' memory), so each staged copy goes where it is read."""
    return lambda worker: (worker.staging is None) != spare


def stage_request(anchor: str | None, max_bytes: int) -> StageRequest | None:
    """What a next run's workers stage: the releasing run's anchor, unless there is none or
    staging is off (`max_bytes` 0)."""
    return StageRequest(path=anchor, max_bytes=max_bytes) if anchor and max_bytes > 0 else None


def probe(workers: list[PooledWorker], who: str) -> list[PooledWorker]:
    """Read the timings and node of each worker whose prewarm finished (once); returns those
    whose prewarm or process failed (the caller drops them; `who` names the pool in the log)."""
    pending = [w for w in workers if w.timings is None and w.prewarmed is not None]
    if not pending:
        return []
    done, _ = ray.wait([w.prewarmed for w in pending], num_returns=len(pending), timeout=0)
    failed = []
    for worker in [w for w in pending if w.prewarmed in done]:
        try:
            worker.timings = ray.get(worker.prewarmed)  # timings.ready_at: when its prewarm ended
            info = ray.get(worker.actor.ready.remote(), timeout=10)
            worker.node, worker.rss_bytes = info.node_id, info.rss_bytes
        except (GetTimeoutError, RayActorError, RayTaskError) as exc:
            log.warning("%s: a worker failed to prepare (%s: %s); dropped", who, type(exc).__name__, exc)
            worker.timings = None
            failed.append(worker)
    return failed


def take_for_nodes(ready: list[PooledWorker], nodes: list[str | None]) -> list[PooledWorker | None]:
    """For each wanted node (None: any node), a worker of `ready` on it, or None; the ones
    chosen are removed from `ready`."""
    out: list[PooledWorker | None] = []
    for node in nodes:
        match = next((w for w in ready if node is None or w.node == node), None)
        if match is not None:
            ready.remove(match)
        out.append(match)
    return out


def stop(worker: PooledWorker) -> None:
    with contextlib.suppress(Exception):
        ray.kill(worker.actor, no_restart=True)


def record_start(rec: Any, worker: PooledWorker, timings: PrewarmTimings, *, since: float | None = None,
                 **attrs: Any) -> None:
    """A prepared worker's start, off the clock: from its request (or `since`, where its hold
    before is recorded elsewhere) to the end of its prewarm (or `since`, if later)."""
    start, end = (worker.requested_at, timings.ready_at) if since is None else (since, max(since, timings.ready_at))
    rec.record("spare_start", start, end, **attrs, **timings.spool_attrs(), **worker.holding_attrs())
