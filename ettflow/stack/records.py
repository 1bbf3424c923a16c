"""What `ettflow up` started, kept on disk, and the processes that belong to a stack.

Every process `up` starts gets `ETTFLOW_STACK_ID=<id>` in its environment, and passes it on to
what it starts (Ray's raylet to its workers and actors, the Prefect worker to its flow-run
processes), so `down` finds all of them by reading each process's environment, even those
that left the process group of the service that started them. Each service starts in a
session of its own (its pid is the session id), and `down` also stops every process of that
session (`session_processes`): Ray's agents retitle themselves (`ray::DashboardAgent`), which
overwrites the environment the kernel shows, and one left to init by its raylet was found
running after `down` (2026-12-05). A recorded pid counts as the same process only while its
start matches the record (a pid can be reused): on Linux the clock ticks from boot to its start
(`/proc/<pid>/stat`), which no setting of the wall clock moves. psutil's `create_time()` is those
ticks plus the boot time read now, which is the wall clock minus the uptime: an NTP step between
`up` and a later `up` moved it by more than a second on a CI host (2026-12-06), so the second
`up` took its own running services for someone else's and started a second worker (psutil #2526).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

STACK_ENV = "ETTFLOW_STACK_ID"


@dataclass(frozen=True, kw_only=True)
class Service:
    """One part of the stack. `pid` None: found running, not started by this stack (so `down`
    leaves it alone). `address`: how it is reached (a URL, host:port, a pool name)."""

    name: str
    address: str
    pid: int | None = None
    create_time: float | None = None  # wall clock, for people; the identity is `start_ticks`
    start_ticks: int | None = None  # clock ticks from boot to its start (Linux; None elsewhere)
    log: str | None = None
    detail: str = ""

    @property
    def started(self) -> bool:
        return self.pid is not None

    def process(self) -> psutil.Process | None:
        """The recorded process while it is alive and still the same one."""
        if self.pid is None:
            return None
        try:
            proc = psutil.Process(self.pid)
            if self.start_ticks is not None:
                if start_ticks(self.pid) != self.start_ticks:
                    return None  # the pid was reused
            elif self.create_time is not None and abs(proc.create_time() - self.create_time) > 1.0:
                return None  # the pid was reused (a record without ticks: another OS, or an older `up`)
            return proc if proc.status() != psutil.STATUS_ZOMBIE else None
        except psutil.Error:
            return None

    @classmethod
    def of_process(cls, name: str, address: str, proc: psutil.Process, **kw) -> Service:
        return cls(name=name, address=address, pid=proc.pid, create_time=proc.create_time(),
                   start_ticks=start_ticks(proc.pid), **kw)


def start_ticks(pid: int) -> int | None:
    """Clock ticks from boot to the start of process `pid` (field 22 of `/proc/<pid>/stat`,
    read after the command name, which may hold spaces and parentheses); None where there is no
    such file (another OS, or the process is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()
    return int(fields[19])  # fields 3.. after the name: starttime is field 22


@dataclass(frozen=True, kw_only=True)
class StackRecord:
    """The stack as `up` left it: `$ETTFLOW_HOME/stack/stack.json`."""

    stack_id: str
    api_url: str
    ui_url: str
    ray_address: str
    pool: str
    ray_temp_dir: str | None = None
    services: tuple[Service, ...] = field(default_factory=tuple)

    def with_service(self, service: Service) -> StackRecord:
        kept = tuple(s for s in self.services if s.name != service.name)
        return StackRecord(**{**asdict(self), "services": (*kept, service)})

    def service(self, name: str) -> Service | None:
        return next((s for s in self.services if s.name == name), None)

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: Path) -> StackRecord | None:
        try:
            raw = json.loads(path.read_text())
            services = tuple(Service(**s) for s in raw.pop("services", ()))
            return cls(**raw, services=services)
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path} is not a stack record ({exc}); remove it once nothing of the stack "
                             "runs") from None


def session_processes(session_id: int) -> list[psutil.Process]:
    """Every live process of the session `session_id` (a service's pid: `up` starts each in a
    session of its own), the leader included, this process excluded; what left the leader's
    tree for init keeps its session."""
    return _live(lambda proc: os.getsid(proc.pid) == session_id)


def stack_processes(stack_id: str) -> list[psutil.Process]:
    """Every live process whose environment carries this stack's id (this process excluded)."""
    return _live(lambda proc: proc.environ().get(STACK_ENV) == stack_id)


def _live(matches: Callable[[psutil.Process], bool]) -> list[psutil.Process]:
    """The live (not zombie) processes `matches`, this one excluded; one that ends while it is
    looked at, or is not ours to read, is left out."""
    found = []
    me = os.getpid()
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == me:
            continue
        try:
            if matches(proc) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (OSError, psutil.Error):
            continue
    return found
