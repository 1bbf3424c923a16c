"""When the deployment of this flow run runs next: Prefect's schedule, as the cluster's warm
pool needs it to prewarm ahead of that run rather than hold workers idle until then."""

from __future__ import annotations

import logging

log = logging.getLogger("ettflow.tasks")


def next_scheduled_run(current_run_id: str) -> float | None:
    """The expected start (epoch s) of the earliest SCHEDULED run of this run's deployment
    other than this one; None outside a deployment, with none scheduled, or when Prefect's API
    does not answer (the pool then fills at once, as for an ad hoc run)."""
    from prefect.runtime import deployment

    if not deployment.id:
        return None
    try:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import (
            DeploymentFilter,
            DeploymentFilterId,
            FlowRunFilter,
            FlowRunFilterId,
            FlowRunFilterState,
            FlowRunFilterStateType,
        )
        from prefect.client.schemas.objects import StateType
        from prefect.client.schemas.sorting import FlowRunSort

        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])),
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
                    any_=[StateType.SCHEDULED])), id=FlowRunFilterId(not_any_=[current_run_id])),
                sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=1)
    except Exception as exc:  # noqa: BLE001 - a hint for the pool: without it, it fills at once
        log.warning("could not read the deployment's next scheduled run (%s: %s); the warm pool fills at once",
                    type(exc).__name__, exc)
        return None
    start = runs[0].expected_start_time if runs else None
    return start.timestamp() if start is not None else None
