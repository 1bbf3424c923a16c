"""A rank's checkpointing: its checkpoint tiers (`tiers.py`: the in-memory copies, then the
durable checkpoints), its anchor, and every restore (the compile cache is `compile_plugin.py`'s).

`checkpoint_restore` (attrs `source`, an `ett.checkpoint_tier.RestoreSource`: "own", the run's
latest checkpoint after a restart; "parent", a warm start from the parent refresh's anchor, with
the restored state's `fingerprint`; "memory", the in-memory tier's copies) is decided once,
here, and returned as a `RestoreReport`. A live recovery's or full restart's restore point
climbs the tiers (`tiers.climb`): the tier it names, then every slower one, all ranks agreeing.
An elastic restart (`placement.min_world_size`) restores the run's own checkpoint at another
world size (`resharded_from`): model and optimizer state resharded by DCP (the same read as a
warm start), the step, and the data cursor, which is the same on every rank of a checkpoint
(trainer/data/pipeline.py), so every later row is trained exactly once; RNG state starts fresh.
A checkpoint or anchor is saved only from finite state: non-finite dense parameters (or a
non-finite last loss) are refused as a `numerics` failure (see `numerics.py`).
With `switches.delta_checkpoint`, a periodic save may be a delta on the last committed one
(`delta_saves.py`), and a restore reads the run's newest restorable chain. The anchor marker's
format lives in `checkpoint/anchor.py`.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ettflow.ett.checkpoint_tier import CheckpointTier, RestoreSource
from ettflow.ett.spool import SpoolWriter
from ettflow.trainer.checkpoint import CheckpointInfo, TrainState
from ettflow.trainer.checkpoint import init_lazy_optimizer_state as init_optimizer_state
from ettflow.trainer.checkpoint.anchor import AnchorInfo, TrainedWith, write_anchor
from ettflow.trainer.checkpoint.config import CheckpointError
from ettflow.trainer.checkpoint.layout import final_dir
from ettflow.trainer.config import ANCHOR_COMMIT, TrainerConfig
from ettflow.trainer.data.windows import Cursor, split_windows
from ettflow.trainer.faults import due_in_phase
from ettflow.trainer.protocol import AnchorHandOff, RestorePoint
from ettflow.trainer.rank.durable_tier import DurableTier
from ettflow.trainer.rank.fault_fire import fire
from ettflow.trainer.rank.host_memory_tier import HostMemoryTier
from ettflow.trainer.rank.restore_report import RestoreReport
from ettflow.trainer.rank.tiers import RESTORE_ORDER, NoTierHolds, RankTier, TierContext, climb

if TYPE_CHECKING:
    from torchrec.distributed import DistributedModelParallel

    from ettflow.trainer.checkpoint.delta import DeltaInfo
    from ettflow.trainer.checkpoint.staged_anchor import AnchorStaging
    from ettflow.trainer.checkpoint.state_keeper import KeeperHandle
    from ettflow.trainer.collectives import Groups

log = logging.getLogger("ettflow.trainer")
DENSE_MODULES = ("dense_arch", "inter_arch", "over_arch")  # the replicated part of the DLRM


class Checkpointing:
    def __init__(self, config: TrainerConfig, rank: int, rec: SpoolWriter, resume: CheckpointInfo | None,
                 parent: Path | None = None, *, keeper: KeeperHandle | None = None,
                 resume_deltas: tuple[DeltaInfo, ...] = (), staging: AnchorStaging | None = None) -> None:
        """resume: the run's own latest checkpoint (a restart), else None, and resume_deltas the
        deltas on it a restore applies in order (its chain, `catalog.Chain`); parent: the anchor
        to warm start from when there is no own checkpoint (model and optimizer state only:
        the step counter starts at 0 and the data cursor at the start of the run's windows).
        keeper: the run's in-memory checkpoint keeper (None: no in-memory tier). staging: the
        anchor this process staged in memory before the run (a pooled worker's), read for the
        warm start when it is the parent."""
        if resume is not None and parent is not None:
            raise ValueError("a rank restores its run's own checkpoint or warm starts from a parent, not both")
        self.ctx = TierContext(config=config, rank=rank, rec=rec)
        self.resume, self.parent = resume, parent
        # only a warm start reads a staged parent: anything else drops it now (its memory, its reading)
        self.staging = staging if resume is None and parent is not None else None
        if staging is not None and self.staging is None:
            staging.discard()
        self.resume_deltas = tuple(resume_deltas) if resume is not None else ()
        self.durable = DurableTier(self.ctx)
        memory = (HostMemoryTier(self.ctx, keeper)
                  if keeper is not None and config.switches.memory_checkpoint else None)
        found: dict[CheckpointTier, RankTier] = {t.kind: t for t in (memory, self.durable) if t is not None}
        self.tiers: tuple[RankTier, ...] = tuple(found[k] for k in RESTORE_ORDER if k in found)  # fastest first
        self.live_point: tuple[int, Cursor] | None = None  # where a live recovery resumed
        self.last_restore: RestoreReport | None = None  # what this attempt's restore read
        self.handoff: AnchorHandOff | None = None  # the anchor in host memory, for the driver to seal

    @property
    def config(self) -> TrainerConfig:
        return self.ctx.config

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def rec(self) -> SpoolWriter:
        return self.ctx.rec

    def tier(self, kind: CheckpointTier) -> RankTier | None:
        """This rank's tier of that kind (None: the run does not have it)."""
        return next((t for t in self.tiers if t.kind is kind), None)

    @property
    def resume_step(self) -> int:
        """The step the run continues at: a live recovery's restore point, its own checkpoint's,
        0 for a cold or warm start."""
        if self.live_point is not None:
            return self.live_point[0]
        if self.resume_deltas:
            return self.resume_deltas[-1].step
        return self.resume.step if self.resume else 0

    @property
    def resharded(self) -> bool:
        """The run's own checkpoint was written by another number of ranks (an elastic restart)."""
        return self.resume is not None and self.resume.world_size != self.config.world_size

    @property
    def resume_cursor(self) -> Cursor | None:
        if self.live_point is not None:
            return self.live_point[1]
        if not self.resume:
            return None
        if self.resharded:
            return common_cursor(self.resume)
        if self.resume_deltas:
            return Cursor.from_dict(self.resume_deltas[-1].cursors[self.rank])
        return Cursor.from_dict(self.resume.cursors[self.rank])

    # ---- the tiers' state ---------------------------------------------------------------
    def prepare_state(self, dmp: DistributedModelParallel, dense_opt: torch.optim.Optimizer,
                      groups: Groups) -> None:
        """The train state of the sharded module `dmp` and the dense optimizer (lazy optimizer
        state created), and every tier bound to it (the durable manager's collectives on the
        checkpoint group)."""
        ctx = self.ctx
        ctx.groups = groups
        ctx.train_state = TrainState(model=dmp, optimizers={"sparse": dmp.fused_optimizer, "dense": dense_opt})
        if self.config.switches.delta_checkpoint:
            from ettflow.trainer.rank.delta_saves import DeltaSaves  # TorchRec's tracker: only when on

            ctx.deltas = DeltaSaves(dmp, self.config)
        dlrm = dmp.module
        ctx.dense_named = [pair for name in DENSE_MODULES for pair in getattr(dlrm, name).named_parameters(prefix=name)]
        init_optimizer_state(dense_opt)
        for tier in self.tiers:
            tier.bind()

    def rebind(self, dmp: DistributedModelParallel, dense_opt: torch.optim.Optimizer, groups: Groups,
               config: TrainerConfig, rec: SpoolWriter) -> None:
        """After a live recovery rebuilt the process group and the sharded module: the next
        attempt's config and spool, and every tier bound to a train state over the new module
        (the in-memory copies and the compile cache are kept)."""
        self.ctx.config, self.ctx.rec = config, rec
        self.prepare_state(dmp, dense_opt, groups)

    def wait_staged(self) -> None:
        """Before a step changes parameters: every tier's staged save has finished copying."""
        for tier in self.tiers:
            tier.before_update()

    def save(self, kind: CheckpointTier, step: int, cursor: Cursor | None, *, loss: float | None = None,
             since: float | None = None) -> float:
        """A save of that tier; returns the seconds the loop was blocked (0: no such tier)."""
        tier = self.tier(kind)
        return tier.save(step, cursor, loss=loss, since=since) if tier is not None else 0.0

    def background_s(self, kind: CheckpointTier) -> float | None:
        tier = self.tier(kind)
        return tier.background_s() if tier is not None else 0.0

    def corrupt_memory(self) -> None:
        """The scripted `corrupt` fault (on the in-memory tier, when the run has it)."""
        memory = self.tier(CheckpointTier.MEMORY)
        if isinstance(memory, HostMemoryTier):
            memory.corrupt()

    def abandon_saves(self) -> None:
        """A peer failed: the saves in flight are dropped (a durable one can never commit: its
        group is gone; an in-memory hand-off finishes)."""
        for tier in self.tiers:
            tier.abandon()

    # ---- restores -----------------------------------------------------------------------
    def restore(self) -> RestoreReport:
        """The `checkpoint_restore` stage: the run's own latest checkpoint (or chain), or the parent anchor."""
        if self.resume is None:
            return self._restored(self._warm_start())
        if self.resharded:
            if not self.config.placement.elastic:
                raise RuntimeError(
                    f"{self.resume.path} was written by {self.resume.world_size} ranks and this attempt has "
                    f"{self.config.world_size}: set placement.min_world_size (flow parameter min_world_size) to "
                    "allow an elastic restart, or restart with the same number of ranks")
            return self._restored(self.durable.restore_resharded(self.resume, common_cursor(self.resume)))
        report = self.durable.restore_own(self.resume, self.resume_deltas)
        return self._restored(replace(report, cursor=self.resume_cursor.as_tuple()))

    def restore_point(self, point: RestorePoint, *, fallback: bool = False) -> RestoreReport:
        """A live recovery's (or a full restart's) restore, collective: `point` from the tier it
        names or, when any rank misses it there, from the next tier down on every rank
        (`tiers.climb`). `fallback`: with no tier holding it, a full restart's ranks warm start
        as they would have (a live recovery's survivors cannot: they raise)."""
        try:
            report = climb(self.tiers, point, self.ctx.groups.control.all_ok)
        except NoTierHolds as exc:
            if fallback and self.parent is not None:
                first = exc.problems[0][1] if len(exc.problems) > 1 else None
                return self._restored(self._warm_start().at(point, memory_problem=first))
            raise CheckpointError(f"live recovery: {exc}; every rank restarts") from exc
        finally:
            self._drop_staging()  # a point in a tier is restored, not the parent
        self.live_point = (report.step, Cursor.from_dict(self.ctx.train_state.cursor))
        if report.source == RestoreSource.MEMORY:
            report = replace(report, chain_resumed=self.resume_chain())
        return self._restored(report)

    def resume_chain(self) -> int | None:
        """After every rank restored an in-memory copy: the durable delta chain goes on from the
        link the copies' records name (`chain_resume.py`) when every rank found that same link
        committed on disk (one all-reduce on the control group; collective, so every rank calls
        it); returns its step, or None: the next durable save is a base."""
        memory, deltas = self.tier(CheckpointTier.MEMORY), self.ctx.deltas
        if deltas is None:  # deltas off: the config's, so every rank returns here, before the collective
            return None
        record = memory.resume if isinstance(memory, HostMemoryTier) else None
        links = record.on_disk(Path(self.config.checkpoint_dir)) if record is not None else None
        step = links[-1].step if links else -1
        high, neg_low, missing = self.ctx.groups.control.max_of([step, -step, 0 if links else 1])
        if missing or high != -neg_low:
            return None
        assert record is not None and links is not None
        deltas.resumed(links, dict(record.rows))
        return step

    def _warm_start(self) -> RestoreReport:
        """The parent anchor, from this process's staged copy when it is that anchor (once: the
        memory goes with it), else from disk; the report says which, and why not."""
        staging, self.staging = self.staging, None
        staged, miss = staging.take(self.parent) if staging is not None else (None, None)
        report = self.durable.warm_start(self.parent, staged=staged)
        return report if staging is None else replace(report, staged=staged is not None, staged_miss=miss)

    def _drop_staging(self) -> None:
        staging, self.staging = self.staging, None
        if staging is not None:
            staging.discard()

    def _restored(self, report: RestoreReport) -> RestoreReport:
        """Keep what this attempt's restore read (the anchor reuses a checkpoint it restored)."""
        self.last_restore = report
        return report

    # ---- the anchor ---------------------------------------------------------------------
    def save_anchor(self, step: int, cursor: Cursor | None, run_id: str, *, loss: float | None = None) -> Path | None:
        """The final checkpoint, durable before this returns, marked with `anchor.json`: a
        restart or a flow retry finds it, and publishing reads it. Refused (a numerics
        failure) when `loss` or a dense parameter is not finite: no NaN anchor is written.
        `cursor` None: nothing was trained in this attempt (a kill after the final checkpoint
        committed, before its `anchor.json`): the anchor is the state restored, with its cursor,
        on every recovery path: the committed checkpoint of `step` when the restore read one
        (durable restart, live recovery from disk), else a checkpoint saved now (a restore
        from the in-memory tier, or one resharded to this world size).

        With `switches.release_before_seal` a checkpoint saved now is not written here: each rank
        serializes its part into host memory (`self.handoff`, returned with its result) and the
        driver writes, seals and marks it once the devices are released; the path returned is
        where it will be."""
        self.handoff = None  # an earlier attempt's, on a process a live recovery kept, is not this one's
        self.durable.check_finite(step, loss=loss, action=f"anchor at step {step}")
        path: Path | None = None
        if cursor is None:
            self.durable.wait()
            cursor = self.resume_cursor
            path = self._restored_checkpoint(step)
            if path is None and cursor is None:  # a warm start that trains nothing: no checkpoint of its own
                return None
        trained = TrainedWith.of(self.config)
        anchor = AnchorInfo(run_id=run_id, step=step, cursor=cursor.to_dict(), world_size=self.config.world_size,
                            model=self.config.model, schema=self.config.schema,
                            parent=self.config.warm_start_from or None, windows=split_windows(self.config)[0],
                            trained_with=trained)
        if path is None and self.config.switches.release_before_seal:
            files, cursor_json = self.durable.hand_off_base(step, cursor)
            self.handoff = AnchorHandOff(rank=self.rank, step=step, world_size=self.config.world_size,
                                         root=str(self.config.checkpoint_dir), files=tuple(sorted(files.items())),
                                         cursor=cursor_json, anchor=anchor if self.rank == 0 else None)
            self._anchor_fault(step)  # scripted: killed with its part handed off, before the release
            return final_dir(self.config.checkpoint_dir, step)  # where the driver seals it
        if path is None:
            path = self.durable.commit_base(step, cursor)
        self._anchor_fault(step)  # scripted: killed between the commit and its marker
        if self.rank == 0:
            write_anchor(Path(path), anchor)
        return Path(path)

    def _anchor_fault(self, step: int) -> None:
        fault = due_in_phase(self.config.failures, attempt=self.rec.attempt, rank=self.rank, phase=ANCHOR_COMMIT)
        if fault is not None:
            fire(fault, self.rec, step=step)

    def _restored_checkpoint(self, step: int) -> Path | None:
        """The committed full checkpoint of `step` this attempt restored, written at this world
        size: an own restore of a base alone (not a chain, not resharded, not memory nor parent)."""
        got = self.last_restore
        if got is None or got.source is not RestoreSource.OWN or got.chain is not None or got.path is None:
            return None
        if got.resharded_from is not None or self.resume_step != step:
            return None
        return Path(got.path)

    def close(self) -> None:
        self._drop_staging()
        for tier in self.tiers:
            tier.close()


def common_cursor(info: CheckpointInfo) -> Cursor:
    """The data cursor every rank of `info` saved (they are equal by the sharding rule); a
    checkpoint whose ranks disagree cannot be resharded."""
    cursors = {Cursor.from_dict(c).as_tuple() for c in info.cursors}
    if len(cursors) != 1:
        raise RuntimeError(f"{info.path}: its ranks saved different data cursors {sorted(cursors)}; it cannot be "
                           "restored at another world size")
    return Cursor.from_dict(info.cursors[0])
