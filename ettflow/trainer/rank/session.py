"""One rank of one attempt: init (recorded stage by stage), compile, train, anchor checkpoint.

The stages, and what each needs (so the concurrent mode can overlap them):

    device_init ─> process_group_init ─> train_module_creation ─┐
         └──────> init_plugins (compile cache, checkpoints) ────┴─> pre_train ─> checkpoint_restore
    preproc_creation (open + validate every data file) ─┐
    init_plugins (the resume cursor) ───────────────────┴─> get_first_batch_data (DPP warm-up)
    pt2_compile needs pre_train/restore, and the first real batch unless the fast batch is on.
    pre_train also needs preproc_creation when it evaluates at start (the held-out pipeline).

Each stage runs inside its heartbeat phase (`rank_heartbeat.py`), so the driver's watchdog
bounds it; a scripted `hang` may stop in one (`hang:rank=1:phase=pt2_compile`). Collectives
time out after `TrainerConfig.process_group_timeout_s`, past every phase bound: the watchdog
judges a hang before gloo or nccl gives up on it.

What the stages build is the rank's `RankState` (rank_state.py): each field is set by one
stage, and reading it before that stage ran is an error naming both.

Nothing here keeps state that a restart would need: it all comes back from the checkpoint.

Where the state comes from (decided in `run`, before any stage): the run's own latest
checkpoint when it has one (a restart or a flow retry: step, cursor and RNG continue);
otherwise the parent anchor when `warm_start_from` is set (a warm start: model and optimizer
state only, possibly from another world size; the step counter starts at 0 and the data
cursor at the start of this run's windows, since a cursor is relative to a run's windows, and
RNG is fresh); otherwise a cold start. Both restores are the `checkpoint_restore` stage, its
`source` attribute saying which ("own" or "parent").
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ettflow.ett.events import PROCESS_PAUSED
from ettflow.ett.spool import SpoolWriter
from ettflow.trainer.checkpoint import CheckpointInfo
from ettflow.trainer.checkpoint.latest import checked_scan, mark_fallbacks
from ettflow.trainer.collectives import Groups, teardown_any
from ettflow.trainer.compile.vec_isa import settled
from ettflow.trainer.config import TrainerConfig
from ettflow.trainer.data.batch import synthetic_batch
from ettflow.trainer.data.pipeline import DataConfig, DataPipeline
from ettflow.trainer.data.windows import split_windows
from ettflow.trainer.faults import due_in_phase
from ettflow.trainer.model import DenseStep, build_dlrm, dense_optimizer, shard
from ettflow.trainer.protocol import Evaluation, RankResult, RestorePoint
from ettflow.trainer.rank.checkpointing import Checkpointing
from ettflow.trainer.rank.compile_plugin import CompilePlugin
from ettflow.trainer.rank.evaluate import evaluate
from ettflow.trainer.rank.fault_fire import fire
from ettflow.trainer.rank.init_pipeline import InitPipeline, Stage
from ettflow.trainer.rank.live_recovery import rebuild_sharded
from ettflow.trainer.rank.loop import TrainLoop
from ettflow.trainer.rank.preemption import PREEMPTION
from ettflow.trainer.rank.rank_state import RankState
from ettflow.trainer.rank.spare import WarmSpare
from ettflow.trainer.rank_heartbeat import Pause, PauseNotices, RankHeartbeat, beat_file

if TYPE_CHECKING:
    from ettflow.trainer.checkpoint.staged_anchor import AnchorStaging
    from ettflow.trainer.checkpoint.state_keeper import KeeperHandle

log = logging.getLogger("ettflow.trainer")

# batches the data pipeline's thread keeps ready (about 90 KB each at the bench's size). Measured:
# 16 instead of 4 did not change the fetches that waited (their queue was full either way: the
# training thread was late on the CPU, step_clock.py); it only leaves room for a slow file read
PREFETCH_BATCHES = 16


def pick_device(config: TrainerConfig) -> torch.device:
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device='cuda' but this rank sees no GPU (check CUDA_VISIBLE_DEVICES)")
    torch.cuda.set_device(0)  # Ray gives each rank one visible GPU
    return torch.device("cuda", 0)


def parent_anchor(config: TrainerConfig) -> Path | None:
    """The anchor a run without a checkpoint of its own warm starts from (None: cold start).
    It is verified (checksums) by the restore itself, on every rank, before DCP reads it."""
    if not config.warm_start_from:
        return None
    path = Path(config.warm_start_from)
    if not path.is_dir():
        raise FileNotFoundError(f"warm_start_from {path} is not a checkpoint folder: name the parent refresh's "
                                "anchor (<work_dir>/checkpoints/step_<n>), or cold start without warm_start_from")
    return path


class TrainerSession:
    def __init__(self, config: TrainerConfig, run_id: str, attempt: int, rank: int,
                 spool_root: Path | str, master_addr: str, master_port: int,
                 *, process_started_at: float | None = None, keeper: KeeperHandle | None = None,
                 warm: WarmSpare | None = None, restart_point: RestorePoint | None = None,
                 staging: AnchorStaging | None = None) -> None:
        """`keeper`: the run's in-memory checkpoint keeper (`checkpoint/memory_tier.py`), or
        None (no in-memory tier). `warm`: what this process prepared before the run (a pooled
        worker, warm_pool.py): the device, dense modules, dense optimizer and compiled step that
        `device_init`, `train_module_creation` and `pt2_compile` then take instead of building.
        `staging`: the anchor it staged in memory meanwhile (`staged_anchor.py`), which the warm
        start reads when it is the run's parent."""
        self.config, self.run_id, self.attempt, self.rank = config, run_id, attempt, rank
        self.spool_root = spool_root
        self.master = (master_addr, master_port)
        self.keeper = keeper
        # a restart of every rank that restores the in-memory tier (newer than the durable checkpoint)
        self.restart_point = restart_point
        self.rec = SpoolWriter(spool_root, run_id, attempt, rank)
        self.process_started_at = process_started_at
        self.state = RankState()
        self.resume: CheckpointInfo | None = None  # the run's own latest checkpoint (the base of its chain)
        self.resume_deltas: tuple = ()  # the deltas on it, in order (`catalog.Chain`)
        self.parent: Path | None = None  # the anchor to warm start from (only when there is no own one)
        self.pause_notices = PauseNotices()
        self.beat = RankHeartbeat(beat_file(spool_root, run_id, attempt, rank), rank, on_pause=self._record_pause)
        self.parked = False  # kept through a peer's failure, waiting to rejoin (live_recovery.py)
        self.warm = warm
        self.staging = staging
        # what a prewarmed process's prewarm met: its compile-cache hit (never restored twice), a refused archive
        self.warm_timings = warm.timings if warm is not None else None
        PREEMPTION.attach(self.rec)

    def _record_pause(self, pause: Pause) -> None:
        """The heartbeat thread's evidence that this process was not running (`ett.timeline`
        owns a step that stalled meanwhile to the host)."""
        self.rec.record(PROCESS_PAUSED, pause.start, pause.end, sync=False)
        took = pause.end - pause.start
        if not self.pause_notices.tell(pause):
            log.debug("rank %d: its process did not run for %.1f s", self.rank, took)
            return
        log.warning("rank %d: its process did not run for %.1f s (stopped, or starved of CPU by its host; "
                    "later pauses under twice this go to the run's timeline only)", self.rank, took)

    # ---- stages -------------------------------------------------------------------------
    def device_init(self) -> torch.device:
        torch.set_num_threads(self.config.threads_per_rank)
        device = self.warm.device if self.warm is not None else pick_device(self.config)
        self.state.device = device
        return device

    def process_group_init(self) -> None:
        """The training, control and checkpoint groups (trainer/collectives.py)."""
        addr, port = self.master
        self.state.groups = Groups.form(self.state.device, init_method=f"tcp://{addr}:{port}", rank=self.rank,
                                        world_size=self.config.world_size,
                                        timeout_s=self.config.process_group_timeout_s,
                                        check=self.config.collective_check)

    def interrupt(self) -> None:
        """A peer failed: unblock this rank's collective in flight (called from the actor's
        second thread; NCCL aborts its communicators, gloo has already failed it)."""
        if self.state.is_set("groups"):
            self.state.groups.interrupt()

    def preproc_creation(self) -> None:
        train, held_out = split_windows(self.config)
        common = dict(root=self.config.data_root, schema=self.config.schema,
                      batch_size=self.config.batch_size, rank=self.rank,
                      world_size=self.config.world_size)
        self.state.data = DataPipeline(DataConfig(windows=train, **common))
        self.state.eval_data = DataPipeline(DataConfig(windows=held_out, **common)) if held_out else None

    def train_module_creation(self) -> None:
        device = self.state.device
        if self.warm is not None:  # the prewarmed dense part, sharded embeddings built on this group
            self.state.dense_step, self.state.dense_opt = self.warm.dense_step, self.warm.dense_opt
            rebuild_sharded(self.state, self.config)
            return
        dlrm = build_dlrm(self.config.model, self.config.schema, device=device)
        dmp = shard(dlrm, self.config.model, self.state.groups.training)
        self.state.dmp = dmp
        self.state.dense_step = DenseStep(dmp.module)
        self.state.dense_opt = dense_optimizer(dmp, self.config.model)

    def init_plugins(self) -> None:
        # the compile cache first: its environment is set before anything imports inductor
        self.state.compiler = CompilePlugin(self.config, self.rank, self.rec, warm=self.warm_timings)
        self.state.checkpointing = Checkpointing(self.config, self.rank, self.rec, self.resume, self.parent,
                                                 keeper=self.keeper, resume_deltas=self.resume_deltas,
                                                 staging=self.staging)
        self.staging = None

    def compile_cache_restore(self) -> dict[str, Any]:
        return self.state.compiler.restore()

    def pre_train(self) -> None:
        self.state.checkpointing.prepare_state(self.state.dmp, self.state.dense_opt, self.state.groups)
        if self.evaluates_at_start:
            self.state.eval_start = self.evaluate()

    @property
    def restores(self) -> bool:
        """Whether the `checkpoint_restore` stage runs (own checkpoint or warm start)."""
        return self.resume is not None or self.parent is not None or self.restart_point is not None

    @property
    def evaluates_at_start(self) -> bool:
        """Only for a cold start: before a restore the model is not the one that trains."""
        return self.config.eval_at_start and not self.restores

    def evaluate(self) -> Evaluation | None:
        data = self.state.eval_data
        if data is None or self.config.eval_batches < 1:
            return None
        batches = itertools.islice(data.batches(None), self.config.eval_batches)
        return Evaluation.of(evaluate(self.state.dmp.module.sparse_arch, self.state.dense_step, batches,
                                      self.state.device, self.state.groups.control))

    def checkpoint_restore(self) -> dict[str, Any]:
        if self.restart_point is not None:  # every rank, from the keeper (the durable checkpoint if that fails)
            return self.state.checkpointing.restore_point(self.restart_point, fallback=True).to_attrs()
        return self.state.checkpointing.restore().to_attrs()

    def get_first_batch_data(self):
        start = self.state.checkpointing.resume_cursor
        it = self.state.data.batches(start, prefetch=PREFETCH_BATCHES)
        self.state.batches = it
        try:
            first = next(it)
        except StopIteration:
            first = None
        self.state.first_batch = first
        return first

    def pt2_compile(self) -> dict[str, Any]:
        compiler = self.state.compiler
        if self.warm is not None and self.warm.compiled_step is not None:
            self.state.compiled_step = compiler.compile(self.state.dense_step, self.state.device, None,
                                                       compiled=self.warm.compiled_step)
            return {"batch": "prewarmed before the run (warm pool)"}
        if self.config.switches.fast_batch:
            batch, source = synthetic_batch(self.config.schema, self.config.batch_size), "synthetic fast batch"
        else:
            batch, source = self.state.first_batch, "first real batch"
            if batch is None:
                return {"batch": "none: no data to train"}
        self.state.compiled_step = compiler.compile(self.state.dense_step, self.state.device, batch)
        isa = settled()
        return {"batch": source, **(isa.to_attrs() if isa is not None else {}), **compiler.cold_attrs()}

    # ---- the whole rank -----------------------------------------------------------------
    def _watched(self, name: str, run):
        """`run` inside its heartbeat phase; a scripted hang in this stage fires first."""
        def stage():
            with self.beat.phase(name):
                fault = due_in_phase(self.config.failures, attempt=self.attempt, rank=self.rank, phase=name)
                if fault is not None:
                    fire(fault, self.rec, step=None)
                return run()
        return stage

    def stages(self) -> list[Stage]:
        return [Stage(s.name, self._watched(s.name, s.run), s.needs, s.background) for s in self._stages()]

    def _stages(self) -> list[Stage]:
        sw = self.config.switches
        # an in-memory restore point's data cursor is known once it is restored
        first_needs = ("preproc_creation", "init_plugins") + (("checkpoint_restore",) if self.restart_point else ())
        first_batch = Stage("get_first_batch_data", self.get_first_batch_data, first_needs,
                            background=sw.fast_batch)
        restore = ("checkpoint_restore",) if self.restores else ()
        # the archive unpacks beside the checkpoint's restore: only the compile reads it
        cache = ("compile_cache_restore",) if CompilePlugin.restores(self.config, self.warm_timings) else ()
        compile_needs = ("pre_train", *restore, *cache) + (() if sw.fast_batch else ("get_first_batch_data",))
        out = [
            Stage("device_init", self.device_init),
            Stage("preproc_creation", self.preproc_creation),
            Stage("process_group_init", self.process_group_init, ("device_init",)),
            Stage("init_plugins", self.init_plugins, ("device_init",)),
        ]
        early_batch = sw.fast_batch and not self.restart_point  # else its cursor waits for the restore
        if early_batch:
            out.append(first_batch)
        out += [
            Stage("train_module_creation", self.train_module_creation, ("process_group_init",)),
            # evaluating at start reads the held-out pipeline that preproc_creation opens
            Stage("pre_train", self.pre_train, ("train_module_creation", "init_plugins")
                  + (("preproc_creation",) if self.evaluates_at_start else ())),
        ]
        if cache:
            out.append(Stage("compile_cache_restore", self.compile_cache_restore, ("init_plugins",)))
        if self.restores:
            out.append(Stage("checkpoint_restore", self.checkpoint_restore, ("pre_train",)))
        if not early_batch:
            out.append(first_batch)
        if sw.compile:
            out.append(Stage("pt2_compile", self.pt2_compile, compile_needs))
        return out

    def run(self) -> RankResult:
        if self.process_started_at is not None:
            # the process start and runtime import belong to device init
            self.rec.record("device_init", self.process_started_at, time.time(), part="process_start")
        self.beat.start()
        with self.beat.phase("device_init"):  # finding the checkpoint to resume reads the folder
            found = checked_scan(self.config)
            chain = found.chain(self.config.world_size)  # the newest base, and the deltas on it
            self.resume, self.resume_deltas = chain.base, chain.deltas
            self.parent = parent_anchor(self.config) if self.resume is None else None
        if chain.skipped is not None and chain.why and self.rank == 0:
            log.warning("checkpoint step %d cannot be restored (%s): restoring step %s", chain.skipped, chain.why,
                        chain.step)
        if self.rank == 0:  # the run's record of checkpoint damage (every rank read the same folder)
            mark_fallbacks(self.rec, found, self.config.world_size)
        pipeline = InitPipeline(self.stages(), recorder=self.rec,
                                concurrent=self.config.switches.parallel_init)
        try:
            pipeline.start().wait_all()
        except BaseException:
            pipeline.close()
            self.close(failed=True)
            raise
        pipeline.close()
        return self._train()

    def _train(self) -> RankResult:
        """The training loop; when it fails and live recovery may keep this rank, the session
        parks instead of closing (`park`), else it closes."""
        try:
            loop = TrainLoop(self.config, self.rank, self.attempt, self.state, self.rec, self.evaluate,
                             beat=self.beat)
            result = replace(loop.run(), finished_at=time.time())
        except BaseException:
            if self.can_park:
                self.park()
            else:
                self.close(failed=True)
            raise
        self.close()
        return result

    # ---- live recovery (live_recovery.py) -----------------------------------------------
    @property
    def can_park(self) -> bool:
        """Live recovery is on and the rank got far enough to keep something worth keeping."""
        return self.config.switches.live_recovery and self.state.is_set("checkpointing") \
            and self.state.is_set("dense_step") and self.state.is_set("dense_opt")

    def park(self) -> None:
        """Keep the process's state for a rejoin; close what belongs to the failed attempt."""
        if self.state.is_set("batches") and hasattr(self.state.batches, "close"):
            self.state.batches.close()
        self.state.checkpointing.abandon_saves()
        self.beat.close()
        PREEMPTION.detach(self.rec)
        self.rec.close()
        self.parked = True

    def rejoin(self, config: TrainerConfig, attempt: int, master: tuple[str, int],
               point: RestorePoint) -> RankResult:
        """A survivor goes on training in attempt `attempt`: a new process group, the sharded
        module rebuilt on it, `point` restored, then training (see live_recovery.py)."""
        if not self.parked:
            raise RuntimeError(f"rank {self.rank} was not parked: only a rank kept through a peer's failure rejoins")
        self.config, self.attempt, self.master, self.parked = config, attempt, master, False
        self.rec = SpoolWriter(self.spool_root, self.run_id, attempt, self.rank)
        self.beat = RankHeartbeat(beat_file(self.spool_root, self.run_id, attempt, self.rank), self.rank,
                                  on_pause=self._record_pause)
        PREEMPTION.attach(self.rec)
        self.beat.start()
        return self._resume(point)

    def join(self, warm: WarmSpare, point: RestorePoint) -> RankResult:
        """A spare takes this rank: the device, dense modules, dense optimizer and compiled step
        it prepared ahead of time (`spare.WarmSpare`), the rank's own data pipelines and plugins,
        then the same steps as a survivor's rejoin."""
        self.beat.start()
        try:
            self.state.device = warm.device
            self.state.dense_step, self.state.dense_opt = warm.dense_step, warm.dense_opt
            self.state.compiled_step = warm.compiled_step
            self.warm_timings = warm.timings
            for name, stage in (("preproc_creation", self.preproc_creation), ("init_plugins", self.init_plugins)):
                with self.beat.phase(name), self.rec.span(name, spare=True):
                    stage()
        except BaseException:
            self.close(failed=True)
            raise
        return self._resume(point)

    def _resume(self, point: RestorePoint) -> RankResult:
        try:
            with self.beat.phase("process_group_init"), self.rec.span("process_group_rebuild",
                                                                       world_size=self.config.world_size):
                self._teardown_groups(failed=True)
                self.process_group_init()
            with self.beat.phase("train_module_creation"), self.rec.span("module_reshard"):
                rebuild_sharded(self.state, self.config)
                self.state.checkpointing.rebind(self.state.dmp, self.state.dense_opt, self.state.groups, self.config,
                                          self.rec)
            with self.beat.phase("checkpoint_restore"), self.rec.span("checkpoint_restore", live=True) as attrs:
                attrs.update(self.state.checkpointing.restore_point(point).to_attrs())
            self.state.batches = self.state.data.batches(self.state.checkpointing.resume_cursor,
                                                         prefetch=PREFETCH_BATCHES)
            self.state.first_batch = None
        except BaseException:
            self.close(failed=True)
            raise
        return self._train()

    def _teardown_groups(self, *, failed: bool) -> None:
        """This rank's groups destroyed (after a peer's failure NCCL's are aborted first)."""
        if self.state.is_set("groups"):
            self.state.groups.teardown(failed=failed)
        else:
            teardown_any()

    def close(self, *, failed: bool = False) -> None:
        """End the session: `failed` when it ends with an error (NCCL's communicators are then
        aborted before the groups are destroyed: a peer may be gone)."""
        if self.staging is not None:  # ended before its checkpointing took it
            self.staging.discard()
            self.staging = None
        if self.state.is_set("checkpointing"):
            self.state.checkpointing.close()
        if self.state.is_set("batches") and hasattr(self.state.batches, "close"):
            self.state.batches.close()
        self._teardown_groups(failed=failed)
        self.beat.close()
        PREEMPTION.detach(self.rec)
        self.rec.close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def process_start_time() -> float:
    try:
        import psutil

        return psutil.Process(os.getpid()).create_time()
    except Exception:  # noqa: BLE001 - best effort, the stage timing still follows
        return time.time()

