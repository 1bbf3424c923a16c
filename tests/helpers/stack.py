"""What the tests of the deployed path share: free ports for a stack of its own, the `ettflow`
command in a subprocess, and an environment holding none of the session's Prefect, Ray or
ettflow settings (the stack under test sets its own)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from helpers.prefect_cli import REPO


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def stack_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RAY_", "ETTFLOW_"))}
    env["ETTFLOW_HOME"] = str(home)
    return env


def port_flags(api_port: int, ray_port: int, client_port: int) -> list[str]:
    return ["--api-port", str(api_port), "--ray-port", str(ray_port), "--ray-client-port", str(client_port)]


def ettflow(env: dict, *args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ettflow", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
