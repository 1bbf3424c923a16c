"""A trainer worker started ahead of the run that will use it: a pooled rank or a spare.

What the warm pool (warm_pool.py, in this process), the cluster's pool (pool_service.py) and
the spare pool (spare_pool.py) share: the key a prewarmed worker depends on, how one starts,
and how its start is recorded in the run that takes it (off the clock).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray

from ettflow.trainer.config import TrainerConfig
from ettflow.trainer.protocol import PrewarmTimings

POOL_RUN_ID = "warm-pool"  # a pooled worker's run until a run takes it


def warm_key(config: TrainerConfig) -> str:
    """What a prewarmed worker depends on: the model, the batch's shapes, the device, the thread
    count and the compile settings (the compile cache's own key, and where it lives)."""
    sw = config.switches
    return json.dumps({"model": asdict(config.model), "schema": asdict(config.schema),
                       "batch_size": config.batch_size, "device": config.device,
                       "threads": config.threads_per_rank, "compile": sw.compile,
                       "compile_cache": sw.compile_cache, "cache_dir": str(config.compile_cache_dir)},
                      sort_keys=True, default=str)


@dataclass
class PooledWorker:
    """A trainer actor started ahead of a run: `prewarmed` is its `prewarm()` call (its result
    the prewarm's timings), `requested_at` when it was asked for."""

    actor: Any
    prewarmed: Any
    requested_at: float
    key: str


def start_worker(config: TrainerConfig, run_id: str, spool_root: Path | str) -> PooledWorker:
    """A trainer actor with no rank yet and no CPU of its own (a spare or a pooled worker); its
    prewarm is not asked for."""
    from ettflow.trainer.rank.actor import TrainerActor

    requested_at = time.time()
    actor = ray.remote(TrainerActor).options(num_cpus=0, max_restarts=0, max_concurrency=2).remote(
        config, run_id, -1, -1, str(spool_root), requested_at)
    return PooledWorker(actor, None, requested_at, warm_key(config))


def record_start(rec: Any, worker: PooledWorker, timings: PrewarmTimings, **attrs: Any) -> None:
    """A prepared worker's start, off the clock: from its request to the end of its prewarm."""
    rec.record("spare_start", worker.requested_at, timings.ready_at, **attrs, **timings.spool_attrs())
