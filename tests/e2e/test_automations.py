"""Events and automations against a real `prefect server` (conftest's `prefect_server`), over
the runs e2e/conftest.py's `measured_runs` made (shared with the browser test).

`ettflow automations apply` created the automations of automations/ettflow.yaml with their
webhook block pointed at a local HTTP receiver. A flow run of the deployment `refresh-adhoc`
(the test flow `measured_run`, which spools a timeline without training: ETT 27.8%, NoF 2)
was archived by ettflow's real hook, which emits `ettflow.run.measured`: the event is read back
through the API (payload, related flow run), and the ETT and NoF automations' webhooks
arrive. Then the `ett-fleet-report` flow, run as a deployment over a warehouse where the
`nightly` deployment's compile time regressed, published its artifacts and the regression
automation's webhook arrives naming the component and its owner. (The file compiled, pure:
unit/test_automations_file.py.)
"""

from __future__ import annotations

import time

import httpx
import pytest

# -- against a real Prefect server ------------------------------------------------------------


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
@pytest.mark.timeout(600)
def test_measured_event_and_automations_fire(measured_runs):
    api, receiver, run_id = measured_runs.api, measured_runs.receiver, measured_runs.run_id
    out, again = measured_runs.applied
    assert "created: ettflow: ETT below 40% on refresh-adhoc" in out and "created: ettflow: NoF above 1" in out
    assert "4 created, 0 updated, 0 deleted" in out
    assert "0 created, 4 updated, 0 deleted" in again  # idempotent
    assert httpx.get(f"{api}/flow_runs/{run_id}").json()["state_type"] == "COMPLETED"

    event = wait_for_event(api, "ettflow.run.measured", lambda e: e["payload"]["run_id"] == run_id)
    payload = event["payload"]
    # 20 s effective of 72 s wall: 2 + 40 compile, 2 failures (1 s detection, 2 s rescheduling, 1 s restore each)
    assert payload["ett_pct"] == 27.78 and payload["nof"] == 2 and payload["wall_s"] == 72.0
    assert payload["components"] == {"effective_training": 20.0, "wasted_training": 2.0, "pt2_compile": 40.0,
                                     "trainer_init": 2.0, "scheduling": 6.0, "shutdown": 2.0}
    assert (payload["model"], payload["mode"], payload["outcome"], payload["deployment"]) == (
        "dlrm", "optimized", "published", "refresh-adhoc")
    assert event["resource"]["prefect.resource.id"] == f"prefect.flow-run.{run_id}"
    assert event["resource"]["ettflow.ett_pct"] == "027.8" and event["resource"]["ettflow.nof"] == "002"
    # nothing was held for it: its capETT is its ETT, in the feed card's name and a label
    assert payload["cap_ett_pct"] == 27.78 and event["resource"]["ettflow.cap_ett_pct"] == "027.8"
    assert event["resource"]["prefect.resource.name"] == "dlrm-optimized · ETT 27.8% · capETT 27.8% · NoF 2 · published"
    # the resource is the run's flow run (the feed shows a known resource's name: issue 43), so it is not
    # among the related ones too; its deployment is
    related = {r["prefect.resource.role"]: r["prefect.resource.id"] for r in event["related"]}
    assert "flow-run" not in related and related["deployment"].startswith("prefect.deployment."), related

    ett_alert = receiver.wait_for(lambda b: b["alert"] == "ett_below")
    assert ett_alert["automation"] == "ettflow: ETT below 40% on refresh-adhoc"
    assert ett_alert["resource"] == f"prefect.flow-run.{run_id}" and ett_alert["payload"]["ett_pct"] == 27.78
    nof_alert = receiver.wait_for(lambda b: b["alert"] == "nof_above")
    assert nof_alert["payload"]["nof"] == 2 and nof_alert["event"] == "ettflow.run.measured"

    # the fleet: nightly's compile time regressed in its last 3 runs (helpers/fleet_runs.py)
    fleet_run_id = measured_runs.fleet_run_id
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
    assert "## Held capacity" in fleet_md and "No capacity was held outside the runs' own slots" in fleet_md
    assert receiver.bodies.count(regression) == 1 and not any(
        b["automation"] == "ettflow: ETT below 60% on refresh-scheduled" for b in receiver.bodies)
