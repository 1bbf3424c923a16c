"""The compile cache of this process: one handle, because inductor's folders are process-wide.

`prepare_compile_env` must run before anything imports inductor or compiles (the actor's
constructor calls it): it points inductor at a fresh per-process folder, keys the archive by
model, shapes, device and threads, and pins the thread count. Later calls return the same
handle, so the rank's plugins restore into and save from the folders inductor really uses.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

import torch

from . import archive
from .cache import CompileCache
from .config import CompileCacheConfig

if TYPE_CHECKING:
    from ettflow.trainer.config import TrainerConfig

_CACHE: CompileCache | None = None  # one per process


def cache_config(config: TrainerConfig) -> CompileCacheConfig:
    """The compile cache's settings for a run: its key holds the model, the batch's shapes, the
    device and the thread count (every rank uses the same)."""
    shapes = {"batch_size": config.batch_size, "dense": len(config.schema.dense),
              "sparse": len(config.schema.sparse)}
    return CompileCacheConfig(
        root=config.compile_cache_dir, enabled=config.switches.compile_cache,
        model={"model": asdict(config.model), "shapes": shapes},
        device="cuda" if (config.device != "cpu" and torch.cuda.is_available()) else "cpu",
        threads=config.threads_per_rank,
        # uncompressed: a restart unpacks the 150 MB precompiled header in ~0.2 s instead of
        # ~0.7 s gunzipping it; the archive is ~170 MB per model and key
        codec="none", max_bytes=512 * 2**20,
    )


def prepare_compile_env(config: TrainerConfig) -> CompileCache:
    """The process's compile cache, its environment prepared on the first call."""
    global _CACHE
    if _CACHE is None:
        _CACHE = CompileCache(cache_config(config))
        _CACHE.prepare_env()
    return _CACHE


def has_archive(config: TrainerConfig) -> bool:
    """Whether a compile of `config` would find its archive (read by name only, from any
    process: nothing is prepared or unpacked)."""
    settings = cache_config(config)
    return settings.enabled and archive.find_archive(settings.root, CompileCache(settings).key) is not None
