"""The compile cache of this process: one handle, because inductor's folders are process-wide.

`prepare_compile_env` must run before anything imports inductor or compiles (the actor's
constructor calls it): it points inductor at a fresh per-process folder, keys the archive by
model, shapes, device and threads, and pins the thread count. Later calls return the same
handle, so the rank's compile plugin (`rank/compile_plugin.py`) restores into and saves from the
folders inductor really uses.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING

from . import archive
from .config import CompileCacheConfig, cache_key, key_parts

if TYPE_CHECKING:
    from ettflow.trainer.config import TrainerConfig

    from .cache import CompileCache

_CACHE: CompileCache | None = None  # one per process


def cache_config(config: TrainerConfig) -> CompileCacheConfig:
    """The compile cache's settings for a run: its key holds the model, the batch's shapes, the
    device and the thread count (every rank uses the same)."""
    shapes = {"batch_size": config.batch_size, "dense": len(config.schema.dense),
              "sparse": len(config.schema.sparse)}
    return CompileCacheConfig(
        root=config.compile_cache_dir, enabled=config.switches.compile_cache,
        isolate=config.switches.compile_cache or not config.switches.local_inductor_cache,
        model={"model": asdict(config.model), "shapes": shapes},
        device=_device(config.device),
        threads=config.threads_per_rank,
        # uncompressed: the default DLRM's CPU archive is ~2 MB (kernel libraries, cache entries;
        # no precompiled header, env.py), which a restart unpacks faster than it would gunzip
        codec="none", max_bytes=512 * 2**20,
    )


def _device(device: str) -> str:
    """The key's device: CUDA only where the process sees one. A process that has not imported
    torch (a flow run's driver: `has_archive` only decides when a spare prewarms) asks the
    NVIDIA driver instead of paying torch's import; a rank has torch imported and asks it."""
    if device == "cpu":
        return "cpu"
    torch = sys.modules.get("torch")
    if torch is None:
        return "cuda" if os.path.exists("/proc/driver/nvidia/version") else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def prepare_compile_env(config: TrainerConfig) -> CompileCache:
    """The process's compile cache, its environment prepared on the first call. A later call for
    another key (another model, shape, device or thread count) raises CompileEnvError: inductor's
    folders are fixed by then, and dynamo's stored frames drop the identity guards that would tell
    two models of the same shapes apart (config.py), so one process compiles for one key."""
    from .cache import CompileCache
    from .env import CompileEnvError

    global _CACHE
    settings = cache_config(config)
    if _CACHE is None:
        _CACHE = CompileCache(settings)
        _CACHE.prepare_env()
    elif settings.enabled and _CACHE.config.enabled and (key := cache_key(key_parts(settings))) != _CACHE.key:
        raise CompileEnvError(
            f"this process's compile cache is keyed {_CACHE.key} ({_CACHE.config.model}); a compile "
            f"for key {key} ({settings.model}) cannot share its process: compile another model in a "
            "process of its own (a new trainer actor)")
    return _CACHE


def apply_compile_settings(config: TrainerConfig) -> None:
    """The process's compile settings, applied in the calling thread: torch 2.13 keeps a config
    setting per context (thread), so every thread that may compile calls this first: the one that
    compiles the step (`compiled.compile_dense_step`), and the one that trains with it, where dynamo
    recompiles by itself on a guard failure (`rank/loop.py`). With the compile cache off, nothing
    (torch's defaults, as an untuned job has them). The ISA check is made on the first call in the
    process (`vec_isa.py`): the training thread's call comes after the compile's and is cheap."""
    if not config.switches.compile_cache:
        return
    from .vec_isa import settle_for

    prepare_compile_env(config).apply_settings()
    settle_for(config.compile_cache_dir)


def drop_stored_frames(config: TrainerConfig, error: BaseException) -> bool:
    """After a compile failed with `error`: when this process's compile cache gave dynamo stored
    frames (`CompileCache.drop_stored_frames`), remove them and dynamo's in-memory code caches, so that a
    second try traces and a save stores new frames; True if it did (a warning says so), False
    when there were none (the error is the compile's own)."""
    if _CACHE is None or not config.switches.compile_cache:
        return False
    return _CACHE.drop_stored_frames(error)


def has_archive(config: TrainerConfig) -> bool:
    """Whether a compile of `config` would find its archive (read by name only, from any
    process: nothing is prepared or unpacked)."""
    settings = cache_config(config)
    return settings.enabled and archive.find_archive(settings.root, cache_key(key_parts(settings))) is not None
