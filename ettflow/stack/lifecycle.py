"""`up`, `down` and `status` of the local stack, in the order the deployed path needs them.

`up` writes its record after each service, so a failure part way leaves a record that `down`
can stop; a service already running (this stack's, or one found at its port) is used as it
is. `down` first cancels the refreshes the worker is running (as the UI's Cancel: their
ranks save, their rows are archived, the stop is no failure) and waits for them, then stops
the worker (no new flow run starts), the Ray head and the server, each with its process tree
and its session (`up` starts each in a session of its own), then every process left that
carries the stack's id or belongs to one of those sessions.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from ettflow.flows.supervise import stop_processes

from . import services
from .config import StackConfig
from .records import Service, StackRecord, session_processes, stack_processes

Say = Callable[[str], None]


def up(cfg: StackConfig, say: Say = print) -> StackRecord:
    """Start, or find running, every service of the stack; wait until each answers."""
    record = StackRecord.read(cfg.record_path)
    if record is not None and not any(s.process() for s in record.services) and not stack_processes(record.stack_id):
        record = None  # a stack that is gone: start afresh, with a new id
    stack_id = record.stack_id if record is not None else uuid.uuid4().hex
    current = record or StackRecord(stack_id=stack_id, api_url=cfg.api_url, ui_url=cfg.ui_url,
                                    ray_address=cfg.head_address, pool=cfg.pool,
                                    ray_temp_dir=None if cfg.ray_address else str(cfg.ray_temp_dir(stack_id)))
    steps = (
        ("prefect-server", lambda: services.prefect_server(cfg, record, stack_id)),
        ("ray-head", lambda: services.ray_head(cfg, record, stack_id)),
        ("work-pool", lambda: services.work_pool(cfg, stack_id)),
        ("deployments", lambda: services.deployments(cfg, stack_id)),
        ("worker", lambda: services.worker(cfg, record, stack_id)),
        ("crash-automation", lambda: services.crash_automation(cfg)),
        ("alert-automations", lambda: services.alert_automations(cfg)),
    )
    for name, start in steps:
        before = record.service(name) if record is not None else None
        svc = start()
        current = current.with_service(svc)
        current.write(cfg.record_path)
        say(_line(svc, again=before is not None and before.pid is not None and before.pid == svc.pid))
    say(f"\nettflow up: the stack is up. Prefect UI: {cfg.ui_url}   (API {cfg.api_url}; Ray {cfg.head_address})")
    say(f"  records and logs: {cfg.stack_dir}   `ettflow status` shows it, `ettflow down` stops it")
    return current


def _line(svc: Service, *, again: bool) -> str:
    how = f"{'running' if again else 'started'} (pid {svc.pid})" if svc.started else ""
    parts = [p for p in (how, svc.detail) if p]
    return f"  {svc.name:<18} {svc.address}  " + "; ".join(parts)


@dataclass(frozen=True)
class Stopped:
    services: tuple[str, ...]  # the recorded services that were stopped
    leftovers: int  # processes of the stack found after them (stopped too)


def down(cfg: StackConfig, say: Say = print) -> Stopped:
    """Stop what `up` started, by its record; leave nothing of the stack running."""
    record = StackRecord.read(cfg.record_path)
    if record is None:
        say(f"ettflow down: no stack recorded under {cfg.stack_dir}: nothing to stop")
        return Stopped((), 0)
    stopped, sessions = [], []
    worker = record.service("worker")
    if worker is not None and worker.process() is not None and services.prefect_healthy(record.api_url):
        _cancel_running(record, say)  # first, while the worker can still carry the cancels out
    head = record.service("ray-head")
    if head is not None and head.started and head.process() is not None:
        _stop_pool(cfg, say)
    for name in ("worker", "ray-head", "prefect-server"):
        svc = record.service(name)
        proc = svc.process() if svc is not None else None
        if proc is None:
            continue
        try:
            group = [proc, *proc.children(recursive=True)]
        except Exception:  # noqa: BLE001 - it ended meanwhile
            group = [proc]
        group += [p for p in session_processes(proc.pid) if p not in group]
        sessions.append(proc.pid)
        stop_processes(group, cfg.stop_s)
        stopped.append(name)
        say(f"  stopped {name} (pid {svc.pid})")
    # what outlived its service: the stack's id in its environment, or its service's session (only
    # of a leader seen alive above: a pid recorded days ago may lead someone else's session now)
    left = stack_processes(record.stack_id)
    for leader in sessions:
        left += [p for p in session_processes(leader) if p not in left]
    if left:
        stop_processes(left, cfg.stop_s)
        say(f"  stopped {len(left)} more process(es) of the stack (flow runs, Ray workers)")
    if record.ray_temp_dir:
        shutil.rmtree(record.ray_temp_dir, ignore_errors=True)
    cfg.record_path.unlink(missing_ok=True)
    kept = [s.name for s in record.services if s.name in ("prefect-server", "ray-head") and not s.started]
    say("ettflow down: the stack is stopped" + (f" (left running, not started by `ettflow up`: {', '.join(kept)})"
                                                  if kept else ""))
    return Stopped(tuple(stopped), len(left))


def _cancel_running(record: StackRecord, say: Say) -> None:
    """The refreshes the worker is running are stopped as an operator's cancel (`deployed_runs.
    cancel_running`): emergency checkpoints, rows archived as cancelled, no failure counted,
    Prefect's state final before `down` goes on. A failure is said, and `down` goes on."""
    from .deployed_runs import cancel_running

    try:
        ended = cancel_running(record.api_url, record.pool, say=say)
    except Exception as exc:  # noqa: BLE001 - stopping the stack must not depend on it
        say(f"  the running refreshes were not cancelled first ({type(exc).__name__}: {exc}): they stop with the "
            "worker and are archived as crashed by the next refresh")
        return
    for run in ended:
        first = run.message.splitlines()[0][:160] if run.message else ""
        say(f"  {run.name}: {run.state.lower()} after {run.seconds:.1f} s" + (f" ({first})" if first else ""))


def _stop_pool(cfg: StackConfig, say: Say) -> None:
    """The head's pool ends with it: first what it held unclaimed goes to the warehouse's
    ledger (`ettflow pool stop`). A failure is said, and the head is stopped anyway."""
    from dataclasses import replace

    from .pool import join_cluster, stop_pool

    try:
        join_cluster(replace(cfg, ray_address=None))  # the head this stack started, not RAY_ADDRESS's
        import ray

        from ettflow.trainer.group.pool_service import service

        pool = service(create=False)
        if pool is not None:
            stop_pool(pool, say=lambda line: say("  " + line))
        ray.shutdown()
    except Exception as exc:  # noqa: BLE001 - stopping the stack must not depend on its pool
        say(f"  the cluster's pool was not stopped first ({type(exc).__name__}: {exc}): what it held unclaimed "
            "since the last run is not in the ledger")


def _answers(svc: Service, record: StackRecord) -> bool:
    """Whether a running service answers on its port (a Ray head's GCS, the Prefect API); the
    worker has no port."""
    if svc.name == "ray-head":
        host, _, port = svc.address.rpartition(":")
        return services.answers(host, int(port))
    if svc.name == "prefect-server":
        return services.prefect_healthy(record.api_url)
    return True


def status(cfg: StackConfig, say: Say = print) -> bool:
    """Say what of the stack is up; True when every service it started still runs."""
    record = StackRecord.read(cfg.record_path)
    if record is None:
        say(f"ettflow status: no stack under {cfg.stack_dir} (`ettflow up` starts one)")
        return False
    healthy = True
    for svc in record.services:
        if svc.started:
            alive = svc.process() is not None
            deaf = alive and not _answers(svc, record)
            healthy &= alive and not deaf
            state = (f"DOWN (pid {svc.pid} is gone; its log: {svc.log})" if not alive else
                     f"NOT ANSWERING (pid {svc.pid} runs, its port does not answer; its log: {svc.log}): "
                     "`ettflow up` replaces it" if deaf else f"up (pid {svc.pid})")
        else:
            state = svc.detail
        say(f"  {svc.name:<18} {svc.address}  {state}")
    api = services.prefect_healthy(record.api_url)
    say(f"Prefect API {record.api_url}: {'answers' if api else 'does not answer'}; UI {record.ui_url}")
    say(f"processes of the stack: {len(stack_processes(record.stack_id))}")
    return healthy and api
