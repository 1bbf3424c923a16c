"""What a rank plugs into its training: the compile cache and the checkpoints.

Each action is recorded as a phase: `compile_cache_restore` and `compile_cache_save` (PT2
compile), `checkpoint_save_blocking` (what the loop waits for) and
`checkpoint_save_background` (the write that overlaps training), `checkpoint_restore`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ettflow.ett.spool import SpoolWriter

from .checkpoint import CheckpointConfig, CheckpointInfo, CheckpointManager, CommitResult, SaveResult, TrainState
from .checkpoint import init_lazy_optimizer_state as init_optimizer_state
from .checkpoint.catalog import scan
from .checkpoint.layout import atomic_write_text
from .compile.cache import CompileCache
from .compile.compiled import compile_module
from .compile.config import CompileCacheConfig
from .config import TrainerConfig
from .data.batch import Batch
from .data.windows import Cursor

log = logging.getLogger("ettflow.trainer")
_CACHE: CompileCache | None = None  # one per process: inductor's folders are process-wide


def prepare_compile_env(config: TrainerConfig) -> CompileCache:
    """Point inductor at a fresh per-process folder, key the archive, pin threads. Must run
    before anything compiles; every rank uses the same thread count (it is in the key)."""
    global _CACHE
    if _CACHE is None:
        shapes = {"batch_size": config.batch_size, "dense": len(config.schema.dense),
                  "sparse": len(config.schema.sparse)}
        _CACHE = CompileCache(CompileCacheConfig(
            root=config.compile_cache_dir, enabled=config.switches.compile_cache,
            model={"model": asdict(config.model), "shapes": shapes},
            device="cuda" if (config.device != "cpu" and torch.cuda.is_available()) else "cpu",
            threads=config.threads_per_rank,
            # uncompressed: a restart unpacks the 150 MB precompiled header in ~0.2 s instead of
            # ~0.7 s gunzipping it; the archive is ~170 MB per model and key
            codec="none", max_bytes=512 * 2**20,
        ))
        _CACHE.prepare_env()
    return _CACHE


ANCHOR_FILE = "anchor.json"


def write_anchor(checkpoint: Path, info: dict[str, Any]) -> None:
    """Mark a committed checkpoint as a run's anchor (atomic: temp file, fsync, rename)."""
    atomic_write_text(checkpoint / ANCHOR_FILE, json.dumps(info, indent=1, sort_keys=True))


def read_anchor(checkpoint: Path | str) -> dict[str, Any] | None:
    path = Path(checkpoint) / ANCHOR_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def latest_checkpoint(config: TrainerConfig) -> CheckpointInfo | None:
    found = scan(config.checkpoint_dir)
    for problem in found.problems:
        log.warning("checkpoint skipped: %s", problem)
    return found.latest


class TrainerPlugins:
    def __init__(self, config: TrainerConfig, rank: int, rec: SpoolWriter, resume: CheckpointInfo | None) -> None:
        self.config, self.rank, self.rec = config, rank, rec
        self.resume = resume
        self.cache = prepare_compile_env(config)
        self.cache_hit = False
        self.manager: CheckpointManager | None = None
        self.train_state: TrainState | None = None
        if config.switches.compile and config.switches.compile_cache:
            with rec.span("compile_cache_restore") as attrs:
                restored = self.cache.restore()
                attrs.update(hit=restored.hit, bytes=restored.bytes, reason=restored.reason)
            self.cache_hit = restored.hit

    @property
    def resume_step(self) -> int:
        return self.resume.step if self.resume else 0

    @property
    def resume_cursor(self) -> Cursor | None:
        if not self.resume:
            return None
        return Cursor.from_dict(self.resume.cursors[self.rank])

    # ---- checkpoints --------------------------------------------------------------------
    def prepare_state(self, state: dict[str, Any]) -> None:
        """Build the checkpoint manager and the train state; create lazy optimizer state."""
        mode = "async" if self.config.switches.async_checkpoint else "sync"
        self.manager = CheckpointManager(
            CheckpointConfig(root=self.config.checkpoint_dir, mode=mode, keep_last=self.config.keep_checkpoints),
            process_group=state["ckpt_pg"], on_commit=self._on_commit,
        )
        self.train_state = TrainState(
            model=state["dmp"], optimizers={"sparse": state["dmp"].fused_optimizer, "dense": state["dense_opt"]}
        )
        init_optimizer_state(state["dense_opt"])

    def restore(self) -> dict[str, Any]:
        assert self.manager is not None and self.train_state is not None and self.resume is not None
        restored = self.manager.load(self.train_state, self.resume)
        log.info("restored %s (step %d)", restored.checkpoint.path, restored.checkpoint.step)
        return {"step": restored.checkpoint.step, "path": str(restored.checkpoint.path),
                "cursor": list(self.resume_cursor.as_tuple()) if self.resume_cursor else None}

    def _on_commit(self, result: CommitResult) -> None:
        if result.background_end > result.background_start:
            self.rec.record("checkpoint_save_background", result.background_start, result.background_end,
                            step=result.step, committed=result.committed, bytes=result.nbytes,
                            path=str(result.path) if result.path else None, error=result.error)

    def save(self, step: int, cursor: Cursor) -> float:
        """A periodic checkpoint; returns the seconds the training loop was blocked."""
        result = self._save(step, cursor)
        self.rec.record("checkpoint_save_blocking", result.blocking_start, result.blocking_end,
                        step=step, mode=result.mode, waited_previous_s=result.waited_previous_s)
        return result.blocking_s

    def _save(self, step: int, cursor: Cursor) -> SaveResult:
        assert self.manager is not None and self.train_state is not None
        self.train_state.step, self.train_state.cursor = step, cursor.to_dict()
        return self.manager.save(step, self.train_state)

    def save_anchor(self, step: int, cursor: Cursor | None, run_id: str) -> Path | None:
        """The final checkpoint, durable before this returns, marked with `anchor.json`: a
        restart or a flow retry finds it, and publishing reads it."""
        assert self.manager is not None
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
            write_anchor(Path(path), {"run_id": run_id, "step": step,
                                      "cursor": cursor.to_dict() if cursor else None,
                                      "world_size": self.config.world_size,
                                      "model": asdict(self.config.model), "schema": self.config.schema.to_dict()})
        return Path(path) if path is not None else None

    # ---- compilation --------------------------------------------------------------------
    def compile(self, state: dict[str, Any], batch: Batch) -> None:
        """Compile the dense step with one forward and backward on `batch` (the fast batch
        or the first real one); nothing is updated: gradients are dropped."""
        device = state["device"]
        compiled = compile_module(state["dense_step"])
        b = batch.to(device)
        n_sparse, dim = len(self.config.schema.sparse), self.config.model.embedding_dim
        embedded = torch.randn(b.batch_size, n_sparse, dim, device=device, requires_grad=True)
        loss, _ = compiled(b.dense, embedded, b.labels)
        loss.backward()
        for p in state["dense_step"].parameters():
            p.grad = None
        state["compiled_step"] = compiled
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
