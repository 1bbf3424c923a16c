"""The shipped automations file, compiled: which automation matches which run (Prefect's own
matcher), and a wrong file refused with the key named (the automations against a real server:
e2e/test_automations.py)."""

from __future__ import annotations

import pytest

from ettflow.tasks.automations import DEFAULT_FILE, AutomationsConfig, compile_automations
from ettflow.tasks.run_event import measured_resource


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


def test_the_event_feed_shows_the_numbers_in_the_resource_name():
    assert measured_resource(run("refresh-adhoc", 27.78, 2))["prefect.resource.name"] == (
        "dlrm-optimized · ETT 27.8% · NoF 2 · completed")
    skipped = measured_resource(run(None, 0.0, 0, outcome="skipped"))
    assert skipped["prefect.resource.name"] == "dlrm-optimized · skipped"
    # capETT beside the ETT, in the name and as a label (issue 43: only the raw JSON had it)
    held = measured_resource({**run("refresh-adhoc", 27.78, 2), "cap_ett_pct": 25.14})
    assert held["prefect.resource.name"] == "dlrm-optimized · ETT 27.8% · capETT 25.1% · NoF 2 · completed"
    assert held["ettflow.cap_ett_pct"] == "025.1" and held["ettflow.ett_pct"] == "027.8"


def test_the_shipped_file_compiles_to_four_automations():
    automations = compile_automations(AutomationsConfig.load(DEFAULT_FILE), "00000000-0000-0000-0000-000000000001")
    assert [a.name for a in automations] == ["ettflow: ETT below 40% on refresh-adhoc",
                                             "ettflow: ETT below 60% on refresh-scheduled",
                                             "ettflow: NoF above 1", "ettflow: component regression"]
    assert all(a.tags == ["ettflow"] and a.actions[0].type == "call-webhook" for a in automations)
    # the automations page shows "A custom trigger": each description says its trigger and threshold (issue 27)
    assert all(a.description.startswith("Trigger: ") and "Action: call the webhook" in a.description
               for a in automations)
    assert "with ETT below 40%" in automations[0].description and "NoF above 1" in automations[2].description
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


def test_without_a_webhook_block_the_alerts_exist_with_no_action_and_say_where_they_show():
    """Issue 43: without `--webhook-url` no ETT, NoF or regression alert existed anywhere in the
    UI. Now the same automations, same triggers, with Prefect's DoNothing: each trigger is a
    `prefect.automation.triggered` event in the Event Feed."""
    automations = compile_automations(AutomationsConfig.load(DEFAULT_FILE), None)
    assert [a.name for a in automations] == ["ettflow: ETT below 40% on refresh-adhoc",
                                             "ettflow: ETT below 60% on refresh-scheduled",
                                             "ettflow: NoF above 1", "ettflow: component regression"]
    assert all([act.type for act in a.actions] == ["do-nothing"] for a in automations)
    assert all("Action: none yet (no webhook block)" in a.description and "Event Feed" in a.description
               and "call the webhook" not in a.description for a in automations)
    assert matching(automations, run("refresh-adhoc", 27.8, 2)) == {"ettflow: ETT below 40% on refresh-adhoc",
                                                                    "ettflow: NoF above 1"}
