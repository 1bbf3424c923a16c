"""Finding the processes a test started, and whether they are still there (psutil)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import psutil


def live_processes(match: Callable[[psutil.Process], bool]) -> list[psutil.Process]:
    """Every live (not zombie) process `match` accepts; one that vanishes meanwhile is skipped."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and match(p):
                found.append(p)
        except psutil.Error:
            continue
    return found


def processes_of(home: Path) -> list[psutil.Process]:
    """Every live process whose environment has ETTFLOW_HOME=home."""
    return live_processes(lambda p: p.environ().get("ETTFLOW_HOME") == str(home))


def trainer_actors(home: Path | None = None) -> list[psutil.Process]:
    """Live `ray::TrainerActor` processes (Ray titles an actor's worker process so) of this
    test's runs: those whose environment has ETTFLOW_HOME=`home` (a Ray its flow process
    started), else those below this process (the session's Ray). Never another test's: the
    suite runs on two workers at once."""
    if home is not None:
        mine = {p.pid for p in processes_of(home)}
    else:
        mine = {p.pid for p in psutil.Process().children(recursive=True)}
    return live_processes(lambda p: p.pid in mine and " ".join(p.cmdline()).startswith("ray::TrainerActor"))


def alive(snapshot: list[psutil.Process]) -> list[psutil.Process]:
    """Those of `snapshot` still running (same pid and start time), zombies excepted."""
    left = []
    for p in snapshot:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.Error:
            continue
    return left


def describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
        except psutil.Error:
            out.append(f"{p.pid} (gone)")
    return out


def stop_group(proc, timeout_s: float = 30.0) -> None:
    """SIGTERM the process group `proc` leads (a `start_new_session` child), SIGKILL it when it
    is still there after `timeout_s`."""
    import os
    import signal
    import subprocess

    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
