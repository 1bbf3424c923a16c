"""What the Prefect UI shows for a refresh: ETT table, timeline picture, snapshot manifest.

Keys are stable per deployment (`ett-<slug>`, `ett-timeline-<slug>`, `snapshot-<slug>`; the
progress artifact is `training-progress-<slug>`), so the UI's Artifacts page keeps each one's
history across runs. Every description starts with the run's ETT%, NoF and final state
(`ett.run_summary.description_head`), so a card cut short still shows them. The snapshot is
shown by its manifest (path, sha256 of each file and of the manifest, step, windows, validation
metrics, parent), not a `file://` link a browser cannot open. Each artifact is attached to its
flow run by id, never through the run context: the crash hook runs in another process.
"""

from __future__ import annotations

import base64
import hashlib
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from uuid import UUID

from ettflow.ett.capacity import Holding, outcome_of, rule_of
from ettflow.ett.event_attrs import SparePlanAttrs
from ettflow.ett.events import COMPONENTS, UNATTRIBUTED, owner_of
from ettflow.ett.interval_plan import PlannedInterval
from ettflow.ett.run_metrics import RunMetrics
from ettflow.publish.config import PublishError
from ettflow.publish.manifest import MANIFEST_FILE, SnapshotManifest, read_manifest
from ettflow.publish.retention import TIMELINE_SUFFIX


def timeline_file(snapshot: str | None, spool_dir: Path) -> Path:
    """Where the timeline picture is saved: beside the snapshot folder (`<run_id>.ett-timeline.png`;
    not inside it, which its manifest's checksums cover), else in the run's spool folder."""
    if snapshot and Path(snapshot).is_dir():
        return Path(snapshot).with_name(Path(snapshot).name + TIMELINE_SUFFIX)
    return spool_dir / ("run" + TIMELINE_SUFFIX)


# nobody owns the value alone (the run's own totals): a table cell of "-" is drawn as a list
# bullet by the Prefect UI's markdown, and "none" read as an error (issue 43)
NO_OWNER = "the whole run"
# one rounding rule for every figure a user reads (issue 43): percent to 1 decimal, seconds to 2,
# slot-seconds whole, counts and rates as they are
DIGITS = {"%": 1, "s": 2, "slot-s": 0}


def _round(value: float | None, unit: str) -> float | int | None:
    if value is None or unit not in DIGITS:
        return value
    return int(round(value)) if DIGITS[unit] == 0 else round(value, DIGITS[unit])


def row(level: str, metric: str, exposed: Any, *, unit: str, raw: Any = None, raw_unit: str | None = None,
        pct_of_wall: float | None = None, owner: str = NO_OWNER) -> dict[str, Any]:
    """One row of the ETT table: the owner beside the metric (the table fits a 1440-px page),
    then the values rounded by their unit (`DIGITS`); `raw` in `raw_unit` (default `unit`)."""
    return {"level": level, "metric": metric, "owner": owner, "exposed": _round(exposed, unit),
            "raw": _round(raw, raw_unit or unit), "% of wall": _round(pct_of_wall, "%")}


def table_rows(m: RunMetrics) -> list[dict[str, Any]]:
    """L1 then L2: each row has level, metric, owner (`NO_OWNER` for the run's own totals),
    exposed (s or %), raw, share of wall. Every value is named by its row: a raw value that is
    not the exposed one's raw time says what it is in the metric's name."""
    wall = m.wall_s or 1.0
    rows = [
        row("L1", "ETT %", m.ett_pct, unit="%"),
        row("L1", "L1 form %, 1 - (TTS + NoF x TTR) / wall", m.ett_l1_pct,
            unit="%"),
        row("L1", "capETT % (raw: slot-s held for the run)",
            m.capacity_ett_pct, unit="%", raw=m.held.held_s, raw_unit="slot-s"),
        row("L1", "unused spares, slot-s (cost)", m.held.unused_spare_s, unit="slot-s", owner="scheduler"),
    ]
    if m.held.prestart_s > 0:
        rows.append(row("L1", "prefetched flow process held, s (no slot)",
                        m.held.prestart_s, unit="s", owner="scheduler"))
    rows += [
        row("L1", "wall s", m.wall_s, unit="s", pct_of_wall=100.0),
        row("L1", "TTS s", m.tts_s, unit="s", pct_of_wall=100 * m.tts_s / wall),
        row("L1", "NoF", m.nof, unit="count"),
        row("L1", "TTR s (total; raw: mean per failure)", m.ttr_total_s, unit="s", raw=m.ttr_mean_s,
            pct_of_wall=100 * m.ttr_total_s / wall),
    ]
    for name in (*COMPONENTS, UNATTRIBUTED):
        rows.append(row("L2", name, m.components[name], unit="s", raw=m.components_raw[name],
                        pct_of_wall=100 * m.components[name] / wall, owner=m.owner(name) or NO_OWNER))
        ray = m.phases.get("ray_start") if name == "scheduling" else None
        if ray is not None:  # no Ray to join: the run started one, and paid for it (`ettflow up` keeps one)
            rows.append(row("L2", "scheduling: ray_start (a Ray of its own)", ray.exposed_s,
                            unit="s", raw=ray.raw_s, pct_of_wall=100 * ray.exposed_s / wall,
                            owner=owner_of("scheduling") or NO_OWNER))
    return rows


def interval_rows(planned: PlannedInterval, m: RunMetrics) -> list[dict[str, Any]]:
    """The checkpoint interval the run trained with and its inputs (`ett.interval_plan`); the
    expected wasted training beside the realized one (raw: the run's wasted_training)."""
    wall = m.wall_s or 1.0
    wasted = m.components["wasted_training"]

    def planned_row(metric: str, exposed: Any, unit: str = "s", **kw: Any) -> dict[str, Any]:
        return row("interval", metric, exposed, unit=unit, owner="storage", **kw)

    rows = [
        planned_row(f"checkpoint interval s ({planned.source.value}; raw: steps)", planned.interval_s,
                    raw=planned.interval_steps, raw_unit="count"),
        planned_row("failure rate per training h (raw: own weight)",
                    None if planned.rate_per_h is None else round(planned.rate_per_h, 4), unit="rate",
                    raw=None if planned.own_weight is None else round(planned.own_weight, 3), raw_unit="rate"),
        planned_row("save blocking s (CSBT, durable)", planned.save_blocking_s),
        planned_row("expected training s", planned.job_s),
        planned_row("expected wasted s (raw: realized)", planned.expected_wasted_s, raw=wasted,
                    pct_of_wall=100 * wasted / wall),
    ]
    return [x for x in rows if x["exposed"] is not None or x["raw"] is not None]  # a probe run plans nothing yet


def spare_rows(plan: SparePlanAttrs) -> list[dict[str, Any]]:
    """The spares the run held and why (`ett.spare_sizing`: expected saving against cost)."""
    return [row("capacity", f"spares held ({plan.rule}; raw: expected failures)", plan.spares, unit="count",
                raw=plan.expected_failures, raw_unit="rate", owner="scheduler"),
            row("capacity", "one spare's cost, slot-s (the run's expected wall)", plan.cost_slot_s, unit="slot-s",
                owner="scheduler")]


def holding_rows(holdings: Sequence[Holding]) -> list[dict[str, Any]]:
    """Each thing held for the run outside its own slots (`ett.capacity.holdings_of_run`): what
    it was (a pooled worker with the rank it became), the rule that held it and its outcome;
    exposed its slot-seconds, raw its seconds."""
    return [row("capacity", f"{_what(h)}: {rule_of(h)}, {outcome_of(h)} (slot-s; raw: s)",
                h.held_s * h.slots, unit="slot-s", raw=h.held_s, raw_unit="s", owner="scheduler") for h in holdings]


def _what(h: Holding) -> str:
    return f"{h.kind} {h.for_rank} (from the pool)" if h.for_rank is not None else h.kind


# why Prefect's duration of a run and its ETT wall differ (issue 43: they stood side by side unexplained)
WALL_NOTE = ("The wall is the study's: from the run's submission to the release of its devices. Prefect's "
             "duration of the flow run is longer: it also counts what runs after the release on the CPU "
             "(publishing the snapshot, archiving the run) and the process's own start and end.")


def timeline_markdown(run_id: str, png: bytes, m: RunMetrics, extra: str = "") -> str:
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    lines = [
        f"### ETT timeline of run `{run_id}`",
        "",
        f"ETT **{m.ett_pct:.1f}%** of {m.wall_s:.1f} s wall; TTS {m.tts_s:.1f} s; NoF {m.nof}; "
        f"TTR {m.ttr_total_s:.1f} s. One row per attempt; red X: failure, black bar: detection.",
        "",
        WALL_NOTE,
        "",
        f"![ETT timeline of run {run_id}]({uri})",
    ]
    if extra:
        lines += ["", extra]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None or value == "" or value == []:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | tuple):
        return ", ".join(map(str, value))
    return str(value).replace("|", "\\|")


def folder_name(path: str | None) -> str | None:
    """A path's last part (a checkpoint's step, a snapshot's run): what a table cell shows. The
    UI cuts a cell at its right edge (issue 43: the anchor's path was cut), so whole paths go
    in the list below the table (`manifest_markdown`), where they wrap."""
    return Path(path).name or path if path else path


def manifest_markdown(manifest: SnapshotManifest, manifest_sha256: str) -> str:
    """The snapshot as its manifest tells it: where, which files (sha256), which step and
    windows, how it validated, and what it came from."""
    lineage, source, validation = manifest.lineage or {}, manifest.source or {}, manifest.validation or {}
    paths = [("snapshot", manifest.path), ("anchor checkpoint", source.get("checkpoint")),
             ("parent snapshot", lineage.get("parent_snapshot")), ("parent anchor", lineage.get("parent_anchor"))]
    rows = [("snapshot", folder_name(manifest.path)), ("run", manifest.run_id), ("step", manifest.step),
            ("windows trained", lineage.get("windows")), ("held out", lineage.get("held_out")),
            ("validation", "passed" if validation.get("passed") else "FAILED"),
            ("parent snapshot", folder_name(lineage.get("parent_snapshot"))),
            ("parent anchor", folder_name(lineage.get("parent_anchor"))),
            ("anchor checkpoint", folder_name(source.get("checkpoint"))),
            (f"{MANIFEST_FILE} sha256", f"`{manifest_sha256}`")]
    rows += [(f"{name} sha256", f"`{info.get('sha256')}` ({info.get('size')} bytes)")
             for name, info in sorted(manifest.files.items())]
    lines = [f"### Inference snapshot of run `{manifest.run_id}`", "", "| field | value |", "|---|---|"]
    lines += [f"| {k} | {_cell(v)} |" for k, v in rows]
    lines += ["", "**Where** (whole paths)", ""]
    lines += [f"- {k}: `{v}`" for k, v in paths if v]
    if manifest.metrics:
        lines += ["", "**Validation metrics**", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {_cell(v)} |" for k, v in sorted(manifest.metrics.items())]
    return "\n".join(lines)


def snapshot_markdown(snapshot: str) -> str:
    """The snapshot's manifest as markdown, or why it cannot be read (the path is still named)."""
    try:
        manifest = read_manifest(snapshot)
        digest = hashlib.sha256((Path(snapshot) / MANIFEST_FILE).read_bytes()).hexdigest()
    except (PublishError, OSError) as exc:
        return f"### Inference snapshot\n\n`{snapshot}`: its manifest cannot be read ({exc})"
    return manifest_markdown(manifest, digest)


def create_skipped_artifact(*, flow_run_id: UUID | str, slug: str, run_id: str, reason: str, head: str) -> UUID:
    """A skipped refresh trained nothing: no ETT table or timeline (an ETT of 0% would be a lie),
    one short artifact that says why (same key as the ETT table, so the deployment's history of
    that key shows the skip in its place)."""
    from prefect.artifacts import MarkdownArtifact

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return MarkdownArtifact(key=f"ett-{slug}", flow_run_id=UUID(str(flow_run_id)),
                                markdown=f"### Run `{run_id}` skipped\n\nskipped: {reason}\n\nNothing was trained: "
                                         "it has no ETT.", description=f"{head} · {reason}").create(_sync=True).id


def create_run_artifacts(*, flow_run_id: UUID | str, slug: str, run_id: str, metrics: RunMetrics, png: bytes,
                         snapshot: str | None, summary: str, head: str,
                         interval: PlannedInterval | None = None,
                         spares: SparePlanAttrs | None = None,
                         holdings: Sequence[Holding] = ()) -> dict[str, UUID]:
    """Create the three artifacts on the flow run `flow_run_id`; returns their ids. `head`
    starts every description (ETT%, NoF, state); `summary` follows it on the ETT table, which
    ends with the checkpoint interval's rows (`interval_rows`) when one was planned."""
    from prefect.artifacts import MarkdownArtifact, TableArtifact

    fr = UUID(str(flow_run_id))
    made: dict[str, UUID] = {}
    with warnings.catch_warnings():  # outside a run context (crash hook): we pass the id ourselves
        warnings.simplefilter("ignore", FutureWarning)
        rows = table_rows(metrics) + (interval_rows(interval, metrics) if interval is not None else [])
        if interval is not None:
            summary = f"{summary}; " + "; ".join(interval.lines())
        if spares is not None:
            rows += spare_rows(spares)
            summary = f"{summary}; spares: {spares.reason}"
        rows += holding_rows(holdings)
        made["table"] = TableArtifact(key=f"ett-{slug}", table=rows, flow_run_id=fr,
                                      description=f"{head} · {summary}").create(_sync=True).id
        made["timeline"] = MarkdownArtifact(key=f"ett-timeline-{slug}", flow_run_id=fr,
                                            markdown=timeline_markdown(run_id, png, metrics),
                                            description=f"{head} · ETT timeline of run {run_id}").create(_sync=True).id
        if snapshot:
            made["snapshot"] = MarkdownArtifact(key=f"snapshot-{slug}", flow_run_id=fr,
                                                markdown=snapshot_markdown(snapshot),
                                                description=f"{head} · inference snapshot manifest of run {run_id}"
                                                ).create(_sync=True).id
    return made
