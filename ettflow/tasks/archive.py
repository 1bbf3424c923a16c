"""State hooks that archive a run's ETT, and the archiving they share.

Every hook does the same thing, idempotently: read the run's spool, compute its ETT, upsert
it into the warehouse (`ett.archive.archive_spooled_run`, keyed by run/attempt/rank/seq and
serialized per run, so two hooks archiving one run, or a flow retry archiving it again, leave
one copy holding the latest spool). Flow hooks (completion, failure, crash, cancellation)
then attach the artifacts to the flow run by its id.

Hooks may run in another process with a stale flow run and no run context (a worker runs
`on_crashed` after the flow's process died): they take everything from their arguments (the
flow run's id and parameters) and the spool, never from the context. A hook never raises
for a run that has no spool (a parameter was rejected before anything ran): it logs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ettflow import paths
from ettflow.ett.archive import Archived, archive_spooled_run
from ettflow.ett.warehouse import RunInfo, Warehouse

from . import run_spool

log = logging.getLogger("ettflow.tasks")


def spool_of(params: Mapping[str, Any]) -> Path:
    return Path(params["spool_root"]) if params.get("spool_root") else paths.spool_root()


def run_info(run_id: str, params: Mapping[str, Any], *, status: str, flow_run_id: str | None,
             tags: Mapping[str, Any] | None = None) -> RunInfo:
    merged = {"world_size": params.get("world_size", 2), "switches": dict(params.get("switches") or {}),
              **dict(params.get("tags") or {}), **dict(tags or {})}
    return RunInfo(run_id=run_id, model=params.get("model") or "dlrm", mode=params.get("mode") or "optimized",
                   flow_run_id=flow_run_id, status=status, tags=merged)


def archive_run(run_id: str, params: Mapping[str, Any], *, status: str, flow_run_id: str | None = None,
                tags: Mapping[str, Any] | None = None) -> Archived | None:
    """Archive the run's spool to the warehouse (the `warehouse_url` parameter, else the
    default); None when the run spooled nothing."""
    spool = spool_of(params)
    evs = run_spool.events(spool, run_id)
    if not evs:
        log.warning("run %s has no spooled events under %s: nothing to archive", run_id, spool)
        return None
    info = run_info(run_id, params, status=status, flow_run_id=flow_run_id,
                    tags={**run_spool.publish_summary(evs), **dict(tags or {})})
    with Warehouse.open(params.get("warehouse_url")) as wh:
        archived = archive_spooled_run(wh, spool, info)
        log.info("archived run %s (%s): ETT %.1f%%, NoF %d, %d events -> %s", run_id, status,
                 archived.metrics.ett_pct, archived.metrics.nof, archived.events, wh.display_url)
    return archived


def deployment_name(flow_run) -> str | None:
    if not getattr(flow_run, "deployment_id", None):
        return None
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            return client.read_deployment(flow_run.deployment_id).name
    except Exception:  # noqa: BLE001 - the key falls back to the flow name
        log.warning("could not read deployment %s", flow_run.deployment_id, exc_info=True)
        return None


def publish_artifacts(flow_name: str, flow_run, archived: Archived) -> None:
    from ettflow.flows.params import slug

    from .artifacts import create_run_artifacts, timeline_file
    from .timeline_plot import render_timeline

    params = dict(flow_run.parameters or {})
    run_id = str(flow_run.id)
    evs = run_spool.events(spool_of(params), run_id)
    m = archived.metrics
    png = render_timeline(evs, m)
    snapshot = run_spool.publish_summary(evs).get("snapshot")
    timeline_file(snapshot, spool_of(params) / run_id).write_bytes(png)
    summary = (f"Run {run_id} ({params.get('model') or 'dlrm'}, {params.get('mode') or 'optimized'}): "
               f"ETT {m.ett_pct:.1f}%, wall {m.wall_s:.1f} s, TTS {m.tts_s:.1f} s, NoF {m.nof}")
    create_run_artifacts(flow_run_id=flow_run.id, slug=slug(deployment_name(flow_run) or flow_name),
                         run_id=run_id, metrics=m, png=png, snapshot=snapshot, summary=summary)


def archive_on_flow_state(flow, flow_run, state) -> None:
    """Flow hook (completion, failure, crash, cancellation): archive, then the artifacts."""
    status = state.type.value.lower()
    archived = archive_run(str(flow_run.id), dict(flow_run.parameters or {}), status=status,
                           flow_run_id=str(flow_run.id), tags={"flow_run_count": flow_run.run_count})
    if archived is not None:
        publish_artifacts(flow.name, flow_run, archived)


def archive_on_task_state(task, task_run, state) -> None:
    """Task hook: archive the run as it stands when one of its tasks ends in `state`."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    params = dict(ctx.parameters) if ctx is not None else {}
    flow_run_id = str(task_run.flow_run_id)
    archive_run(flow_run_id, params, status=f"{task.name} {state.name.lower()}", flow_run_id=flow_run_id)
