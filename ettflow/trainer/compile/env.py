"""Point every folder inductor writes compiled artifacts to into one working folder, and leave
out the precompiled header.

On CPU a warm restart needs, besides the FX-graph and AOTAutograd cache entries, the built
kernel libraries (`<cache>/<xx>/<hash>.so`, found by a hash of their source and flags). On
CUDA, Triton's binaries land in TRITON_CACHE_DIR, also pointed inside the folder.

Inductor's precompiled header (`cpp_cache_precompile_headers`, on by default) is turned off in a
process with the archive (`skip_precompiled_headers`): the header (`<hash>.h.gch`) was ~156 MB of
every 158 MB CPU archive, which every warm process restored (the README job's warm refresh:
1.7-2.2 s of restore on its critical path, both ranks unpacking at once; 0.8 s without it), and
with it on, every new process preprocesses the header and hashes the result before loading its
first kernel, hit or not. What it costs: a cold compile, each kernel parsing the header itself,
about a quarter slower (BENCHMARKS.md, `python -m ettflow.bench.precompiled_header`); a model
compiles cold once per key, and warm many times. Inductor still puts
a header, where one is built (a process without the archive that isolates its folders, or a
user's setting), in `default_cache_dir()/precompiled_headers` (a folder under the temp dir
computed at import, outside TORCHINDUCTOR_CACHE_DIR), so that folder is redirected here too.

Must run before torch compiles anything in the process: some paths are memoized on first use.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from ettflow.trainer import _torch_compat as compat

from . import trust

INDUCTOR_SUBDIR = "inductor"
HEADER_SUBDIR = "precompiled_headers"  # inside the inductor folder
TRITON_SUBDIR = "triton"
DYNAMO_SUBDIR = "dynamo"  # inside the inductor folder: dynamo's stored frames (caching precompile)


class CompileEnvError(RuntimeError):
    pass


def already_compiled() -> bool:
    """A frame was compiled, or inductor's compile workers (which keep the environment they
    started with) are already up."""
    return compat.dynamo_counters()["frames"]["total"] > 0 or compat.compile_workers_started()


def default_inductor_dir() -> str:
    """Where inductor caches when nobody redirects it: TORCHINDUCTOR_CACHE_DIR (importing
    torchrec sets it to the default), else PyTorch's default under the temp dir."""
    return compat.inductor_cache_dir()


def redirect_compile_dirs(work_dir: Path) -> dict[str, str]:
    """Send inductor's cache, the precompiled headers and Triton's cache into `work_dir`.
    Returns what was set (for logs and for child processes)."""
    if already_compiled():
        raise CompileEnvError(
            "torch already compiled a frame in this process, so inductor's cache folders are "
            "fixed: call CompileCache.prepare_env() before the first torch.compile call runs"
        )
    inductor = trust.make_private_dir(work_dir / INDUCTOR_SUBDIR)
    env = {
        # importing torchrec already sets it (to the default under the temp dir): override
        "TORCHINDUCTOR_CACHE_DIR": str(inductor),
        "TRITON_CACHE_DIR": str(inductor / TRITON_SUBDIR),
    }
    os.environ.update(env)
    header_dir = redirect_precompiled_headers(inductor / HEADER_SUBDIR)
    return {**env, "precompiled_headers": header_dir}


def redirect_precompiled_headers(header_dir: Path) -> str:
    """Inductor keeps the header folder as a module constant and memoizes the header build:
    both are reset through `_torch_compat` (TorchCompatError on a torch that renamed them,
    rather than a header silently left outside the archive). Returns the folder in use."""
    return compat.redirect_precompiled_header_dir(header_dir)


def skip_precompiled_headers() -> None:
    """Compile without inductor's precompiled header (the module docstring says why); the
    environment variable too, for any child process that imports inductor."""
    os.environ["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] = "0"
    compat.set_precompile_headers(False)


def set_caching_precompile(on: bool) -> None:
    """Dynamo stores its traced frames beside inductor's entries, and loads them (cache.py)."""
    compat.set_caching_precompile(on)


def reset_code_caches() -> None:
    """Forget the frames dynamo compiled or installed in this process (not its callbacks)."""
    compat.reset_code_caches()


def set_job_id(job_id: str) -> None:
    """PGO (automatic dynamic shapes) state is only kept across processes under a job id."""
    os.environ["TORCH_COMPILE_JOB_ID"] = job_id
    torch.compiler.config.job_id = job_id  # the env var is only read when torch is imported


WORK_PREFIX = "ettflow-pt2-"


def make_work_dir(parent: str | None = None) -> Path:
    """A fresh working folder named after this process (`ettflow-pt2-<pid>-<random>`), after
    removing those of processes that are gone (a killed rank cannot clean up its folder)."""
    parent_dir = Path(parent or tempfile.gettempdir())
    sweep_orphan_work_dirs(parent_dir)
    return Path(tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{os.getpid()}-", dir=parent_dir))


def sweep_orphan_work_dirs(parent: Path) -> list[Path]:
    """Remove working folders whose process no longer exists on this host. A folder whose
    pid is alive (or unreadable) is kept: a reused pid only delays the cleanup."""
    removed = []
    for path in parent.glob(f"{WORK_PREFIX}*"):
        pid_text = path.name[len(WORK_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid() or _alive(int(pid_text)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists but not ours
        return True
    return True


def pin_threads(threads: int) -> None:
    """The FX-graph cache key holds the intra-op thread count on CPU: pin it (every rank the
    same) so a restart with another count does not miss."""
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
