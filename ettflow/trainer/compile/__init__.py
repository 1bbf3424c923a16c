"""The PT2 compile cache of the trainer: restore an archive before compiling, save it after.

See `cache.py` for the flow and `env.py` for what a warm restart needs on disk.
"""

from .cache import CompileCache, RestoreMiss, RestoreResult, SaveResult
from .compiled import compile_module
from .config import CompileCacheConfig, cache_key, key_parts
from .env import CompileEnvError
from .stats import CompileStats, RecompileCounter, process_recompile_counter

__all__ = [
    "CompileCache",
    "CompileCacheConfig",
    "CompileEnvError",
    "CompileStats",
    "RecompileCounter",
    "RestoreMiss",
    "RestoreResult",
    "SaveResult",
    "cache_key",
    "compile_module",
    "key_parts",
    "process_recompile_counter",
]
