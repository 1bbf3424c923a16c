"""`apply_automations` against a real Prefect server with no webhook block on it (issue 43:
without `--webhook-url` no alert existed): the alerts are created with Prefect's DoNothing
action, their triggers unchanged, and applying again changes nothing."""

from __future__ import annotations


def test_without_a_webhook_block_the_alerts_are_applied_with_no_action(prefect_harness):
    from prefect.client.orchestration import get_client

    from ettflow.tasks.automations import AutomationsConfig, apply_automations

    config = AutomationsConfig.from_mapping({"webhook_block": "ettflow-test-no-such-block", "ett_below": {"*": 50},
                                             "nof_above": 1, "component_regression": False})
    done = apply_automations(config)
    try:
        assert not done.webhook
        assert set(done.created) == {"ettflow: ETT below 50% on any run", "ettflow: NoF above 1"}
        with get_client(sync_client=True) as client:
            mine = [a for a in client.read_automations() if a.name in done.created]
        assert len(mine) == 2 and all(a.enabled and [act.type for act in a.actions] == ["do-nothing"] for a in mine)
        assert all("Event Feed" in a.description for a in mine)
        again = apply_automations(config)
        assert again.created == () and set(again.updated) == set(done.created) and again.deleted == ()
    finally:
        with get_client(sync_client=True) as client:
            for a in client.read_automations():
                if a.name in done.created:
                    client.delete_automation(a.id)
