"""Each service of the local stack: find it running, or start it and wait until it answers.

A service `up` starts runs in a session of its own (so a terminal's Ctrl-C on `up` does not
reach it), logs to `$ETTFLOW_HOME/stack/logs/<name>.log`, and carries the stack's id in its
environment (`records.STACK_ENV`). A port that is taken by something that is not the service
`up` expects, or by the service of another home's stack, is an error that names the port, who
holds it and the flag to change it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

from .config import REPO, StackConfig, StackError
from .records import STACK_ENV, Service, StackRecord

PREFECT = str(Path(sys.executable).with_name("prefect"))
RAY = str(Path(sys.executable).with_name("ray"))
WORKER_POLL_S = 2  # how often the worker asks for flow runs (Prefect's default 10 s is on every run's TTS)
# how far ahead of a scheduled run's time the worker starts its process: the process imports
# and connects, then waits for its time (the server's WaitForScheduledTime rule), so a
# scheduled refresh's clock starts on a ready process. That process is held for the run
# before its submission: it is recorded (`flow_prestart`) and counted beside the run's ETT.
WORKER_PREFETCH_S = 30


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def listener_pid(port: int) -> int | None:
    """The pid listening on `port`, as far as this user can see (None: nobody it can see)."""
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                return conn.pid
    except psutil.Error:
        pass
    return None


def listener(port: int) -> str:
    """Who listens on `port`, in words ("pid 123 (nginx)"), as far as this user can see."""
    pid = listener_pid(port)
    if pid is None:
        return "another program"
    try:
        return f"pid {pid} ({psutil.Process(pid).name()})"
    except psutil.Error:
        return f"pid {pid}"


def other_home(cfg: StackConfig, port: int) -> str | None:
    """The home of another ettflow stack whose service listens on `port` (its process carries a
    stack id and a home that is not `cfg.home`), else None. Joining it would start a second
    worker on the same work pool, with another home's records and another Ray token."""
    pid = listener_pid(port)
    try:
        env = psutil.Process(pid).environ() if pid is not None else {}
    except psutil.Error:
        return None
    home = env.get("ETTFLOW_HOME") if env.get(STACK_ENV) else None
    if home and Path(home).resolve() != Path(cfg.home).resolve():
        return home
    return None


def refuse_other_home(cfg: StackConfig, port: int, what: str, flag: str) -> None:
    home = other_home(cfg, port)
    if home is not None:
        raise StackError(f"port {port} on {cfg.host} is the {what} of another ettflow stack (home {home}): stop it "
                         f"(`ETTFLOW_HOME={home} ettflow down`), or give this stack other ports with {flag} "
                         "(--api-port, --ray-port and --ray-client-port)")


def answers(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def prefect_healthy(api_url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{api_url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def prefect_api(api_url: str) -> Iterator[None]:
    """This process's Prefect client talks to the stack's server inside the block."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        yield


def service_env(cfg: StackConfig, stack_id: str, **extra: str) -> dict[str, str]:
    """The environment of every process the stack starts: the caller's, with the stack's id,
    its Prefect server, its Ray and its home, and no telemetry."""
    from ettflow.console import RAY_SKIP_ENV, VERBOSE_ENV, ray_skip_regex

    env = dict(os.environ)
    env.update({
        STACK_ENV: stack_id, "ETTFLOW_HOME": str(cfg.home), "PREFECT_HOME": str(cfg.home / "prefect"),
        "PREFECT_API_URL": cfg.api_url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_CLI_PROMPT": "false", "RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": cfg.head_address,
        VERBOSE_ENV: "1" if cfg.verbose else "0",
    })
    if not cfg.ray_address:  # the stack's own head: token authentication with the stack's token
        env.update(ray_auth_env(cfg))
        env.pop("RAY_AUTH_TOKEN", None)
    if not cfg.verbose:  # the console's table of known noise, for the lines Ray forwards to a flow run
        env.setdefault(RAY_SKIP_ENV, ray_skip_regex())
    env.update(extra)
    return env


def ray_token(cfg: StackConfig) -> Path:
    """The stack's Ray authentication token (made once, readable by this user only). Every
    process of the stack names the file (`RAY_AUTH_TOKEN_PATH`), never the token itself; a
    driver without it cannot join the head (Ray 2.60 enforces it with `RAY_AUTH_MODE=token`)."""
    path = cfg.stack_dir / "ray_auth_token"
    if not path.is_file() or not path.read_text().strip():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path


def ray_auth_env(cfg: StackConfig) -> dict[str, str]:
    """What a process needs to join the stack's own head (set before Ray is imported: Ray reads
    its authentication mode then)."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(ray_token(cfg))}


def start_process(cfg: StackConfig, name: str, argv: list[str], env: dict[str, str]) -> tuple[psutil.Process, Path]:
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    log = cfg.log_dir / f"{name}.log"
    with open(log, "ab") as out:
        popen = subprocess.Popen(argv, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
    return psutil.Process(popen.pid), log


def wait_until(ready: Callable[[], bool], proc: psutil.Process, log: Path, what: str, timeout_s: float) -> None:
    """Poll `ready` until it holds; the process dying or the time running out is an error
    that quotes the end of its log."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
            raise StackError(f"{what} exited before it answered; the end of its log ({log}):\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise StackError(f"{what} did not answer within {timeout_s:.0f} s (its log: {log}):\n{_tail(log)}\n"
                             "`ettflow down` stops what started")
        time.sleep(0.5)


def _tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _ours(record: StackRecord | None, name: str) -> Service | None:
    svc = record.service(name) if record is not None else None
    return svc if svc is not None and svc.process() is not None else None


def prefect_server(cfg: StackConfig, record: StackRecord | None, stack_id: str) -> Service:
    """The Prefect server (API and UI), its database under `home/prefect`."""
    found = _ours(record, "prefect-server")
    if found is not None and prefect_healthy(cfg.api_url):
        return found
    if prefect_healthy(cfg.api_url):
        refuse_other_home(cfg, cfg.api_port, "Prefect server", "--api-port N")
        return Service(name="prefect-server", address=cfg.api_url,
                       detail="found running, not started by `ettflow up` (`down` leaves it)")
    if not port_free(cfg.host, cfg.api_port):
        raise StackError(f"port {cfg.api_port} on {cfg.host} is taken by {listener(cfg.api_port)}, which is not a "
                         "Prefect server: stop it, or give the stack another port with --api-port N")
    proc, log = start_process(cfg, "prefect-server", [PREFECT, "server", "start", "--host", cfg.host, "--port",
                                                      str(cfg.api_port)], service_env(cfg, stack_id))
    wait_until(lambda: prefect_healthy(cfg.api_url), proc, log, "the Prefect server", cfg.start_timeout_s)
    return Service.of_process("prefect-server", cfg.api_url, proc, log=str(log))


NO_DRAIN = ("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")  # a head's SIGTERM stops it at once (`ray_head`)


def ray_head(cfg: StackConfig, record: StackRecord | None, stack_id: str) -> Service:
    """The Ray head flow runs join (`RAY_ADDRESS` in the worker's environment); none when the
    caller names a cluster of its own."""
    if cfg.ray_address:
        return Service(name="ray-head", address=cfg.ray_address, detail="the cluster RAY_ADDRESS names")
    found = _ours(record, "ray-head")
    if found is not None and answers(cfg.host, cfg.ray_port):
        return found
    stale = _stop_stale(found, cfg)  # `ray start --block` outlives its GCS when `ray stop` ends that
    if not port_free(cfg.host, cfg.ray_port):
        who = listener(cfg.ray_port)
        if "gcs_server" in who:
            refuse_other_home(cfg, cfg.ray_port, "Ray head", "--ray-port N")
            return Service(name="ray-head", address=cfg.head_address,
                           detail=f"found running ({who}), not started by `ettflow up` (`down` leaves it)")
        raise StackError(f"port {cfg.ray_port} on {cfg.host} is taken by {who}, which is not a Ray head: stop it, "
                         "or give the stack another port with --ray-port N")
    if not port_free(cfg.host, cfg.ray_client_port):
        raise StackError(f"port {cfg.ray_client_port} on {cfg.host} (Ray Client) is taken by "
                         f"{listener(cfg.ray_client_port)}: stop it, or choose another with --ray-client-port N")
    temp = cfg.ray_temp_dir(stack_id)
    argv = [RAY, "start", "--head", "--block", "--node-ip-address", cfg.host, "--port", str(cfg.ray_port),
            "--ray-client-server-port", str(cfg.ray_client_port), "--num-cpus", str(cfg.cpus),
            "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", str(temp)]
    env = service_env(cfg, stack_id)
    # `down` cancels the runs and stops the pool before it stops the head: Ray 2.60's drain on
    # SIGTERM (for Serve replicas behind a proxy) would then wait its whole default 30 s for a
    # raylet that does not exit on its own (an idle head: 35 s from SIGTERM to exit, 4.7 s with
    # the drain off), and `down` would SIGKILL it after `stop_s`. A value of the user's is kept.
    env.setdefault(*NO_DRAIN)
    proc, log = start_process(cfg, "ray-head", argv, env)

    def started() -> bool:
        return answers(cfg.host, cfg.ray_port) and "Ray runtime started" in log.read_text(errors="replace")

    wait_until(started, proc, log, "the Ray head", cfg.start_timeout_s)
    return Service.of_process("ray-head", cfg.head_address, proc, log=str(log), detail=f"{cfg.cpus} CPUs" + stale)


def _stop_stale(found: Service | None, cfg: StackConfig) -> str:
    """A recorded service whose process lives but whose port does not answer (its children
    ended: `ray stop` by hand ends a head's GCS and raylet and leaves `ray start --block`) is
    stopped before a new one starts; what the new one's line says about it."""
    if found is None:
        return ""
    from ettflow.flows.supervise import stop_processes

    proc = found.process()
    if proc is None:
        return ""
    with contextlib.suppress(psutil.Error):
        stop_processes([proc, *proc.children(recursive=True)], cfg.stop_s)
    return f"; replaces pid {found.pid}, which no longer answered on its port"


def work_pool(cfg: StackConfig, stack_id: str) -> Service:
    """The process work pool the deployments name (created once; an existing one is kept)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with prefect_api(cfg.api_url), get_client(sync_client=True) as client:
        try:
            client.read_work_pool(cfg.pool)
            return Service(name="work-pool", address=cfg.pool, detail="exists")
        except ObjectNotFound:
            pass
    _prefect_cli(cfg, stack_id, "work-pool", "create", cfg.pool, "--type", "process")
    return Service(name="work-pool", address=cfg.pool, detail="created (type process)")


def deployments(cfg: StackConfig, stack_id: str) -> Service:
    """`prefect deploy --all` of the deployments file (again on every `up`: a changed file or
    code is what the next runs use)."""
    out = _prefect_cli(cfg, stack_id, "deploy", "--all", "--prefect-file", str(cfg.prefect_file),
                       cwd=cfg.prefect_file.parent)
    names = sorted(set(_deployment_names(out)))
    return Service(name="deployments", address=str(cfg.prefect_file), detail=", ".join(names) or "applied")


def _deployment_names(out: str) -> Iterator[str]:
    import re

    yield from re.findall(r"Deployment '([^']+)' successfully created", out)


def _prefect_cli(cfg: StackConfig, stack_id: str, *args: str, cwd: Path | None = None) -> str:
    done = subprocess.run([PREFECT, "--no-prompt", *args], env=service_env(cfg, stack_id), cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=cfg.start_timeout_s, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise StackError(f"`prefect {' '.join(args)}` failed (exit {done.returncode}):\n"
                         f"{(done.stdout + done.stderr)[-2000:]}")
    return done.stdout + done.stderr


def worker(cfg: StackConfig, record: StackRecord | None, stack_id: str) -> Service:
    """A process worker on the pool: each flow run a process of its own, joining the stack's
    Ray, sending heartbeats the crash automation watches."""
    found = _ours(record, "worker")
    if found is not None:
        return found
    name = f"ettflow-local-{stack_id[:8]}"
    env = service_env(cfg, stack_id, PREFECT_FLOWS_HEARTBEAT_FREQUENCY=str(cfg.heartbeat_s),
                      PREFECT_WORKER_QUERY_SECONDS=str(WORKER_POLL_S))
    proc, log = start_process(cfg, "worker", [PREFECT, "worker", "start", "--pool", cfg.pool, "--type", "process",
                                              "--name", name, "--prefetch-seconds", str(WORKER_PREFETCH_S)], env)
    wait_until(lambda: _worker_online(cfg, name), proc, log, "the Prefect worker", cfg.start_timeout_s)
    return Service.of_process("worker", cfg.pool, proc, log=str(log),
                              detail=f"{name}, heartbeats every {cfg.heartbeat_s} s")


def _worker_online(cfg: StackConfig, name: str) -> bool:
    from prefect.client.orchestration import get_client

    with prefect_api(cfg.api_url), get_client(sync_client=True) as client:
        return any(w.name == name and str(getattr(w.status, "value", w.status)) == "ONLINE"
                   for w in client.read_workers_for_work_pool(cfg.pool))


def crash_automation(cfg: StackConfig) -> Service:
    """Prefect's zombie detection: a run whose heartbeats stop is marked CRASHED."""
    from ettflow.flows.zombies import ensure_zombie_automation

    with prefect_api(cfg.api_url):
        automation, created = ensure_zombie_automation(cfg.heartbeat_s)
    return Service(name="crash-automation", address=str(getattr(automation, "id", "")),
                   detail=("created: " if created else "exists: ") + automation.name)


def alert_automations(cfg: StackConfig) -> Service:
    """The shipped alerts (`automations/ettflow.yaml`), posting to the webhook block; without a
    block and without `webhook_url`, applied with no action: their triggers are the alerts, in
    the Event Feed, and the detail says how to add the posting."""
    from ettflow.tasks.automations import DEFAULT_FILE, AutomationsConfig, apply_automations, save_webhook_block

    config = AutomationsConfig.load(DEFAULT_FILE)
    with prefect_api(cfg.api_url):
        if cfg.webhook_url:
            save_webhook_block(config.webhook_block, cfg.webhook_url)
        done = apply_automations(config)
    changed = len(done.created) + len(done.updated)
    posting = "" if done.webhook else (
        f"; no webhook (Webhook block {config.webhook_block!r}): they show in the Event Feed when they trigger, "
        "`ettflow up --webhook-url URL` adds the posting")
    return Service(name="alert-automations", address=str(DEFAULT_FILE),
                   detail=f"{changed} applied ({len(done.created)} created, {len(done.updated)} updated){posting}")
