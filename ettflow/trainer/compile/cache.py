"""The reusable PT2 compile cache: an archive restored before compiling and saved after.

    cache = CompileCache(CompileCacheConfig(root=cfg.compile_cache_dir, model=..., threads=1))
    cache.prepare_env()          # before torch compiles anything in this process
    restored = cache.restore()   # RestoreResult: hit or not, never raises on a bad archive
    ... compile, first steps ...
    saved = cache.save()         # SaveResult: written, or skipped with the reason
    cache.stats()                # CompileStats: cache hits/misses, recompiles

A failed restore or save never stops training: it is reported and the run compiles cold.

Dynamo's traced frame (`CompileCacheConfig.precompile`, on by default): with dynamo's caching
precompile on, a compile records the traced frame and its guards, `save` has torch write them
under inductor's folder (`inductor/dynamo/<source id>/entry`, archived with the rest), and a warm
process's `torch.compile` call loads them instead of tracing (the default model: 1.9-2.3 s ->
1.2-1.5 s warm, bit for bit the same loss and gradient; BENCHMARKS.md). torch checks the frame's
own and its inlined functions' sources; a frame that fails to load is logged and traced again,
and a compile that fails on one (torch lets some install errors escape) is tried once more
without it (`drop_stored_frames`).
Such a hit counts as `CompileStats.frames_loaded`, with no FX-graph or AOT hit and no compile.

Trust: inductor unpickles its cache entries, so an archive is restored only when the archive
root, the archive, its manifest and the working folder are owned by this user and not
writable by others (`trust.py`), and the archive matches its manifest's SHA-256 (`archive.verify`);
otherwise the restore is a miss (`RestoreMiss.UNTRUSTED` / `UNVERIFIED`), logged with the fix.

What a warm CPU restart needs (measured by leaving each out): the FX-graph and AOTAutograd
cache entries and the kernel libraries (`<xx>/<hash>.so`: without them all are rebuilt).
Sources (.cpp, .py, .h) and the PGO state are regenerated cheaply. A process with the archive
compiles without inductor's precompiled header (`env.skip_precompiled_headers`: ~150 MB that
only speeds up a cold compile, which each archive carried to every warm process). The mega-cache artifacts
(`torch.compiler.save_cache_artifacts`) duplicate the FX-graph/AOTAutograd/PGO entries;
they are stored too (`mega_cache=True`) so an archive from a torch that moved its folders
still yields cache hits, but alone they leave every C++ kernel to rebuild.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from . import archive, env, trust
from .config import CompileCacheConfig, cache_key, key_parts
from .stats import CompileStats, compile_stats, process_recompile_counter, read_counters

log = logging.getLogger(__name__)
LOCAL_CACHE_DIR = "compile-local"  # an untuned run's local cache when PyTorch's own cannot be trusted
BUILT_SUFFIXES = (".so", ".gch", ".pch", ".cubin", ".hsaco")


class RestoreMiss(Enum):
    """Why a restore did not load an archive."""

    DISABLED = "disabled"
    NO_ARCHIVE = "no_archive"
    UNTRUSTED = "untrusted"  # a folder or file not owned by this user, or writable by others
    UNVERIFIED = "unverified"  # no manifest, or the archive does not match it
    UNREADABLE = "unreadable"  # verified, but unpacking failed


@dataclass(frozen=True, kw_only=True)
class RestoreResult:
    hit: bool
    bytes: int = 0
    seconds: float = 0.0
    path: Path | None = None
    files: int = 0
    mega_cache: bool = False  # torch.compiler.load_cache_artifacts ran on stored artifacts
    miss: RestoreMiss | None = None  # None on a hit
    reason: str = ""  # why not a hit, for people (no archive, disabled, the error of a corrupt one)


@dataclass(frozen=True, kw_only=True)
class SaveResult:
    bytes: int = 0
    seconds: float = 0.0
    path: Path | None = None
    files: int = 0
    skipped_reason: str | None = None

    @property
    def saved(self) -> bool:
        return self.skipped_reason is None


class CompileCache:
    def __init__(self, config: CompileCacheConfig) -> None:
        self.config = config
        self.key_parts: dict[str, Any] = key_parts(config)
        self.key = cache_key(self.key_parts)
        self._owns_work_dir = config.work_dir is None
        self.work_dir: Path | None = config.work_dir  # type: ignore[assignment]
        self.env: dict[str, str] = {}
        self._restored: set[str] = set()
        self._restore_hit = False
        self._baseline: dict[str, int] = {}
        self._base_compiles = self._base_recompiles = 0

    @property
    def inductor_dir(self) -> Path:
        return self._require_env() / env.INDUCTOR_SUBDIR

    def prepare_env(self) -> dict[str, str]:
        """Point inductor's folders into this process's working folder, set the PGO job id and
        pin the thread count. Call before anything is compiled (raises CompileEnvError after)."""
        if not self.config.isolate and (local := _local_cache_env()) is not None:
            # a local cache kept across restarts, as an untuned job keeps PyTorch's own
            self.env = local
            env.pin_threads(self.config.threads)
            counter = process_recompile_counter()
            self._baseline = read_counters()
            self._base_compiles, self._base_recompiles = counter.compiles, counter.recompiles
            return dict(self.env)
        if self.work_dir is None:
            self.work_dir = env.make_work_dir()
            atexit.register(self.cleanup)  # a SIGKILLed rank's folder goes at the next start
        trust.make_private_dir(self.work_dir)
        self.env = env.redirect_compile_dirs(self.work_dir)
        env.pin_threads(self.config.threads)
        counter = process_recompile_counter()
        self._baseline = read_counters()
        self._base_compiles, self._base_recompiles = counter.compiles, counter.recompiles
        self._restored = set(self._built_files())
        self.apply_settings()
        return dict(self.env)

    def apply_settings(self) -> None:
        """Set the PGO job id and, with the archive, compile without the precompiled header (the key
        says so: config.PRECOMPILED_HEADERS; without the archive, torch's default). torch 2.13 keeps
        a config setting in a context variable: one made in another thread (the actor's start) is
        not seen by a compile in a rank's init thread, so every thread that may compile calls
        this first (`process_cache.apply_compile_settings`)."""
        env.set_job_id(f"ettflow-{self.key}")
        if self.config.enabled:
            env.skip_precompiled_headers()
            env.set_caching_precompile(self.config.precompile)

    def restore(self) -> RestoreResult:
        """Unpack this key's archive into the working folder if it can be trusted (see the module
        docstring); a miss (with its `RestoreMiss` and reason) otherwise, never an exception."""
        t0 = time.perf_counter()
        if not self.config.enabled:
            return RestoreResult(hit=False, miss=RestoreMiss.DISABLED, reason="compile cache disabled")
        work = self._require_env()
        root = self.config.root

        def miss(kind: RestoreMiss, reason: str, path: Path | None = None, size: int = 0) -> RestoreResult:
            if kind in (RestoreMiss.UNTRUSTED, RestoreMiss.UNVERIFIED, RestoreMiss.UNREADABLE):
                log.warning("compile cache: %s", reason)
            return RestoreResult(hit=False, bytes=size, seconds=time.perf_counter() - t0, path=path,
                                 miss=kind, reason=reason)

        if not self.config.enabled:
            return RestoreResult(hit=False, miss=RestoreMiss.DISABLED, reason="compile cache disabled")
        if root.is_dir() and (why := trust.first_untrusted(root, work)):
            return miss(RestoreMiss.UNTRUSTED, why)
        path = archive.find_archive(root, self.key)
        if path is None:
            return miss(RestoreMiss.NO_ARCHIVE, f"no archive for key {self.key} in {root}")
        manifest = archive.manifest_path(path)
        if why := trust.first_untrusted(path, *([manifest] if manifest.exists() else [])):
            return miss(RestoreMiss.UNTRUSTED, why, path)
        size = 0
        try:
            size = path.stat().st_size
            archive.verify(path)
        except (archive.ArchiveUnverified, OSError) as e:
            return miss(RestoreMiss.UNVERIFIED, f"{e}: not loaded, compiling cold; the next save replaces it",
                        path, size)
        try:
            files, mega = archive.unpack(path, work)
        except archive.UNPACK_ERRORS as e:
            self._reset_inductor_dir()
            return miss(RestoreMiss.UNREADABLE, f"archive {path} is unreadable ({type(e).__name__}: {e}); "
                        "ignored, compiling cold; the next save replaces it", path, size)
        loaded = self._load_mega_cache(mega)
        self._restored = set(self._built_files())
        self._restore_hit = True
        return RestoreResult(hit=True, bytes=size, seconds=time.perf_counter() - t0, path=path,
                             files=files, mega_cache=loaded)

    def save(self, *, force: bool = False) -> SaveResult:
        """Archive the working folder (+ the mega-cache artifacts) for this key. Skipped, with
        the reason, when disabled, when nothing was compiled, when a warm restart added
        nothing (unless `force`), or when the archive would pass max_bytes."""
        t0 = time.perf_counter()

        def skipped(reason: str) -> SaveResult:
            return SaveResult(seconds=time.perf_counter() - t0, skipped_reason=reason)

        if not self.config.enabled:
            return skipped("compile cache disabled")
        self._require_env()
        # torch writes dynamo's stored frames from save_cache_artifacts only where the setting is
        # on in the calling thread's context, which may not be the one that compiled
        self.apply_settings()
        if not (self.inductor_dir / "fxgraph").is_dir():
            return skipped("nothing compiled in this working folder yet: save after the first "
                           "compiled step")
        stats = self.stats()
        # a traced frame (a miss, a load error, or frames dropped then traced again) is stored anew
        traced = self.config.precompile and stats.frames_compiled > 0
        if not force and self._restore_hit and stats.fxgraph_miss == 0 and stats.aot_miss == 0 \
                and stats.built_objects == 0 and stats.frame_misses == stats.frame_load_errors == 0 \
                and not traced:
            return skipped("restored archive is up to date (no cache miss since restore)")
        mega = self._mega_cache_bytes() if self.config.mega_cache else None
        dest = archive.archive_path(self.config.root, self.key, self.config.codec)
        try:
            packed = archive.pack(self.inductor_dir, env.INDUCTOR_SUBDIR, dest,
                                  codec=self.config.codec,
                                  compresslevel=self.config.compresslevel,
                                  max_bytes=self.config.max_bytes, mega_cache=mega)
        except archive.ArchiveTooLarge as e:
            return skipped(f"archive too large ({e}): raise CompileCacheConfig.max_bytes or "
                           "use codec='gz'; the previous archive (if any) is kept")
        except OSError as e:
            return skipped(f"could not write {dest} ({e}): check free space and permissions "
                           f"of {self.config.root}")
        for other in archive.SUFFIX:  # drop an archive of this key in the other codec
            if (stale := archive.archive_path(self.config.root, self.key, other)) != dest:
                stale.unlink(missing_ok=True)
        archive.prune(self.config.root, keep=self.config.keep_archives, protect=dest)
        return SaveResult(bytes=packed.bytes, seconds=time.perf_counter() - t0, path=dest,
                          files=packed.files)

    def drop_stored_frames(self, error: BaseException) -> bool:
        """Remove dynamo's stored frames from the working folder and its code caches, after a
        compile that failed with `error` (`compiled.compile_dense_step`); False if there were none."""
        if not (self.config.enabled and self.config.precompile and self.work_dir is not None):
            return False
        frames = self.work_dir / env.INDUCTOR_SUBDIR / env.DYNAMO_SUBDIR
        if not frames.is_dir():
            return False
        log.warning("compile cache: the compile failed with dynamo's stored frame from the archive "
                    "(%s: %s); tracing again without it, and the save stores a new one",
                    type(error).__name__, str(error)[:300])
        shutil.rmtree(frames, ignore_errors=True)
        env.reset_code_caches()
        return True

    def stats(self) -> CompileStats:
        built = 0
        if self.work_dir is not None:
            built = len(set(self._built_files()) - self._restored)
        return compile_stats(self._baseline, process_recompile_counter(), built,
                             self._base_compiles, self._base_recompiles)

    def cleanup(self) -> None:
        """Remove the working folder if this cache made it (loaded kernels stay usable)."""
        if self._owns_work_dir and self.work_dir is not None:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    # -- internals -----------------------------------------------------------------------

    def _require_env(self) -> Path:
        if self.work_dir is None or not self.env:
            raise RuntimeError("CompileCache.prepare_env() must run first (before compiling)")
        return self.work_dir

    def _built_files(self) -> list[str]:
        root = self.work_dir / env.INDUCTOR_SUBDIR if self.work_dir else None
        if root is None or not root.is_dir():
            return []
        return [os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root)
                for f in fs if f.endswith(BUILT_SUFFIXES)]

    def _reset_inductor_dir(self) -> None:
        shutil.rmtree(self.inductor_dir, ignore_errors=True)
        trust.make_private_dir(self.inductor_dir)

    @staticmethod
    def _load_mega_cache(mega: bytes | None) -> bool:
        if not mega:
            return False
        try:
            return torch.compiler.load_cache_artifacts(mega) is not None
        except Exception as e:  # noqa: BLE001 - a stale or foreign blob: the folder alone still serves
            log.warning("compile cache: load_cache_artifacts failed (%s); using the folder", e)
            return False

    @staticmethod
    def _mega_cache_bytes() -> bytes | None:
        try:
            saved = torch.compiler.save_cache_artifacts()
        except Exception as e:  # noqa: BLE001 - whatever torch raises, archiving the folder still helps
            log.warning("compile cache: save_cache_artifacts failed (%s); archiving folder", e)
            return None
        return saved[0] if saved else None


def _local_cache_env() -> dict[str, str] | None:
    """Where an untuned run (`isolate=False`) keeps its local cache across restarts: PyTorch's own
    folder, as an untuned job does, unless another user could have written what inductor would
    unpickle from it (by default it is in the shared temp folder, where another user can make it
    first; a umask of 002 leaves it group-writable). Then this user's private folder
    `<data_home>/compile-local` (kept across restarts all the same), and if even that cannot be
    trusted, None: the process compiles in a private folder of its own, cold."""
    default = env.default_inductor_dir()  # torch makes it when missing
    refused = trust.first_untrusted(Path(default))
    if refused is None:
        return {"TORCHINDUCTOR_CACHE_DIR": default}
    from ettflow.paths import data_home

    own = data_home() / LOCAL_CACHE_DIR
    try:
        trust.make_private_dir(own)
        why = trust.first_untrusted(own)
    except OSError as e:
        why = f"{own} cannot be made ({type(e).__name__}: {e})"
    if why is None:
        log.warning("%s; this user's private local cache %s is used instead (kept across restarts)", refused, own)
        return env.redirect_compile_dirs(own)
    log.warning("%s, and %s; compiling in a private folder of this process instead (cold)", refused, why)
    return None
