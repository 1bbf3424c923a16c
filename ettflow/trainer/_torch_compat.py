"""The one wall between ettflow and torch's internals: every private torch API the project uses.

Each function below names the internal it relies on in its docstring. When a torch upgrade
removes or renames one, the function raises `TorchCompatError` naming the internal, what stops
working and the torch version, instead of silently losing a feature (a warm restart that
rebuilds its precompiled header, a recompile count that stays 0). `check_all()` probes every
internal without changing any state; tests/test_torch_compat.py calls it, so an upgrade fails
loudly in the test suite first.

Internals in use (see `INTERNALS`):

- inductor: `codecache._HEADER_DIR` / `_HEADER_LOCK_DIR` / `_precompile_header` (the
  precompiled header's folder, redirected into the compile cache) and
  `async_compile._pool_set` (whether compile workers already started);
- dynamo: `utils.counters`, `utils.get_compilation_metrics`, `callback_handler`,
  `callback.CallbackTrigger` / `CallbackArgs` and `torch._guards.CompileId` (cache hit and
  recompile statistics);
- inductor's CPU ISA check: `cpu_vec_isa.x86_isa_checker` / `supported_vec_isa_list` /
  `valid_vec_isa_list`, `config.cpp.vec_isa_ok` and `cpp_builder.get_cpp_compiler` (the check
  made once per host, `compile/vec_isa.py`);
- sharded tensors (TorchRec's default state): the module `torch.distributed._shard.sharded_tensor`,
  `ShardedTensor._init_from_local_shards_and_global_metadata`, `ShardedTensor._process_group`
  and `torch.distributed.remote_device._remote_device` (host staging for async checkpoints).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FIX = ("install the torch version this ettflow was tested with (see pyproject.toml), or port "
       "ettflow/trainer/_torch_compat.py to this torch (tests/test_torch_compat.py lists every internal)")


@dataclass(frozen=True, kw_only=True)
class Internal:
    """One torch internal: an attribute path (`attr`, dotted, "" for the module itself) inside
    `module`, and what stops working without it (`consequence`)."""

    module: str
    attr: str = ""
    consequence: str

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attr}" if self.attr else self.module

    def resolve(self) -> Any:
        """The object, imported and looked up; TorchCompatError when torch has no such thing."""
        try:
            obj: Any = importlib.import_module(self.module)
            for part in self.attr.split(".") if self.attr else ():
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise TorchCompatError(self) from e
        return obj


class TorchCompatError(RuntimeError):
    """A torch internal ettflow relies on is missing in the installed torch."""

    def __init__(self, internal: Internal) -> None:
        self.internal = internal.name
        self.torch_version = torch.__version__
        super().__init__(f"torch {self.torch_version} has no {internal.name}: {internal.consequence}; {FIX}")


_CODECACHE = "torch._inductor.codecache"
_SHARDED = "torch.distributed._shard.sharded_tensor"
_WARM_HEADER = ("the compile cache cannot redirect the precompiled header into its working folder, so "
                "warm restarts rebuild it (~10 s on CPU)")
_RECOMPILES = "compile statistics cannot count Dynamo compiles and recompiles"
_STAGING = "async checkpoints cannot stage TorchRec ShardedTensors into host memory"

HEADER_DIR = Internal(module=_CODECACHE, attr="_HEADER_DIR", consequence=_WARM_HEADER)
HEADER_LOCK_DIR = Internal(module=_CODECACHE, attr="_HEADER_LOCK_DIR", consequence=_WARM_HEADER)
PRECOMPILE_HEADER = Internal(module=_CODECACHE, attr="_precompile_header.cache_clear", consequence=_WARM_HEADER)
POOL_SET = Internal(module="torch._inductor.async_compile", attr="_pool_set",
                    consequence="the compile cache cannot tell whether inductor's compile workers "
                                "(which keep the environment they started with) are already running")
COUNTERS = Internal(module="torch._dynamo.utils", attr="counters",
                    consequence="compile statistics (cache hits and misses, frames, graph breaks) cannot be read")
COMPILATION_METRICS = Internal(module="torch._dynamo.utils", attr="get_compilation_metrics",
                               consequence="compile statistics cannot report why a frame recompiled")
CALLBACK_HANDLER = Internal(module="torch._dynamo", attr="callback_handler", consequence=_RECOMPILES)
REGISTER_START = Internal(module="torch._dynamo", attr="callback_handler.register_start_callback",
                          consequence=_RECOMPILES)
REMOVE_START = Internal(module="torch._dynamo", attr="callback_handler.remove_start_callback",
                        consequence=_RECOMPILES)
START_CALLBACKS = Internal(module="torch._dynamo", attr="callback_handler.start_callbacks",
                           consequence=_RECOMPILES)
CALLBACK_ARGS = Internal(module="torch._dynamo.callback", attr="CallbackArgs", consequence=_RECOMPILES)
TRIGGER_DYNAMO = Internal(module="torch._dynamo.callback", attr="CallbackTrigger.DYNAMO", consequence=_RECOMPILES)
COMPILE_ID = Internal(module="torch._guards", attr="CompileId.from_string", consequence=_RECOMPILES)
SHARD = Internal(module=_SHARDED, attr="Shard", consequence=_STAGING)
SHARDED_TENSOR = Internal(module=_SHARDED, attr="ShardedTensor", consequence=_STAGING)
INIT_FROM_LOCAL = Internal(module=_SHARDED, attr="ShardedTensor._init_from_local_shards_and_global_metadata",
                           consequence=_STAGING)
PROCESS_GROUP = Internal(module=_SHARDED, attr="ShardedTensor._process_group", consequence=_STAGING)
REMOTE_DEVICE = Internal(module="torch.distributed.remote_device", attr="_remote_device", consequence=_STAGING)
_ISA = ("every compiling process runs inductor's CPU ISA check again (a test library built and loaded per "
        "ISA: ~1.1 s of a warm compile, ~8 s of a cold one here) instead of once per host (compile/vec_isa.py)")
_VEC_ISA = "torch._inductor.cpu_vec_isa"
ISA_FLAGS = Internal(module=_VEC_ISA, attr="x86_isa_checker", consequence=_ISA)
ISA_LIST = Internal(module=_VEC_ISA, attr="supported_vec_isa_list", consequence=_ISA)
ISA_VALID = Internal(module=_VEC_ISA, attr="valid_vec_isa_list", consequence=_ISA)
ISA_OK = Internal(module="torch._inductor.config", attr="cpp.vec_isa_ok", consequence=_ISA)
CPP_COMPILER = Internal(module="torch._inductor.cpp_builder", attr="get_cpp_compiler", consequence=_ISA)
PRECOMPILE_HEADERS = Internal(
    module="torch._inductor.config", attr="cpp_cache_precompile_headers",
    consequence="a compile-cache archive would carry inductor's ~150 MB precompiled header, and every warm "
                "process would preprocess that header again before loading its first kernel (compile/env.py)")
CACHING_PRECOMPILE = Internal(
    module="torch._dynamo.config", attr="caching_precompile",
    consequence="a warm process traces the dense step again instead of loading dynamo's stored frame "
                "(compile/cache.py)")
RESET_CODE_CACHES = Internal(
    module="torch._dynamo", attr="reset_code_caches",
    consequence="a compile that failed on dynamo's stored frame cannot be tried again without it (compile/compiled.py)")
CACHE_DIR = Internal(module="torch._inductor.runtime.cache_dir_utils", attr="cache_dir",
                    consequence="a run without the compile cache cannot name PyTorch's local inductor cache folder")
# TorchRec (same rule: a private name it could rename in any release)
COLLECTIVE_VALIDATION = Internal(
    module="torchrec.distributed.collective_utils", attr="_INITIALIZED",
    consequence="live recovery cannot rebuild the sharded module on a new process group in a process that built "
                "one before (its DistributedModelParallel would skip a broadcast the joining spare makes)")

INTERNALS: tuple[Internal, ...] = (
    HEADER_DIR, HEADER_LOCK_DIR, PRECOMPILE_HEADER, POOL_SET, COUNTERS, COMPILATION_METRICS,
    CALLBACK_HANDLER, REGISTER_START, REMOVE_START, START_CALLBACKS, CALLBACK_ARGS, TRIGGER_DYNAMO,
    COMPILE_ID, SHARD, SHARDED_TENSOR, INIT_FROM_LOCAL, PROCESS_GROUP, REMOTE_DEVICE, COLLECTIVE_VALIDATION,
    CACHE_DIR, ISA_FLAGS, ISA_LIST, ISA_VALID, ISA_OK, CPP_COMPILER, PRECOMPILE_HEADERS, CACHING_PRECOMPILE,
    RESET_CODE_CACHES,
)


def _probe(internal: Internal) -> None:
    """Raise TorchCompatError if `internal` is missing; looks only, changes nothing."""
    if internal is PROCESS_GROUP:  # an instance attribute: ShardedTensor sets it in _prepare_init
        cls = SHARDED_TENSOR.resolve()
        try:
            source = inspect.getsource(cls._prepare_init)
        except (AttributeError, OSError, TypeError) as e:
            raise TorchCompatError(internal) from e
        if "self._process_group =" not in source:
            raise TorchCompatError(internal)
        return
    if internal is CALLBACK_ARGS:
        fields = {f.name for f in dataclasses.fields(internal.resolve())}
        if not {"callback_trigger", "compile_id"} <= fields:
            raise TorchCompatError(internal)
        return
    internal.resolve()


def check_all() -> list[str]:
    """The message of every internal the installed torch lacks (empty when all are there).
    Imports the modules they live in; sets, clears and starts nothing."""
    missing = []
    for internal in INTERNALS:
        try:
            _probe(internal)
        except TorchCompatError as e:
            missing.append(str(e))
    return missing


# -- torchrec ---------------------------------------------------------------------------------


def forget_dmp_initialization() -> None:
    """Let the next DistributedModelParallel of this process initialize as in a fresh one.

    TorchRec broadcasts its collective-validation flag from rank 0 once per process
    (`collective_utils.init_collective_validation`, guarded by `_INITIALIZED`); a rank that
    rebuilds its DMP on a new process group with a new peer (live recovery) must take part in
    that broadcast again, as the peer does. Relies on `torchrec.distributed.collective_utils.
    _INITIALIZED` (module level)."""
    module = importlib.import_module(COLLECTIVE_VALIDATION.module)
    if not hasattr(module, COLLECTIVE_VALIDATION.attr):
        raise TorchCompatError(COLLECTIVE_VALIDATION)
    setattr(module, COLLECTIVE_VALIDATION.attr, False)


# -- inductor ---------------------------------------------------------------------------------


def redirect_precompiled_header_dir(header_dir: Path) -> str:
    """Point inductor's precompiled header (and its locks) at `header_dir`; returns the folder now
    in use. Relies on `torch._inductor.codecache._HEADER_DIR` and `_HEADER_LOCK_DIR` (module
    constants computed at import) and `_precompile_header.cache_clear` (the header build is
    memoized on its folder)."""
    codecache = importlib.import_module(_CODECACHE)
    for internal in (HEADER_DIR, HEADER_LOCK_DIR, PRECOMPILE_HEADER):
        internal.resolve()
    codecache._HEADER_DIR = str(header_dir)
    codecache._HEADER_LOCK_DIR = str(header_dir / "locks")
    codecache._precompile_header.cache_clear()
    return codecache._HEADER_DIR


def precompiled_header_dir() -> str:
    """The folder inductor puts its precompiled header in (`torch._inductor.codecache._HEADER_DIR`)."""
    return HEADER_DIR.resolve()


def inductor_cache_dir() -> str:
    """Where inductor caches when nobody redirects it (TORCHINDUCTOR_CACHE_DIR, else its
    default under the temp dir): `torch._inductor.runtime.cache_dir_utils.cache_dir`."""
    return str(CACHE_DIR.resolve()())


def compile_workers_started() -> bool:
    """Whether inductor's compile-worker pools exist in this process. Relies on
    `torch._inductor.async_compile._pool_set` (every pool started so far); a module not yet
    imported has started none, and is not imported here."""
    module = sys.modules.get(POOL_SET.module)
    if module is None:
        return False
    return len(POOL_SET.resolve()) > 0


def cpu_isa_flags() -> list[str]:
    """The vector-ISA flags this CPU claims (`torch._inductor.cpu_vec_isa.x86_isa_checker`)."""
    return list(ISA_FLAGS.resolve()())


def cpu_isa_names() -> list[str]:
    """Inductor's ISAs, best first, each named by its flags (`cpu_vec_isa.supported_vec_isa_list`)."""
    return [str(isa) for isa in ISA_LIST.resolve()]


def valid_cpu_isas() -> list[str]:
    """Inductor's own check of every ISA the CPU claims (`cpu_vec_isa.valid_vec_isa_list`: each
    builds a test library and loads it in a child process; memoized for the process)."""
    return [str(isa) for isa in ISA_VALID.resolve()()]


def vec_isa_ok_setting() -> bool | None:
    """`torch._inductor.config.cpp.vec_isa_ok` (TORCHINDUCTOR_VEC_ISA_OK): None, inductor checks."""
    return ISA_OK.resolve()


def precompile_headers_setting() -> bool:
    """`torch._inductor.config.cpp_cache_precompile_headers` (TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS)."""
    return bool(PRECOMPILE_HEADERS.resolve())


def set_precompile_headers(on: bool) -> None:
    """Whether inductor builds (and every new process checks) a precompiled header for its CPU
    kernels (`config.cpp_cache_precompile_headers`; part of its FX-graph cache key)."""
    PRECOMPILE_HEADERS.resolve()
    importlib.import_module("torch._inductor.config").cpp_cache_precompile_headers = on


def caching_precompile_setting() -> bool:
    """Whether dynamo stores and loads its traced frames in this thread's context."""
    return bool(CACHING_PRECOMPILE.resolve())


def set_caching_precompile(on: bool) -> None:
    """Dynamo's caching precompile (`torch._dynamo.config.caching_precompile`) in this thread's
    context: a compile stores its traced frame and guards under inductor's cache folder (written by
    `torch.compiler.save_cache_artifacts`), and a later process loads the frame instead of tracing.
    On, dynamo drops its identity guards and bundles the AOT cache entries (compile/config.py)."""
    CACHING_PRECOMPILE.resolve()
    importlib.import_module("torch._dynamo.config").caching_precompile = on


def reset_code_caches() -> None:
    """Clear dynamo's in-memory caches keyed by code objects: what it compiled or installed from a
    stored frame (`torch._dynamo.reset_code_caches`; its callbacks stay, unlike `reset`)."""
    RESET_CODE_CACHES.resolve()()


def set_vec_isa_ok() -> None:
    """Take every ISA the CPU claims as valid, without inductor's check (`config.cpp.vec_isa_ok`)."""
    ISA_OK.resolve()
    importlib.import_module("torch._inductor.config").cpp.vec_isa_ok = True


def cpp_compiler() -> str:
    """The C++ compiler inductor builds CPU kernels with (`cpp_builder.get_cpp_compiler`)."""
    return str(CPP_COMPILER.resolve()())


# -- dynamo -----------------------------------------------------------------------------------


def dynamo_counters() -> Any:
    """Dynamo's process-wide counters (`torch._dynamo.utils.counters`: group -> Counter of name ->
    count), e.g. `["frames"]["ok"]`, `["inductor"]["fxgraph_cache_hit"]`."""
    return COUNTERS.resolve()


def recorded_recompile_reasons() -> list[str]:
    """The recompile reasons Dynamo recorded, oldest first. Relies on
    `torch._dynamo.utils.get_compilation_metrics()` and its `recompile_reason` field."""
    return [m.recompile_reason for m in COMPILATION_METRICS.resolve()() if m.recompile_reason]


def add_compile_start_callback(callback: Callable[[Any], None]) -> None:
    """Have `callback(args)` run at the start of each compile, once however often it is added.
    Relies on `torch._dynamo.callback_handler` (`start_callbacks`, `register_start_callback`);
    `torch.compiler.reset()` clears it."""
    if callback not in START_CALLBACKS.resolve():
        REGISTER_START.resolve()(callback)


def remove_compile_start_callback(callback: Callable[[Any], None]) -> None:
    """Undo `add_compile_start_callback` (nothing if not added). Relies on
    `torch._dynamo.callback_handler.remove_start_callback`."""
    if callback in START_CALLBACKS.resolve():
        REMOVE_START.resolve()(callback)


def dynamo_compile_id(args: Any) -> str | None:
    """The compile id of a compile-start callback's `args` (a `torch._dynamo.callback.CallbackArgs`)
    when Dynamo traces a frame (`CallbackTrigger.DYNAMO`); None for other triggers (lazy
    backward, autotuning, cudagraph recording)."""
    if args.callback_trigger != TRIGGER_DYNAMO.resolve():
        return None
    return args.compile_id


def frame_compile_index(compile_id: str) -> int:
    """n in a compile id `frame/n`: 0 for a frame's first compile, > 0 for a recompile (torch
    raises ValueError for an id it cannot parse). Relies on `torch._guards.CompileId.from_string`
    and its `frame_compile_id`."""
    parsed = COMPILE_ID.resolve()(compile_id)
    return (parsed.frame_compile_id or 0) if parsed is not None else 0


# -- sharded tensors --------------------------------------------------------------------------


def sharded_tensor_types() -> tuple[type, type]:
    """(Shard, ShardedTensor), from the private module `torch.distributed._shard.sharded_tensor`
    (TorchRec's sharded state is made of them)."""
    return SHARD.resolve(), SHARDED_TENSOR.resolve()


def cpu_placement(placement: Any) -> Any:
    """The placement `rank:<same rank>/cpu` of a shard placed by `placement`; relies on
    `torch.distributed.remote_device._remote_device` (what ShardMetadata.placement holds)."""
    return REMOTE_DEVICE.resolve()(f"rank:{placement.rank()}/cpu")


def sharded_tensor_like(like: Any, shards: Sequence[Any], metadata: Any) -> Any:
    """A ShardedTensor of `shards` (this rank's) and global `metadata`, in the process group of
    the ShardedTensor `like`. Relies on `ShardedTensor._init_from_local_shards_and_global_metadata`
    (no cross-rank validation or communication) and the instance attribute `_process_group`."""
    init = INIT_FROM_LOCAL.resolve()
    try:
        group = like._process_group
    except AttributeError as e:
        raise TorchCompatError(PROCESS_GROUP) from e
    return init(list(shards), metadata, process_group=group)
