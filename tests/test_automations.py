"""Events and automations against a real `prefect server` (conftest's `prefect_server`).

`ettflow automations apply` creates the automations of automations/ettflow.yaml with their
webhook block pointed at a local HTTP receiver. A flow run of the deployment `refresh-adhoc`
(the test flow `measured_run`, which spools a timeline without training: ETT 27.8%, NoF 2)
is archived by ettflow's real hook, which emits `ettflow.run.measured`: the event is read back
through the API (payload, related flow run), and the ETT and NoF automations' webhooks
arrive. Then the `ett-fleet-report` flow, run as a deployment over a warehouse where the
`nightly` deployment's compile time regressed, publishes its artifacts and the regression
automation's webhook arrives naming the component and its owner.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from fleet_runs import archive_fleet, run_as_deployment

from ettflow.tasks.automations import DEFAULT_FILE, AutomationsConfig, compile_automations
from ettflow.tasks.run_event import measured_resource

REPO = Path(__file__).resolve().parents[1]


# -- the file, compiled: which automation matches which run (Prefect's own matcher) ----------


def matching(automations, payload: dict) -> set[str]:
    """The automations whose trigger matches the run's `ettflow.run.measured` resource, by the
    server's own matcher."""
    from prefect.server.events.schemas.events import ResourceSpecification

    resource = measured_resource(payload)
    return {a.name for a in automations if "ettflow.run.measured" in a.trigger.expect
            and ResourceSpecification(a.trigger.match.model_dump()).matches(resource)}


def run(deployment: str | None, ett: float, nof: int, outcome: str = "completed") -> dict:
    return {"run_id": "r", "model": "dlrm", "mode": "optimized", "deployment": deployment, "outcome": outcome,
            "ett_pct": ett, "nof": nof}


def test_the_shipped_file_compiles_to_four_automations():
    automations = compile_automations(AutomationsConfig.load(DEFAULT_FILE), "00000000-0000-0000-0000-000000000001")
    assert [a.name for a in automations] == ["ettflow: ETT below 40% on refresh-adhoc",
                                             "ettflow: ETT below 60% on refresh-scheduled",
                                             "ettflow: NoF above 1", "ettflow: component regression"]
    assert all(a.tags == ["ettflow"] and a.actions[0].type == "call-webhook" for a in automations)
    assert matching(automations, run("refresh-adhoc", 27.8, 2)) == {"ettflow: ETT below 40% on refresh-adhoc",
                                                                    "ettflow: NoF above 1"}
    assert matching(automations, run("refresh-adhoc", 40.0, 1)) == set()  # not below 40, not above 1
    assert matching(automations, run("refresh-scheduled", 59.96, 0)) == set()  # its label is 060.0
    assert matching(automations, run("refresh-scheduled", 59.94, 0)) == {"ettflow: ETT below 60% on refresh-scheduled"}
    assert matching(automations, run(None, 10.0, 0)) == set()  # no deployment, no '*' rule
    assert matching(automations, run("refresh-adhoc", 0.0, 0, outcome="skipped")) == set()


def test_a_star_threshold_covers_every_run():
    config = AutomationsConfig.from_mapping({"webhook_block": "b", "ett_below": {"*": 50}, "nof_above": None,
                                             "component_regression": False})
    automations = compile_automations(config, "00000000-0000-0000-0000-000000000001")
    assert [a.name for a in automations] == ["ettflow: ETT below 50% on any run"]
    assert matching(automations, run(None, 49.9, 0)) == matching(automations, run("x", 12, 3)) == {
        "ettflow: ETT below 50% on any run"}


@pytest.mark.parametrize(("data", "error"), [
    ({"webhook_block": "b", "ett_below": {"d": 0}}, r"ett_below\['d'\] must be an ETT% in \(0, 100\]"),
    ({"webhook_block": "b", "nof_abov": 1}, "unknown key.*nof_abov"),
    ({"ett_below": {"d": 50}}, "`webhook_block` must name a Prefect Webhook block"),
    ({"webhook_block": "b", "nof_above": -1}, "`nof_above` must be a whole number"),
])
def test_a_wrong_file_is_refused_with_the_key_named(data, error):
    with pytest.raises(ValueError, match=error):
        AutomationsConfig.from_mapping(data)


# -- against a real Prefect server ------------------------------------------------------------


class Receiver:
    """A local HTTP server that keeps the JSON bodies POSTed to it."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.cond = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver.cond:
                    receiver.bodies.append(json.loads(body))
                    receiver.cond.notify_all()
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def wait_for(self, pred, timeout: float = 90) -> dict:
        deadline = time.time() + timeout
        with self.cond:
            while True:
                found = next((b for b in self.bodies if pred(b)), None)
                if found is not None:
                    return found
                left = deadline - time.time()
                assert left > 0, f"no matching webhook call within {timeout} s; received: {self.bodies}"
                self.cond.wait(left)


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.server.shutdown()


def ettflow(env: dict, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "ettflow.cli", *args], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, f"ettflow {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def events(api: str, name: str) -> list[dict]:
    body = {"filter": {"event": {"name": [name]}, "order": "DESC"}, "limit": 50}
    return httpx.post(f"{api}/events/filter", json=body, timeout=30).json()["events"]


def wait_for_event(api: str, name: str, pred, timeout: float = 60) -> dict:
    deadline = time.time() + timeout
    while True:
        found = next((e for e in events(api, name) if pred(e)), None)
        if found is not None or time.time() > deadline:
            assert found is not None, f"no {name} event matched within {timeout} s: {events(api, name)}"
            return found
        time.sleep(1)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.timeout(600)
def test_measured_event_and_automations_fire(prefect_server, receiver, tmp_path):
    env, api = prefect_server
    env = {**env, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}", "ETTFLOW_HOME": str(tmp_path / "home")}
    out = ettflow(env, "automations", "apply", "--webhook-url", receiver.url)
    assert "created: ettflow: ETT below 40% on refresh-adhoc" in out and "created: ettflow: NoF above 1" in out
    assert "4 created, 0 updated, 0 deleted" in out
    assert "0 created, 4 updated, 0 deleted" in ettflow(env, "automations", "apply")  # idempotent

    warehouse = f"sqlite:///{tmp_path / 'warehouse.db'}"
    spool = tmp_path / "spool"
    run_id = run_as_deployment(env, "measured-run", "refresh-adhoc", "tests/fleet_runs.py:measured_run",
                               {"spool_root": str(spool), "warehouse_url": warehouse, "compile_s": 40, "failures": 2})
    assert httpx.get(f"{api}/flow_runs/{run_id}").json()["state_type"] == "COMPLETED"

    event = wait_for_event(api, "ettflow.run.measured", lambda e: e["payload"]["run_id"] == run_id)
    payload = event["payload"]
    # 20 s effective of 72 s wall: 2 + 40 compile, 2 failures (1 s detection, 2 s rescheduling, 1 s restore each)
    assert payload["ett_pct"] == 27.78 and payload["nof"] == 2 and payload["wall_s"] == 72.0
    assert payload["components"] == {"effective_training": 20.0, "wasted_training": 2.0, "pt2_compile": 40.0,
                                     "trainer_init": 2.0, "scheduling": 6.0, "shutdown": 2.0}
    assert (payload["model"], payload["mode"], payload["outcome"], payload["deployment"]) == (
        "dlrm", "optimized", "published", "refresh-adhoc")
    assert event["resource"]["prefect.resource.id"] == f"ettflow.run.{run_id}"
    assert event["resource"]["ettflow.ett_pct"] == "027.8" and event["resource"]["ettflow.nof"] == "002"
    related = {r["prefect.resource.role"]: r["prefect.resource.id"] for r in event["related"]}
    assert related["flow-run"] == f"prefect.flow-run.{run_id}" and related["deployment"].startswith(
        "prefect.deployment.")

    ett_alert = receiver.wait_for(lambda b: b["alert"] == "ett_below")
    assert ett_alert["automation"] == "ettflow: ETT below 40% on refresh-adhoc"
    assert ett_alert["resource"] == f"ettflow.run.{run_id}" and ett_alert["payload"]["ett_pct"] == 27.78
    nof_alert = receiver.wait_for(lambda b: b["alert"] == "nof_above")
    assert nof_alert["payload"]["nof"] == 2 and nof_alert["event"] == "ettflow.run.measured"

    # the fleet: nightly's compile time regressed in its last 3 runs (tests/fleet_runs.py)
    archive_fleet(warehouse, spool, time.time() - 15 * 3600)
    fleet_run_id = run_as_deployment(env, "ett-fleet-report", "ett-fleet-report",
                                     "ettflow/flows/fleet.py:ett_fleet_report", {"warehouse_url": warehouse})
    assert httpx.get(f"{api}/flow_runs/{fleet_run_id}").json()["state_type"] == "COMPLETED"
    regression = receiver.wait_for(lambda b: b["alert"] == "component_regression")
    assert regression["resource"] == "ettflow.regression.nightly.pt2_compile"
    assert {k: regression["payload"][k] for k in ("deployment", "component", "owner", "recent_median_s",
                                                   "history_median_s", "threshold_s")} == {
        "deployment": "nightly", "component": "pt2_compile", "owner": "compiler", "recent_median_s": 20.0,
        "history_median_s": 10.0, "threshold_s": 11.0}
    found = httpx.post(f"{api}/artifacts/filter",
                       json={"artifacts": {"flow_run_id": {"any_": [fleet_run_id]}}}).json()
    by_key = {a["key"]: a for a in found}
    # the measured run has no deployment tag: its deployment comes from Prefect
    assert set(by_key) == {"ett-fleet", "ett-fleet-nightly", "ett-fleet-hourly", "ett-fleet-refresh-adhoc"}
    fleet_md = by_key["ett-fleet"]["data"]
    assert "**pt2_compile** of `nightly` (owner: **compiler**)" in fleet_md
    assert f"/runs/flow-run/{run_id})" in fleet_md  # the worst run links to its flow run
    assert fleet_md.count("data:image/png;base64,") == 2
    assert receiver.bodies.count(regression) == 1 and not any(
        b["automation"] == "ettflow: ETT below 60% on refresh-scheduled" for b in receiver.bodies)
