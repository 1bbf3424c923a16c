"""Inductor's CPU vector-ISA check, made once per host and compile-cache root instead of once per process.

Before its first CPU kernel, inductor checks every vector ISA the CPU's flags claim (AMX,
AVX-512 VNNI, AVX-512, AVX2 here) by building a small test library with that ISA's flags and
loading it in a child Python process (`torch._inductor.cpu_vec_isa`), and then some of their
sub-features (AVX-512 BF16, VNNI, AMX tiles) the same way. Every new process pays it: measured on
the 2026-12-05 host, 8.0 s of a cold compile (an empty inductor folder) and 1.2-1.4 s of a warm one
(the test libraries restored from the archive), on each rank's, spare's and pooled worker's
compile. The base check's outcome depends only on the host (the CPU's flags, the C++ compiler,
torch and the Python that loads the library), so:

- the first compiling process of a host (per compile-cache root) checks as inductor does and,
  when every candidate passed, records it (`cpu-isa/<digest>.json`, the digest over what the
  check depends on);
- a later process whose digest has that record sets inductor's own switch
  (`config.cpp.vec_isa_ok`, what `TORCHINDUCTOR_VEC_ISA_OK=1` sets), which takes the candidates'
  base check as passed; their sub-feature checks still run as before, so the same ISA and the
  same flags are picked, the same kernels built (tests/integration/test_vec_isa_choice.py);
  measured: 1.1 s less a warm compile (`python -m ettflow.bench.isa_check`);
- the first process sets the switch too once its check passed, so every process of the host
  compiles with the same setting: it is part of inductor's cache key (the archive's key says
  so, `ISA_CHECK`).

A host where a candidate failed records nothing and keeps inductor's per-process check (a check
that failed once, say a probe that timed out on a loaded host, is not taken as the host's answer).
A user's own `TORCHINDUCTOR_VEC_ISA_OK` wins: nothing is read or set. Only x86-64 has the check
(inductor takes other architectures' ISAs without one). The record is JSON, read only from a
folder this user owns and nobody else can write (`trust.py`); at worst a forged one makes the
base check pass for ISAs the CPU claims. Runs without the compile cache switch (the untuned
baseline) keep torch's default.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from . import trust

log = logging.getLogger("ettflow.trainer")

ISA_CHECK = "once-per-host"  # the archive's key part (config.key_parts): processes set inductor's switch
RECORD_FORMAT = 1
RECORD_DIR = "cpu-isa"


class IsaCheck(Enum):
    USER = "user"  # TORCHINDUCTOR_VEC_ISA_OK set by the user: left as it is
    NOT_X86 = "not-x86"  # no check to skip
    RECORDED = "recorded"  # an earlier process's record: every candidate passed, switch set
    CHECKED = "checked"  # checked here, every candidate passed, recorded, switch set
    FAILED_CANDIDATE = "failed-candidate"  # a candidate failed here: not recorded, inductor checks per process


@dataclass(frozen=True)
class Outcome:
    check: IsaCheck
    valid: tuple[str, ...] = ()
    seconds: float = 0.0  # this process's check (0 when a record was taken)

    def to_attrs(self) -> dict[str, object]:
        return {"cpu_isa": self.check.value, "cpu_isa_s": round(self.seconds, 3)}


@dataclass(frozen=True, kw_only=True)
class Host:
    """What inductor's check depends on: its candidates (the ISAs whose flags the CPU claims) and
    the digest of everything that could change their outcome."""

    candidates: tuple[str, ...]
    digest: str


def digest_of(parts: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def read_record(folder: Path, host: Host) -> tuple[str, ...] | None:
    """The valid ISAs an earlier check of this host recorded; None when there is no record, it is
    not trusted (owner, mode) or not readable, or it is not this host's."""
    path = folder / f"{host.digest}.json"
    if not path.is_file():
        return None
    try:
        why = trust.first_untrusted(folder, path)
        if why is not None:
            log.warning("cpu ISA record not taken (%s): the check runs", why)
            return None
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    valid, candidates = data.get("valid"), data.get("candidates")
    if (data.get("format") != RECORD_FORMAT or data.get("digest") != host.digest
            or not isinstance(candidates, list) or tuple(candidates) != host.candidates
            or not isinstance(valid, list) or not all(isinstance(v, str) for v in valid)):
        return None
    return tuple(valid)


def write_record(folder: Path, host: Host, valid: Sequence[str], seconds: float) -> None:
    """Atomically (a reader sees the old record or the new one); a folder that cannot be written
    loses only the record: the next process checks again."""
    try:
        trust.make_private_dir(folder)
        body = json.dumps({"format": RECORD_FORMAT, "digest": host.digest, "candidates": list(host.candidates),
                           "valid": list(valid), "check_s": round(seconds, 3), "at": time.time()})
        fd, tmp = tempfile.mkstemp(prefix=".cpu-isa-", dir=folder)
    except OSError as exc:
        log.warning("cpu ISA record not written in %s (%s): the next process checks again", folder, exc)
        return
    try:
        with os.fdopen(fd, "w") as f:
            f.write(body)
        os.replace(tmp, folder / f"{host.digest}.json")
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        log.warning("cpu ISA record not written in %s (%s): the next process checks again", folder, exc)


def settle(folder: Path, host: Host | None, *, check: Callable[[], Sequence[str]],
           set_ok: Callable[[], None], user_set: bool, clock: Callable[[], float] = time.perf_counter) -> Outcome:
    """The decision (pure but for the record's folder): `host` None is a non-x86 host; `check`
    runs inductor's own check and returns the valid ISAs; `set_ok` sets inductor's switch."""
    if user_set:
        return Outcome(IsaCheck.USER)
    if host is None:
        return Outcome(IsaCheck.NOT_X86)
    recorded = read_record(folder, host)
    if recorded is not None and recorded == host.candidates:
        set_ok()
        return Outcome(IsaCheck.RECORDED, recorded)
    t0 = clock()
    valid = tuple(check())
    seconds = clock() - t0
    if valid == host.candidates:
        write_record(folder, host, valid, seconds)
        set_ok()
        return Outcome(IsaCheck.CHECKED, valid, seconds)
    log.warning("inductor's CPU ISA check failed for %s (valid: %s): not recorded, each process checks again",
                sorted(set(host.candidates) - set(valid)), list(valid))
    return Outcome(IsaCheck.FAILED_CANDIDATE, valid, seconds)


# ---- the torch side -------------------------------------------------------------------------

_SETTLED: Outcome | None = None  # inductor's switch is process-wide: one decision per process


def this_host() -> Host | None:
    """This host's candidates and digest (None: not x86-64, no check). Reads torch's internals
    through `_torch_compat`."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    import torch

    from ettflow.trainer import _torch_compat as compat

    flags = compat.cpu_isa_flags()
    candidates = tuple(name for name in compat.cpu_isa_names() if all(f in flags for f in name.split()))
    compiler = compat.cpp_compiler()
    resolved = shutil.which(compiler) or compiler
    with contextlib.suppress(OSError):
        st = os.stat(resolved)
        resolved = f"{os.path.realpath(resolved)}:{st.st_size}:{int(st.st_mtime)}"
    parts = {"torch": torch.__version__, "torch_at": os.path.dirname(torch.__file__), "python": sys.executable,
             "compiler": resolved, "flags": sorted(flags), "candidates": candidates, "machine": platform.machine(),
             "node": platform.node()}
    return Host(candidates=candidates, digest=digest_of(parts))


def settled() -> Outcome | None:
    """This process's decision, once `settle_for` made it (None: it has not compiled yet)."""
    return _SETTLED


def settle_for(compile_cache_dir: Path) -> Outcome:
    """This process's decision, made on the first call (before its first compile) and kept; the
    switch it set is set again on each later call, since torch 2.13 keeps a config setting per
    context (thread): a compile in another thread would otherwise check again, under another key."""
    global _SETTLED
    from ettflow.trainer import _torch_compat as compat

    if _SETTLED is None:
        _SETTLED = settle(Path(compile_cache_dir) / RECORD_DIR, this_host(), check=compat.valid_cpu_isas,
                          set_ok=compat.set_vec_isa_ok, user_set=compat.vec_isa_ok_setting() is not None)
    elif _SETTLED.check in (IsaCheck.RECORDED, IsaCheck.CHECKED):
        compat.set_vec_isa_ok()
    return _SETTLED
