"""Refreshes as deployment runs: created on the stack's server, executed by its worker (each
in a process of its own, joining the stack's Ray), waited for here, then compared.

This is what `ettflow up --refreshes N` runs: the numbers a user's deployment gets, not those
of one long-lived process (`ettflow refresh`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ettflow.tasks.parameters import RefreshParameters

from .config import StackError
from .services import prefect_api

FINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "CRASHED"})
PROGRESS_EVERY_S = 30.0  # a line while a run has not changed state, so a long one is seen to live


@dataclass(frozen=True)
class DeployedRun:
    """A finished deployment run as the server tells it."""

    run_id: str
    name: str
    state: str  # the state type: COMPLETED, FAILED, ...
    message: str
    url: str  # its page in the UI
    seconds: float  # creation to final state

    @property
    def completed(self) -> bool:
        return self.state == "COMPLETED"


def state_kind(state) -> str:
    """A flow run state's type as the server names it ("RUNNING", "COMPLETED", ...); a run with
    no state yet is "PENDING"."""
    return str(getattr(state.type, "value", state.type)) if state is not None else "PENDING"


def run_and_wait(api_url: str, ui_url: str, deployment: str, parameters: RefreshParameters | Mapping[str, Any], *,
                 timeout_s: float, say: Callable[[str], None] = print, poll_s: float = 2.0,
                 log_hint: str = "the worker's log", scheduled_at: float | None = None) -> DeployedRun:
    """Create a run of `deployment` ("flow/deployment") with `parameters`, follow its state
    until it is final, and return it. A refresh's parameters (`RefreshParameters`) go as
    their sections, each merged into the deployment's own (Prefect replaces a whole top-level
    parameter: a run's `training` would drop the deployment's other training fields).
    `scheduled_at` (epoch s): the run is scheduled for then,
    as a deployment's schedule creates its runs (the worker starts its process ahead of it:
    prefetch); None: it is due now (ad hoc). A run still going after `timeout_s` is an error
    (it keeps running on the worker)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with prefect_api(api_url), get_client(sync_client=True) as client:
        try:
            dep = client.read_deployment_by_name(deployment)
        except ObjectNotFound:
            raise StackError(f"no deployment {deployment!r} on {api_url}: `ettflow up` applies prefect.yaml's "
                             "deployments") from None
        state = None
        if scheduled_at is not None:
            from datetime import datetime, timezone

            from prefect.states import Scheduled

            state = Scheduled(scheduled_time=datetime.fromtimestamp(scheduled_at, tz=timezone.utc))
        given = parameters.to_json() if isinstance(parameters, RefreshParameters) else dict(parameters)
        merged = {name: {**dep.parameters[name], **value}
                  if isinstance(value, dict) and isinstance(dep.parameters.get(name), dict) else value
                  for name, value in given.items()}
        flow_run = client.create_flow_run_from_deployment(dep.id, parameters=merged, state=state)
        run_id, url = str(flow_run.id), f"{ui_url}/runs/flow-run/{flow_run.id}"
        say(f"  deployment run {flow_run.name} created" + (
            f", scheduled {scheduled_at - time.time():.0f} s ahead" if scheduled_at is not None else "") + f": {url}")
        t0 = last_change = time.monotonic()
        seen = None
        while True:
            flow_run = client.read_flow_run(flow_run.id)
            state = flow_run.state
            kind = state_kind(state)
            name = state.name if state is not None else "Pending"
            if name != seen:
                seen, last_change = name, time.monotonic()
                say(f"  [{time.monotonic() - t0:6.1f} s] {name}")
            elif time.monotonic() - last_change > PROGRESS_EVERY_S:
                last_change = time.monotonic()
                say(f"  [{time.monotonic() - t0:6.1f} s] still {name} (follow it in {log_hint})")
            if kind in FINAL:
                return DeployedRun(run_id, flow_run.name, kind, (state.message or "") if state else "", url,
                                   time.monotonic() - t0)
            if time.monotonic() - t0 > timeout_s + max(0.0, (scheduled_at or 0.0) - time.time()):
                raise StackError(f"deployment run {run_id} is still {name} after {timeout_s:.0f} s (it goes on on the "
                                 f"worker): {url}")
            time.sleep(poll_s)


ACTIVE = ("RUNNING", "PENDING", "CANCELLING")  # runs a worker has taken: their processes run now
CANCEL_WAIT_S = 90.0  # a cancelled run's end: the ranks' emergency checkpoint, the hooks, the archive


def cancel_running(api_url: str, pool: str, *, timeout_s: float = CANCEL_WAIT_S, poll_s: float = 1.0,
                   say: Callable[[str], None] = print) -> list[DeployedRun]:
    """Cancel every run of work pool `pool` a worker is executing, as the UI's Cancel does (the
    run set CANCELLING: its worker stops the process, the ranks take their emergency checkpoint,
    the stop is the operator's, not a failure, and the hooks archive the run), and wait until
    each is final, at most `timeout_s`; the runs as they ended (a run still going after the
    wait is returned with its state then). The worker must still be running: it carries the
    cancel out. Scheduled runs that have not started are left to the schedule."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        WorkPoolFilter,
        WorkPoolFilterName,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelling

    with prefect_api(api_url), get_client(sync_client=True) as client:
        running = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
                any_=[StateType(s) for s in ACTIVE]))),
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])))
        if not running:
            return []
        t0 = time.monotonic()
        for run in running:
            if run.state is not None and run.state.type != StateType.CANCELLING:
                client.set_flow_run_state(run.id, Cancelling(message="stopped by `ettflow down`"))
            say(f"  cancelling the running refresh {run.name} ({run.id}): its ranks save, its row is archived")
        ended: dict[str, DeployedRun] = {}
        while True:
            for run in running:
                key = str(run.id)
                if key in ended:
                    continue
                now = client.read_flow_run(run.id)
                kind = state_kind(now.state)
                if kind in FINAL:
                    ended[key] = DeployedRun(key, now.name, kind, now.state.message or "", "", time.monotonic() - t0)
            if len(ended) == len(running) or time.monotonic() - t0 > timeout_s:
                break
            time.sleep(poll_s)
        for run in running:
            if str(run.id) not in ended:
                say(f"  the refresh {run.name} ({run.id}) did not end within {timeout_s:.0f} s of its cancel: "
                    "it is stopped with the worker, and archived as crashed by the next refresh")
        return list(ended.values())
