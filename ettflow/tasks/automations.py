"""ettflow's Prefect automations: a file under version control, compiled and applied to a server.

`AutomationsConfig` is the file (`automations/ettflow.yaml`): the webhook block every action
calls, the ETT% threshold per deployment, the NoF threshold, and whether component
regressions alert. `compile_automations` turns it into Prefect automations:

- ``ettflow: ETT below T% on D``: an `ettflow.run.measured` event of deployment D (any run
  for ``*``) whose ``ettflow.ett_pct`` label is below T (`ett.thresholds.ett_below_globs`),
  not skipped;
- ``ettflow: NoF above N``: an `ettflow.run.measured` event whose ``ettflow.nof`` is above N;
- ``ettflow: component regression``: an `ettflow.component.regressed` event (the fleet report).

Each one's action calls the webhook block with a JSON body: ``alert`` (which rule),
``automation``, ``event``, ``resource`` (the run or the regression) and the event's
``payload``. Without that block on the server they are applied all the same, with Prefect's
`DoNothing` action (issue 43: no alert existed anywhere without a webhook): Prefect 3.9.1 has
no action that alerts inside its own UI without an outside service (a notification needs a
block; an incident is Prefect Cloud's), but every trigger is an event, ``prefect.automation.triggered``
naming the automation and the run's event, which the Event Feed lists and the automation's page
counts. `--webhook-url` then adds the posting. `apply_automations` creates or updates them by
name and deletes the ettflow automations (tag ``ettflow``) the file no longer names: applying
twice changes nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ettflow.ett.thresholds import ett_below_globs, nof_above_globs

from .fleet_report import REGRESSED_EVENT
from .run_event import EVENT as MEASURED_EVENT

DEFAULT_FILE = Path(__file__).resolve().parents[2] / "automations" / "ettflow.yaml"
TAG = "ettflow"
ANY_DEPLOYMENT = "*"
KEYS = ("webhook_block", "ett_below", "nof_above", "component_regression")


@dataclass(frozen=True, kw_only=True)
class AutomationsConfig:
    webhook_block: str
    ett_below: dict[str, float] = field(default_factory=dict)  # deployment ('*': any run) -> ETT% threshold
    nof_above: int | None = None
    component_regression: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.webhook_block, str) or not self.webhook_block:
            raise ValueError("automations: `webhook_block` must name a Prefect Webhook block")
        for deployment, threshold in self.ett_below.items():
            if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 100:
                raise ValueError(f"automations: ett_below[{deployment!r}] must be an ETT% in (0, 100], "
                                 f"not {threshold!r}")
        if self.nof_above is not None and (isinstance(self.nof_above, bool) or not isinstance(self.nof_above, int)
                                           or self.nof_above < 0):
            raise ValueError(f"automations: `nof_above` must be a whole number >= 0 or null, not {self.nof_above!r}")

    @classmethod
    def from_mapping(cls, data: Any, source: str = "the automations file") -> AutomationsConfig:
        if not isinstance(data, dict):
            raise ValueError(f"{source} must be a mapping with keys {', '.join(KEYS)}")
        unknown = sorted(set(data) - set(KEYS))
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {', '.join(unknown)}; known: {', '.join(KEYS)}")
        ett_below = data.get("ett_below") or {}
        if not isinstance(ett_below, dict):
            raise ValueError(f"{source}: `ett_below` maps a deployment name (or '*') to an ETT% threshold")
        return cls(webhook_block=data.get("webhook_block"), ett_below={str(k): v for k, v in ett_below.items()},
                   nof_above=data.get("nof_above"), component_regression=bool(data.get("component_regression", True)))

    @classmethod
    def load(cls, path: Path | str = DEFAULT_FILE) -> AutomationsConfig:
        import yaml

        path = Path(path)
        return cls.from_mapping(yaml.safe_load(path.read_text()), source=str(path))


def webhook_body(alert: str) -> str:
    """The Jinja template of the webhook's JSON body (rendered by the Prefect server)."""
    return ('{"alert": ' + json.dumps(alert) + ', "automation": {{ automation.name | tojson }}, '
            '"event": {{ event.event | tojson }}, "resource": {{ event.resource.id | tojson }}, '
            '"payload": {{ event.payload | tojson }}}')


NO_WEBHOOK_ACTION = ("Action: none yet (no webhook block): each trigger is listed in the Event Feed as "
                     "prefect.automation.triggered; `ettflow automations apply --webhook-url URL` adds the POST.")


def compile_automations(config: AutomationsConfig, webhook_block_id: Any | None) -> list:
    """The Prefect automations (`AutomationCore`) the config describes, calling the webhook
    block `webhook_block_id` (None: no block, `DoNothing`: the trigger alone is the alert)."""
    from prefect.events.actions import CallWebhook, DoNothing
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    def make(name: str, alert: str, description: str, event: str, match: dict[str, Any]) -> AutomationCore:
        trigger = EventTrigger(expect={event}, match=match, posture=Posture.Reactive, threshold=1, within=0)
        if webhook_block_id is None:
            action, description = DoNothing(), description.replace("Action: call the webhook.", NO_WEBHOOK_ACTION)
        else:
            action = CallWebhook(block_document_id=webhook_block_id, payload=webhook_body(alert))
        return AutomationCore(name=name, description=description, enabled=True, tags=[TAG], trigger=trigger,
                              actions=[action])

    out = []
    for deployment, threshold in sorted(config.ett_below.items()):
        match: dict[str, Any] = {"prefect.resource.id": "prefect.flow-run.*", "ettflow.outcome": "!skipped",
                                 "ettflow.ett_pct": ett_below_globs(float(threshold))}
        where = "any run"
        if deployment != ANY_DEPLOYMENT:
            match["ettflow.deployment"] = deployment
            where = deployment
        out.append(make(f"ettflow: ETT below {threshold:g}% on {where}", "ett_below",
                        f"Trigger: an {MEASURED_EVENT} event of {where} (not skipped) with ETT below "
                        f"{threshold:g}% (its ettflow.ett_pct label). Action: call the webhook. From "
                        "automations/ettflow.yaml.",
                        MEASURED_EVENT, match))
    if config.nof_above is not None:
        out.append(make(f"ettflow: NoF above {config.nof_above}", "nof_above",
                        f"Trigger: an {MEASURED_EVENT} event with NoF above {config.nof_above} (its ettflow.nof "
                        "label: the run failed more often). Action: call the webhook. From automations/ettflow.yaml.",
                        MEASURED_EVENT,
                        {"prefect.resource.id": "prefect.flow-run.*",
                         "ettflow.nof": nof_above_globs(config.nof_above)}))
    if config.component_regression:
        out.append(make("ettflow: component regression", "component_regression",
                        f"Trigger: an {REGRESSED_EVENT} event (the fleet report found a lost component "
                        "above its baseline: ettflow/ett/fleet.py's rule). Action: call the webhook.",
                        REGRESSED_EVENT, {"prefect.resource.id": "ettflow.regression.*"}))
    return out


def save_webhook_block(name: str, url: str) -> None:
    """Create or overwrite the Webhook block `name` (POST to `url`)."""
    from prefect.blocks.webhook import Webhook

    Webhook(method="POST", url=url).save(name, overwrite=True)


def webhook_block_id(name: str):
    """The id of the Webhook block `name` on the server; None when it has none."""
    from prefect.blocks.webhook import Webhook

    try:
        block = Webhook.load(name)
    except ValueError:
        return None
    return block._block_document_id


@dataclass(frozen=True)
class Applied:
    created: tuple[str, ...]
    updated: tuple[str, ...]
    deleted: tuple[str, ...]
    webhook: bool = True  # their action posts to the webhook block (False: none on the server, `DoNothing`)


def apply_automations(config: AutomationsConfig) -> Applied:
    """Create or update every automation of `config` on the configured Prefect API (by name),
    and delete the ettflow automations it no longer names."""
    from prefect.client.orchestration import get_client

    block = webhook_block_id(config.webhook_block)
    wanted = compile_automations(config, block)
    created, updated, deleted = [], [], []
    with get_client(sync_client=True) as client:
        existing = [a for a in client.read_automations() if TAG in (a.tags or [])]
        by_name = {a.name: a for a in existing}
        for automation in wanted:
            if automation.name in by_name:
                client.update_automation(by_name[automation.name].id, automation)
                updated.append(automation.name)
            else:
                client.create_automation(automation)
                created.append(automation.name)
        names = {a.name for a in wanted}
        for old in existing:
            if old.name not in names:
                client.delete_automation(old.id)
                deleted.append(old.name)
    return Applied(tuple(created), tuple(updated), tuple(deleted), webhook=block is not None)
