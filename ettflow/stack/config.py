"""The local stack's settings: a keyword-only dataclass, checked when it is made."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_POOL = "ettflow-process"  # the work pool prefect.yaml's deployments name
REPO = Path(__file__).resolve().parents[2]  # an editable install: prefect.yaml is at the repository's root


class StackError(RuntimeError):
    """The stack cannot be brought up or down as asked; the message says what to do."""


@dataclass(frozen=True, kw_only=True)
class StackConfig:
    """Where the stack lives and how it is reached.

    home: `$ETTFLOW_HOME` (records under `home/stack`, the Prefect server's database under
    `home/prefect`). host: the address the Prefect server binds and the Ray head advertises
    (loopback by default; Ray's own processes listen on every interface, which is why the
    stack's Ray requires its token). api_port: the Prefect server's API and UI.
    ray_port / ray_client_port: the Ray head's GCS and Ray Client ports (the client port must
    lie outside Ray's worker ports, 10002-19999). ray_address: an existing Ray cluster to use
    instead of starting a head (`RAY_ADDRESS`). num_cpus: the head's CPUs (at least the world
    size and a spare). heartbeat_s: the worker's flow-run heartbeats (>= 30, Prefect's floor),
    which the crash automation watches. prefect_file: the deployments to apply. webhook_url:
    where the alert automations post (optional: without one, and without the webhook block
    on the server, the alerts are applied with no action, showing in the Event Feed when they
    trigger, and `up` says so). start_timeout_s: how long a
    service may take to answer. stop_s: SIGTERM to SIGKILL on `down`. verbose: the worker's
    flow runs show every library's output."""

    home: Path
    host: str = "127.0.0.1"
    api_port: int = 4200
    ray_port: int = 6390  # not Ray's 6379: Redis's port, often taken on a developer's machine
    ray_client_port: int = 10001
    ray_address: str | None = None
    num_cpus: int | None = None
    pool: str = DEFAULT_POOL
    heartbeat_s: int = 30
    prefect_file: Path = REPO / "prefect.yaml"
    webhook_url: str | None = None
    start_timeout_s: float = 240.0
    stop_s: float = 10.0
    verbose: bool = False

    def __post_init__(self) -> None:
        for name in ("api_port", "ray_port", "ray_client_port"):
            port = getattr(self, name)
            if not isinstance(port, int) or not 0 < port < 65536:
                raise StackError(f"{name} must be a TCP port (1-65535), got {port!r}")
        if 10002 <= self.ray_client_port <= 19999:
            raise StackError(f"ray_client_port {self.ray_client_port} is among Ray's worker ports (10002-19999): "
                             "choose one outside them")
        if len({self.api_port, self.ray_port, self.ray_client_port}) < 3:
            raise StackError(f"the ports must differ: api {self.api_port}, ray {self.ray_port}, "
                             f"ray client {self.ray_client_port}")
        if self.heartbeat_s < 30:
            raise StackError(f"heartbeat_s must be at least 30 (Prefect's floor for flow-run heartbeats), "
                             f"got {self.heartbeat_s}")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise StackError(f"num_cpus must be 1 or more, got {self.num_cpus}")
        if not self.prefect_file.is_file():
            raise StackError(f"no deployments file at {self.prefect_file}: run `ettflow up` from an editable install "
                             "of the repository (scripts/setup.sh), whose prefect.yaml it applies")

    @property
    def api_url(self) -> str:
        return f"http://{self.host}:{self.api_port}/api"

    @property
    def ui_url(self) -> str:
        return f"http://{self.host}:{self.api_port}"

    @property
    def head_address(self) -> str:
        """The Ray cluster flow runs join: the given one, else the stack's own head."""
        return self.ray_address or f"{self.host}:{self.ray_port}"

    @property
    def cpus(self) -> int:
        return self.num_cpus or max(os.cpu_count() or 1, 4)

    @property
    def stack_dir(self) -> Path:
        return self.home / "stack"

    @property
    def record_path(self) -> Path:
        return self.stack_dir / "stack.json"

    @property
    def log_dir(self) -> Path:
        return self.stack_dir / "logs"

    def ray_temp_dir(self, stack_id: str) -> Path:
        """The head's temporary folder: short, since Ray puts unix sockets in it (107 bytes)."""
        return Path("/tmp") / f"ettflow-ray-{stack_id[:12]}"


def config_from(args: argparse.Namespace) -> StackConfig:
    """The settings a command's flags give (`ETTFLOW_HOME`, `RAY_ADDRESS`; unset flags keep the defaults)."""
    from ettflow import paths

    kw: dict[str, Any] = {"home": paths.data_home(), "ray_address": os.environ.get("RAY_ADDRESS") or None}
    for name in ("host", "api_port", "ray_port", "ray_client_port", "num_cpus", "webhook_url", "verbose"):
        if getattr(args, name, None) is not None:
            kw[name] = getattr(args, name)
    return StackConfig(**kw)
