"""A measurement in a fresh Python process: the child prints its result as one marked JSON line
(`emit`), the parent runs it and reads the last such line (`run_child`). A fresh process because
what the benches and the compile probe measure (imports, a cold or warm compile, inductor's
folders) is per process. Here, not under `bench`, because the trainer's compile probe uses it
too, and the trainer does not import the bench."""

from __future__ import annotations

import json
import subprocess
import sys


def emit(marker: str, result: dict) -> None:
    """The child's side: its result, on one line after `marker` (other output may surround it)."""
    print(marker + json.dumps(result), flush=True)


def run_child(module: str, args: list[str], marker: str, what: str) -> dict:
    """Run `python -m module *args` and return the result it emitted last. Raises RuntimeError
    naming `what`, with the end of its stderr, when it failed or emitted nothing."""
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(marker)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(marker):])
