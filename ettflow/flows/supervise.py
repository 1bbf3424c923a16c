"""`ettflow refresh` as a supervisor and a worker, so that nothing it starts outlives it.

A refresh run in one process starts an ephemeral Prefect API server (a uvicorn subprocess) and
a local Ray (gcs_server, raylet, its agents and workers). A SIGKILL of that process cannot be
caught: the flow run stayed RUNNING and those processes were orphaned. So the command is two
processes:

- the **supervisor** is the `ettflow refresh` process. It starts the worker in a session of
  its own (a terminal's Ctrl-C reaches the supervisor only, which forwards it), becomes the
  reaper of every orphan below it (Linux `PR_SET_CHILD_SUBREAPER`), and waits. When the
  worker dies of a signal, the supervisor kills Ray's processes at once, marks the worker's
  unfinished flow runs CRASHED through the still running API server (the worker's report
  names it), stops that server and every other process left below it, and exits non-zero.
- the **worker** (`python -m ettflow`, which calls `worker_main`) runs the command's real work. Its
  `ParentGuard` thread polls its parent; when the supervisor is gone (killed), it sends the
  worker SIGTERM, so the run ends through Prefect's own crash handling: the flow run is
  CRASHED and its `on_crashed` hooks archive the run. The worker then restates the CRASHED
  message with the reason, stops the API server, then Ray's processes and whatever else is
  left below it (it is a subreaper too), and exits. If that orderly crash has not finished within
  `SupervisorConfig.grace_s`, the guard marks the run CRASHED itself, kills everything and
  exits.

The worker's flow runs carry the tag `refresh-process:<token>`, so either process finds them
through the API. The supervisor is used when `refresh` runs as the `ettflow` command (the CLI
passes its argv); a caller of `cmd_refresh` in-process (tests with their own Prefect harness)
runs the work in-process as before.

Prefect's own mechanisms and where they apply: in Prefect 3.9.1 a flow run emits
`prefect.flow-run.heartbeat` events every `PREFECT_FLOWS_HEARTBEAT_FREQUENCY` seconds (at
least 30), and a server-side automation that expects the next heartbeat marks a silent run
CRASHED ("zombie flow runs", `ettflow.flows.zombies`). That fits runs on a long-lived server
(deployments run by a worker). An ephemeral API lives in the process that runs the flow, so
nothing is left to notice the missing heartbeats when that process dies; there, the
supervisor is the mechanism, and Prefect's part is its SIGTERM crash handling in the worker.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from ettflow.flows.env_defaults import set_env_defaults

SUPERVISOR_ENV = "ETTFLOW_REFRESH_SUPERVISOR"  # the supervisor's pid, in the worker's environment
ARGV_ENV = "ETTFLOW_REFRESH_ARGV"  # the command's argv as JSON (not on the worker's command line)
REPORT_ENV = "ETTFLOW_REFRESH_REPORT"  # where the worker writes its `WorkerReport`
TAG_PREFIX = "refresh-process:"

_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
_FINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "CRASHED"})


@dataclass(frozen=True, kw_only=True)
class SupervisorConfig:
    """Timings of the supervisor and the worker's guard.

    poll_s: how often the guard checks that the supervisor is alive. grace_s: how long the
    worker's orderly crash (Prefect's crash handling and hooks, Ray and server shutdown) may
    take after the supervisor died before the guard kills everything. stop_s: how long a
    process left behind has between SIGTERM and SIGKILL."""

    poll_s: float = 0.2
    grace_s: float = 20.0
    stop_s: float = 3.0

    def __post_init__(self) -> None:
        for name in ("poll_s", "grace_s", "stop_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SupervisorConfig.{name} must be > 0 seconds, got {getattr(self, name)!r}")


@dataclass(frozen=True, kw_only=True)
class WorkerReport:
    """What the worker tells its supervisor once its Prefect API is up: the API's URL, the pid
    of the ephemeral server it started (None for a configured server) and its flow runs' tag."""

    api_url: str
    server_pid: int | None
    tag: str

    def write(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(path)

    @classmethod
    def read(cls, path: Path) -> WorkerReport | None:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None


def should_supervise(args: argparse.Namespace) -> bool:
    """True in the `ettflow refresh` process itself (the CLI gave its argv), not in the worker
    and not for in-process callers."""
    return getattr(args, "argv", None) is not None and SUPERVISOR_ENV not in os.environ


def become_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process (Linux); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(1), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def stop_processes(procs: Iterable[psutil.Process], stop_s: float) -> None:
    """SIGTERM, then SIGKILL after `stop_s` for those still alive; reaps them."""
    procs = list(procs)
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=stop_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=stop_s)


def descendants(*, but: Iterable[int | None] = ()) -> list[psutil.Process]:
    keep = set(but)
    try:
        return [p for p in psutil.Process().children(recursive=True) if p.pid not in keep]
    except psutil.Error:
        return []


def mark_crashed(api_url: str, tag: str, message: str, *, restate_crashed: bool) -> list[str]:
    """Set CRASHED with `message` on the flow runs tagged `tag` that have not ended (and on
    those already CRASHED when `restate_crashed`); returns their ids."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.states import Crashed

    marked = []
    with SyncPrefectClient(api_url) as client:
        for run in client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag]))):
            kind = run.state.type.value if run.state is not None else "PENDING"
            if kind not in _FINAL or (restate_crashed and kind == "CRASHED"):
                earlier = f" (it ended: {run.state.message})" if run.state is not None and run.state.message else ""
                client.set_flow_run_state(run.id, Crashed(message=message + earlier), force=True)
                marked.append(str(run.id))
    return marked


# ---- the supervisor: the `ettflow refresh` process ------------------------------------------


def run_supervised(argv: list[str], config: SupervisorConfig = SupervisorConfig()) -> int:
    """Run `ettflow <argv>` in a worker process and wait; leave nothing running behind it."""
    set_env_defaults()
    reaper = become_subreaper()
    folder = Path(tempfile.mkdtemp(prefix="ettflow-refresh-"))
    report = folder / "worker.json"
    env = {**os.environ, SUPERVISOR_ENV: str(os.getpid()), ARGV_ENV: json.dumps(argv), REPORT_ENV: str(report)}
    worker = subprocess.Popen([sys.executable, "-m", "ettflow"], env=env,  # worker_main: ettflow/__main__.py
                              stdin=subprocess.DEVNULL, start_new_session=True)
    forward = {signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGTERM, signal.SIGHUP: signal.SIGTERM}
    previous = {s: signal.signal(s, lambda signum, _f: worker.send_signal(forward[signum])) for s in forward}
    seen: dict[int, psutil.Process] = {}  # where re-parenting to us is not available
    try:
        while True:
            try:
                code = worker.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if not reaper:
                    seen.update((p.pid, p) for p in descendants())
        if code < 0:
            return _after_worker_killed(worker.pid, -code, WorkerReport.read(report), config)
        stop_processes(descendants() + [p for p in seen.values() if p.is_running()], config.stop_s)
        return code
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        shutil.rmtree(folder, ignore_errors=True)


def _after_worker_killed(pid: int, signum: int, report: WorkerReport | None, config: SupervisorConfig) -> int:
    name = signal.Signals(signum).name
    server = report.server_pid if report is not None else None
    stop_processes(descendants(but=[server]), config.stop_s)  # Ray first: the API is still needed
    if report is not None:
        message = (f"the refresh worker process (pid {pid}) was killed by {name}; `ettflow refresh` "
                   f"(pid {os.getpid()}) stopped its Ray processes")
        try:
            runs = mark_crashed(report.api_url, report.tag, message, restate_crashed=False)
        except Exception as exc:  # noqa: BLE001 - the processes are stopped below whatever happens
            print(f"ettflow refresh: could not mark the run CRASHED at {report.api_url}: {exc}", file=sys.stderr)
        else:
            if runs:
                print(f"ettflow refresh: flow run {', '.join(runs)} marked CRASHED; `ettflow archive --pending` "
                      "archives its ETT from the spool", file=sys.stderr)
    stop_processes(descendants(), config.stop_s)
    print(f"ettflow refresh: the refresh worker (pid {pid}) was killed by {name}; nothing it started is left running",
          file=sys.stderr)
    return 128 + signum


# ---- the worker ---------------------------------------------------------------------------


class ParentGuard(threading.Thread):
    """Watches the supervisor from inside the worker; when it is gone, asks the worker's main
    thread to stop (SIGTERM) and, if that has not finished in `grace_s`, ends the worker."""

    def __init__(self, supervisor: int, report_path: Path, config: SupervisorConfig) -> None:
        super().__init__(name="ettflow-parent-guard", daemon=True)
        self.supervisor, self.report_path, self.config = supervisor, report_path, config
        self.lost = threading.Event()
        self.done = threading.Event()
        self.report: WorkerReport | None = None

    @property
    def reason(self) -> str:
        return (f"the `ettflow refresh` process (pid {self.supervisor}) was killed; its worker (pid {os.getpid()}) "
                "stopped the run, Ray and the Prefect server")

    def run(self) -> None:
        while os.getppid() == self.supervisor:
            if self.done.wait(self.config.poll_s):
                return
        self.lost.set()
        print(f"ettflow refresh: {self.reason.split(';')[0]}: stopping the run", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        if self.done.wait(self.config.grace_s):
            return
        print(f"ettflow refresh: the run did not stop within {self.config.grace_s:g} s: killing it", file=sys.stderr,
              flush=True)
        _end_orphaned(self, self.report_path, self.config)


def _exit_on_sigterm(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def _start_api(tag: str) -> WorkerReport:
    """The Prefect API this worker's flow runs use: the configured one, else Prefect's
    ephemeral server, started now (the same instance the flow's client reuses)."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    if url:
        return WorkerReport(api_url=str(url), server_pid=None, tag=tag)
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start()
    return WorkerReport(api_url=server.api_url, server_pid=server.server_process.pid, tag=tag)


def worker_main(run: Callable[[list[str]], int], config: SupervisorConfig = SupervisorConfig()) -> int:
    """The worker: `run(argv)` (the `ettflow` command's main) under a `ParentGuard`. On a normal exit, Prefect's and
    Ray's own exit handlers run first (logs and events are flushed, Ray shuts down, the
    ephemeral server stops), then `_stop_leftovers`, registered first; an orphaned worker ends
    through `_end_orphaned`."""
    argv = json.loads(os.environ.pop(ARGV_ENV))
    report_path = Path(os.environ.pop(REPORT_ENV))
    become_subreaper()
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # Ray and Prefect replace it while they run
    guard = ParentGuard(int(os.environ[SUPERVISOR_ENV]), report_path, config)
    atexit.register(_stop_leftovers, guard, report_path, config)
    guard.start()
    code = 1
    try:
        set_env_defaults()
        import prefect

        guard.report = _start_api(f"{TAG_PREFIX}{uuid.uuid4().hex[:12]}")
        guard.report.write(report_path)
        with prefect.tags(guard.report.tag):
            code = run(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    if guard.lost.is_set():
        _end_orphaned(guard, report_path, config)
    return code


def _end_orphaned(guard: ParentGuard, report_path: Path, config: SupervisorConfig) -> None:
    """The supervisor is gone and Prefect's crash handling has run: say why in the CRASHED
    state, stop Ray, the API server and anything else below, and exit at once (the exit
    handlers would only talk to a stopped server)."""
    try:
        if guard.report is not None:
            try:
                mark_crashed(guard.report.api_url, guard.report.tag, guard.reason, restate_crashed=True)
            except Exception as exc:  # noqa: BLE001 - the processes are stopped below whatever happens
                print(f"ettflow refresh: could not mark the run CRASHED: {exc}", file=sys.stderr)
        _stop_leftovers(guard, report_path, config, server=guard.report and guard.report.server_pid)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _stop_leftovers(guard: ParentGuard, report_path: Path, config: SupervisorConfig,
                    server: int | None = None) -> None:
    """The worker's last exit handler, and the end of an orphaned worker: the API `server`
    first (gracefully), then every other process left below the worker at once with SIGKILL,
    Ray's gcs_server and raylet last. Ray's processes need no orderly stop (the spool and the
    checkpoints are durable), and they cannot have one here: when its raylet or GCS dies, a
    connected Ray driver (this process) exits on the spot, and an agent's death takes the
    raylet with it."""
    try:
        stop_processes([p for p in descendants() if p.pid == server], config.stop_s)
        rest = sorted(descendants(), key=lambda p: _name(p) in ("raylet", "gcs_server"))
        for p in rest:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(rest, timeout=config.stop_s)
        if guard.lost.is_set():
            shutil.rmtree(report_path.parent, ignore_errors=True)
    finally:
        guard.done.set()


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return ""


