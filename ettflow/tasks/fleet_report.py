"""The fleet report's I/O: read the warehouse, draw, publish markdown artifacts, emit regressions.

- `read_fleet`: the warehouse's runs with a ``deployment`` column (the row's ``deployment``
  tag, else the deployment Prefect knows for its flow run, else none).
- `ett_over_time_png`, `component_shares_png`: the pictures (matplotlib, Agg), coloured by
  `ett.palette`.
- `fleet_markdown`, `deployment_markdown`: the artifacts' text, pictures embedded as PNG data
  URIs (as the run timeline), worst runs linked to their flow runs in the UI.
- `publish_fleet_artifacts`: one markdown artifact per deployment (``ett-fleet-<slug>``)
  and one for the fleet (``ett-fleet``), on the current flow run.
- `emit_regressions`: one ``ettflow.component.regressed`` event per regression (resource
  ``ettflow.regression.<deployment>.<component>``, labels ``ettflow.deployment``,
  ``ettflow.component``, ``ettflow.owner``), for the regression automation.
"""

from __future__ import annotations

import base64
import io
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import pandas as pd

from ettflow.ett import fleet
from ettflow.ett.events import L2_ORDER, OWNERS
from ettflow.ett.palette import COLOURS, FAILURE_COLOUR
from ettflow.ett.report import numeric_column
from ettflow.ett.warehouse import Warehouse

from .plan import slug

CAP_COLUMN = "capacity_ett_pct"  # the warehouse's capETT% of a run (held capacity counted)

REGRESSED_EVENT = "ettflow.component.regressed"
FLEET_KEY = "ett-fleet"
log = logging.getLogger("ettflow.tasks")


# -- reading ------------------------------------------------------------------------------

def deployment_names(flow_run_ids: Sequence[str]) -> dict[str, str]:
    """flow run id -> its deployment's name, as Prefect knows them (only against an API; runs
    without a deployment, or ids Prefect does not know, are left out)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.settings import PREFECT_API_URL

    ids = []
    for value in flow_run_ids:
        try:
            ids.append(UUID(str(value)))
        except ValueError:
            continue
    if not ids or not PREFECT_API_URL.value():
        return {}
    out: dict[str, str] = {}
    with get_client(sync_client=True) as client:
        names: dict[UUID, str] = {}
        for i in range(0, len(ids), 200):
            for fr in client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids[i:i + 200]))):
                if fr.deployment_id is None:
                    continue
                if fr.deployment_id not in names:
                    names[fr.deployment_id] = client.read_deployment(fr.deployment_id).name
                out[str(fr.id)] = names[fr.deployment_id]
    return out


def read_fleet(warehouse_url: str | None, *, last: int | None = None, ask_prefect: bool = True) -> pd.DataFrame:
    """The warehouse's runs (the `last` most recent; all when None) with their deployment."""
    with Warehouse.open(warehouse_url) as wh:
        runs = wh.runs_frame(limit=last)
    names: dict[str, str] = {}
    if ask_prefect and not runs.empty:
        try:
            names = deployment_names([str(f) for f in runs["flow_run_id"].dropna()])
        except Exception:  # noqa: BLE001 - the view still works, by the rows' own tags
            log.warning("could not read the runs' deployments from Prefect", exc_info=True)
    return fleet.with_deployment(runs, names)


# -- pictures ------------------------------------------------------------------------------

def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def ett_axis(values: Iterable[float], goal: float | None = None) -> tuple[float, float]:
    """The ETT% axis: from 0 to a quarter above the highest value (and the goal, when one is
    set), in steps of 5, at most 100; (0, 100) with nothing to show. Fixed at 0-100, runs at
    1.6-4.5% drew a flat line (issue 27)."""
    top = max([v for v in values if v == v] + ([goal] if goal is not None else []), default=None)
    if top is None or top >= 80:
        return 0.0, 100.0
    return 0.0, float(min(100, max(5, math.ceil(top * 1.25 / 5) * 5)))


def ett_over_time_png(runs: pd.DataFrame, title: str, goal: float | None = None) -> bytes:
    """ETT% of each trained run by its start time, one line per deployment, and beside it (dotted,
    the same colour) its capETT% where the run recorded one (the capacity held for it counted:
    issue 43, the fleet showed capETT only as a mean); runs that did not complete marked with a
    red X; the axis scaled to the data (`ett_axis`), the goal as a dashed line where one is set,
    the legend outside the plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = fleet.trained(runs)
    cap_all = numeric_column(done, CAP_COLUMN)
    fig, ax = plt.subplots(figsize=(9, 3.2), dpi=90)
    for deployment, group in done.groupby("deployment", sort=True):
        when = pd.to_datetime(group["wall_start"], unit="s", utc=True)
        (line,) = ax.plot(when, group["ett_pct"], marker="o", markersize=4, label=f"{deployment} ETT")
        cap = numeric_column(group, CAP_COLUMN)
        if cap.notna().any():
            ax.plot(when, cap, linestyle=":", marker=".", markersize=4, color=line.get_color(),
                    label=f"{deployment} capETT")
        bad = group["status"] != "completed"
        if bad.any():
            ax.plot(when[bad], group["ett_pct"][bad], linestyle="none", marker="X", markersize=9,
                    color=FAILURE_COLOUR)
    ax.set_ylim(*ett_axis([*done["ett_pct"], *cap_all.dropna()], goal))
    if goal is not None:
        ax.axhline(goal, linestyle="--", linewidth=1, color="grey", label=f"goal {goal:g}%")
    ax.set_ylabel("ETT %")
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=10)
    if len(done):
        ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.autofmt_xdate()
    return _png(fig)


def component_shares_png(runs: pd.DataFrame, title: str, last: int = 20) -> bytes:
    """The last `last` trained runs as stacked bars: each L2 bucket's share of the run's wall
    time, labelled with its owner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = fleet.trained(runs).tail(last)
    fig, ax = plt.subplots(figsize=(9, 3.2), dpi=90)
    x = range(len(done))
    bottom = [0.0] * len(done)
    for c in L2_ORDER:
        share = [100 * s / w if w else 0.0 for s, w in zip(done[f"{c}_s"], done["wall_s"], strict=True)]
        ax.bar(x, share, bottom=bottom, color=COLOURS[c], label=f"{c} ({OWNERS.get(c, '-')})", width=0.8)
        bottom = [b + s for b, s in zip(bottom, share, strict=True)]
    ax.set_xticks(list(x), [pd.to_datetime(t, unit="s", utc=True).strftime("%m-%d %H:%M")
                            for t in done["wall_start"]], rotation=45, ha="right", fontsize=7)
    ax.set_ylim(0, 100)
    ax.set_ylabel("% of wall time")
    ax.set_xlabel("run start (UTC)", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _png(fig)


# -- markdown ------------------------------------------------------------------------------

def _image(png: bytes, alt: str) -> str:
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"


def md_table(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "(none)"
    cells = frame.astype(object).where(frame.notna(), "-")
    lines = ["| " + " | ".join(map(str, frame.columns)) + " |", "|" + "---|" * len(frame.columns)]
    for row in cells.itertuples(index=False):
        lines.append("| " + " | ".join(str(v).replace("|", "\\|") for v in row) + " |")
    return "\n".join(lines)


# why the summary's held slot-s and the ledger's differ (issue 43: 4,103.1 against 4,118.7, unexplained)
SUMMARY_NOTE = ("ETT columns and held slot-s count the runs that trained; the held-capacity ledger (last section) "
                "also counts what was held for skipped runs and for no run (prewarmed workers no run claimed).")


def summary_md(summary: pd.DataFrame) -> str:
    """`fleet.deployment_summary` as the artifacts show it: ETT's mean, min and last in one
    column and the skipped runs beside the trained ones, so the table fits the artifact page
    (issue 43: its last columns were cut at the right edge); held capacity in whole slot-seconds."""
    if summary.empty:
        return "(none)"

    def pct(v: Any) -> str:
        return "-" if v is None or pd.isna(v) else f"{v:.1f}"

    shown = pd.DataFrame({
        "deployment": summary["deployment"],
        "runs": [f"{r} (+{k} skipped)" if k else str(r) for r, k in zip(summary["runs"], summary["skipped"],
                                                                         strict=True)],
        "ETT % mean / min / last": [f"{pct(a)} / {pct(b)} / {pct(c)}" for a, b, c in
                                    zip(summary["ETT_mean%"], summary["ETT_min%"], summary["ETT_last%"], strict=True)],
        "capETT % mean": [pct(v) for v in summary["capETT_mean%"]],
        "held slot-s": [int(round(v)) for v in summary["held_s"]],
        "NoF": summary["NoF"],
        "not completed": summary["not_completed"],
        "last run (UTC)": [str(v).removesuffix(" UTC")[5:] if isinstance(v, str) else "-"
                               for v in summary["last_started"]],  # "12-05 07:48": the year is the page's
    })
    return md_table(shown)


def flow_run_url(flow_run_id: Any) -> str | None:
    """The UI page of a flow run: PREFECT_UI_URL's, else the path within the UI."""
    try:
        UUID(str(flow_run_id))
    except ValueError:
        return None
    from prefect.settings import PREFECT_UI_URL

    base = PREFECT_UI_URL.value()
    return f"{base.rstrip('/') if base else ''}/runs/flow-run/{flow_run_id}"


RUN_LABEL_CHARS = 8  # a run id's first characters label its link: the whole id made the table scroll sideways


def _worst_md(runs: pd.DataFrame, n: int) -> str:
    worst = fleet.worst_runs(runs, n)
    links = []
    for run, fr in zip(worst["run"], worst["flow_run_id"], strict=True):
        url, label = flow_run_url(fr), str(run)[:RUN_LABEL_CHARS]
        links.append(f"[{label}]({url})" if url else label)
    return md_table(worst.assign(run=links).drop(columns="flow_run_id"))


def _regressions_md(found: Sequence[fleet.Regression], rule: fleet.RegressionRule) -> str:
    lines = [f"Rule: {fleet.describe_rule(rule)}.", ""]
    if not found:
        return "\n".join(lines + ["No regression."])
    for r in found:
        b = r.baseline
        lines.append(f"- **{r.component}** of `{r.deployment}` (owner: **{r.owner}**): "
                     f"median {b.recent_median_s:.1f} s "
                     f"over the last {len(r.runs)} runs, above {b.threshold_s:.1f} s (history median "
                     f"{b.history_median_s:.1f} s, MAD {b.mad_s:.2f} s)")
    return "\n".join(lines)


def _waste_md(runs: pd.DataFrame) -> str:
    rule = fleet.WasteRule()
    found = fleet.waste_above_expected(runs, rule) if "model" in runs.columns else []
    lines = [f"Rule: {fleet.describe_waste_rule(rule)}.", ""]
    if not found:
        return "\n".join(lines + ["No model's waste is above its plan."])
    for f in found:
        lines.append(f"- model **{f.model}** (owner: **{f.owner}**): wasted training median "
                     f"{f.realized_median_s:.1f} s over its last {len(f.runs)} runs, against "
                     f"{f.expected_median_s:.1f} s expected by their checkpoint plans: its failure rate or save "
                     "cost has changed")
    return "\n".join(lines)


def goal_of(goals: Mapping[str, float], deployment: str | None) -> float | None:
    """The ETT% goal drawn for `deployment` (None: the fleet's): the automations' `ett_below`
    threshold for it, else the one for every run (`*`), else none."""
    return goals.get(deployment, goals.get("*")) if deployment is not None else goals.get("*")


def deployment_markdown(deployment: str, runs: pd.DataFrame, rule: fleet.RegressionRule, worst: int = 5,
                        goal: float | None = None) -> str:
    """One deployment's view: its ETT over time (with its goal line), components per owner,
    worst runs, regressions."""
    summary = fleet.deployment_summary(runs)
    found = [r for r in fleet.regressions(runs, rule) if r.deployment == deployment]
    return "\n".join([
        f"# ETT of deployment `{deployment}`", "", summary_md(summary), "",
        "## ETT% per run over time (dotted: capETT%)", "",
        _image(ett_over_time_png(runs, f"ETT% per run: {deployment}", goal), f"ETT per run of {deployment}"), "",
        "## Components per owner (share of wall time)", "",
        _image(component_shares_png(runs, f"where the wall time went: {deployment}"), f"components of {deployment}"),
        "", md_table(fleet.component_shares(runs)), "",
        f"## Worst {worst} runs", "", _worst_md(runs, worst), "",
        "## Regressions", "", _regressions_md(found, rule), "", _waste_md(runs),
    ])


@dataclass(frozen=True)
class HeldTables:
    """The held-capacity ledger summed per model (`ett.report.held_table`) and per model, kind,
    rule and outcome (`ett.report.held_rule_table`)."""

    by_model: pd.DataFrame
    by_rule: pd.DataFrame


def held_markdown(held: HeldTables | None) -> str:
    """The held-capacity ledger per model, then per rule and outcome, or a line saying none."""
    if held is None or held.by_model.empty:
        return "No capacity was held outside the runs' own slots (no pooled worker, spare or prefetched process)."
    from ettflow.ett.report import HELD_NOTE, HELD_RULE_NOTE

    return "\n".join([md_table(held.by_model), "", HELD_NOTE, "", "### Which rule held what, and whether a run "
                      "used it", "", md_table(held.by_rule), "", HELD_RULE_NOTE])


def read_held(warehouse_url: str | None) -> HeldTables:
    """The warehouse's held-capacity ledger summed per model and per rule (`ett.capacity`)."""
    from ettflow.ett.capacity import held_by_model, held_by_rule
    from ettflow.ett.report import held_rule_table, held_table

    with Warehouse.open(warehouse_url) as wh:
        holdings = wh.holdings()
    return HeldTables(held_table(held_by_model(holdings)), held_rule_table(held_by_rule(holdings)))


def fleet_markdown(runs: pd.DataFrame, rule: fleet.RegressionRule, worst: int = 10,
                   held: HeldTables | None = None, goal: float | None = None) -> str:
    """The fleet's view: every deployment's summary and ETT over time, the components per
    owner over all runs, the worst runs, every regression, and what the pool and spares held
    (the ledger, with what no run used)."""
    return "\n".join([
        "# ETT of the fleet", "", summary_md(fleet.deployment_summary(runs)), "", SUMMARY_NOTE, "",
        "## ETT% per run over time (dotted: capETT%)", "",
        _image(ett_over_time_png(runs, "ETT% per run, by deployment", goal), "ETT per run of the fleet"), "",
        "## Components per owner (share of wall time, all deployments)", "",
        _image(component_shares_png(runs, "where the wall time went: the fleet's last runs"),
               "components of the fleet"),
        "", md_table(fleet.component_shares(runs)), "",
        f"## Worst {worst} runs", "", _worst_md(runs, worst), "",
        "## Regressions", "", _regressions_md(fleet.regressions(runs, rule), rule), "", _waste_md(runs), "",
        "## Held capacity (the pool's and spares' ledger, per model)", "", held_markdown(held),
    ])


# -- publishing ----------------------------------------------------------------------------

def publish_fleet_artifacts(runs: pd.DataFrame, rule: fleet.RegressionRule, held: HeldTables | None = None,
                            goals: Mapping[str, float] | None = None) -> dict[str, UUID]:
    """Create the fleet artifact and one per deployment on the current flow run; key -> id.
    `goals`: ETT% goal lines by deployment (`*`: every run), as the automations' `ett_below`."""
    from prefect.artifacts import create_markdown_artifact

    done = fleet.trained(runs)
    made: dict[str, UUID] = {}
    mean = f"mean ETT {done['ett_pct'].mean():.1f}%" if len(done) else "no trained run"
    made[FLEET_KEY] = create_markdown_artifact(
        key=FLEET_KEY, markdown=fleet_markdown(runs, rule, held=held, goal=goal_of(goals or {}, None)),
        description=f"Fleet: {runs['deployment'].nunique()} deployments, {len(done)} runs, {mean}")
    for deployment, group in runs.groupby("deployment", sort=True):
        trained = fleet.trained(group)
        last = f"last ETT {trained['ett_pct'].iloc[-1]:.1f}%" if len(trained) else "no trained run"
        key = f"{FLEET_KEY}-{slug(str(deployment))}"
        made[key] = create_markdown_artifact(key=key, markdown=deployment_markdown(
            str(deployment), group, rule, goal=goal_of(goals or {}, str(deployment))),
                                             description=f"{deployment}: {len(trained)} runs, {last}")
    return made


def emit_regressions(found: Sequence[fleet.Regression], related: Sequence[Mapping[str, str]] = ()) -> int:
    """Emit one `REGRESSED_EVENT` per regression; how many were emitted (none without a
    configured API, PREFECT_API_URL)."""
    from prefect.events import emit_event
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        return 0
    sent = 0
    for r in found:
        b = r.baseline
        event = emit_event(
            REGRESSED_EVENT,
            resource={"prefect.resource.id": f"ettflow.regression.{r.deployment}.{r.component}",
                      "prefect.resource.name": f"{r.component} of {r.deployment}",
                      "ettflow.deployment": r.deployment, "ettflow.component": r.component,
                      "ettflow.owner": r.owner},
            related=[dict(x) for x in related],
            payload={"deployment": r.deployment, "component": r.component, "owner": r.owner,
                     "recent_median_s": b.recent_median_s, "history_median_s": b.history_median_s,
                     "mad_s": b.mad_s, "threshold_s": b.threshold_s, "runs": list(r.runs)})
        sent += event is not None
    return sent
