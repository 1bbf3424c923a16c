"""What the compile cache is keyed by, where it lives, and how big an archive may get.

The key names everything a compiled graph depends on that the caches inside the archive do
not check for us cheaply: the model config (with the fixed shapes), torch and Python versions,
the device (type and CUDA capability) and the intra-op thread count (inductor's CPU kernels
specialize on it). The caches inside are content-addressed, so a key that misses a
dependency never makes them wrong, only slower: the stale entries just miss. Dynamo's stored
frame (`precompile`) is the exception: it checks its own source and its inlined functions'
sources, but it drops its identity guards (which `torch.cat`, which activation module), so the
key must pin what those guards checked: the torch version and the model config do.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .vec_isa import ISA_CHECK

ARCHIVE_FORMAT = 1  # bump when the archive layout changes: old archives then just miss
# inductor's precompiled header in a process with the archive: off (env.skip_precompiled_headers).
# The switch is part of inductor's own FX-graph key, so it is part of the archive's: an archive
# compiled with the header (~150 MB of it) would mostly miss in a process without it
PRECOMPILED_HEADERS = "off"
CODECS = ("gz", "none")


@dataclass(frozen=True, kw_only=True)
class CompileCacheConfig:
    """Where archives live (`root`, beside the checkpoints, shared by attempts and runs) and
    what keys them. `work_dir` is this process's inductor working folder; None makes a fresh
    temporary one (local disk), which `CompileCache.cleanup` removes.

    `isolate`: point inductor's folders at that fresh per-process folder. With the archive
    (`enabled`) it always is. Without it, `isolate=True` makes every compile truly cold (a
    restart on a fresh host, the study's fleet), `isolate=False` leaves PyTorch's own local
    cache (`/tmp/torchinductor_<user>`, which outlives processes: an untuned job restarting on
    the same host compiles partly warm without any archive); call `prepare_env` either way."""

    root: str | Path
    enabled: bool = True
    max_bytes: int = 256 * 2**20  # archive bound (as stored); the default DLRM's CPU archive is ~2 MB
    model: Mapping[str, Any] = field(default_factory=dict)  # model config + fixed shapes
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    threads: int = 1  # torch intra-op threads, pinned by prepare_env: the same on every rank
    codec: str = "gz"
    compresslevel: int = 1  # gzip's level for codec "gz"
    mega_cache: bool = True  # also store torch.compiler.save_cache_artifacts() (see cache.py)
    # dynamo's caching precompile (`torch._dynamo.config.caching_precompile`, cache.py says what it
    # stores): a warm process loads the traced frame and its guards instead of tracing it again.
    # torch writes the frame from `save_cache_artifacts`, so it needs `mega_cache`
    precompile: bool = True
    keep_archives: int = 4  # archives of other keys kept in root (oldest removed first)
    work_dir: str | Path | None = None
    isolate: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))
        if self.enabled and not self.isolate:
            raise ValueError("CompileCacheConfig: the archive (enabled=True) restores into and saves from an "
                             "isolated folder; isolate=False is for a run without it")
        if self.work_dir is not None:
            object.__setattr__(self, "work_dir", Path(self.work_dir))
        object.__setattr__(self, "model", dict(self.model))
        if self.max_bytes <= 0:
            raise ValueError(
                f"CompileCacheConfig.max_bytes must be > 0, got {self.max_bytes}; "
                "to turn the cache off set enabled=False"
            )
        if self.threads < 1:
            raise ValueError(f"CompileCacheConfig.threads must be >= 1, got {self.threads}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(
                f"CompileCacheConfig.device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}"
            )
        if self.codec not in CODECS:
            raise ValueError(
                f"CompileCacheConfig.codec must be one of {CODECS}, got {self.codec!r}"
            )
        if not 0 <= self.compresslevel <= 9:
            raise ValueError(f"compresslevel must be in 0..9 (gzip), got {self.compresslevel}")
        if self.precompile and self.enabled and not self.mega_cache:
            raise ValueError("CompileCacheConfig: precompile=True stores dynamo's traced frames through "
                             "torch.compiler.save_cache_artifacts; set mega_cache=True, or precompile=False")
        if self.keep_archives < 1:
            raise ValueError(f"keep_archives must be >= 1, got {self.keep_archives}")
        try:
            json.dumps(self.model, sort_keys=True)
        except TypeError as e:
            raise ValueError(
                f"CompileCacheConfig.model must be JSON-able (pass dataclasses.asdict of the "
                f"model config and plain shapes): {e}"
            ) from None


def device_tag(device: str) -> str:
    """'cpu' or 'cuda-sm90-cu12.8-NVIDIA H100 80GB HBM3' (capability, CUDA and model of the given or
    current CUDA device). The model too: dynamo's stored frame is refused on another GPU model of
    the same capability (torch's SystemInfo check), and two models sharing a key would replace
    each other's archive at every run."""
    if device == "cpu":
        return "cpu"
    import torch

    index = int(device.split(":", 1)[1]) if ":" in device else None
    major, minor = torch.cuda.get_device_capability(index)
    return f"cuda-sm{major}{minor}-cu{torch.version.cuda}-{torch.cuda.get_device_name(index)}"


def torch_version() -> str:
    """torch's version, read from its installed metadata where torch is not imported yet: a
    flow run's driver computes the cache key without paying torch's import (~1.2 s here).
    The two agree (a unit test checks it); an imported torch is what really runs."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return str(torch.__version__)
    from importlib.metadata import version

    return version("torch")


def key_parts(config: CompileCacheConfig) -> dict[str, Any]:
    return {
        "format": ARCHIVE_FORMAT,
        "model": config.model,
        "torch": torch_version(),
        "device": device_tag(config.device),
        "threads": config.threads,
        "python": ".".join(map(str, sys.version_info[:3])),
        "machine": platform.machine(),
        "cpu_isa_check": ISA_CHECK,  # inductor's ISA switch, part of its own key (vec_isa.py)
        "cpp_precompiled_headers": PRECOMPILED_HEADERS,
        # on, the AOT cache entries are bundled and dynamo drops its identity guards (cache.py)
        "dynamo_precompile": config.precompile and config.enabled,
    }


def cache_key(parts: Mapping[str, Any]) -> str:
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:24]
