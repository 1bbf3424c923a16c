"""The PT2 compile cache of the trainer: restore an archive before compiling, save it after.

See `cache.py` for the flow and `env.py` for what a warm restart needs on disk.
"""

from ettflow.lazy import lazy_getattr

# Names resolve on first use (PEP 562): the compile's values (stats) cross into processes that
# never compile (a flow's), and must not import torch there.
_WHERE = {
    "CompileCache": "ettflow.trainer.compile.cache",
    "CompileCacheConfig": "ettflow.trainer.compile.config",
    "CompileEnvError": "ettflow.trainer.compile.env",
    "CompileStats": "ettflow.trainer.compile.stats",
    "RecompileCounter": "ettflow.trainer.compile.stats",
    "RestoreMiss": "ettflow.trainer.compile.cache",
    "RestoreResult": "ettflow.trainer.compile.cache",
    "SaveResult": "ettflow.trainer.compile.cache",
    "cache_key": "ettflow.trainer.compile.config",
    "compile_module": "ettflow.trainer.compile.compiled",
    "key_parts": "ettflow.trainer.compile.config",
    "process_recompile_counter": "ettflow.trainer.compile.stats",
}


__getattr__ = lazy_getattr(__name__, globals(), _WHERE)


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
