"""Prefect's zombie-run detection for deployed refreshes: a run whose heartbeats stop is CRASHED.

A flow run emits a `prefect.flow-run.heartbeat` event every `PREFECT_FLOWS_HEARTBEAT_FREQUENCY`
seconds (Prefect 3.9.1: 180 by default, at least 30) from a thread of the process that runs
it. When a worker's flow process dies without a word (SIGKILL, a lost node), the heartbeats
stop and nothing else changes the run's state; Prefect's documented answer is an automation
on the server that expects the next heartbeat (or a final state) within a bound after each
heartbeat and otherwise changes the run to CRASHED. That state change makes the run's
`on_crashed` archiving apply (through the worker or `ettflow archive --pending`).

`ensure_zombie_automation()` creates that automation once on the server the Prefect client
points at (`python -m ettflow.flows.zombies`); run it once per server, next to `prefect
deploy`. It needs a lasting server (`prefect server start` or Prefect Cloud, whose managed
"Unresponsive run detection" does the same): an ephemeral API lives inside the process that
runs the flow and dies with it, which is why `ettflow refresh` uses its own supervisor
(`ettflow.flows.supervise`).
"""

from __future__ import annotations

from datetime import timedelta

# a refresh's final-state hook sends it after its last heartbeat (`tasks.run_event.emit_finished`)
from ettflow.tasks.run_event import FINISHED_EVENT

NAME = "ettflow: crash flow runs whose heartbeats stopped"
FINAL_EVENTS = ("prefect.flow-run.Completed", "prefect.flow-run.Failed", "prefect.flow-run.Cancelled",
                "prefect.flow-run.Crashed", FINISHED_EVENT)


def missing_after_s(heartbeat_s: float) -> float:
    """How long after a heartbeat, with no next one and no final state, a run is a zombie:
    two missed beats and a margin, so one late event is never a crash."""
    if heartbeat_s < 30:
        raise ValueError(f"Prefect emits flow-run heartbeats at most every 30 s, got heartbeat_s={heartbeat_s!r}")
    return 2.5 * heartbeat_s


def zombie_automation(heartbeat_s: float | None = None):
    """The automation (not yet created): after a heartbeat, expect another one or a final state
    within `missing_after_s(heartbeat_s)`, else change the flow run to CRASHED."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification
    from prefect.settings import get_current_settings

    beat = heartbeat_s if heartbeat_s is not None else get_current_settings().flows.heartbeat_frequency
    if beat is None:
        raise ValueError("flow-run heartbeats are off: set PREFECT_FLOWS_HEARTBEAT_FREQUENCY (>= 30 s) on the "
                         "workers, and pass the same value here")
    within = missing_after_s(beat)
    return Automation(
        name=NAME,
        description=f"A flow run that sent no heartbeat and reached no final state for {within:.0f} s after its "
                    f"last heartbeat (heartbeats every {beat:.0f} s) is marked CRASHED.",
        trigger=EventTrigger(
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *FINAL_EVENTS},
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message=f"no heartbeat for {within:.0f} s: the flow run's process is gone")],
    )


def ensure_zombie_automation(heartbeat_s: float | None = None) -> tuple[object, bool]:
    """Create the automation unless one with its name exists (one that predates `FINISHED_EVENT`
    is brought up to date); (automation, created)."""
    from prefect.automations import Automation

    try:
        found = Automation.read(name=NAME)
    except ValueError:  # not found
        return zombie_automation(heartbeat_s).create(), True
    if FINISHED_EVENT not in found.trigger.expect:
        try:
            found.trigger.expect = {*found.trigger.expect, FINISHED_EVENT}
            found.update()
        except Exception as exc:  # noqa: BLE001 - it still crashes dead runs; say what it lacks
            import logging

            logging.getLogger("ettflow.flows").warning(
                "the automation %r could not be brought up to date (%s): it may fire on a completed run whose "
                "last heartbeat arrived late; delete it and run `python -m ettflow.flows.zombies` again", NAME, exc)
    return found, False


if __name__ == "__main__":
    automation, created = ensure_zombie_automation()
    print(f"{'created' if created else 'exists'}: automation {automation.name!r} ({automation.id})")
