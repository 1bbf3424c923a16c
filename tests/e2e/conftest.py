"""Fixtures of the end-to-end level: the trainer tests' data and their reference run."""

from __future__ import annotations

import pytest

from helpers.trainer_runs import config, drive


@pytest.fixture(scope="session")
def trainer_world(tmp_path_factory, ray_session):
    """The trainer tests' folder: 3 windows of 768 rows under data/ (2 trained: 24 steps of
    2 ranks x 32; the third held out), their spool under spool/."""
    from ettflow.trainer.data.synthetic import SyntheticConfig, generate_windows

    root = tmp_path_factory.mktemp("trainer")
    generate_windows(root / "data", SyntheticConfig(windows=3, rows_per_window=768, files_per_window=2, seed=7))
    return root


@pytest.fixture(scope="session")
def clean_run(trainer_world, compile_cache):
    """The reference: the optimized switches, never interrupted, evaluated before and after.
    Every interrupted trainer run must end with its parameters, bitwise."""
    return drive(trainer_world, config(trainer_world, "clean", compile_cache, eval_at_start=True), "clean")


@pytest.fixture(scope="session")
def measured_runs(prefect_server, tmp_path_factory):
    """What the automations and browser tests look at, made once: the shipped automations
    applied (`ettflow automations apply`, webhooks to a local receiver), a flow run of the
    deployment `refresh-adhoc` measured without training (helpers/fleet_runs.py: ETT 27.8%,
    NoF 2) archived by ettflow's real hook, then a small fleet whose `nightly` deployment's
    compile time regressed and the `ett-fleet-report` flow run as a deployment over it."""
    import time
    from types import SimpleNamespace

    from helpers.fleet_runs import archive_fleet, run_as_deployment
    from helpers.prefect_cli import REPO, ettflow
    from helpers.webhooks import Receiver

    env, api = prefect_server
    tmp = tmp_path_factory.mktemp("measured")
    env = {**env, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}", "ETTFLOW_HOME": str(tmp / "home")}
    receiver = Receiver()
    applied = [ettflow(env, "automations", "apply", "--webhook-url", receiver.url),
               ettflow(env, "automations", "apply")]  # the second: nothing new to create
    warehouse, spool = f"sqlite:///{tmp / 'warehouse.db'}", tmp / "spool"
    run_id = run_as_deployment(env, "measured-run", "refresh-adhoc", "tests/helpers/fleet_runs.py:measured_run",
                               {"spool_root": str(spool), "warehouse_url": warehouse, "compile_s": 40, "failures": 2})
    archive_fleet(warehouse, spool, time.time() - 15 * 3600)
    fleet_run_id = run_as_deployment(env, "ett-fleet-report", "ett-fleet-report",
                                     "ettflow/flows/fleet.py:ett_fleet_report", {"warehouse_url": warehouse})
    yield SimpleNamespace(api=api, env=env, applied=applied, receiver=receiver, run_id=run_id,
                          fleet_run_id=fleet_run_id, warehouse=warehouse)
    receiver.close()
