"""`ettflow report`: per-run L1/L2 and a per-model summary over time, from any warehouse.

The per-run table has the columns of the study's per-model bars: ETT%, TTS, NoF, TTR and
the six L2 components as a share of wall time (plus unattributed), after the run's status
(its final Prefect state: completed, failed, crashed, cancelled; or skipped) and deployment;
`prefect_run` links the flow run when the Prefect UI's URL is given (PREFECT_UI_URL). A
refresh that trained nothing has status `skipped`: it shows without an ETT% and the daily
means leave it out. Failed and crashed runs stay in the daily means, counted in their own
columns (`SUMMARY_NOTE` says so under the table).
`lineage_table` is a model's chain of refreshes (`ettflow report --model M --lineage`);
`interval_table` its checkpoint intervals, expected against realized waste (`--intervals`). Pure
formatting over pandas frames; the CLI reads the frames from the warehouse.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import pandas as pd

from .events import L2_ORDER, NOT_INTERVAL_WASTE, component_of, owner_of
from .interval_plan import TAG

if TYPE_CHECKING:
    from .capacity import HeldByKind, HeldByRule
    from .lineage import LineageRecord

SKIPPED = "skipped"  # the status of a run that trained nothing (ett.lineage.Outcome.SKIPPED)
COMPLETED, FAILED, CRASHED = "completed", "failed", "crashed"  # final states (warehouse `status`)
SUMMARY_NOTE = (
    "Daily means: skipped runs (nothing trained) are left out. Failed and crashed runs count in them: "
    "the device time they lost is the time ETT exists to show; the failed and crashed columns count them, "
    "and ett_completed_mean is the mean over completed runs only.")

SHORT = {
    "scheduling": "sched",
    "trainer_init": "init",
    "pt2_compile": "compile",
    "effective_training": "effective",
    "wasted_training": "wasted",
    "shutdown": "shutdown",
    "unattributed": "unattr",
}


def flow_run_url(ui_url: str | None, flow_run_id: str | None) -> str | None:
    """The flow run's page in the Prefect UI (`<ui>/runs/flow-run/<id>`); None without both."""
    if not ui_url or not flow_run_id or not isinstance(flow_run_id, str):
        return None
    return f"{ui_url.rstrip('/')}/runs/flow-run/{flow_run_id}"


def _deployment(tags: object) -> str:
    return str(tags.get("deployment") or "-") if isinstance(tags, dict) else "-"


def run_table(runs: pd.DataFrame, ui_url: str | None = None) -> pd.DataFrame:
    """One row per run: status, deployment, L1, then each L2 component as % of wall (a
    skipped run: no ETT%), then the flow run's URL in the Prefect UI at `ui_url` (if given)."""
    tags = runs["tags"] if "tags" in runs else pd.Series([None] * len(runs), index=runs.index)
    out = pd.DataFrame(
        {
            "run": runs["run_id"],
            "model": runs["model"],
            "mode": runs["mode"],
            "status": runs["status"],
            "deployment": [_deployment(t) for t in tags],
            "started": runs["wall_start"].map(utc_minute),
            "wall_s": runs["wall_s"].round(1),
            "ETT%": runs["ett_pct"].where(runs["status"] != SKIPPED).round(1),
            # capacity-inclusive: what the pool and spares held for the run counts too (ett.capacity)
            "capETT%": numeric_column(runs, "capacity_ett_pct").where(runs["status"] != SKIPPED).round(1),
            "held_s": numeric_column(runs, "held_s").round(1),
            # a skipped run trained nothing: no time to start, and no component shares (its wall
            # was the skip's decision, not a scheduler's queue)
            "TTS_s": runs["tts_s"].where(runs["status"] != SKIPPED).round(1),
            "NoF": runs["nof"].astype(int),
            "TTR_mean_s": runs["ttr_mean_s"].round(1),
        }
    )
    for c in L2_ORDER:
        out[f"{SHORT[c]}%"] = (100 * runs[f"{c}_s"] / runs["wall_s"]).where(runs["status"] != SKIPPED).round(1)
    if ui_url:
        ids = runs["flow_run_id"] if "flow_run_id" in runs else [None] * len(runs)
        out["prefect_run"] = [flow_run_url(ui_url, i) or "-" for i in ids]
    return out.reset_index(drop=True)


def utc_minute(epoch: float) -> str:
    """An epoch-seconds time as shown everywhere: to the minute, in UTC, labelled (the warehouse
    holds epoch seconds, which are UTC)."""
    return pd.to_datetime(float(epoch), unit="s", utc=True).strftime("%Y-%m-%d %H:%M UTC")


def numeric_column(runs: pd.DataFrame, name: str) -> pd.Series:
    """A numeric column that rows archived before it existed lack (NaN there, or everywhere
    when the frame has no such column)."""
    return pd.to_numeric(runs[name], errors="coerce") if name in runs else pd.Series([float("nan")] * len(runs),
                                                                                    index=runs.index)


def model_summary(runs: pd.DataFrame) -> pd.DataFrame:
    """Per model and day: how many runs trained, their ETT% (mean, min, max), wall and
    failures; skipped runs are counted apart and left out of the means; failed and crashed
    runs are counted apart and stay in them (`SUMMARY_NOTE`); `ett_completed_mean` is the
    mean of the completed runs alone."""
    skipped = runs["status"] == SKIPPED
    frame = runs.assign(day=pd.to_datetime(runs["wall_start"], unit="s", utc=True).dt.strftime("%Y-%m-%d UTC"),
                        skipped=skipped.astype(int), failed=(runs["status"] == FAILED).astype(int),
                        crashed=(runs["status"] == CRASHED).astype(int),
                        ett_completed=runs["ett_pct"].where(runs["status"] == COMPLETED),
                        **{c: runs[c].where(~skipped) for c in ("ett_pct", "wall_s", "tts_s")})
    grouped = frame.groupby(["model", "day"], sort=True)
    out = grouped.agg(
        runs=("ett_pct", "count"),
        skipped=("skipped", "sum"),
        failed=("failed", "sum"),
        crashed=("crashed", "sum"),
        ett_mean=("ett_pct", "mean"),
        ett_completed_mean=("ett_completed", "mean"),
        ett_min=("ett_pct", "min"),
        ett_max=("ett_pct", "max"),
        wall_mean_s=("wall_s", "mean"),
        tts_mean_s=("tts_s", "mean"),
        failures=("nof", "sum"),
    )
    return out.round(1).reset_index()


def held_table(rows: Sequence[HeldByKind]) -> pd.DataFrame:
    """The held-capacity ledger per model (`ett.capacity.held_by_model`): what pooled workers,
    spares, keepers and prefetched flow processes held outside the runs' own slots, the part
    no run used (unused spares, workers the pool released unclaimed: cost), and per resource."""
    return pd.DataFrame([{"model": r.model, "holdings": r.holdings, "held_s": round(r.held_s, 1),
                          "slot_s": round(r.slot_s, 1), "unused_slot_s": round(r.unused_slot_s, 1),
                          "gpu_s": round(r.gpu_s, 1), "cpu_s": round(r.cpu_s, 1), "GiB_s": round(r.gib_s, 1)}
                         for r in rows],
                        columns=["model", "holdings", "held_s", "slot_s", "unused_slot_s", "gpu_s", "cpu_s", "GiB_s"])


def held_rule_table(rows: Sequence[HeldByRule]) -> pd.DataFrame:
    """The ledger per model, kind, rule and outcome (`ett.capacity.held_by_rule`): which rule
    held what, and whether a run used it."""
    return pd.DataFrame([{"model": r.model, "kind": r.kind, "rule": r.rule, "outcome": r.outcome,
                          "holdings": r.holdings, "held_s": round(r.held_s, 1), "slot_s": round(r.slot_s)}
                         for r in rows],
                        columns=["model", "kind", "rule", "outcome", "holdings", "held_s", "slot_s"])


HELD_RULE_NOTE = ("Rules: just-in-time (the pool prewarmed for a scheduled run, its measured prewarm ahead), "
                  "keep-alive (kept after a release while the model's gaps say a run comes in time), "
                  "spare-by-saving (held ahead of a failure: its expected saving exceeds its slot-s), "
                  "spare-at-loss (started when a rank was lost), spare-shared (a run's part of a spare the "
                  "cluster's pool held for its model's training runs, by their savings), worker-prefetch (the "
                  "Prefect worker started the flow process ahead of its scheduled time).")

HELD_NOTE = ("Held capacity: pooled workers and spares (one trainer slot each; a GPU where their bundle has one), "
             "keepers and flow processes a worker started ahead of their scheduled time (no slot), from request to "
             "release. unused_slot_s is cost: spares that never replaced a rank, workers the pool released "
             "unclaimed. Each run's capETT% counts what was held for it; this ledger also what was held for nobody.")


def component_table(components: pd.DataFrame, wall_s: float, *, phases: bool = True) -> pd.DataFrame:
    """One run's L2 in detail: each component and (`phases`) each phase, exposed and raw, with owners."""
    frame = components.copy() if phases else components[components["kind"] == "component"].copy()
    # the row's owner as archived (a component's is its largest phase's in that run: `RunMetrics.owner`)
    stored = frame["owner"] if "owner" in frame.columns else [None] * len(frame)
    frame["owner"] = [o if isinstance(o, str) and o else (owner_of(n) or "-") for o, n in zip(stored, frame["name"])]
    frame["exposed_%"] = (100 * frame["exposed_s"] / wall_s).round(1) if wall_s > 0 else 0.0
    order = {name: i for i, name in enumerate(L2_ORDER)}
    # components first in sweep priority, then phases grouped under their component
    frame["_k"] = [
        (0, order[n], 0.0) if kind == "component"
        else (1, order.get(component_of(n) or "", 99), -exposed)
        for kind, n, exposed in zip(frame["kind"], frame["name"], frame["exposed_s"])
    ]
    frame = frame.sort_values("_k", kind="stable").drop(columns="_k")
    cols = ["kind", "name", "owner", "exposed_s", "raw_s", "exposed_%"]
    return frame[cols].round(3).reset_index(drop=True)


def _span(windows: Sequence[str]) -> str:
    if not windows:
        return "-"
    return windows[0] if len(windows) == 1 else f"{windows[0]}..{windows[-1]} ({len(windows)})"


def lineage_table(records: Sequence[LineageRecord], runs: pd.DataFrame) -> pd.DataFrame:
    """A model's chain, one row per refresh (oldest first): run, windows trained, parent,
    outcome, ETT% (from its archived run row; none for a skipped or unarchived run), why."""
    ett = dict(zip(runs["run_id"], runs["ett_pct"], strict=True)) if not runs.empty else {}
    rows = [{"run": r.run_id,
             "started": utc_minute(r.created_at),
             "windows": _span(r.windows), "parent": r.parent_run_id or "(cold)", "outcome": r.outcome.value,
             "ETT%": None if r.outcome.value == SKIPPED or r.run_id not in ett else round(float(ett[r.run_id]), 1),
             "reason": r.reason or ""}
            for r in records]
    return pd.DataFrame(rows, columns=["run", "started", "windows", "parent", "outcome", "ETT%", "reason"])


INTERVAL_PHASES = ("train_step_replay", "lost_in_flight", "checkpoint_save_blocking", *NOT_INTERVAL_WASTE)


def interval_table(runs: pd.DataFrame, phases: Mapping[tuple[str, str], float]) -> pd.DataFrame:
    """One row per refresh (oldest first): the checkpoint interval it trained with and where it
    came from (`ett.interval_plan`: history, probe, fixed; '-' when none was recorded), its
    inputs (failure rate per training hour, CSBT), the expected wasted training, and the
    realized one: the run's `wasted_training` (replay and lost in flight, save blocking:
    `phases`, (run, phase) -> exposed s) less its stalls and hangs (`NOT_INTERVAL_WASTE`:
    wasted, but no interval can change them), also as % of wall, and realized / expected."""
    rows = []
    for _, run in runs.iterrows():
        planned = (run["tags"] or {}).get(TAG) or {}
        rid, wall = run["run_id"], float(run["wall_s"]) or 1.0
        stalled = sum(phases.get((rid, phase), 0.0) for phase in NOT_INTERVAL_WASTE)
        expected, realized = planned.get("expected_wasted_s"), float(run["wasted_training_s"]) - stalled
        replay = phases.get((rid, "train_step_replay"), 0.0) + phases.get((rid, "lost_in_flight"), 0.0)
        rows.append({
            "run": rid,
            "started": utc_minute(run["wall_start"]),
            "status": run["status"], "source": planned.get("source", "-"),
            "interval_steps": planned.get("interval_steps"),
            "interval_s": _r(planned.get("interval_s"), 2),
            "rate_per_h": _r(planned.get("rate_per_h"), 3), "csbt_s": _r(planned.get("save_blocking_s"), 3),
            "NoF": int(run["nof"]), "saves": int(run["checkpoint_saves"]),
            "expected_wasted_s": _r(expected, 2), "wasted_s": round(realized, 2),
            "replay_s": round(replay, 2),
            "save_blocking_s": round(phases.get((rid, "checkpoint_save_blocking"), 0.0), 2),
            "wasted%": round(100 * realized / wall, 1),
            "realized/expected": round(realized / expected, 2) if expected else None,
        })
    columns = ["run", "started", "status", "source", "interval_steps", "interval_s", "rate_per_h", "csbt_s", "NoF",
               "saves", "expected_wasted_s", "wasted_s", "replay_s", "save_blocking_s", "wasted%", "realized/expected"]
    frame = pd.DataFrame(rows, columns=columns)
    return frame.astype({"interval_steps": "Int64"})


def _r(value: float | None, digits: int) -> float | None:
    return None if value is None else round(float(value), digits)


def render(frame: pd.DataFrame, fmt: str) -> str:
    if fmt == "csv":
        return frame.to_csv(index=False)
    if fmt == "json":
        return json.dumps(json.loads(frame.to_json(orient="records")), indent=2)
    if fmt == "table":
        if frame.empty:
            return "(no rows)"
        return frame.to_string(index=False)
    raise ValueError(f"unknown format {fmt!r}: use table, csv or json")
