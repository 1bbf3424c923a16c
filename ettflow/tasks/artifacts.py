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

TIMELINE_SUFFIX = ".ett-timeline.png"


def timeline_file(snapshot: str | None, spool_dir: Path) -> Path:
    """Where the timeline picture is saved: beside the snapshot folder (`<run_id>.ett-timeline.png`;
    not inside it, which its manifest's checksums cover), else in the run's spool folder."""
    if snapshot and Path(snapshot).is_dir():
        return Path(snapshot).with_name(Path(snapshot).name + TIMELINE_SUFFIX)
    return spool_dir / ("run" + TIMELINE_SUFFIX)


# nobody owns the value: a table cell of "-" is drawn as a list bullet by the Prefect UI's markdown
NO_OWNER = "none"


def table_rows(m: RunMetrics) -> list[dict[str, Any]]:
    """L1 then L2: each row has level, metric, exposed (s or %), raw, share of wall, owner (`NO_OWNER`
    where nobody owns it). Every value is named by its row: a raw value that is not the exposed
    one's raw time says what it is in the metric's name."""
    wall = m.wall_s or 1.0
    rows = [
        {"level": "L1", "metric": "ETT %", "exposed": round(m.ett_pct, 2), "raw": None, "pct_of_wall": None,
         "owner": NO_OWNER},
        {"level": "L1", "metric": "ETT % in the study's L1 form, 1 - (TTS + NoF x TTR) / wall (an upper bound)",
         "exposed": round(m.ett_l1_pct, 2), "raw": None, "pct_of_wall": None, "owner": NO_OWNER},
        {"level": "L1", "metric": "capacity-inclusive ETT % (raw: slot-s held for the run by the pool and spares)",
         "exposed": round(m.capacity_ett_pct, 2), "raw": round(m.held.held_s, 3), "pct_of_wall": None,
         "owner": NO_OWNER},
        {"level": "L1", "metric": "unused spares, slot-s (cost)", "exposed": round(m.held.unused_spare_s, 3),
         "raw": None, "pct_of_wall": None, "owner": "scheduler"},
    ]
    if m.held.prestart_s > 0:
        rows.append({"level": "L1", "metric": "flow process held before its scheduled start, s (worker prefetch; "
                     "no trainer slot)", "exposed": round(m.held.prestart_s, 3), "raw": None, "pct_of_wall": None,
                     "owner": "scheduler"})
    rows += [
        {"level": "L1", "metric": "wall s", "exposed": round(m.wall_s, 3), "raw": None, "pct_of_wall": 100.0,
         "owner": NO_OWNER},
        {"level": "L1", "metric": "TTS s", "exposed": round(m.tts_s, 3), "raw": None,
         "pct_of_wall": round(100 * m.tts_s / wall, 1), "owner": NO_OWNER},
        {"level": "L1", "metric": "NoF", "exposed": m.nof, "raw": None, "pct_of_wall": None, "owner": NO_OWNER},
        {"level": "L1", "metric": "TTR s (total; raw: the mean per failure)", "exposed": round(m.ttr_total_s, 3),
         "raw": round(m.ttr_mean_s, 3), "pct_of_wall": round(100 * m.ttr_total_s / wall, 1), "owner": NO_OWNER},
    ]
    for name in (*COMPONENTS, UNATTRIBUTED):
        rows.append({"level": "L2", "metric": name, "exposed": round(m.components[name], 3),
                     "raw": round(m.components_raw[name], 3),
                     "pct_of_wall": round(100 * m.components[name] / wall, 1), "owner": m.owner(name) or NO_OWNER})
        ray = m.phases.get("ray_start") if name == "scheduling" else None
        if ray is not None:  # no Ray to join: the run started one, and paid for it (`ettflow up` keeps one)
            rows.append({"level": "L2", "metric": "scheduling: ray_start (a local Ray started on this run's clock)",
                         "exposed": round(ray.exposed_s, 3), "raw": round(ray.raw_s, 3),
                         "pct_of_wall": round(100 * ray.exposed_s / wall, 1),
                         "owner": owner_of("scheduling") or NO_OWNER})
    return rows


def interval_rows(planned: PlannedInterval, m: RunMetrics) -> list[dict[str, Any]]:
    """The checkpoint interval the run trained with and its inputs (`ett.interval_plan`); the
    expected wasted training beside the realized one (raw: the run's wasted_training)."""
    wall = m.wall_s or 1.0

    def row(metric: str, exposed: Any, raw: Any = None, pct: float | None = None) -> dict[str, Any]:
        return {"level": "interval", "metric": metric, "exposed": exposed, "raw": raw, "pct_of_wall": pct,
                "owner": "storage"}

    def r(v: float | None, digits: int = 3) -> float | None:
        return None if v is None else round(v, digits)

    wasted = m.components["wasted_training"]
    rows = [
        row(f"checkpoint interval s ({planned.source.value}; raw: steps)", r(planned.interval_s),
            planned.interval_steps),
        row("failure rate per training h (raw: own weight)", r(planned.rate_per_h, 4), r(planned.own_weight)),
        row("save blocking s (CSBT, durable)", r(planned.save_blocking_s)),
        row("expected training s", r(planned.job_s)),
        row("expected wasted s (raw: realized wasted_training)", r(planned.expected_wasted_s), round(wasted, 3),
            round(100 * wasted / wall, 1)),
    ]
    return [x for x in rows if x["exposed"] is not None or x["raw"] is not None]  # a probe run plans nothing yet


def spare_rows(plan: SparePlanAttrs) -> list[dict[str, Any]]:
    """The spares the run held and why (`ett.spare_sizing`: expected saving against cost)."""
    return [{"level": "capacity", "metric": f"spares held ({plan.rule}; raw: expected failures)",
             "exposed": plan.spares, "raw": plan.expected_failures, "pct_of_wall": None, "owner": "scheduler"},
            {"level": "capacity", "metric": "one spare's cost, slot-s (the run's expected wall)",
             "exposed": plan.cost_slot_s, "raw": None, "pct_of_wall": None, "owner": "scheduler"}]


def holding_rows(holdings: Sequence[Holding]) -> list[dict[str, Any]]:
    """Each thing held for the run outside its own slots (`ett.capacity.holdings_of_run`): what
    it was, the rule that held it and its outcome; exposed its slot-seconds, raw its seconds."""
    return [{"level": "capacity", "metric": f"held: {h.kind}, rule {rule_of(h)}, {outcome_of(h)} (slot-s; raw: s)",
             "exposed": round(h.held_s * h.slots, 1), "raw": round(h.held_s, 2), "pct_of_wall": None,
             "owner": "scheduler"} for h in holdings]


def timeline_markdown(run_id: str, png: bytes, m: RunMetrics, extra: str = "") -> str:
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    lines = [
        f"### ETT timeline of run `{run_id}`",
        "",
        f"ETT **{m.ett_pct:.1f}%** of {m.wall_s:.1f} s wall; TTS {m.tts_s:.1f} s; NoF {m.nof}; "
        f"TTR {m.ttr_total_s:.1f} s. One row per attempt; red X: failure, black bar: detection.",
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


def folder_first(path: str | None) -> str | None:
    """A long path as `name (in parent)`: the UI cuts a table cell at its right edge, and the
    name (a checkpoint's step, a snapshot's run) is what tells one from another."""
    if not path:
        return path
    p = Path(path)
    return f"{p.name} (in {p.parent})" if p.name and str(p.parent) not in ("", ".") else path


def manifest_markdown(manifest: SnapshotManifest, manifest_sha256: str) -> str:
    """The snapshot as its manifest tells it: where, which files (sha256), which step and
    windows, how it validated, and what it came from."""
    lineage, source, validation = manifest.lineage or {}, manifest.source or {}, manifest.validation or {}
    rows = [("path", folder_first(manifest.path)), ("run", manifest.run_id), ("step", manifest.step),
            ("windows trained", lineage.get("windows")), ("held out", lineage.get("held_out")),
            ("validation", "passed" if validation.get("passed") else "FAILED"),
            ("parent snapshot", folder_first(lineage.get("parent_snapshot"))),
            ("parent anchor", folder_first(lineage.get("parent_anchor"))),
            ("anchor checkpoint", folder_first(source.get("checkpoint"))),
            (f"{MANIFEST_FILE} sha256", f"`{manifest_sha256}`")]
    rows += [(f"{name} sha256", f"`{info.get('sha256')}` ({info.get('size')} bytes)")
             for name, info in sorted(manifest.files.items())]
    lines = [f"### Inference snapshot of run `{manifest.run_id}`", "", "| field | value |", "|---|---|"]
    lines += [f"| {k} | {_cell(v)} |" for k, v in rows]
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
