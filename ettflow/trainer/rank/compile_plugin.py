"""A rank's compile cache around PT2's compile of the dense step: `compile_cache_restore`, an
init stage of its own while the rank restores its checkpoint (a spare's process restored it
already: its hit is taken, never restored twice in one process), the compile itself, and
`compile_cache_save` when the archive missed. Ranks that miss the same key at once do not all
compile cold: the first claims the key, compiles and saves; the others wait for its archive,
restore it and compile warm (`compile/cold_claim.py`; the pt2_compile stage's `cold_*`
attributes say which, and how long it waited). The process's cache handle lives in
`compile/process_cache.py`."""

from __future__ import annotations

import time

import torch

from ettflow.ett.spool import SpoolWriter
from ettflow.trainer.compile.cache import RestoreResult
from ettflow.trainer.compile.cold_claim import ColdTurn, turn_after_miss
from ettflow.trainer.compile.compiled import compile_dense_step
from ettflow.trainer.compile.process_cache import prepare_compile_env
from ettflow.trainer.config import TrainerConfig
from ettflow.trainer.data.batch import Batch
from ettflow.trainer.protocol import CompileReport, PrewarmTimings


class CompilePlugin:
    def __init__(self, config: TrainerConfig, rank: int, rec: SpoolWriter, *,
                 warm: PrewarmTimings | None = None) -> None:
        """warm: the prewarm of a spare's or pooled worker's process, which restored the compile
        cache already (its hit), so it is not restored again. An archive that prewarm refused
        as damaged is this run's to report (a zero-length `compile_cache_restore` with the
        refusal, `pooled`: the row's tag and the run's warning), though the prewarm ran before
        the run (issue 42 #4)."""
        self.config, self.rank, self.rec = config, rank, rec
        self.cache = prepare_compile_env(config)
        self.cache_hit = False
        self.missed: RestoreResult | None = None  # the restore's result when it missed
        self.cold: ColdTurn | None = None  # how a miss took its turn at the cold compile
        self.stored = False  # the archive holds this process's compile already: not saved again
        if config.switches.compile and config.switches.compile_cache and warm is not None:
            self.cache_hit = bool(warm.cache_hit)  # a spare restored the archive before it compiled (spare.py)
            self.stored = warm.cache_stored
            if warm.cache_miss:
                now = time.time()
                rec.record("compile_cache_restore", now, now, hit=False, miss=warm.cache_miss,
                           reason=warm.cache_reason, pooled=True, repair=warm.cache_repair)

    @staticmethod
    def restores(config: TrainerConfig, warm: PrewarmTimings | None) -> bool:
        """Whether the rank restores the archive itself (`restore`: its own init stage, beside
        the checkpoint's restore; the compile waits for it). Never twice in one process:
        extracting the archive rewrites the kernels it loaded, so a prewarmed process does not."""
        return config.switches.compile and config.switches.compile_cache and warm is None

    def restore(self) -> dict[str, object]:
        """The archive unpacked into this process's inductor folders: the `compile_cache_restore`
        stage's attributes (a miss is reported, never raised: the compile runs cold)."""
        restored = self.cache.restore()
        self.cache_hit = restored.hit
        self.missed = None if restored.hit else restored
        return {"hit": restored.hit, "bytes": restored.bytes, "reason": restored.reason,
                "miss": restored.miss.value if restored.miss is not None else None}

    def compile(self, dense_step: torch.nn.Module, device: torch.device, batch: Batch | None, *,
                compiled: torch.nn.Module | None = None) -> torch.nn.Module:
        """The dense step compiled with one forward and backward on `batch` (the fast batch
        or the first real one); nothing is updated: gradients are dropped.
        `compiled`: the step this process compiled before the run
        (warm_pool.py), taken as it is; its graphs are stored in the cache all the same when
        the archive missed."""
        if compiled is None and batch is None:
            raise ValueError("compile needs a batch, or the step this process compiled before")
        claim = None
        if compiled is None and self.missed is not None:
            # a live owner is waited for until it releases; the phase's watchdog bound is the last one
            claim, self.cold, self.cache_hit = turn_after_miss(self.cache, self.missed,
                                                               max_wait_s=self.config.compile_timeout_s)
        try:
            compiled = compiled if compiled is not None else compile_dense_step(dense_step, batch, self.config, device)
            if self.config.switches.compile_cache and not (self.cache_hit or self.stored) and self._saves():
                # Saved at once, before training: a rank killed early must still leave a warm
                # cache for its restart (a background save was seen cut short by such a kill).
                with self.rec.span("compile_cache_save") as attrs:
                    saved = self.cache.save()
                    attrs.update(bytes=saved.bytes, skipped=saved.skipped_reason)
        finally:
            if claim is not None:
                claim.release()  # saved, or the compile failed (then its waiters compile, each)
        return compiled

    def _saves(self) -> bool:
        """Every process that missed compiled the same graphs with the same key; one stores them:
        the claim's owner, else rank 0 where no owner was (no turn taken, or the owner left no
        archive). Never two at once: two saves racing can pair one's archive with the other's
        manifest (`archive.pack`), and every restore would refuse it."""
        if self.cold is None:
            return self.rank == 0
        return self.cold.claimed or (self.rank == 0 and self.cold.orphaned)

    def cold_attrs(self) -> dict[str, object]:
        """The pt2_compile stage's account of a miss's turn (nothing when the archive hit)."""
        return self.cold.to_attrs() if self.cold is not None else {}

    def report(self) -> CompileReport:
        return CompileReport(stats=self.cache.stats(), cache_hit=self.cache_hit)
