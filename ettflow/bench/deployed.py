"""The benchmarks' jobs as deployment runs: the product's path, not one long-lived process.

`DeployedRunner` brings up (or finds) the local stack of `ettflow up` (Prefect server, Ray
head, process worker, deployments), creates each job as a run of the `refresh-adhoc`
deployment with the job's parameters, waits for it, and reads it back: its events from its
spool, its result from its warehouse's lineage (a deployment run's return value is not kept).
Each run is a new process that the worker starts, joining the head; its ranks and spares come
from the cluster's warm pool, which the previous job's release filled.

`InProcessRunner` runs the flow in this process (Prefect's ephemeral API, a local Ray, the
process's own warm pool): the old path, kept for `--path in-process` and comparison. Both give
`run(params) -> (result, events)`, `wait_pool(timeout_s)`, `keep_warm(on)` and `close()`, and
name their `path` for the results' rows.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ettflow.ett.events import PhaseEvent
from ettflow.tasks.parameters import RefreshParameters

DEPLOYMENT = "refresh-model/refresh-adhoc"
PATHS = ("deployed", "in-process")
RUN_TIMEOUT_S = 3600.0


class RunFailed(RuntimeError):
    pass


def prepare_environment(path: str) -> None:
    """Before Ray is imported (it reads its authentication mode then): the deployed path's
    bench process joins the stack's head for the cluster's pool and its own parts, with the
    stack's token (its path, never its value). A cluster named by RAY_ADDRESS is the user's."""
    if path != "deployed" or os.environ.get("RAY_ADDRESS"):
        return
    from ettflow.stack.config import config_from
    from ettflow.stack.services import ray_auth_env

    os.environ.update(ray_auth_env(config_from(None)))


def read_back(spool: Path, warehouse_url: str, run_id: str) -> tuple[dict[str, Any], list[PhaseEvent]]:
    """A finished refresh as `refresh_model` returns it, from its lineage, and its events."""
    from sqlalchemy import select

    from ettflow.ett.spool import read_spool
    from ettflow.ett.warehouse import Warehouse
    from ettflow.ett.warehouse_models import RefreshLineage

    with Warehouse.open(warehouse_url) as wh:
        with wh.engine.connect() as conn:
            model = conn.execute(select(RefreshLineage.model).where(RefreshLineage.run_id == run_id)).scalar()
        record = next((r for r in wh.lineage(model) if r.run_id == run_id), None) if model else None
    if record is None:
        raise RunFailed(f"run {run_id} left no lineage record in {warehouse_url}")
    result = {"run_id": run_id, "model": record.model, "anchor": record.anchor, "snapshot": record.snapshot,
              "outcome": record.outcome.value, "windows": list(record.windows), "parent": record.parent_run_id}
    return result, read_spool(spool, run_id).events


class InProcessRunner:
    """`refresh_model` called in this process (the flow's ephemeral API, this process's pool)."""

    path = "in-process"
    deployment = "-"

    def run(self, params: RefreshParameters) -> tuple[dict[str, Any], list[PhaseEvent]]:
        from ettflow.ett.spool import read_spool
        from ettflow.flows.refresh import refresh_model

        state = refresh_model(**params.flow_kwargs(), return_state=True)
        run_id = str(state.state_details.flow_run_id)
        spool = Path(params.storage.spool_root)
        if not state.is_completed():
            raise RunFailed(f"refresh {run_id} of {params.model} ended {state.name}: {state.message}; "
                            f"its spool is {spool / run_id}")
        return state.result(), read_spool(spool, run_id).events

    def wait_pool(self, timeout_s: float) -> int:
        from ettflow.trainer.group.warm_pool import POOL

        return POOL.wait_ready(timeout_s) if POOL.workers else 0

    def keep_warm(self, on: bool) -> None:
        from ettflow.trainer.group.warm_pool import POOL

        POOL.keep_warm(on)

    def close(self) -> None:
        from ettflow.trainer.group.warm_pool import POOL

        POOL.close()


class DeployedRunner:
    """Each job a run of `deployment` on the local stack (`ettflow up`'s), executed by its
    worker in a process of its own; `say` gets the stack's start-up lines."""

    path = "deployed"

    def __init__(self, say=print, deployment: str = DEPLOYMENT) -> None:
        from ettflow.flows.env_defaults import set_env_defaults
        from ettflow.stack.config import StackConfig, config_from
        from ettflow.stack.lifecycle import status, up
        from ettflow.stack.records import StackRecord

        set_env_defaults()
        self.deployment, self.say = deployment, say
        self.cfg: StackConfig = config_from(None)
        record = StackRecord.read(self.cfg.record_path)
        if record is not None and status(self.cfg, say=lambda line: None):  # a running stack, on its own ports
            say(f"the deployed path: the local stack under {self.cfg.home} ({record.ui_url})")
        else:
            say(f"the deployed path: bringing up the local stack under {self.cfg.home}")
            up(self.cfg, say=say)
            record = StackRecord.read(self.cfg.record_path)
        if record is None:
            raise RunFailed(f"no stack recorded under {self.cfg.stack_dir} after `ettflow up`")
        self.api_url, self.ui_url = record.api_url, record.ui_url

    def run(self, params: RefreshParameters) -> tuple[dict[str, Any], list[PhaseEvent]]:
        from ettflow.ett.redact import has_password
        from ettflow.stack.deployed_runs import run_and_wait

        url = params.warehouse.warehouse_url
        if not isinstance(url, str) or has_password(url):  # Prefect keeps parameters in clear
            raise RunFailed("a deployed bench job needs its own warehouse_url without a password (a SQLite file)")
        run = run_and_wait(self.api_url, self.ui_url, self.deployment, params, timeout_s=RUN_TIMEOUT_S,
                           say=lambda line: None, log_hint=str(self.cfg.log_dir / "worker.log"))
        if not run.completed:
            raise RunFailed(f"deployment run {run.run_id} of {params.model} ended {run.state}: {run.message} "
                            f"({run.url}; the worker's log: {self.cfg.log_dir / 'worker.log'})")
        return read_back(Path(params.storage.spool_root), url, run.run_id)

    def wait_pool(self, timeout_s: float) -> int:
        from ettflow.stack.pool import wait_for_pool

        ready, _ = wait_for_pool(self.cfg, timeout_s)
        return ready

    def keep_warm(self, on: bool) -> None:
        """The cluster's pool is always kept (its policy bounds it)."""

    def close(self) -> None:
        """The stack keeps running, its runs in the UI (`ettflow down` stops it): said, so that a
        second bench under another home is not refused its ports unexplained."""
        self.say(f"the local stack under {self.cfg.home} keeps running (the jobs' runs: {self.ui_url}/runs); "
                 f"`ETTFLOW_HOME={self.cfg.home} ettflow down` stops it")


def runner(path: str, say=print) -> InProcessRunner | DeployedRunner:
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    return InProcessRunner() if path == "in-process" else DeployedRunner(say)
