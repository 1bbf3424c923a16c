"""What the tests of the deployed path share: free ports for a stack of its own, the `ettflow`
command in a subprocess, and an environment holding none of the session's Prefect, Ray or
ettflow settings (the stack under test sets its own)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from ettflow.stack.services import NO_DRAIN

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


@contextlib.contextmanager
def ray_head(cpus: int = 4, timeout_s: float = 120.0) -> Iterator[dict[str, str]]:
    """A Ray head of its own, as `ettflow up` starts one (`ray start --head`, token
    authentication, in a session of its own: a worker's stop of a flow run signals the flow's
    process group, never this); yields what a process needs to join it (RAY_ADDRESS and the
    token's settings), and stops it (its whole group) at the end."""
    port, client = free_ports(2)
    temp = tempfile.mkdtemp(prefix="rh")  # short: Ray's socket paths live under it
    log_path, token = Path(temp) / "head.log", Path(temp) / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    join = {"RAY_ADDRESS": f"127.0.0.1:{port}", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    env.setdefault(*NO_DRAIN)  # as `ettflow up` starts it: its stop is not a 30 s drain
    with open(log_path, "wb") as log:
        head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
                                 "--node-ip-address", "127.0.0.1", "--port", str(port), "--ray-client-server-port",
                                 str(client), "--num-cpus", str(cpus), "--include-dashboard", "false",
                                 "--disable-usage-stats", "--temp-dir", temp],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while "Ray runtime started" not in log_path.read_text(errors="replace"):
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Ray head did not start: {log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.2)
        yield join
    finally:
        from helpers.processes import stop_group

        with contextlib.suppress(ProcessLookupError):
            stop_group(head)
        shutil.rmtree(temp, ignore_errors=True)


@contextlib.contextmanager
def deployed_worker(env: dict[str, str], home: Path, log_path: Path) -> Iterator[tuple[dict[str, str],
                                                                                      subprocess.Popen]]:
    """A Ray head of its own (`ray_head`) and a process worker of the `prefect.yaml` work pool
    that joins it, as `ettflow up` runs them (ETTFLOW_HOME=`home`, its output in `log_path`);
    yields (the worker's environment, its process) and stops both at the end."""
    from helpers.prefect_cli import POOL, PREFECT
    from helpers.processes import stop_group

    with ray_head() as joins, open(log_path, "wb") as log:
        worker_env = {**env, **joins, "ETTFLOW_HOME": str(home)}
        worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", POOL, "--type", "process"],
                                  env=worker_env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            yield worker_env, worker
        finally:
            stop_group(worker)
