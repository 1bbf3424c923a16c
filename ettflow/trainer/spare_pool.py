"""One warm spare per placement: a trainer actor started and prewarmed ahead of a failure.

The pool keeps at most one spare and hands it out (`take`: wait until it is prewarmed, then it
is the caller's). The first spare starts and prewarms with the ranks' init (`prewarm`; its
imports and compile share the host with theirs, a cost the optimized mode's TTS carries, so
that a failure early in training finds it ready); a new spare starts and prewarms right after a
hand-off, in the background, off the critical path. A failure that comes before the spare is
ready waits for it (`take`). `start` alone starts the process without its compile.

A spare asks Ray for no CPU (`num_cpus=0`): it idles until it joins, and then runs in the
place of a rank whose process, and whose share of the node, is gone. It holds no accelerator,
so the pool is used only on a CPU placement (see spare.py). Its start is recorded off the
clock as `spare_start` (from the request to prewarmed, with the prewarm's timings).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from ettflow.ett.spool import SpoolWriter

from .config import TrainerConfig


class SpareUnavailable(RuntimeError):
    """No spare could be prepared in time (its start failed or timed out)."""


@dataclass
class _Starting:
    actor: Any
    prewarmed: Any  # ObjectRef of prewarm() (None: not asked yet)
    requested_at: float


class SparePool:
    def __init__(self, config: TrainerConfig, run_id: str, spool_root: Path | str) -> None:
        self.config, self.run_id, self.spool_root = config, run_id, Path(spool_root)
        self._spare: _Starting | None = None

    @property
    def has_spare(self) -> bool:
        return self._spare is not None

    def start(self) -> None:
        """Start a spare's process unless there is one: its imports run now, its prewarm (the
        dense step's compile) waits for `prewarm`, so it does not compete with the ranks' own start."""
        if self._spare is not None:
            return
        from .actor import TrainerActor

        requested_at = time.time()
        actor = ray.remote(TrainerActor).options(num_cpus=0, max_restarts=0, max_concurrency=2).remote(
            self.config, self.run_id, -1, -1, str(self.spool_root), requested_at)
        self._spare = _Starting(actor, None, requested_at)

    def prewarm(self) -> None:
        """Have the spare prepare (spare.py), in the background; starts one if there is none."""
        self.start()
        if self._spare.prewarmed is None:
            self._spare.prewarmed = self._spare.actor.prewarm.remote()

    def take(self, attempt: int, timeout_s: float) -> tuple[Any, dict]:
        """The spare, prewarmed (waits up to `timeout_s`; starts one if there is none), and its
        `ready()` info. It is the caller's from here."""
        self.prewarm()
        spare, self._spare = self._spare, None
        try:
            timings = ray.get(spare.prewarmed, timeout=timeout_s)
            info = ray.get(spare.actor.ready.remote(), timeout=timeout_s)
        except (GetTimeoutError, RayActorError, RayTaskError) as exc:
            with contextlib.suppress(Exception):
                ray.kill(spare.actor, no_restart=True)
            raise SpareUnavailable(f"no warm spare within {timeout_s:g} s: {type(exc).__name__}: {exc}") from exc
        with SpoolWriter(self.spool_root, self.run_id, attempt, -1) as rec:
            rec.record("spare_start", spare.requested_at, timings["ready_at"], **{
                k: v for k, v in timings.items() if k in ("build_s", "compile_s", "cache_hit", "prewarm_s")})
        return spare.actor, info

    def close(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None:
            with contextlib.suppress(Exception):
                ray.kill(spare.actor, no_restart=True)
