"""What the compiler did in this process: cache hits and misses, frames, recompiles.

torch keeps no recompile counter: `counters["stats"]["unique_graphs"]` also grows with graph
breaks, and `counters["frames"]["ok"]` with every first compile. A recompile is a Dynamo
compile of a frame that already has a compiled entry: its CompileId reads `frame/n` with
n > 0. `RecompileCounter` counts those from Dynamo's compile-start callback.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from typing import Any


def _compat():
    """torch's internals (`_torch_compat`), imported when a compile is watched: the stats'
    values travel to processes (a flow's) that never import torch."""
    from ettflow.trainer import _torch_compat

    return _torch_compat


COUNTERS = {  # stats field -> (torch counter group, name)
    "fxgraph_hit": ("inductor", "fxgraph_cache_hit"),
    "fxgraph_miss": ("inductor", "fxgraph_cache_miss"),
    "fxgraph_bypass": ("inductor", "fxgraph_cache_bypass"),
    "aot_hit": ("aot_autograd", "autograd_cache_hit"),
    "aot_miss": ("aot_autograd", "autograd_cache_miss"),
    "aot_bypass": ("aot_autograd", "autograd_cache_bypass"),
    "frames_compiled": ("frames", "ok"),
    # dynamo's stored frames (caching precompile, cache.py): loaded, not stored, stored but unloadable
    "frames_loaded": ("dynamo_cache", "dynamo_cache_hit"),
    "frame_misses": ("dynamo_cache", "dynamo_cache_miss"),
    "frame_load_errors": ("dynamo_cache", "dynamo_cache_error"),
    "unique_graphs": ("stats", "unique_graphs"),
}


def read_counters() -> dict[str, int]:
    counters = _compat().dynamo_counters()
    out = {name: int(counters[group][key]) for name, (group, key) in COUNTERS.items()}
    out["graph_breaks"] = int(sum(counters["graph_break"].values()))  # keyed by reason
    return out


class RecompileCounter:
    """Counts Dynamo compiles and recompiles. Install once per process, before compiling;
    `torch.compiler.reset()` drops the callback (call `install()` again after it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.compiles = 0
        self.recompiles = 0
        self.recompiled_ids: list[str] = []

    def _on_start(self, args: Any) -> None:
        compile_id = _compat().dynamo_compile_id(args)
        if compile_id is None:
            return
        recompile = _compat().frame_compile_index(compile_id) > 0
        with self._lock:
            self.compiles += 1
            if recompile:
                self.recompiles += 1
                self.recompiled_ids.append(compile_id)

    def install(self) -> RecompileCounter:
        _compat().add_compile_start_callback(self._on_start)
        return self

    def uninstall(self) -> None:
        _compat().remove_compile_start_callback(self._on_start)


_process_counter: RecompileCounter | None = None


def process_recompile_counter() -> RecompileCounter:
    """The process-wide counter (installed on first use)."""
    global _process_counter
    if _process_counter is None:
        _process_counter = RecompileCounter()
    return _process_counter.install()


def recompile_reasons(limit: int = 8) -> tuple[str, ...]:
    """Best effort: the reasons Dynamo recorded for its latest recompiles."""
    reasons = _compat().recorded_recompile_reasons()
    return tuple(r[:300] for r in reasons[-limit:])


@dataclass(frozen=True, kw_only=True)
class CompileStats:
    """Counts since `CompileCache.prepare_env` (or process start). `built_objects`: kernel
    libraries and precompiled headers built in this process instead of restored (0 on a
    truly warm restart; a counter hit alone does not show a header rebuilt). `frames_loaded`:
    dynamo's stored frames loaded instead of traced (caching precompile, `cache.py`); such a
    frame is not compiled (`frames_compiled`, `compiles`) and shows no FX-graph or AOT hit."""

    fxgraph_hit: int = 0
    fxgraph_miss: int = 0
    fxgraph_bypass: int = 0
    aot_hit: int = 0
    aot_miss: int = 0
    aot_bypass: int = 0
    frames_compiled: int = 0
    frames_loaded: int = 0
    frame_misses: int = 0
    frame_load_errors: int = 0
    unique_graphs: int = 0
    graph_breaks: int = 0
    compiles: int = 0
    recompiles: int = 0
    recompile_reasons: tuple[str, ...] = field(default_factory=tuple)
    built_objects: int = 0

    @property
    def warm(self) -> bool:
        """Everything came from the cache: hits (FX graphs, or dynamo's stored frames, none traced:
        torch counts a frame loaded before it checks the frame's sources, and traces a rejected
        one), no misses of either, nothing rebuilt, no recompiles."""
        loaded = self.frames_loaded > 0 and self.frames_compiled == 0
        return ((self.fxgraph_hit > 0 or loaded) and self.fxgraph_miss == 0
                and self.aot_miss == 0 and self.frame_misses == 0 and self.frame_load_errors == 0
                and self.built_objects == 0 and self.recompiles == 0)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "recompile_reasons": list(self.recompile_reasons),
                "warm": self.warm}


def compile_stats(baseline: dict[str, int], recompiles: RecompileCounter,
                  built_objects: int, base_compiles: int = 0,
                  base_recompiles: int = 0) -> CompileStats:
    now = read_counters()
    delta = {k: now[k] - baseline.get(k, 0) for k in now}
    n_recompiles = recompiles.recompiles - base_recompiles
    return CompileStats(
        **delta,
        compiles=recompiles.compiles - base_compiles,
        recompiles=n_recompiles,
        recompile_reasons=recompile_reasons() if n_recompiles else (),
        built_objects=built_objects,
    )
