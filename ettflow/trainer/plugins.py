"""What a rank plugs into its training: the compile cache and the checkpoints.

Each action is recorded as a phase: `compile_cache_restore` and `compile_cache_save` (PT2
compile), `checkpoint_save_blocking` (what the loop waits for) and
`checkpoint_save_background` (the write that overlaps training), `checkpoint_restore` (attrs
`source`: "own", the run's latest checkpoint after a restart; "parent", a warm start from the
parent refresh's anchor, with the restored state's `fingerprint`).
An elastic restart (`placement.min_world_size`) restores the run's own checkpoint at another
world size (`resharded_from`): model and optimizer state resharded by DCP (the same read as a
warm start), the step, and the data cursor, which is the same on every rank of a checkpoint
(trainer/data/pipeline.py), so every later row is trained exactly once; RNG state starts fresh.
A checkpoint or anchor is saved only from finite state: non-finite dense parameters (or a
non-finite last loss) are refused as a `numerics` failure (see `numerics.py`).
The anchor marker's format lives in `checkpoint/anchor.py`, the process's compile-cache
handle in `compile/process_cache.py`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from ettflow.ett.spool import SpoolWriter

from .checkpoint import CheckpointConfig, CheckpointInfo, CheckpointManager, CommitResult, SaveResult, TrainState
from .checkpoint import init_lazy_optimizer_state as init_optimizer_state
from .checkpoint.anchor import AnchorInfo, write_anchor
from .checkpoint.fingerprint import state_fingerprint
from .compile.compiled import compile_module
from .compile.process_cache import prepare_compile_env
from .config import TrainerConfig
from .data.batch import Batch
from .data.windows import Cursor
from .numerics import refuse_nonfinite
from .rank_state import RankState

log = logging.getLogger("ettflow.trainer")
DENSE_MODULES = ("dense_arch", "inter_arch", "over_arch")  # the replicated part of the DLRM


class TrainerPlugins:
    def __init__(self, config: TrainerConfig, rank: int, rec: SpoolWriter, resume: CheckpointInfo | None,
                 parent: Path | None = None) -> None:
        """resume: the run's own latest checkpoint (a restart), else None; parent: the anchor
        to warm start from when there is no own checkpoint (model and optimizer state only:
        the step counter starts at 0 and the data cursor at the start of the run's windows)."""
        if resume is not None and parent is not None:
            raise ValueError("a rank restores its run's own checkpoint or warm starts from a parent, not both")
        self.config, self.rank, self.rec = config, rank, rec
        self.resume, self.parent = resume, parent
        self.cache = prepare_compile_env(config)
        self.cache_hit = False
        self.manager: CheckpointManager | None = None
        self.train_state: TrainState | None = None
        self.dense_named: list[tuple[str, torch.Tensor]] = []  # checked before every save
        if config.switches.compile and config.switches.compile_cache:
            with rec.span("compile_cache_restore") as attrs:
                restored = self.cache.restore()
                attrs.update(hit=restored.hit, bytes=restored.bytes, reason=restored.reason)
            self.cache_hit = restored.hit

    @property
    def resume_step(self) -> int:
        """The step the run continues at: its own checkpoint's, 0 for a cold or warm start."""
        return self.resume.step if self.resume else 0

    @property
    def resharded(self) -> bool:
        """The run's own checkpoint was written by another number of ranks (an elastic restart)."""
        return self.resume is not None and self.resume.world_size != self.config.world_size

    @property
    def resume_cursor(self) -> Cursor | None:
        if not self.resume:
            return None
        if self.resharded:
            return common_cursor(self.resume)
        return Cursor.from_dict(self.resume.cursors[self.rank])

    # ---- checkpoints --------------------------------------------------------------------
    def prepare_state(self, state: RankState) -> None:
        """Build the checkpoint manager and the train state; create lazy optimizer state."""
        mode = "async" if self.config.switches.async_checkpoint else "sync"
        self.manager = CheckpointManager(
            CheckpointConfig(root=self.config.checkpoint_dir, mode=mode, keep_last=self.config.keep_checkpoints),
            process_group=state.ckpt_pg, on_commit=self._on_commit,
        )
        self.train_state = TrainState(
            model=state.dmp, optimizers={"sparse": state.dmp.fused_optimizer, "dense": state.dense_opt}
        )
        dlrm = state.dmp.module
        self.dense_named = [pair for name in DENSE_MODULES
                            for pair in getattr(dlrm, name).named_parameters(prefix=name)]
        init_optimizer_state(state.dense_opt)

    def check_finite(self, step: int, *, loss: float | None, action: str) -> None:
        """Raise (and record) a numerics failure unless the last loss and the dense parameters
        are finite; `action` names what is refused ("checkpoint at step 10")."""
        refuse_nonfinite(self.rec, self.dense_named, rank=self.rank, step=step, loss=loss, action=action)

    def restore(self) -> dict[str, Any]:
        """The `checkpoint_restore` stage: the run's own latest checkpoint, or the parent anchor."""
        assert self.manager is not None and self.train_state is not None
        if self.resume is None:
            return self._warm_start()
        if self.resharded:
            return self._restore_resharded()
        restored = self.manager.load(self.train_state, self.resume)
        log.info("restored %s (step %d)", restored.checkpoint.path, restored.checkpoint.step)
        return {"source": "own", "step": restored.checkpoint.step, "path": str(restored.checkpoint.path),
                "cursor": list(self.resume_cursor.as_tuple()) if self.resume_cursor else None}

    def _restore_resharded(self) -> dict[str, Any]:
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
        return {"source": "own", "step": self.resume.step, "path": str(restored.checkpoint.path),
                "cursor": list(cursor.as_tuple()), "resharded_from": self.resume.world_size,
                "world_size": self.config.world_size}

    def _warm_start(self) -> dict[str, Any]:
        assert self.manager is not None and self.train_state is not None and self.parent is not None
        restored = self.manager.load_parent(self.train_state, self.parent)
        parent = restored.checkpoint
        fingerprint = state_fingerprint(self.train_state.model.state_dict())
        log.info("warm start from %s (step %d of %d ranks)", parent.path, parent.step, parent.world_size)
        return {"source": "parent", "path": str(parent.path), "parent_step": parent.step,
                "parent_world_size": parent.world_size, "world_size": self.config.world_size,
                "fingerprint": fingerprint}

    def _on_commit(self, result: CommitResult) -> None:
        if result.background_end > result.background_start:
            self.rec.record("checkpoint_save_background", result.background_start, result.background_end,
                            step=result.step, committed=result.committed, bytes=result.nbytes,
                            path=str(result.path) if result.path else None, error=result.error)

    def save(self, step: int, cursor: Cursor, *, loss: float | None = None) -> float:
        """A periodic checkpoint; returns the seconds the training loop was blocked. Refused
        (a numerics failure) when `loss` or a dense parameter is not finite. The loop is blocked
        from the call: the finite check is part of the save's blocking time."""
        called = time.time()
        self.check_finite(step, loss=loss, action=f"checkpoint at step {step}")
        result = self._save(step, cursor)
        start = min(called, result.blocking_start)
        self.rec.record("checkpoint_save_blocking", start, result.blocking_end,
                        step=step, mode=result.mode, waited_previous_s=result.waited_previous_s)
        return result.blocking_end - start

    def _save(self, step: int, cursor: Cursor) -> SaveResult:
        assert self.manager is not None and self.train_state is not None
        self.train_state.step, self.train_state.cursor = step, cursor.to_dict()
        return self.manager.save(step, self.train_state)

    def save_anchor(self, step: int, cursor: Cursor | None, run_id: str, *, loss: float | None = None) -> Path | None:
        """The final checkpoint, durable before this returns, marked with `anchor.json`: a
        restart or a flow retry finds it, and publishing reads it. Refused (a numerics
        failure) when `loss` or a dense parameter is not finite: no NaN anchor is written."""
        assert self.manager is not None
        self.check_finite(step, loss=loss, action=f"anchor at step {step}")
        if cursor is None:  # nothing trained in this attempt: the restored checkpoint is it
            self.manager.wait()
            path = self.resume.path if self.resume else None
        else:
            result = self._save(step, cursor)
            self.manager.wait()
            commit = result.commit_result()
            if not commit.committed:
                raise RuntimeError(f"the anchor checkpoint at step {step} did not commit: {commit.error}")
            path = commit.path
        if path is not None and self.rank == 0:
            write_anchor(Path(path), AnchorInfo(run_id=run_id, step=step,
                                                cursor=cursor.to_dict() if cursor else None,
                                                world_size=self.config.world_size,
                                                model=self.config.model, schema=self.config.schema,
                                                parent=self._parent_anchor(), windows=self._windows()))
        return Path(path) if path is not None else None

    def _parent_anchor(self) -> str | None:
        """The anchor this run was warm started from (a restart reads it from its own
        checkpoint's run: the config names it either way), None for a cold start."""
        return self.config.warm_start_from or None

    def _windows(self) -> tuple[str, ...]:
        from .session import split_windows  # session builds the plugins: imported here, not at the top

        return split_windows(self.config)[0]

    # ---- compilation --------------------------------------------------------------------
    def compile(self, state: RankState, batch: Batch) -> None:
        """Compile the dense step with one forward and backward on `batch` (the fast batch
        or the first real one); nothing is updated: gradients are dropped. Sets
        `state.compiled_step`."""
        device = state.device
        compiled = compile_module(state.dense_step)
        b = batch.to(device)
        n_sparse, dim = len(self.config.schema.sparse), self.config.model.embedding_dim
        embedded = torch.randn(b.batch_size, n_sparse, dim, device=device, requires_grad=True)
        loss, _ = compiled(b.dense, embedded, b.labels)
        loss.backward()
        for p in state.dense_step.parameters():
            p.grad = None
        state.compiled_step = compiled
        if self.config.switches.compile_cache and not self.cache_hit and self.rank == 0:
            # Saved at once, before training: a rank killed early must still leave a warm
            # cache for its restart (a background save was seen cut short by such a kill).
            # Every rank compiled the same graphs with the same key: rank 0 stores them.
            with self.rec.span("compile_cache_save") as attrs:
                saved = self.cache.save()
                attrs.update(bytes=saved.bytes, skipped=saved.skipped_reason)

    def compile_report(self) -> dict[str, Any]:
        report = self.cache.stats().to_dict()
        report["cache_hit"] = self.cache_hit
        return report

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()


def common_cursor(info: CheckpointInfo) -> Cursor:
    """The data cursor every rank of `info` saved (they are equal by the sharding rule); a
    checkpoint whose ranks disagree cannot be resharded."""
    cursors = {Cursor.from_dict(c).as_tuple() for c in info.cursors}
    if len(cursors) != 1:
        raise RuntimeError(f"{info.path}: its ranks saved different data cursors {sorted(cursors)}; it cannot be "
                           "restored at another world size")
    return Cursor.from_dict(info.cursors[0])
