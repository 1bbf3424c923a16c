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

A run that Prefect marks CRASHED died without recording why: `on_crashed` first adds an
`orchestrator` failure to its spool (`ett.orphans`: at the driver's last heartbeat, or the end
of the last spooled event, detected now), so its row counts it (NoF) and its timeline shows it,
and marks the task runs it left open CRASHED (`crash_open_task_runs`: else the UI shows the
train task Running forever).

A warehouse outage never fails a hook: the row waits as pending in the spool
(`ett.archive.archive_or_defer`) and a warning says how to retry (`ettflow archive --run ID`).

`finish_run` is where a finished run is measured and announced, once: archive, then the
run's `RunSummary` (`ett.run_summary`: ETT%, NoF and the failures, components, model, mode,
windows, state, outcome), from which come the artifacts' descriptions, the run's tags, the
final line of its progress artifact and its state message. The flow body calls it just before
it returns its final state (so the state carries the message: Prefect runs the completion and
failure hooks after the state is set); the hooks then find the run finished
(`finished_in_body`) and do nothing again. The crash and cancellation hooks call it themselves
and set a new state of the same type with the message (`run_labels.restate_with_message`),
as does the failure hook for a run that failed outside the body's reach (a flow timeout).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ettflow import paths
from ettflow.ett.archive import ArchiveResult, archive_or_defer, describe_problems, outage_reason, settles_lineage
from ettflow.ett.heartbeat import heartbeat_file, read_heartbeat
from ettflow.ett.lineage import LineageRecord, Outcome, settle_ended_run
from ettflow.ett.orphans import record_orchestrator_failure
from ettflow.ett.run_summary import (
    FinalState,
    RunSummary,
    description_head,
    failure_line,
    measured_name,
    progress_history,
    reason_is_cut,
    run_tags,
    state_message,
    summarize,
)
from ettflow.ett.spool import SpoolWriteError
from ettflow.ett.warehouse import RunInfo, Warehouse
from ettflow.tasks.run_spool import RunRecorder

from . import run_labels, run_spool
from .parameters import RefreshParameters
from .run_event import emit_finished, emit_run_measured
from .skipped import skip_reason
from .warehouse_url import resolve_warehouse_url

log = logging.getLogger("ettflow.tasks")


Params = RefreshParameters | Mapping[str, Any]


def run_params(params: Params | None) -> RefreshParameters:
    """A run's parameters as far as they are valid (a hook's run may have been refused by them)."""
    return params if isinstance(params, RefreshParameters) else RefreshParameters.lenient(params)


def spool_of(params: Params) -> Path:
    root = run_params(params).storage.spool_root
    return Path(root) if root else paths.spool_root()


def recorder_of(params: Params, run_id: str) -> RunRecorder:
    """The run's spool, where its parameters put it."""
    return RunRecorder(spool_of(params), run_id)


def run_info(run_id: str, params: Params, *, status: str, flow_run_id: str | None,
             tags: Mapping[str, Any] | None = None) -> RunInfo:
    p = run_params(params)
    chosen = {name: value for name, value in p.switches.model_dump().items() if value is not None}
    merged = {"world_size": p.training.world_size, "switches": chosen, **dict(p.tags or {}), **dict(tags or {})}
    return RunInfo(run_id=run_id, model=p.model, mode=p.mode, flow_run_id=flow_run_id, status=status, tags=merged)


def log_result(result: ArchiveResult) -> None:
    """One log line per archive: the ETT and where it went, the spool's problems named; a
    pending row is a warning that says how to retry."""
    m = result.metrics
    problems = f"; {describe_problems(result.problems)}" if result.problems else ""
    if result.pending is not None:
        log.warning("%s (ETT %.1f%%, NoF %d, %d events%s)", result.pending.message, m.ett_pct, m.nof,
                    result.events, problems)
        return
    log.log(logging.WARNING if result.problems else logging.INFO,
            "archived run %s (%s): ETT %.1f%%, NoF %d, %d events -> %s%s", result.run_id, result.status,
            m.ett_pct, m.nof, result.events, result.warehouse, problems)


def archive_run(run_id: str, params: Params, *, status: str, flow_run_id: str | None = None,
                tags: Mapping[str, Any] | None = None) -> ArchiveResult | None:
    """Archive the run's spool to the warehouse its parameters name (`resolve_warehouse_url`,
    else the default); None when the run spooled nothing on its clock (nothing at all, or only
    work off it, such as a stopped run's anchor published). A warehouse outage leaves the row
    pending (`ArchiveResult.pending`, logged as a warning) instead of raising. A run that ended
    (crashed, failed, cancelled) before it spooled anything may still hold window claims (it
    died between its claim and its trainer's reservation): they are released (`settle_unspooled`)."""
    params = run_params(params)
    spool = spool_of(params)
    evs = RunRecorder(spool, run_id).events()
    if not run_spool.measurable(evs):  # nothing, or only work off the clock (a stopped run's anchor published)
        if evs:
            log.info("run %s spooled only work off the clock (%s): no ETT row", run_id,
                     ", ".join(sorted({e.phase for e in evs})))
        else:
            log.warning("run %s has no spooled events under %s: nothing to archive", run_id, spool)
        settle_unspooled(run_id, params, status)
        return None
    skipped = skip_reason(evs)  # nothing was trained: a `skipped` row, not a 0% ETT run
    if skipped is not None:
        status, tags = "skipped", {**dict(tags or {}), "skip_reason": skipped}
    info = run_info(run_id, params, status=status, flow_run_id=flow_run_id,
                    tags={**run_spool.publish_summary(evs), **run_spool.interval_tags(evs), **dict(tags or {})})
    result = archive_or_defer(lambda: resolve_warehouse_url(params.warehouse), spool, info)
    log_result(result)
    return result


def settle_unspooled(run_id: str, params: RefreshParameters, status: str) -> LineageRecord | None:
    """A run that ended `status` with nothing spooled: its live window claims released and its
    lineage recorded (`lineage.settle_ended_run`), so the model's next refresh need not wait for
    them to go stale (a day). Only for a run whose heartbeat began (the flow starts it before the
    claim); nothing for another status, for a run whose own record waits in the spool, or with the
    warehouse down (logged: the next refresh that waits on the claims, or their staleness,
    releases them)."""
    spool = spool_of(params)
    if not settles_lineage(spool, run_id, status) or not heartbeat_file(spool, run_id).is_file():
        return None  # no heartbeat: it never got as far as its claim (refused, or died before)
    try:
        with Warehouse.open(resolve_warehouse_url(params.warehouse)) as wh:
            settled = settle_ended_run(wh, params.model, run_id, status,
                                       reason=f"its run ended {status} before it spooled anything")
    except Exception as exc:  # noqa: BLE001 - a hook never fails over this; the claims lapse at worst
        log.warning("run %s ended %s: its window claims could not be released (%s)", run_id, status,
                    outage_reason(exc))
        return None
    if settled is not None:
        log.warning("run %s ended %s before it spooled anything: windows %s of model %s released", run_id, status,
                    ", ".join(settled.windows), params.model)
    return settled


def record_crash(spool: Path, run_id: str, message: str | None) -> None:
    """Add the orchestrator failure of a run Prefect marked CRASHED (once; see `ett.orphans`)."""
    beat = read_heartbeat(spool, run_id)
    try:
        placed = record_orchestrator_failure(
            spool, run_id, last_alive=beat.last_beat if beat is not None else None, detected_at=time.time(),
            reason=f"Prefect marked the flow run CRASHED: {message or 'its process died'}"[:500],
            detection="prefect_crashed")
    except SpoolWriteError as exc:
        log.error("cannot record the crash of run %s in its spool: %s", run_id, exc)
        return
    if placed is not None:
        log.warning("run %s crashed: orchestrator failure recorded at %.3f (attempt %d), detected at %.3f",
                    run_id, placed.failed_at, placed.attempt, placed.detected_at)


def crash_open_task_runs(flow_run_id: str, message: str | None) -> int:
    """Mark the task runs a CRASHED flow run left open (pending or running: the process that
    ran them is gone, so nothing else will end them) CRASHED too; how many. Only against a
    configured Prefect API (a worker's hook); a failure is logged, never raised."""
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        return 0
    try:
        from uuid import UUID

        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import (
            TaskRunFilter,
            TaskRunFilterFlowRunId,
            TaskRunFilterState,
            TaskRunFilterStateType,
        )
        from prefect.client.schemas.objects import StateType
        from prefect.states import Crashed

        open_states = TaskRunFilterState(type=TaskRunFilterStateType(
            any_=[StateType.PENDING, StateType.RUNNING, StateType.SCHEDULED]))
        with get_client(sync_client=True) as client:
            left = client.read_task_runs(task_run_filter=TaskRunFilter(
                flow_run_id=TaskRunFilterFlowRunId(any_=[UUID(flow_run_id)]), state=open_states))
            for task_run in left:
                client.set_task_run_state(task_run.id, Crashed(
                    message=f"its flow run crashed: {message or 'its process died'}"[:500]), force=True)
    except Exception:  # noqa: BLE001 - the row matters more than the task runs' display
        log.warning("could not mark the open task runs of crashed flow run %s CRASHED", flow_run_id, exc_info=True)
        return 0
    if left:
        log.warning("flow run %s crashed: its open task runs %s marked CRASHED", flow_run_id,
                    ", ".join(t.name for t in left))
    return len(left)


def publish_artifacts(flow_run, archived: ArchiveResult, summary: RunSummary, artifact_slug: str) -> None:
    from ettflow.ett.capacity import holdings_of_run

    from .artifacts import create_run_artifacts, create_skipped_artifact, timeline_file
    from .timeline_plot import render_timeline

    params = run_params(flow_run.parameters)
    run_id = str(flow_run.id)
    evs = recorder_of(params, run_id).events()
    if archived.status == "skipped":  # nothing trained: no timeline, no ETT table (issue 27)
        create_skipped_artifact(flow_run_id=flow_run.id, slug=artifact_slug, run_id=run_id,
                                reason=skip_reason(evs) or "skipped", head=description_head(summary))
        return
    m = archived.metrics
    png = render_timeline(evs, m)
    snapshot = run_spool.publish_summary(evs).get("snapshot")
    picture = timeline_file(snapshot, spool_of(params) / run_id)
    try:
        picture.write_bytes(png)
    except OSError as exc:  # a full disk: the Prefect artifacts below still carry the picture
        picture.unlink(missing_ok=True)
        log.warning("cannot save the timeline picture %s (%s): it is in the run's Prefect artifacts only",
                    picture, exc)
    text = (f"run {run_id} ({summary.model}, {summary.mode}): ETT {m.ett_pct:.1f}%, wall {m.wall_s:.1f} s, "
            f"TTS {m.tts_s:.1f} s, NoF {m.nof}")
    create_run_artifacts(flow_run_id=flow_run.id, slug=artifact_slug, run_id=run_id, metrics=m, png=png,
                         snapshot=snapshot, summary=text, head=description_head(summary),
                         interval=run_spool.planned_interval(evs), spares=run_spool.spare_plan(evs),
                         holdings=holdings_of_run(run_id, summary.model, evs, m.wall_start, m.wall_end))


# flow run id -> the final state its flow body finished it with (`finish_run`); the hooks of
# that state, run right after in the same process, find it here and do not archive again
_FINISHED_IN_BODY: dict[str, FinalState] = {}


def finished_in_body(run_id: str, state: FinalState) -> bool:
    """Whether the flow body finished the run with `state` (asked once, by that state's hook)."""
    return _FINISHED_IN_BODY.pop(run_id, None) is state


def _run_logger(flow_run):
    try:
        from prefect.logging.loggers import flow_run_logger

        return flow_run_logger(flow_run)
    except Exception:  # noqa: BLE001 - no Prefect logging: the module's logger
        return log


def finish_run(flow_name: str, flow_run, *, state: FinalState, outcome: str, reason: str | None = None,
               windows: tuple[str, ...] = (), params: Params | None = None,
               in_body: bool = False, archive: bool = True) -> RunSummary:
    """Archive the finished run and announce it (see the module docstring); returns its
    summary: the one place where a run's measured result exists after archiving.

    `outcome`: the lineage outcome (published, gated, skipped, failed), or crashed/cancelled.
    `params`: the run's parameters (default: the flow run's). `in_body`: called by the flow
    body before it returns `state` (its hooks then skip the run). `archive` False: a refused
    run, announced without an ETT row."""
    from .plan import slug as slug_of

    params = run_params(params if params is not None else flow_run.parameters)
    run_id = str(flow_run.id)
    if archive and state is FinalState.FAILED and not recorder_of(params, run_id).events():
        archive = False  # refused before it recorded anything (a parameter): no row, nothing to warn about
        settle_unspooled(run_id, params, state.value)  # it may have failed after its claim (its heartbeat says)
    deployment = run_labels.deployment_name(flow_run)
    archived = archive_run(run_id, params, status=state.value, flow_run_id=run_id,
                           tags={"flow_run_count": getattr(flow_run, "run_count", 1), "deployment": deployment}) \
        if archive else None
    if archived is not None and archived.status == "skipped":
        outcome = Outcome.SKIPPED.value
    summary = summarize(archived.metrics if archived is not None else None, run_id=run_id,
                        model=params.model, mode=params.mode,
                        state=state, outcome=outcome, windows=windows, reason=reason)
    name = measured_name(summary)  # the runs list shows the result; the event names the run so
    if run_labels.name_flow_run(run_id, name):
        flow_run = flow_run.model_copy(update={"name": name}) if hasattr(flow_run, "model_copy") else flow_run
    if archived is not None:  # the `ettflow.run.measured` event (tasks.run_event)
        emit_run_measured(flow_run, archived, outcome=outcome, deployment=deployment, params=params)
    logger = _run_logger(flow_run)
    if not (in_body and state is FinalState.COMPLETED):  # a completed body's failures were told at each restart
        for failure in recorder_of(params, run_id).failures():
            logger.warning("%s", failure_line(failure))
    slug = slug_of(deployment or flow_name)
    if archived is not None:
        try:
            publish_artifacts(flow_run, archived, summary, slug)
        except Exception:  # noqa: BLE001 - the row is written; the artifacts are its pictures
            logger.warning("could not attach the ETT artifacts to flow run %s", run_id, exc_info=True)
    run_labels.tag_flow_run(run_id, run_tags(summary, run_labels.current_tags(run_id)))
    from .progress import RunProgress

    message = state_message(summary)
    RunProgress(run_id, slug).finish(state.title, message,
                                     progress_history(archived.metrics)
                                     if archived is not None and archived.status != "skipped" else None)
    logger.log(logging.INFO if state is FinalState.COMPLETED else logging.WARNING, "%s: %s", state.title, message)
    if reason_is_cut(summary.reason):  # the state message has its first line: the whole of it is here
        logger.warning("%s, in full: %s", state.title, summary.reason)
    if in_body:
        _FINISHED_IN_BODY[run_id] = state
    return summary


def archive_on_flow_state(flow, flow_run, state) -> None:
    """Flow hook (completion, failure, crash, cancellation): unless the flow body finished the
    run already (`finish_run`), archive and announce it now. A crash is recorded first; a
    failed (e.g. timed out), crashed or cancelled run then gets a state of the same type whose
    message says its ETT."""
    value = state.type.value.lower()
    try:  # a runner runs the cancellation hooks while the run is CANCELLING: it ends CANCELLED
        final = FinalState("cancelled" if value == "cancelling" else value)
    except ValueError:
        log.warning("archive hook called for a %s state: nothing to do", state.type.value)
        return
    try:
        _archive_final(flow, flow_run, state, final, after_runner=value == "cancelling")
    finally:  # last: after every heartbeat this process sent (the crash automation expects it)
        emit_finished(str(flow_run.id))


def _archive_final(flow, flow_run, state, final: FinalState, *, after_runner: bool = False) -> None:
    params = run_params(flow_run.parameters)
    run_id = str(flow_run.id)
    if finished_in_body(run_id, final):
        return
    if final is FinalState.CRASHED and recorder_of(params, run_id).events():
        record_crash(spool_of(params), run_id, getattr(state, "message", None))
    if final is FinalState.CRASHED:
        crash_open_task_runs(run_id, getattr(state, "message", None))
    reason = getattr(state, "message", None) or None
    # the body records published, gated or skipped; a hook knows only the state
    summary = finish_run(flow.name, flow_run, state=final, outcome=final.value, reason=reason, params=params)
    if final is not FinalState.COMPLETED and summary.measured:
        if after_runner:  # the runner sets its own CANCELLED after these hooks: the message goes on that
            run_labels.restate_when_final(run_id, final.value, state_message(summary))
        else:
            run_labels.restate_with_message(run_id, final.value, state_message(summary))


def archive_on_task_state(task, task_run, state) -> None:
    """Task hook: archive the run as it stands when one of its tasks ends in `state`."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    params = run_params(ctx.parameters if ctx is not None else None)
    flow_run_id = str(task_run.flow_run_id)
    archive_run(flow_run_id, params, status=f"{task.name} {state.name.lower()}", flow_run_id=flow_run_id)
