"""One warm spare per placement: a trainer actor started and prewarmed ahead of a failure.

The pool keeps at most one spare and hands it out (`take`: wait until it is prewarmed, then it
is the caller's). The first spare starts and prewarms with the ranks' init (`prewarm`; its
imports and compile share the host with theirs, a cost the optimized mode's TTS carries, so
that a failure early in training finds it ready); a new spare starts and prewarms right after a
hand-off, in the background, off the critical path. A failure that comes before the spare is
ready waits for it (`take`). `start` alone starts the process without its compile.

On a CPU placement a spare asks Ray for no CPU (`num_cpus=0`): it idles until it joins, and
then runs in the place of a rank whose process, and whose share of the node, is gone. On a GPU
placement a spare holds a device: the placement reserves a bundle for it (`bundle`: {GPU: 1}
plus its CPUs), it prewarms there (CUDA context, dense modules, compiled step from the cache),
and after a hand-off the next spare starts in the bundle the failed rank left (the group moves
`bundle`). Its start is recorded off the clock as `spare_start` (from the request to prewarmed,
with the prewarm's timings, its GPUs and CPUs: held capacity, `ett.capacity`).

A spare that dies while it waits (the OOM killer, a lost process) is replaced: the group's poll
pings the waiting spare every `PING_S` (`watch`, never blocking); a dead one is recorded (its
hold, `lost=True`), logged with its pid, and a new spare starts and prewarms in the background,
so the next failure still finds one.

When this process keeps a warm pool (warm_pool.py), a CPU placement's first spare is one the
pool prepared before the run (`pooled`), and a spare the run did not use goes back to the pool
at the end; a GPU spare belongs to its placement and is stopped with it. On a cluster whose
pool serves every run of the model (`shared`: pool_service.py's `share_spares`), the run holds
no spare of its own: the pool holds the ones the model's training runs pay for together, and a
loss takes one of them (`take`, rule `spare-shared`), the pool preparing the next.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from ettflow.ett.spare_sizing import AT_LOSS as SPARE_AT_LOSS
from ettflow.ett.spare_sizing import RULE as SPARE_BY_SAVING
from ettflow.ett.spare_sizing import SHARED as SPARE_SHARED
from ettflow.ett.spare_sizing import SpareDecision
from ettflow.ett.spool import SpoolWriter
from ettflow.trainer.config import TrainerConfig
from ettflow.trainer.group.warm_pool import PooledWorker, WarmPool, record_start, start_worker
from ettflow.trainer.protocol import WorkerInfo

log = logging.getLogger("ettflow.trainer")


PING_S = 1.0  # how often the waiting spare is asked whether it lives
MAX_REPLACED = 3  # spares lost or failed in one run before the pool stops replacing them (a spare that
# fails its prewarm every time, a CUDA OOM, must not respawn forever; a failure then restarts every rank)


class SpareUnavailable(RuntimeError):
    """No spare could be prepared in time (its start failed or timed out)."""


class SparePool:
    def __init__(self, config: TrainerConfig, run_id: str, spool_root: Path | str, *, actor_cls: type,
                 pool: WarmPool, bundle: tuple[Any, int] | None = None) -> None:
        """`actor_cls`: the rank's actor class a spare is (`RayWorkerGroup`'s); `bundle`:
        (placement group, index) the next spare starts in (a GPU placement); None: a spare with
        no resources of its own (a CPU placement)."""
        self.config, self.run_id, self.spool_root = config, run_id, Path(spool_root)
        self.actor_cls, self.pool = actor_cls, pool
        self.bundle = bundle
        self._spare: PooledWorker | None = None
        self._pooled = False  # the spare came prewarmed from the warm pool
        self._ping: Any = None  # a liveness call to the waiting spare, in flight
        self._pinged_at = 0.0
        self._pid: int | None = None  # the waiting spare's process, once a ping answered
        self.replaced = 0  # spares lost or failed and replaced in this run
        # the cluster's pool holds the model's spares for its training runs (pool_service.py,
        # `share_spares`): the run holds none of its own; a loss takes one of the pool's (`start`)
        self.shared: SpareDecision | None = None

    @property
    def held(self) -> bool:
        """A spare is held ahead of a failure (`ett.spare_sizing` found it pays); False: one is
        started only when a rank is lost (`take`), its start part of that recovery, or taken from
        the spares the cluster's pool holds for the model's training runs (`shared`)."""
        return self.config.holds_spare and self.shared is None

    @property
    def has_spare(self) -> bool:
        return self._spare is not None

    def start(self) -> None:
        """Start a spare's process unless there is one: its imports run now, its prewarm (the
        dense step's compile) waits for `prewarm`, so it does not compete with the ranks' own start."""
        if self._spare is not None:
            return
        (pooled,) = self.pool.take(self.config, [None], self.run_id, spare=True) if self.bundle is None else (None,)
        if pooled is not None:  # a pooled worker holds no bundle of this placement
            self._spare, self._pooled = pooled[0], True
        else:
            self._spare = start_worker(self.config, self.run_id, self.spool_root, actor_cls=self.actor_cls,
                                       bundle=self.bundle)
            self._pooled = False
        if not (self._pooled and self._spare.rule == SPARE_SHARED):  # a shared one says so
            self._spare.rule = self._rule  # held for this run from now: the ledger says why

    @property
    def _rule(self) -> str:
        """Why the run holds its spare, as its ledger line says (`ett.spare_sizing`)."""
        return SPARE_BY_SAVING if self.held else SPARE_AT_LOSS

    def prewarm(self) -> None:
        """Have the spare prepare (spare.py), in the background; starts one if there is none."""
        self.start()
        if self._spare.prewarmed is None:
            self._spare.prewarmed = self._spare.actor.prewarm.remote()

    @property
    def spare_pid(self) -> int | None:
        """The waiting spare's process id, once it answered a ping (None: none yet)."""
        return self._pid if self._spare is not None else None

    def watch(self, attempt: int) -> bool:
        """Ask the waiting spare whether it lives (at most every `PING_S`, never waiting);
        replace it when its process died. True when it was replaced."""
        spare = self._spare
        if spare is None:
            return False
        if spare.prewarmed is not None and spare.timings is None:  # its prewarm: done, and did it work?
            done, _ = ray.wait([spare.prewarmed], timeout=0)
            if done:
                try:
                    spare.timings = ray.get(done[0])
                except (RayActorError, RayTaskError) as exc:  # it died, or its prewarm raised (a CUDA OOM)
                    self._replace_lost(spare, attempt, exc)
                    return True
        if self._ping is None:
            if time.monotonic() - self._pinged_at >= PING_S:
                self._ping, self._pinged_at = spare.actor.ready.remote(), time.monotonic()
            return False
        ready, _ = ray.wait([self._ping], timeout=0)
        if not ready:
            return False
        ping, self._ping = self._ping, None
        try:
            self._pid = ray.get(ping).pid
            return False
        except RayActorError as exc:  # its process is gone (a RayTaskError would be a live actor's error)
            self._replace_lost(spare, attempt, exc)
            return True
        except RayTaskError:
            return False

    def _replace_lost(self, spare: PooledWorker, attempt: int, exc: BaseException) -> None:
        now = time.time()
        who = f"pid {self._pid}" if self._pid is not None else "its process had not answered a ping yet"
        log.warning("the run's warm spare (%s) died while it waited (%s): another starts", who, type(exc).__name__)
        self._record_unused(spare, attempt, now, lost=True)
        with contextlib.suppress(Exception):
            ray.kill(spare.actor, no_restart=True)
        # the ping in flight was to the dead spare: left pending, the next poll would read its
        # error as the new spare's death and kill that one too (CI: a second spare lost 0.3 s on)
        self._spare, self._pooled, self._pid, self._ping = None, False, None, None
        self.replaced += 1
        if self.replaced > MAX_REPLACED:
            log.warning("%d spares of this run were lost or failed: no more are started (a failure restarts every "
                        "rank)", self.replaced)
            return
        self.prewarm()

    def _record_unused(self, spare: PooledWorker, attempt: int, released_at: float, **attrs: Any) -> None:
        """The hold of a spare no rank took (released, or lost), off the clock: held capacity
        (`ett.capacity`); a spool that cannot be written loses only this line."""
        with contextlib.suppress(OSError), SpoolWriter(self.spool_root, self.run_id, attempt, -1) as rec:
            rec.record("spare_start", spare.requested_at, released_at, pooled=self._pooled, used=False,
                       released_at=released_at, **attrs, **spare.holding_attrs())

    def take(self, attempt: int, timeout_s: float) -> tuple[Any, WorkerInfo]:
        """The spare, prewarmed (waits up to `timeout_s`; starts one if there is none), and its
        `ready()` info. It is the caller's from here."""
        self.prewarm()
        spare, pooled, self._spare = self._spare, self._pooled, None
        self._ping, self._pid = None, None
        try:
            timings = ray.get(spare.prewarmed, timeout=timeout_s)
            info = ray.get(spare.actor.adopt.remote(self.config, self.run_id, attempt, -1, str(self.spool_root)),
                           timeout=timeout_s)
        except (GetTimeoutError, RayActorError, RayTaskError) as exc:
            with contextlib.suppress(Exception):
                ray.kill(spare.actor, no_restart=True)
            raise SpareUnavailable(f"no warm spare within {timeout_s:g} s: {type(exc).__name__}: {exc}") from exc
        with SpoolWriter(self.spool_root, self.run_id, attempt, -1) as rec:
            now = time.time()
            # a shared one's hold so far is its sharing runs' parts (`end_run`): none of it here
            shared = pooled and spare.rule == SPARE_SHARED
            record_start(rec, spare, timings, since=now if shared else None, pooled=pooled, used=True, taken_at=now)
        return spare.actor, info

    def close(self, attempt: int | None = None) -> None:
        """Stop the spare, or give it to the warm pool when the process keeps one (a prewarmed
        spare the run did not need is the next run's). Its hold is recorded in `attempt` (off
        the clock: an unused spare is capacity held for the run, `ett.capacity`)."""
        spare, self._spare = self._spare, None
        self._ping = None
        if spare is None:
            return
        if attempt is not None:
            self._record_unused(spare, attempt, time.time())
        if spare.prewarmed is not None and self.config.switches.warm_pool and self.bundle is None:
            self.pool.give(spare)
            return
        with contextlib.suppress(Exception):
            ray.kill(spare.actor, no_restart=True)
