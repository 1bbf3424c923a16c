"""A warm spare: a trainer process prepared ahead of time to take a failed rank's place.

`prewarm` does, before any failure, everything of a rank's start that needs no rank, no process
group and no data: the imports (torch, TorchRec, inductor), the device, the dense modules and
their optimizer, and the compiled dense step (its graphs from the compile-cache archive when
the run has one, one forward and backward on a synthetic batch, nothing updated). It also reads
and checks the footers of the run's data files (schema.py keeps them per process), so the data
index a rank builds when it joins costs a stat per file (0.9-1.9 s of a 141-window recovery). What it
builds is a `WarmSpare`; `TrainerSession.join` turns it into a rank (live_recovery.py). The
sharded embedding collection is not built here: it needs the new process group.

Only where a spare holds no accelerator: on a CPU host here. On a GPU node the failed rank's
place is taken by a new actor in the freed bundle (ray_group.py), which starts the slower way.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from ettflow.trainer.compile.archive import ArchiveUnverified, find_archive, verify
from ettflow.trainer.compile.cache import CompileCache, RestoreMiss
from ettflow.trainer.compile.cold_claim import turn_after_miss
from ettflow.trainer.compile.compiled import compile_dense_step
from ettflow.trainer.compile.process_cache import prepare_compile_env
from ettflow.trainer.config import TrainerConfig
from ettflow.trainer.data.batch import synthetic_batch
from ettflow.trainer.data.schema import DataError
from ettflow.trainer.data.windows import StreamIndex
from ettflow.trainer.model import DenseStep, build_dlrm
from ettflow.trainer.protocol import PrewarmTimings, Repair

log = logging.getLogger("ettflow.trainer")


@dataclass(eq=False)
class WarmSpare:
    """What a spare prepared: `dense_step` holds the dense modules the rank will train,
    `dense_opt` their optimizer, `compiled_step` the compiled `dense_step` (None: eager)."""

    device: torch.device
    dense_step: DenseStep
    dense_opt: torch.optim.Optimizer
    compiled_step: nn.Module | None
    timings: PrewarmTimings


def prewarm(config: TrainerConfig, device: torch.device) -> WarmSpare:
    """Build and compile a rank's dense part for `config` on `device` (see the module docstring)."""
    t0 = time.time()
    import pyarrow.dataset  # noqa: F401 - the rank's first Parquet read imports it (and pandas): not on the recovery

    torch.set_num_threads(config.threads_per_rank)
    dlrm = build_dlrm(config.model, config.schema, device=device)
    dense_step = DenseStep(dlrm)
    dense_opt = torch.optim.Adam(list(dense_step.parameters()), lr=config.model.dense_lr)
    built = time.time()
    compiled = None
    cache_hit, refused, repair, stored = None, None, None, False
    if config.switches.compile:
        claim = turn = None
        if config.switches.compile_cache:
            cache = prepare_compile_env(config)
            restored = cache.restore()
            cache_hit = restored.hit
            refused = restored if restored.miss in REPAIRABLE else None
            if not cache_hit:  # the pool's workers prewarm at once: one compiles cold (cold_claim.py)
                claim, turn, cache_hit = turn_after_miss(cache, restored, max_wait_s=config.compile_timeout_s)
        try:
            compiled = compile_dense_step(dense_step, synthetic_batch(config.schema, config.batch_size), config,
                                          device)
            if refused is not None:  # met the damage
                repair = repair_after(cache, restored_since=bool(cache_hit))
                stored = repair in (Repair.REPLACED, Repair.REPLACED_BY_ANOTHER)
            elif turn is not None and turn.claimed:  # the waiters restore what it saves
                stored = cache.save().saved
        finally:
            if claim is not None:
                claim.release()
    compiled_at = time.time()
    read_footers(config)
    return WarmSpare(device=device, dense_step=dense_step, dense_opt=dense_opt, compiled_step=compiled,
                     timings=PrewarmTimings(build_s=built - t0, compile_s=compiled_at - built, cache_hit=cache_hit,
                                            footers_s=time.time() - compiled_at,
                                            cache_miss=refused.miss.value if refused is not None else None,
                                            cache_reason=refused.reason if refused is not None else "",
                                            cache_repair=repair.value if repair is not None else None,
                                            cache_stored=stored))


# a damaged archive this process can replace with what it compiled (an untrusted one is left:
# the folder or file is not this user's to overwrite)
REPAIRABLE = (RestoreMiss.UNVERIFIED, RestoreMiss.UNREADABLE)


def repair_after(cache: CompileCache, *, restored_since: bool) -> Repair:
    """What became of the damaged archive this prewarm refused: another process saved one since
    and this one restored it (its turn at the cold compile, `cold_claim.py`: nothing to replace),
    or this one compiled cold and replaces it (`_repair`)."""
    return Repair.RESTORED_REPLACEMENT if restored_since else _repair(cache)


def _repair(cache: CompileCache) -> Repair:
    """Replace the damaged archive with this process's cold compile, unless another worker
    of the pool did since (a prewarmed worker is never rank 0 of a run yet, and rank 0's save
    was the only repair: every prewarm compiled cold until one became rank 0, issue 42 #4)."""
    path = find_archive(cache.config.root, cache.key)
    if path is not None:
        try:
            verify(path)
            return Repair.REPLACED_BY_ANOTHER  # meanwhile
        except (ArchiveUnverified, OSError):
            pass
    saved = cache.save(force=True)
    if saved.saved:
        log.warning("compile cache: the damaged archive was replaced by this pooled worker's cold compile (%s)",
                    saved.path)
        return Repair.REPLACED
    log.warning("compile cache: the damaged archive could not be replaced: %s", saved.skipped_reason)
    return Repair.NOT_REPLACED


def read_footers(config: TrainerConfig) -> None:
    """Check the footers of the run's training and evaluation windows (kept per process). A root
    that cannot be read is left to the rank's own start, which names the problem."""
    chosen = [config.windows] + ([config.eval_windows] if config.eval_windows is not None else [])
    for windows in chosen:  # (None: every window, the held-out one included)
        try:
            StreamIndex(config.data_root, config.schema, windows)
        except (DataError, OSError) as exc:
            log.debug("spare: the data footers of %s were not read ahead (%s)", config.data_root, exc)
            return
