"""A rank's checkpointing: its durable checkpoints (DCP, with their delta chain), its in-memory
tier, its anchor, and every restore (the compile cache is `compile_plugin.py`'s).

Each action is recorded as a phase: `checkpoint_save_blocking` (what the loop waits for) and
`checkpoint_save_background` (the write that overlaps training), `checkpoint_restore` (attrs
`source`, an `ett.checkpoint_tier.RestoreSource`: "own", the run's latest checkpoint after a
restart; "parent", a warm start from the parent refresh's anchor, with the restored state's
`fingerprint`; "memory", the in-memory tier's copies).
An elastic restart (`placement.min_world_size`) restores the run's own checkpoint at another
world size (`resharded_from`): model and optimizer state resharded by DCP (the same read as a
warm start), the step, and the data cursor, which is the same on every rank of a checkpoint
(trainer/data/pipeline.py), so every later row is trained exactly once; RNG state starts fresh.
A checkpoint or anchor is saved only from finite state: non-finite dense parameters (or a
non-finite last loss) are refused as a `numerics` failure (see `numerics.py`).
With `switches.delta_checkpoint`, a periodic save may be a delta on the last committed one
(`delta_saves.py`; `checkpoint_save_blocking` attrs `kind`, `bytes`, `parent`), and a restore
reads the run's newest restorable chain: its base, then each delta in order (attrs `deltas`).
Anchors and warm starts read and write bases only.
The anchor marker's format lives in `checkpoint/anchor.py`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ettflow.ett.checkpoint_tier import RestoreSource
from ettflow.ett.spool import SpoolWriter
from ettflow.trainer.checkpoint import (
    CheckpointConfig,
    CheckpointInfo,
    CheckpointManager,
    CommitResult,
    SaveResult,
    TrainState,
)
from ettflow.trainer.checkpoint import init_lazy_optimizer_state as init_optimizer_state
from ettflow.trainer.checkpoint.anchor import AnchorInfo, write_anchor
from ettflow.trainer.checkpoint.config import CheckpointError
from ettflow.trainer.checkpoint.delta import apply_chain
from ettflow.trainer.checkpoint.fingerprint import state_fingerprint
from ettflow.trainer.checkpoint.latest import checked_scan
from ettflow.trainer.checkpoint.memory_tier import MemoryCopyError, MemoryTier
from ettflow.trainer.config import ANCHOR_COMMIT, TrainerConfig
from ettflow.trainer.data.windows import Cursor, split_windows
from ettflow.trainer.faults import due_in_phase
from ettflow.trainer.protocol import MEMORY, RestorePoint
from ettflow.trainer.rank.fault_fire import fire
from ettflow.trainer.rank.numerics import refuse_nonfinite
from ettflow.trainer.rank.restore_report import ChainRead, RestoreReport

if TYPE_CHECKING:
    from torchrec.distributed import DistributedModelParallel

    from ettflow.trainer.checkpoint.delta import DeltaInfo
    from ettflow.trainer.checkpoint.results import RestoreResult
    from ettflow.trainer.collectives import Group, Groups
    from ettflow.trainer.rank.delta_saves import DeltaSaves

log = logging.getLogger("ettflow.trainer")
DENSE_MODULES = ("dense_arch", "inter_arch", "over_arch")  # the replicated part of the DLRM


class Checkpointing:
    def __init__(self, config: TrainerConfig, rank: int, rec: SpoolWriter, resume: CheckpointInfo | None,
                 parent: Path | None = None, *, keeper: Any = None,
                 resume_deltas: tuple[DeltaInfo, ...] = ()) -> None:
        """resume: the run's own latest checkpoint (a restart), else None, and resume_deltas the
        deltas on it a restore applies in order (its chain, `catalog.Chain`); parent: the anchor
        to warm start from when there is no own checkpoint (model and optimizer state only:
        the step counter starts at 0 and the data cursor at the start of the run's windows).
        keeper: the run's in-memory checkpoint keeper (None: no in-memory tier)."""
        if resume is not None and parent is not None:
            raise ValueError("a rank restores its run's own checkpoint or warm starts from a parent, not both")
        self.config, self.rank, self.rec = config, rank, rec
        self.resume, self.parent = resume, parent
        self.resume_deltas = tuple(resume_deltas) if resume is not None else ()
        self.deltas: DeltaSaves | None = None  # with switches.delta_checkpoint (prepare_state)
        self.control: Group | None = None  # the control group (prepare_state): restore agreements
        self.manager: CheckpointManager | None = None
        self.train_state: TrainState | None = None
        self.dense_named: list[tuple[str, torch.Tensor]] = []  # checked before every save
        # the in-memory tier (a copy of every save in host memory that outlives the rank)
        self.memory = (MemoryTier(keeper, rank, config.world_size, on_done=self._on_memory_done,
                                  policy=config.delta_policy if config.switches.delta_checkpoint else None)
                       if keeper is not None and config.switches.memory_checkpoint else None)
        self.live_point: tuple[int, Cursor] | None = None  # where a live recovery resumed
        self.restored_path: Path | None = None  # the committed checkpoint the last restore read (None: memory, parent)
        self._memory_background: list[float] = []  # seconds, each in-memory copy's background part

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

    # ---- checkpoints --------------------------------------------------------------------
    def prepare_state(self, dmp: DistributedModelParallel, dense_opt: torch.optim.Optimizer,
                      groups: Groups) -> None:
        """Build the checkpoint manager (its collectives on the checkpoint group) and the train state of the
        sharded module `dmp` and the dense optimizer; create lazy optimizer state."""
        mode = "async" if self.config.switches.async_checkpoint else "sync"
        self.manager = CheckpointManager(
            CheckpointConfig(root=self.config.checkpoint_dir, mode=mode, keep_last=self.config.keep_checkpoints),
            process_group=groups.checkpoint.pg, on_commit=self._on_commit, async_staging=self.async_staging,
        )
        self.control = groups.control
        self.train_state = TrainState(model=dmp, optimizers={"sparse": dmp.fused_optimizer, "dense": dense_opt})
        if self.config.switches.delta_checkpoint:
            from ettflow.trainer.rank.delta_saves import DeltaSaves  # TorchRec's tracker: only when on

            self.deltas = DeltaSaves(dmp, self.config)
        dlrm = dmp.module
        self.dense_named = [pair for name in DENSE_MODULES
                            for pair in getattr(dlrm, name).named_parameters(prefix=name)]
        init_optimizer_state(dense_opt)

    @property
    def async_staging(self) -> bool:
        """Stage a save in the background, waited for before the next backward (`wait_staged`):
        with an accelerator (a DMA into pinned buffers overlaps the forward). On a CPU host the
        copy holds the Python lock, so staging in the background only moves it into the next
        step (measured: `ettflow.bench.save_blocking`): there the save copies while it blocks."""
        return self.config.switches.async_checkpoint and torch.accelerator.is_available()

    def wait_staged(self) -> None:
        """Before a step changes parameters: the background staging of the last save must be
        done; its wait is that save's blocking (recorded as `checkpoint_save_blocking`)."""
        if self.manager is None:
            return
        staged = self.manager.wait_staged()
        if staged is not None and staged.waited_s > 0:
            self.rec.record("checkpoint_save_blocking", staged.start, staged.end, sync=False, step=staged.step,
                            staging_wait=True)

    def rebind(self, dmp: DistributedModelParallel, dense_opt: torch.optim.Optimizer, groups: Groups,
               config: TrainerConfig, rec: SpoolWriter) -> None:
        """After a live recovery rebuilt the process group and the sharded module: the next
        attempt's config and spool, a checkpoint manager on the new checkpoint group and a
        train state over the new module (the in-memory tier and compile cache are kept)."""
        self.config, self.rec = config, rec
        if self.manager is not None:
            self.manager.close()
        self.prepare_state(dmp, dense_opt, groups)

    def abandon_saves(self) -> None:
        """A peer failed: the save in flight can never commit (its group is gone); drop it
        without waiting on the group (a live recovery builds a new manager)."""
        if self.manager is not None:
            try:
                self.manager.close()
            except Exception as exc:  # noqa: BLE001 - expected: the save's collective lost its peer
                log.info("checkpoint save in flight abandoned after a peer's failure: %s", exc)
            self.manager = None
        if self.memory is not None:
            self.memory.wait()

    def restore_point(self, point: RestorePoint, *, fallback: bool = False) -> RestoreReport:
        """A live recovery's (or a full restart's) restore, collective: the in-memory copy of
        `point.step` on every rank, or, when it is missing or fails its checksum on any rank,
        the durable checkpoint on every rank (with a warning); `point` itself may name the
        durable one. The ranks agree on the control group (gloo). `fallback`: with no durable
        checkpoint either, a full restart's ranks warm start as they would have (a live
        recovery's survivors cannot: they raise)."""
        assert self.manager is not None and self.train_state is not None
        problem = memory_problem = None
        if point.source is MEMORY:
            read = None
            if self.memory is None:
                problem = "this rank has no in-memory tier"
            else:
                try:
                    read = self.memory.restore(self.train_state, point.step)
                except MemoryCopyError as exc:
                    problem = str(exc)
            if self.control.all_ok(problem is None):
                self.live_point = (point.step, Cursor.from_dict(self.train_state.cursor))
                self.restored_path = None
                if self.deltas is not None:
                    self.deltas.restored(None)  # the next save is a base
                return RestoreReport(source=RestoreSource.MEMORY, step=point.step, point=point,
                                     memory_deltas=read["deltas"] if read is not None else None)
            log.warning("in-memory copy of step %d not usable (%s): every rank restores the durable checkpoint",
                        point.step, problem or "a peer's copy failed")
            memory_problem = problem or "a peer's copy failed its check"
        # the run's newest restorable chain (a base, or a base and its deltas), or the one named
        chain = checked_scan(self.config).chain(self.config.world_size) \
            if point.source is MEMORY or point.path is None or not is_base(point.path) else None
        path = (chain.base.path if chain.base is not None else None) if chain is not None else point.path
        if path is None and fallback and self.parent is not None:
            return self._warm_start().at(point, memory_problem=memory_problem)
        if path is None:
            raise CheckpointError(f"live recovery: the in-memory copy of step {point.step} failed and the run has "
                                  "no durable checkpoint; every rank restarts")
        restored, read = self._load_own(path, chain.deltas if chain is not None else ())
        self.live_point = (self.train_state.step, Cursor.from_dict(self.train_state.cursor))
        return RestoreReport(source=RestoreSource.OWN, step=self.train_state.step,
                             path=str(restored.checkpoint.path), chain=read, point=point,
                             memory_problem=memory_problem)

    def save_memory(self, step: int, cursor: Cursor | None, *, since: float | None = None) -> float:
        """A copy of the state at `step` into the in-memory tier; returns the seconds the loop was
        blocked (recorded as `memory_save_blocking`, from `since` when given: the end of what the
        loop recorded last). No tier: 0."""
        if self.memory is None or self.train_state is None:
            return 0.0
        t0 = time.time() if since is None else min(since, time.time())
        self.train_state.step, self.train_state.cursor = step, (cursor or Cursor()).to_dict()
        touched = self.deltas.memory_rows() if self.deltas is not None else None
        self.memory.save(step, self.train_state, touched=touched)
        t1 = time.time()
        self.rec.record("memory_save_blocking", t0, t1, sync=False, step=step,
                        **({"kind": self.memory.last_kind} if self.memory.policy is not None else {}))
        return t1 - t0

    def corrupt_memory(self) -> None:
        """The scripted `corrupt` fault: from now on this rank's copies are corrupted as the keeper
        stores them (their checksums kept), so a restore from them must fail."""
        if self.memory is not None:
            self.memory.corrupt_copies = True

    def memory_background_s(self) -> float | None:
        """The longest background part (checksum + hand-off) of this rank's in-memory copies so
        far (0: none); None while one is still in flight (its time is not known yet, and
        waiting for it would stop training)."""
        if self.memory is None:
            return 0.0
        if self.memory.in_flight:
            return None
        self.memory.wait()
        return max(self._memory_background, default=0.0)

    def _on_memory_done(self, result: Any) -> None:
        self._memory_background.append(result.end - result.start)
        self.rec.record("memory_save_background", result.start, result.end, step=result.step,
                        bytes=result.nbytes, ok=result.ok, kind=result.kind,
                        **({"error": result.error[:300]} if result.error else {}))

    def check_finite(self, step: int, *, loss: float | None, action: str) -> None:
        """Raise (and record) a numerics failure unless the last loss and the dense parameters
        are finite; `action` names what is refused ("checkpoint at step 10")."""
        refuse_nonfinite(self.rec, self.dense_named, rank=self.rank, step=step, loss=loss, action=action)

    def restore(self) -> RestoreReport:
        """The `checkpoint_restore` stage: the run's own latest checkpoint (or chain), or the parent anchor."""
        assert self.manager is not None and self.train_state is not None
        if self.resume is None:
            return self._warm_start()
        if self.resharded:
            return self._restore_resharded()
        restored, read = self._load_own(self.resume, self.resume_deltas)
        return RestoreReport(source=RestoreSource.OWN, step=self.train_state.step,
                             path=str(restored.checkpoint.path), cursor=self.resume_cursor.as_tuple(), chain=read)

    def _load_own(self, base: CheckpointInfo | Path | str, deltas: tuple[DeltaInfo, ...] = ()
                  ) -> tuple[RestoreResult, ChainRead | None]:
        """Restore one of the run's own chains: its base, then its deltas in order (each verified
        before it is read), so the state equals a full checkpoint of the chain's last step; the
        delta saves build on it. (The base's RestoreResult, and what was read past it: None for a
        base alone.) `restored_path` names the base when it is the whole chain (an anchor
        of that step reuses it), else None: no committed full checkpoint holds this step."""
        assert self.manager is not None and self.train_state is not None
        restored = self.manager.load(self.train_state, base)
        rows = apply_chain(self.train_state, [d.path for d in deltas], self.rank) if deltas else 0
        self.restored_path = None if deltas else Path(restored.checkpoint.path)
        if self.deltas is not None:
            from ettflow.trainer.checkpoint.catalog import Chain

            self.deltas.restored(Chain(base=restored.checkpoint, deltas=tuple(deltas)))
        if not deltas:
            log.info("restored %s (step %d)", restored.checkpoint.path, restored.checkpoint.step)
            return restored, None
        log.info("restored %s (step %d) and %d delta(s) on it, to step %d", restored.checkpoint.path,
                 restored.checkpoint.step, len(deltas), self.train_state.step)
        return restored, ChainRead(base_step=restored.checkpoint.step, deltas=tuple(d.step for d in deltas),
                                   rows=rows)

    def _restore_resharded(self) -> RestoreReport:
        assert self.manager is not None and self.train_state is not None and self.resume is not None
        if not self.config.placement.elastic:
            raise RuntimeError(
                f"{self.resume.path} was written by {self.resume.world_size} ranks and this attempt has "
                f"{self.config.world_size}: set placement.min_world_size (flow parameter min_world_size) to "
                "allow an elastic restart, or restart with the same number of ranks")
        cursor = common_cursor(self.resume)
        restored = self.manager.load_parent(self.train_state, self.resume)  # weights only, resharded
        log.info("restored %s (step %d of %d ranks) on %d ranks", restored.checkpoint.path, self.resume.step,
                 self.resume.world_size, self.config.world_size)
        return RestoreReport(source=RestoreSource.OWN, step=self.resume.step, path=str(restored.checkpoint.path),
                             cursor=cursor.as_tuple(), resharded_from=self.resume.world_size,
                             world_size=self.config.world_size)

    def _warm_start(self) -> RestoreReport:
        assert self.manager is not None and self.train_state is not None and self.parent is not None
        restored = self.manager.load_parent(self.train_state, self.parent)
        parent = restored.checkpoint
        fingerprint = state_fingerprint(self.train_state.model.state_dict())
        log.info("warm start from %s (step %d of %d ranks)", parent.path, parent.step, parent.world_size)
        return RestoreReport(source=RestoreSource.PARENT, path=str(parent.path), parent_step=parent.step,
                             parent_world_size=parent.world_size, world_size=self.config.world_size,
                             fingerprint=fingerprint)

    def _on_commit(self, result: CommitResult) -> None:
        if self.deltas is not None:
            self.deltas.base_committed(result)
        if result.background_end > result.background_start:
            self.rec.record("checkpoint_save_background", result.background_start, result.background_end,
                            step=result.step, committed=result.committed, bytes=result.nbytes,
                            path=str(result.path) if result.path else None, error=result.error)

    def save(self, step: int, cursor: Cursor, *, loss: float | None = None, since: float | None = None) -> float:
        """A periodic checkpoint; returns the seconds the training loop was blocked. Refused
        (a numerics failure) when `loss` or a dense parameter is not finite. The loop is blocked
        from the call (`since`: from the end of what it recorded last, the step before): the
        finite check is part of the save's blocking time."""
        called = time.time() if since is None else min(since, time.time())
        self.check_finite(step, loss=loss, action=f"checkpoint at step {step}")
        if self.deltas is not None:
            self.manager.wait()  # a base in flight commits first: it may be the head a delta names
            kind, why = self.deltas.choose()
            if kind == "delta":
                return self._save_delta(step, cursor, called)
            log.debug("checkpoint of step %d is a base: %s", step, why)
        result = self._save(step, cursor)
        start = min(called, result.blocking_start)
        self.rec.record("checkpoint_save_blocking", start, result.blocking_end,
                        step=step, mode=result.mode, waited_previous_s=result.waited_previous_s,
                        **({"kind": "base"} if self.deltas is not None else {}))
        return result.blocking_end - start

    def _save_delta(self, step: int, cursor: Cursor, called: float) -> float:
        """A delta checkpoint of `step` on the last committed one, written while the loop waits
        (it is small: the touched rows); raises CheckpointError when it did not commit."""
        assert self.manager is not None and self.train_state is not None and self.deltas is not None
        self.train_state.step, self.train_state.cursor = step, cursor.to_dict()
        parent = self.deltas.head.step if self.deltas.head else None
        commit = self.deltas.save(step, self.train_state, self.manager.group)
        end = time.time()
        if not commit.committed and not commit.unsupported:
            raise CheckpointError(f"delta checkpoint of step {step} failed: {commit.error}")
        if not commit.committed:  # deltas are off from now on: this save is a base after all
            return self.save(step, cursor, since=called)
        self.rec.record("checkpoint_save_blocking", called, end, step=step, mode="delta", kind="delta",
                        parent=parent, bytes=commit.bytes, path=str(commit.path))
        return end - called

    def _save(self, step: int, cursor: Cursor) -> SaveResult:
        """A full save (a base); periodic, emergency or anchor."""
        assert self.manager is not None and self.train_state is not None
        self.train_state.step, self.train_state.cursor = step, cursor.to_dict()
        if self.deltas is not None:
            self.deltas.base_started(step)
        return self.manager.save(step, self.train_state)

    def save_anchor(self, step: int, cursor: Cursor | None, run_id: str, *, loss: float | None = None) -> Path | None:
        """The final checkpoint, durable before this returns, marked with `anchor.json`: a
        restart or a flow retry finds it, and publishing reads it. Refused (a numerics
        failure) when `loss` or a dense parameter is not finite: no NaN anchor is written.
        `cursor` None: nothing was trained in this attempt (a kill after the final checkpoint
        committed, before its `anchor.json`): the anchor is the state restored, with its cursor,
        on every recovery path: the committed checkpoint of `step` when the restore read one
        (durable restart, live recovery from disk), else a checkpoint saved now (a restore
        from the in-memory tier, or one resharded to this world size)."""
        assert self.manager is not None
        self.check_finite(step, loss=loss, action=f"anchor at step {step}")
        path: Path | None = None
        if cursor is None:
            self.manager.wait()
            cursor = self.resume_cursor
            path = self._restored_checkpoint(step)
            if path is None and cursor is None:  # a warm start that trains nothing: no checkpoint of its own
                return None
        if path is None:
            result = self._save(step, cursor)
            self.manager.wait()
            commit = result.commit_result()
            if not commit.committed:
                raise RuntimeError(f"the anchor checkpoint at step {step} did not commit: {commit.error}")
            path = commit.path
        fault = due_in_phase(self.config.failures, attempt=self.rec.attempt, rank=self.rank, phase=ANCHOR_COMMIT)
        if fault is not None:  # scripted: killed between the commit and its marker
            fire(fault, self.rec, step=step)
        if self.rank == 0:
            write_anchor(Path(path), AnchorInfo(run_id=run_id, step=step, cursor=cursor.to_dict(),
                                                world_size=self.config.world_size,
                                                model=self.config.model, schema=self.config.schema,
                                                parent=self._parent_anchor(), windows=self._windows()))
        return Path(path)

    def _restored_checkpoint(self, step: int) -> Path | None:
        """The committed checkpoint of `step` this attempt restored, written at this world size."""
        restored = self.restored_path
        if restored is None or self.resume_step != step or self.resharded:
            return None
        return restored

    def _parent_anchor(self) -> str | None:
        """The anchor this run was warm started from (a restart reads it from its own
        checkpoint's run: the config names it either way), None for a cold start."""
        return self.config.warm_start_from or None

    def _windows(self) -> tuple[str, ...]:
        return split_windows(self.config)[0]

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
        if self.memory is not None:
            self.memory.close()


def is_base(path: str | Path) -> bool:
    """Whether a checkpoint folder's name is a full checkpoint's (`step_<n>`), not a delta's."""
    from ettflow.trainer.checkpoint.layout import parse_name

    return parse_name(Path(path).name) is not None


def common_cursor(info: CheckpointInfo) -> Cursor:
    """The data cursor every rank of `info` saved (they are equal by the sharding rule); a
    checkpoint whose ranks disagree cannot be resharded."""
    cursors = {Cursor.from_dict(c).as_tuple() for c in info.cursors}
    if len(cursors) != 1:
        raise RuntimeError(f"{info.path}: its ranks saved different data cursors {sorted(cursors)}; it cannot be "
                           "restored at another world size")
    return Cursor.from_dict(info.cursors[0])
