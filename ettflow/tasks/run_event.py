"""The Prefect event every archived refresh emits: `ettflow.run.measured`.

Emitted once per final flow state, after the run's row is archived (or left pending: the
numbers come from the spool either way), so automations can react to a run's ETT:

- resource: the run's flow run (``prefect.flow-run.<run_id>``), named ``<model>-<mode> · ETT 27.8%
  · capETT 25.1% · NoF 2 · completed``: Prefect's event feed shows a resource's name only for
  the resources it knows (flow runs, deployments, ...), and an id of its own
  (``ettflow.run.<id>``, as before issue 43) read as that bare id on every card; with labels an automation's
  trigger can match (`ett.thresholds`): ``ettflow.model``, ``ettflow.mode``,
  ``ettflow.outcome``, ``ettflow.deployment`` (when the run has one), ``ettflow.ett_pct`` and
  ``ettflow.cap_ett_pct`` (``DDD.D``) and ``ettflow.nof`` (``DDD``);
- related resources: its deployment (role ``deployment``);
- payload: `measured_payload`: ETT%, NoF, TTS, TTR, wall, the six components' exposed seconds
  (and unattributed), model, mode, deployment and outcome (the final state: completed, failed,
  crashed, cancelled; ``skipped`` when nothing was trained).

Emitting never fails the hook: without a configured API (PREFECT_API_URL; Prefect would
start an ephemeral server just for the event) nothing is emitted, and an error is logged.
"""

from __future__ import annotations

import logging
from typing import Any

from ettflow.ett.archive import ArchiveResult
from ettflow.ett.events import COMPONENTS, UNATTRIBUTED
from ettflow.ett.thresholds import ett_label, nof_label

from .parameters import RefreshParameters

EVENT = "ettflow.run.measured"
# emitted by a refresh's final-state hook on its flow run, through the same client queue as the
# run's heartbeats, so it reaches the server after the last of them. Prefect's own final-state
# event is the server's: a heartbeat sent just before the final state can arrive after it, open
# a new wait with nothing left to end it, and the crash automation (`flows.zombies`, which
# expects this event too) fired on completed runs (issue 27)
FINISHED_EVENT = "ettflow.flow-run.finished"
log = logging.getLogger("ettflow.tasks")


def measured_payload(archived: ArchiveResult, *, model: str, mode: str, deployment: str | None) -> dict[str, Any]:
    m = archived.metrics
    return {
        "run_id": archived.run_id,
        "model": model,
        "mode": mode,
        "deployment": deployment,
        "outcome": archived.status,
        "ett_pct": round(m.ett_pct, 2),
        "cap_ett_pct": round(m.capacity_ett_pct, 2),  # what the pool and spares held for it counted too
        "nof": m.nof,
        "tts_s": round(m.tts_s, 3),
        "ttr_total_s": round(m.ttr_total_s, 3),
        "wall_s": round(m.wall_s, 3),
        "components": {c: round(m.components[c], 3) for c in COMPONENTS},
        "unattributed_s": round(m.components[UNATTRIBUTED], 3),
        "failures": [{"class": f.failure_class, "reason": f.reason[:200]} for f in m.failures],
        "archived": archived.archived,
    }


def resource_name(payload: dict[str, Any]) -> str:
    """`dlrm-optimized · ETT 27.8% · capETT 25.1% · NoF 2 · completed` (skipped:
    `dlrm-optimized · skipped`)."""
    head = f"{payload['model']}-{payload['mode']}"
    if payload["outcome"] == "skipped":
        return f"{head} · skipped"
    cap = f" · capETT {payload['cap_ett_pct']:.1f}%" if payload.get("cap_ett_pct") is not None else ""
    return f"{head} · ETT {payload['ett_pct']:.1f}%{cap} · NoF {payload['nof']} · {payload['outcome']}"


def measured_resource(payload: dict[str, Any]) -> dict[str, str]:
    labels = {
        "prefect.resource.id": f"prefect.flow-run.{payload['run_id']}",
        # the event feed shows a resource's name: the numbers in it (issue 27: they were only in the JSON)
        "prefect.resource.name": resource_name(payload),
        "ettflow.model": payload["model"],
        "ettflow.mode": payload["mode"],
        "ettflow.outcome": payload["outcome"],
        "ettflow.ett_pct": ett_label(payload["ett_pct"]),
        "ettflow.nof": nof_label(payload["nof"]),
    }
    if payload.get("cap_ett_pct") is not None:
        labels["ettflow.cap_ett_pct"] = ett_label(payload["cap_ett_pct"])
    if payload["deployment"]:
        labels["ettflow.deployment"] = payload["deployment"]
    return labels


def emit_run_measured(flow_run, archived: ArchiveResult, *, outcome: str | None = None,
                      deployment: str | None = None, params: RefreshParameters | None = None):
    """Emit `ettflow.run.measured` for the archived run of `flow_run`; the event, or None
    when nothing was emitted (no API, or an error: logged). `outcome` (default: the archived
    status) and `deployment` (default: read from Prefect) when the caller knows them."""
    from prefect.events import emit_event
    from prefect.settings import PREFECT_API_URL

    from .run_labels import deployment_name

    if not PREFECT_API_URL.value():
        return None
    if params is None:
        params = RefreshParameters.lenient(flow_run.parameters)
    if deployment is None:
        deployment = deployment_name(flow_run)
    payload = measured_payload(archived, model=params.model, mode=params.mode, deployment=deployment)
    if outcome is not None:
        payload["outcome"] = outcome
    related = []  # the flow run is the event's resource (`measured_resource`)
    if getattr(flow_run, "deployment_id", None):
        related.append({"prefect.resource.id": f"prefect.deployment.{flow_run.deployment_id}",
                        "prefect.resource.role": "deployment", "prefect.resource.name": deployment or ""})
    try:
        event = emit_event(EVENT, resource=measured_resource(payload), related=related, payload=payload)
    except Exception:  # noqa: BLE001 - an event is a notification: the run's row matters more
        log.warning("could not emit %s for run %s", EVENT, archived.run_id, exc_info=True)
        return None
    if event is not None:
        log.info("emitted %s for run %s (ETT %.1f%%, NoF %d)", EVENT, archived.run_id, payload["ett_pct"],
                 payload["nof"])
    return event


def emit_finished(flow_run_id: str) -> None:
    """The run's `FINISHED_EVENT` (its final-state hook, after its work); never raises."""
    from prefect.events import emit_event
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        return
    try:
        emit_event(FINISHED_EVENT, resource={"prefect.resource.id": f"prefect.flow-run.{flow_run_id}"})
    except Exception:  # noqa: BLE001 - a notification: the run is archived either way
        log.warning("could not emit %s for flow run %s", FINISHED_EVENT, flow_run_id, exc_info=True)
