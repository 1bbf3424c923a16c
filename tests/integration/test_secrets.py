"""A warehouse password never leaks, and a bad warehouse fails a refresh before anything runs.

On the session's Prefect test harness (a temporary API server), no Ray: the refresh fails in
its first task, so nothing is reserved or trained. Checked for a password given to
`ettflow refresh --warehouse-url`: not in stdout/stderr, the logs, the flow run's stored
parameters, the run's state message or the spool. A Prefect `Secret` block named by
`warehouse_secret` supplies the URL to the check and to the archiving hooks.
"""

from __future__ import annotations

import argparse
import json
import logging
import uuid

import pytest
from sqlalchemy import make_url

from ettflow.ett.sample import write_sample_run
from ettflow.ett.spool import read_spool
from ettflow.ett.warehouse import Warehouse
from ettflow.ett.warehouse_db import ENV_URL

from helpers.flows import flow_kwargs

pytestmark = pytest.mark.timeout(600)

SECRET = "pw-" + uuid.uuid4().hex[:10]
BAD_URL = f"postgresql+psycopg://postgres:{SECRET}@127.0.0.1:5999/x"  # nothing listens on 5999
SHOWN = "postgresql+psycopg://postgres:***@127.0.0.1:5999/x"


@pytest.fixture
def no_env_url(monkeypatch):
    monkeypatch.setenv(ENV_URL, "placeholder")  # recorded, so a value set by the command is undone
    monkeypatch.delenv(ENV_URL)


@pytest.fixture
def logs(caplog):
    """Everything logged, Prefect's run loggers included (they do not propagate to the root)."""
    prefect_logger = logging.getLogger("prefect")
    caplog.set_level(logging.DEBUG)
    prefect_logger.addHandler(caplog.handler)
    yield caplog
    prefect_logger.removeHandler(caplog.handler)


def client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def flow_runs() -> list:
    from prefect.client.schemas.sorting import FlowRunSort

    with client() as c:
        return c.read_flow_runs(sort=FlowRunSort.START_TIME_DESC)


def task_runs(flow_run_id) -> dict[str, str]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with client() as c:
        runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {r.name.rsplit("-", 1)[0]: r.state.type.value for r in runs}


def cli_args(*argv: str):
    from ettflow.flows import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["refresh", *argv])


def run_params(flow_data, tmp_path) -> dict:
    return {"data_root": str(flow_data), "world_size": 2, "batch_size": 32, "max_embeddings": 100,
            "work_root": str(tmp_path / "work"), "snapshot_root": str(tmp_path / "snap"),
            "spool_root": str(tmp_path / "spool")}


def test_refresh_with_a_password_url_fails_fast_and_leaks_nothing(prefect_harness, flow_data, tmp_path,
                                                                  no_env_url, logs, capfd):
    p = run_params(flow_data, tmp_path)
    args = cli_args("--warehouse-url", BAD_URL, "--data-root", p["data_root"], "--no-failure",
                    *(f"--param={k}={json.dumps(p[k])}" for k in ("work_root", "snapshot_root", "spool_root",
                                                                  "max_embeddings")))
    assert args.func(args) == 1
    out, err = capfd.readouterr()
    run = flow_runs()[0]
    assert f"warehouse {SHOWN} (holds a password: passed in ETTFLOW_WAREHOUSE_URL" in out
    assert f"ettflow refresh: warehouse {SHOWN} is unreachable: " in err and "fix ETTFLOW_WAREHOUSE_URL" in err
    assert "Traceback" not in out + err
    for where, text in {"stdout": out, "stderr": err, "logs": logs.text,
                        "parameters": json.dumps(run.parameters), "state": run.state.message or ""}.items():
        assert SECRET not in text, f"the password is in the {where}"
    assert run.state.is_failed() and (run.parameters.get("warehouse") or {}).get("warehouse_url") is None
    assert "warehouse_url" not in run.parameters  # a section, never the flat name
    # failed in its first task: nothing reserved, trained or spooled
    assert task_runs(run.id) == {"check-warehouse": "FAILED"}
    assert not (tmp_path / "spool" / str(run.id)).exists()


def test_the_check_fails_the_flow_with_a_typed_failure(prefect_harness, flow_data, tmp_path, no_env_url):
    from ettflow.flows.refresh import refresh_model
    from ettflow.tasks.warehouse_url import WarehouseUnavailable

    state = refresh_model(**flow_kwargs({**run_params(flow_data, tmp_path),
                                         "warehouse_url": "postgresql+psycopg://postgres@127.0.0.1:5999/x"}),
                          return_state=True)
    assert state.is_failed() and isinstance(state.result(raise_on_failure=False), WarehouseUnavailable)
    assert state.message.startswith("warehouse postgresql+psycopg://postgres@127.0.0.1:5999/x is unreachable")
    assert state.message.endswith("fix the warehouse_url parameter")
    assert task_runs(state.state_details.flow_run_id) == {"check-warehouse": "FAILED"}
    assert not (tmp_path / "spool" / str(state.state_details.flow_run_id)).exists()


def test_a_secret_block_names_the_warehouse(prefect_harness, postgres_schema_url, tmp_path, no_env_url, logs):
    """The URL, password included, comes from a Secret block: the check opens it, the hooks
    archive to it, and the password appears in no log line and no warehouse row."""
    from prefect.blocks.system import Secret

    from ettflow.tasks import archive
    from ettflow.tasks.errors import ParameterError
    from ettflow.tasks.warehouse_url import open_check, resolve_warehouse_url

    url = make_url(postgres_schema_url).set(password=SECRET).render_as_string(hide_password=False)  # trust auth
    name = f"ettflow-warehouse-{uuid.uuid4().hex[:8]}"
    Secret(value=url).save(name)
    params = {"warehouse_secret": name, "spool_root": str(tmp_path / "spool"), "model": "m", "mode": "optimized"}
    assert resolve_warehouse_url({"warehouse_secret": name}) == url
    assert open_check({"warehouse_secret": name}) == make_url(url).render_as_string(hide_password=True)
    write_sample_run(tmp_path / "spool", "run-s", seed=5)
    archived = archive.archive_run("run-s", params, status="completed", flow_run_id="run-s")
    assert archived is not None
    with Warehouse.open(url) as wh:
        runs, events = wh.runs_frame(run_id="run-s"), wh.table_frame("events", "run-s")
    assert len(runs) == 1 and len(events) == len(read_spool(tmp_path / "spool", "run-s").events)
    assert SECRET not in runs.to_json(date_format="iso") + events.to_json(date_format="iso")
    assert SECRET not in logs.text
    with pytest.raises(ParameterError, match="parameter 'warehouse_secret' names no readable Prefect Secret block"):
        resolve_warehouse_url({"warehouse_secret": name + "-missing"})


def test_a_deployment_run_with_a_password_url_is_refused_before_prefect_stores_it(prefect_harness):
    """Issue 42 #8: the deployment's parameter schema says a `warehouse_url` holds no password,
    so the Prefect server refuses such a run when it is created (the UI's Run, `prefect
    deployment run --param`), before the parameters are stored; the flow's own check ran only
    after Prefect had stored them. A URL without one is accepted. The neighbours: a password in
    the URL's query (psycopg takes it there too), one with a '/' in it, and the fleet report's
    own `warehouse_url` argument."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect.utilities.callables import parameter_schema

    from ettflow.flows.fleet import ett_fleet_report
    from ettflow.flows.refresh import refresh_model

    bad = (BAD_URL, f"postgresql+psycopg://postgres@127.0.0.1:5999/x?sslmode=disable&password={SECRET}",
           f"postgresql+psycopg://postgres:{SECRET}/x@127.0.0.1:5999/x")
    with get_client(sync_client=True) as client:
        fleet = client.create_deployment(
            flow_id=client.create_flow(ett_fleet_report), name=f"secrets-{uuid.uuid4().hex[:6]}",
            parameter_openapi_schema=parameter_schema(ett_fleet_report).model_dump(), enforce_parameter_schema=True)
        flow_id = client.create_flow(refresh_model)
        deployment = client.create_deployment(flow_id=flow_id, name=f"secrets-{uuid.uuid4().hex[:6]}",
                                              parameter_openapi_schema=parameter_schema(refresh_model).model_dump(),
                                              enforce_parameter_schema=True)
        before = {r.id for r in flow_runs()}
        for url in bad:
            with pytest.raises(PrefectHTTPStatusError, match="warehouse.warehouse_url"):
                client.create_flow_run_from_deployment(deployment, parameters={"warehouse": {"warehouse_url": url}})
            with pytest.raises(PrefectHTTPStatusError, match="warehouse_url"):
                client.create_flow_run_from_deployment(fleet, parameters={"warehouse_url": url})
        assert {r.id for r in flow_runs()} == before  # nothing stored
        ok = client.create_flow_run_from_deployment(
            deployment, parameters={"warehouse": {"warehouse_url": "postgresql+psycopg://postgres@127.0.0.1:5999/x"}})
        assert ok.parameters["warehouse"]["warehouse_url"].endswith("postgres@127.0.0.1:5999/x")
        fleet_ok = client.create_flow_run_from_deployment(
            fleet, parameters={"warehouse_url": "postgresql+psycopg://postgres@127.0.0.1:5999/x?sslmode=disable"})
        for run in (ok, fleet_ok):
            client.delete_flow_run(run.id)
