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
            kind = str(getattr(state.type, "value", state.type)) if state is not None else "PENDING"
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
