"""The Ray actor that hosts one rank. Its constructor only remembers who it is: a restarted
or replaced actor gets everything else back from the checkpoint and the compile cache.
An exception that ends `train` leaves the actor as a `FailureError` (its `Failure` typed from
the exception's type), so the driver never reads a message to classify it.
The constructor runs in the worker process's main thread: it installs the rank's SIGTERM
handler there (`preemption.py`), in place of Ray's, which would end the process at once."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

from ettflow.console import RankLineFormatter
from ettflow.ett.failures import FailureError
from ettflow.trainer.classify import failure_from_exception
from ettflow.trainer.config import TrainerConfig
from ettflow.trainer.protocol import (
    PrewarmTimings,
    RankResult,
    RestorePoint,
    StageRequest,
    StagingStatus,
    WorkerInfo,
)
from ettflow.trainer.rank.phase import RankLifecycle, RankPhase


class TrainerActor:
    def __init__(self, config: TrainerConfig, run_id: str, attempt: int, rank: int, spool_root: str,
                 requested_at: float) -> None:
        """rank -1: a spare (spare.py), which gets its rank and attempt when it joins."""
        from ettflow.console import quiet_third_party, verbose_from_env

        quiet_third_party(verbose_from_env())  # before torch/torchrec/fbgemm are imported
        from ettflow.trainer.rank.session import process_start_time

        self.config, self.run_id, self.attempt, self.rank = config, run_id, attempt, rank
        self.spool_root = Path(spool_root)
        self.session = None  # kept only while PARKED (live recovery)
        self.warm = None  # a spare's or pooled worker's prepared state (spare.py) while PREWARMED
        self.staging = None  # a pooled worker's staged parent anchor (checkpoint/staged_anchor.py)
        # `stage` may come from the pool on the actor's second thread while a run's `train` or
        # `join` starts on the first: the phase check and the staging's hand-over are one step
        self._staging_lock = threading.Lock()
        self.lifecycle = RankLifecycle(_who(rank))
        # Ray may hand this actor a worker process it started earlier (its pool): the rank's
        # own start counts from when the driver asked for it, never before.
        self.started_at = max(process_start_time(), requested_at)
        logging.basicConfig(level=logging.INFO)
        _log_as(_who(rank))
        for noisy in ("torchrec", "root", "fbgemm_gpu", "torch.distributed"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        # before anything imports inductor: compile dirs, job id and thread count
        from ettflow.trainer.compile.process_cache import prepare_compile_env

        prepare_compile_env(config)
        from ettflow.trainer.rank.preemption import PREEMPTION

        PREEMPTION.install(config.preemption_grace_s)

    def ready(self) -> WorkerInfo:
        import psutil
        import ray

        return WorkerInfo(pid=os.getpid(), node_ip=ray.util.get_node_ip_address(),
                          node_id=ray.get_runtime_context().get_node_id(), created_at=self.started_at,
                          ready_at=time.time(), rss_bytes=psutil.Process().memory_info().rss)

    def rendezvous(self) -> tuple[str, int]:
        import ray

        from ettflow.trainer.rank.session import free_port

        return ray.util.get_node_ip_address(), free_port()

    def adopt(self, config: TrainerConfig, run_id: str, attempt: int, rank: int, spool_root: str) -> WorkerInfo:
        """A worker started ahead of time (warm_pool.py, spare_pool.py) becomes `rank` of
        `run_id`'s `attempt` (rank -1: the run's spare, which gets its rank when it joins)."""
        self.lifecycle.require("adopt", RankPhase.IDLE, RankPhase.PREWARMED)
        self.config, self.run_id, self.attempt = config, run_id, attempt
        self.spool_root = Path(spool_root)
        self._become(rank)
        return self.ready()

    def train(self, master_addr: str, master_port: int, keeper=None, point: RestorePoint | None = None) -> RankResult:
        """Start the rank and train. `keeper`: the run's in-memory checkpoint keeper (None: no
        in-memory tier); `point`: a restart's in-memory restore point (None: the durable
        checkpoint, or a warm start). A worker that prewarmed (warm_pool.py) starts from what it
        prepared, with no process start on the run's clock. A session that fails may stay
        parked here for a `rejoin`."""
        from ettflow.trainer.rank.session import TrainerSession

        with self._staging_lock:
            self.lifecycle.require("train", RankPhase.IDLE, RankPhase.PREWARMED)
            self.lifecycle.enter(RankPhase.TRAINING, "train")
            staging, self.staging = self.staging, None
        warm, self.warm = self.warm, None
        session = TrainerSession(self.config, self.run_id, self.attempt, self.rank, self.spool_root,
                                 master_addr, master_port, keeper=keeper, warm=warm, restart_point=point,
                                 process_started_at=None if warm is not None else self.started_at,
                                 staging=staging)
        return self._typed(session, session.run)

    def interrupt(self) -> None:
        """A peer failed: unblock this rank's collective in flight (the driver calls it on the
        actor's second thread while `train` runs; NCCL aborts its communicators, gloo has
        already failed it: trainer/collectives.py)."""
        session = self.session
        if session is not None:
            session.interrupt()

    def parked(self) -> bool:
        """Whether this rank kept its session through a peer's failure (it can `rejoin`)."""
        return self.lifecycle.phase is RankPhase.PARKED

    def rejoin(self, config: TrainerConfig, attempt: int, master_addr: str, master_port: int,
               point: RestorePoint) -> RankResult:
        """A survivor goes on in `attempt` (live_recovery.py)."""
        self.lifecycle.require("rejoin", RankPhase.PARKED)  # only a rank kept through a peer's failure
        self.lifecycle.enter(RankPhase.TRAINING, "rejoin")
        self.config, self.attempt = config, attempt
        session = self.session
        return self._typed(session, lambda: session.rejoin(config, attempt, (master_addr, master_port), point))

    def prewarm(self, stage: StageRequest | None = None) -> PrewarmTimings:
        """A spare: prepare everything of a rank's start that needs no rank (spare.py). `stage`:
        the anchor the next run will likely warm start from, read into memory meanwhile by a
        thread of its own (a pooled worker's; staged_anchor.py)."""
        from ettflow.trainer.rank.session import pick_device
        from ettflow.trainer.rank.spare import prewarm

        self.lifecycle.require("prewarm", RankPhase.IDLE)
        t0 = time.time()
        if stage is not None:
            self.stage(stage)
        self.warm = prewarm(self.config, pick_device(self.config))
        self.lifecycle.enter(RankPhase.PREWARMED, "prewarm")
        done = time.time()
        return replace(self.warm.timings, started_at=self.started_at, ready_at=done, prewarm_s=done - t0)

    def stage(self, request: StageRequest) -> bool:
        """A pooled worker stages its next run's likely parent (instead of what it staged before:
        a newer run sealed its anchor); returns at once, False when a run already took it (too
        late: nothing staged)."""
        from ettflow.trainer.checkpoint.staged_anchor import AnchorStaging

        with self._staging_lock:
            if self.lifecycle.phase not in (RankPhase.IDLE, RankPhase.PREWARMED):
                logging.getLogger("ettflow.trainer").info("not staging %s: this worker already trains", request.path)
                return False
            old, self.staging = self.staging, AnchorStaging.start(request)
        if old is not None:
            old.discard()
        return True

    def staging_status(self) -> StagingStatus | None:
        """What this pooled worker stages now, and how far it got (None: nothing)."""
        with self._staging_lock:
            return self.staging.status() if self.staging is not None else None

    def unstage(self) -> None:
        """Drop what this pooled worker stages (the pool keeps it for a spare's place: nothing read)."""
        with self._staging_lock:
            old, self.staging = self.staging, None
        if old is not None:
            old.discard()

    def join(self, config: TrainerConfig, attempt: int, rank: int, master_addr: str, master_port: int,
             keeper, point: RestorePoint) -> RankResult:
        """A spare takes `rank` in `attempt` (live_recovery.py)."""
        from ettflow.trainer.rank.session import TrainerSession

        with self._staging_lock:
            self.lifecycle.require("join", RankPhase.PREWARMED)  # a spare prepares first
            self.lifecycle.enter(RankPhase.TRAINING, "join")
            staging, self.staging = self.staging, None
        if staging is not None:  # a live recovery restores the run's point, not a parent
            staging.discard()
        self.config, self.attempt = config, attempt
        self._become(rank)
        session = TrainerSession(config, self.run_id, attempt, rank, self.spool_root, master_addr, master_port,
                                 keeper=keeper)
        warm, self.warm = self.warm, None
        return self._typed(session, lambda: session.join(warm, point))

    def _become(self, rank: int) -> None:
        """This process is `rank` from now on (-1: the run's spare): in its errors and log lines."""
        self.rank = rank
        self.lifecycle.who = _who(rank)
        _log_as(_who(rank))

    def _typed(self, session, run) -> RankResult:
        """Run the TRAINING call `run`; the rank ends FINISHED, PARKED (its session kept for a
        rejoin) or FAILED."""
        self.session = session
        try:
            result = run()
        except BaseException as exc:
            if not session.parked:
                self.session = None
            self.lifecycle.enter(RankPhase.PARKED if session.parked else RankPhase.FAILED, "fail")
            if isinstance(exc, FailureError) or not isinstance(exc, Exception):
                raise  # already typed (a scripted fault, a numerics check), or not an error (an exit)
            # every error leaves the rank typed, its cause chained
            raise FailureError(failure_from_exception(exc, rank=self.rank, attempt=self.attempt)) from exc
        self.session = None
        self.lifecycle.enter(RankPhase.FINISHED, "finish")
        return result


def _who(rank: int) -> str:
    return f"rank {rank}" if rank >= 0 else "spare"


def _log_as(who: str) -> None:
    for handler in logging.getLogger().handlers:
        handler.setFormatter(RankLineFormatter(who))
