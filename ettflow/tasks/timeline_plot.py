"""The picture of a run: one row per attempt, its time coloured by L2 component, failures
marked; CPU publishing after the devices were released on a row of its own (off the clock).
The axis is the run's wall (submission to release): off-clock work past it (a CPU publish
that takes longer than the run) is said in words in its row, never allowed to squeeze the run
(issue 43: a 110-s publish had set the axis of a 23.7-s run).

Drawn from the same intervals the metric sweeps (`ett.timeline.intervals_of`), so the colours
are the partition's: where phases overlap, the higher-priority component is drawn on top.
Returns PNG bytes (matplotlib, Agg backend: no display needed).
"""

from __future__ import annotations

import io
from collections.abc import Sequence

from ettflow.ett.events import COMPONENTS, FAILURE, FAILURE_DETECTED, SUBMITTED, PhaseEvent
from ettflow.ett.palette import COLOURS, DETECTED_COLOUR, FAILURE_COLOUR, PUBLISH_COLOUR
from ettflow.ett.run_metrics import RunMetrics
from ettflow.ett.timeline import faults, intervals_of


def render_timeline(events: Sequence[PhaseEvent], metrics: RunMetrics, *, title: str = "") -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = metrics.wall_start
    attempts = sorted({a.attempt for a in metrics.attempts}) or [0]
    publish = [e for e in events if e.phase == "publish_standalone"]
    rows = [f"attempt {a}" for a in attempts] + (["publish (CPU)"] if publish else [])
    fig, ax = plt.subplots(figsize=(10, 1.1 + 0.55 * len(rows)), dpi=100)
    intervals, _, _ = intervals_of(events, faults(events))
    # lowest priority first, so the component that wins an instant is drawn on top
    for component in reversed(COMPONENTS):
        for row, attempt in enumerate(attempts):
            spans = [(iv.start - t0, iv.end - iv.start) for iv in intervals
                     if iv.attempt == attempt and iv.component == component and iv.end > iv.start]
            if spans:
                ax.broken_barh(spans, (row - 0.35, 0.7), facecolors=COLOURS[component], linewidth=0)
    end = axis_end(metrics)
    if publish:
        row = len(attempts)
        for e in publish:
            failed = e.info.outcome in ("failed", "withdrawn")  # nothing published: hatched
            start, stop = e.start - t0, min(e.end - t0, end)
            if stop > start:
                ax.broken_barh([(start, max(stop - start, 1e-3))], (row - 0.35, 0.7),
                               facecolors="none" if failed else PUBLISH_COLOUR, edgecolors=PUBLISH_COLOUR,
                               hatch="//" if failed else None)
        note = publish_note(publish, t0, end)
        if note:
            ax.text(end, row, note + " ", ha="right", va="center", fontsize=8, color="#333333")
    for e in events:
        if e.phase in (FAILURE, FAILURE_DETECTED) and e.attempt in attempts:
            row = attempts.index(e.attempt)
            style = dict(marker="X", color=FAILURE_COLOUR, markersize=11) if e.phase == FAILURE else dict(
                marker="|", color=DETECTED_COLOUR, markersize=18, markeredgewidth=2)
            ax.plot([e.start - t0], [row], linestyle="none", zorder=5, **style)
        elif e.phase == SUBMITTED:
            ax.plot([e.start - t0], [0], marker=">", color=DETECTED_COLOUR, linestyle="none", zorder=5)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, end)
    ax.set_xlabel("seconds since submission")
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(color=COLOURS[c], label=c) for c in COMPONENTS]
    handles += [plt.Line2D([], [], marker="X", color=FAILURE_COLOUR, linestyle="none", label="failure"),
                plt.Line2D([], [], marker="|", color=DETECTED_COLOUR, linestyle="none", markersize=12,
                           label="detected")]
    if publish:
        handles.append(Patch(color=PUBLISH_COLOUR, label="publish (off clock)"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(rows) < 3 else -0.2),
              ncol=5, fontsize=8, frameon=False)
    ax.set_title(title or (f"run {metrics.run_id}: ETT {metrics.ett_pct:.1f}%, wall {metrics.wall_s:.1f} s, "
                           f"NoF {metrics.nof}"), fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def axis_end(metrics: RunMetrics) -> float:
    """The picture's axis: the run's wall, a hair more so its last bar shows."""
    return metrics.wall_s * 1.01 or 1.0


def publish_note(publish: Sequence[PhaseEvent], t0: float, end: float) -> str:
    """What of the CPU publishing lies past the axis, in words ("" when nothing does)."""
    past = [e for e in publish if e.end - t0 > end]
    if not past:
        return ""
    first, last = min(e.start for e in past) - t0, max(e.end for e in past) - t0
    took = sum(e.duration for e in past)
    return f"publish on the CPU, off the clock: {first:.1f}-{last:.1f} s ({took:.1f} s) →"
