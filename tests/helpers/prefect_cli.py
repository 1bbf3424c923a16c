"""The `prefect` and `ettflow` commands as a test runs them against a real server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).with_name("prefect"))
POOL = "ettflow-process"  # the work pool prefect.yaml names (conftest's `prefect_server` creates it)


def prefect(env: dict, *args: str, timeout: float = 300) -> str:
    """`prefect ARGS` in the repository; its output (the test fails, with it, on a non-zero exit)."""
    out = subprocess.run([PREFECT, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"prefect {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout + out.stderr


def ettflow(env: dict, *args: str, timeout: float = 300) -> str:
    """`python -m ettflow.cli ARGS` in the repository; its stdout."""
    out = subprocess.run([sys.executable, "-m", "ettflow.cli", *args], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, f"ettflow {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout
