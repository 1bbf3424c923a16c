"""`ett_fleet_report`: the fleet view of ETT, published as markdown artifacts (daily in prefect.yaml).

    read the warehouse (runs with their deployment)
    -> one artifact per deployment (`ett-fleet-<deployment>`) and one for the fleet (`ett-fleet`):
       ETT% per run over time, components per owner as stacked shares, the worst runs linked to
       their flow runs, the regressions naming component and owner (`ett.fleet`), and the
       held-capacity ledger per model (what pooled workers and spares held, used or not)
    -> one `ettflow.component.regressed` event per regression (the regression automation)

`ettflow report --fleet` prints the same view in the terminal.
"""

from __future__ import annotations

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from ettflow.ett.fleet import RegressionRule, regressions
from ettflow.tasks.fleet_report import emit_regressions, publish_fleet_artifacts, read_fleet, read_held
from ettflow.tasks.parameters import NoSecretUrl
from ettflow.tasks.warehouse_url import resolve_warehouse_url


@task(name="read-fleet", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=10)
def read_fleet_task(warehouse: dict, last: int | None):
    """`warehouse`: the flow's warehouse parameters (resolved here, so no URL travels between tasks)."""
    return read_fleet(resolve_warehouse_url(warehouse), last=last)


@task(name="read-held-capacity", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=10)
def read_held_task(warehouse: dict):
    """The held-capacity ledger per model (pooled workers, spares, what the pool released unclaimed)."""
    return read_held(resolve_warehouse_url(warehouse))


@task(name="publish-fleet-artifacts", cache_policy=NO_CACHE)
def publish_task(runs, rule: RegressionRule, held=None) -> dict:
    return publish_fleet_artifacts(runs, rule, held, goals=ett_goals())


def ett_goals() -> dict[str, float]:
    """The ETT% goal lines: the shipped automations' `ett_below` thresholds (none when the file
    cannot be read: the views are drawn without them, and the log says why)."""
    from ettflow.tasks.automations import AutomationsConfig

    try:
        return dict(AutomationsConfig.load().ett_below)
    except (OSError, ValueError) as exc:
        get_run_logger().warning("no ETT goal lines: the automations file cannot be read (%s)", exc)
        return {}


@task(name="emit-regressions", cache_policy=NO_CACHE)
def emit_task(runs, rule: RegressionRule, flow_run_id: str | None) -> int:
    """Emit the regressions' events; how many regressions there are."""
    related = ([{"prefect.resource.id": f"prefect.flow-run.{flow_run_id}", "prefect.resource.role": "flow-run"}]
               if flow_run_id else [])
    found = regressions(runs, rule)
    emit_regressions(found, related)
    return len(found)


@flow(name="ett-fleet-report", flow_run_name="fleet-report")
def ett_fleet_report(
    warehouse_url: NoSecretUrl = None,
    warehouse_secret: str | None = None,
    last: int | None = 2000,
    recent: int = 3,
    min_history: int = 5,
    k: float = 3.0,
    min_increase_s: float = 1.0,
) -> dict:
    """Publish the fleet's ETT view; returns the artifact keys made and the regressions found.

    Args:
        warehouse_url: The warehouse's SQLAlchemy URL, without a password (parameters are stored in clear); null:
            warehouse_secret, else the worker's ETTFLOW_WAREHOUSE_URL, else the per-user SQLite file.
        warehouse_secret: The name of a Prefect Secret block that holds the warehouse URL (with its password).
        last: Read only the N most recent runs (null: all).
        recent: Regression rule: the window, the last N trained runs of a deployment.
        min_history: Regression rule: the runs needed before the window to judge it.
        k: Regression rule: a component regressed when median(window) > median(history) + max(k x 1.4826 x MAD,
            min_increase_s).
        min_increase_s: Regression rule: the least increase in seconds that counts (a flat history has MAD 0).
    """
    from prefect.runtime import flow_run

    rule = RegressionRule(recent=recent, min_history=min_history, k=k, min_increase_s=min_increase_s)
    warehouse = {"warehouse_url": warehouse_url, "warehouse_secret": warehouse_secret}
    runs = read_fleet_task(warehouse, last)
    made = publish_task(runs, rule, read_held_task(warehouse))
    found = emit_task(runs, rule, flow_run.id)
    get_run_logger().info("fleet report: %d runs over %d deployments, %d artifacts, %d regressions", len(runs),
                          runs["deployment"].nunique() if len(runs) else 0, len(made), found)
    return {"artifacts": sorted(made), "regressions": found}
