"""What a finished refresh says about itself in the Prefect UI: its state message, its name and
tags, the head of its artifacts' descriptions, and one log line per failed attempt.

A `RunSummary` is the run's measured result after archiving (ETT%, NoF and the failures, TTS,
the L2 components, model, mode, windows, final state and outcome); everything the UI shows is
a pure function of it, so the strings are defined here and tested exactly:

- `state_message`: ``ETT 91.2% · NoF 1 · TTS 8.3 s · infrastructure: rank 1 killed at step 16``:
  the numbers first (the UI cuts a long message at "See More"), then how the refresh ended when
  that is not a plain publish (``gated: ...``, ``failed: ...``, ``crashed: ...``, ``cancelled:
  ...``), then its failures, each reason once. A skipped refresh trained nothing: its message is
  only why it was skipped.
- `run_name`: ``dlrm-optimized 2024010100..2024010103 (4)``: model, mode and the windows;
  `measured_name` adds the result once archived (``· ETT 42.6%``, ``· skipped``), for the runs list.
- `run_tags`: ``model:dlrm``, ``mode:optimized``, ``failures:1``, ``outcome:published``, on top
  of the run's other tags (the deployment's), so the UI filters runs by them.
- `description_head`: ``ETT 91.2% · NoF 1 · Completed``, the start of every artifact's description.
- `failure_line`: ``attempt 0 ended with an infrastructure failure: rank 1 killed at step 16
  (rank 1, step 16); detail: <Ray's text>``: ettflow's words first, the raw detail after.

Pure: no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .failures import Failure, FailureClass
from .lineage import Outcome
from .run_metrics import RunMetrics

SEP = " · "
FAILURES_NAMED = 3  # failures spelled out in a state message; the rest are counted
REASON_CHARS = 120  # a failure's reason in a state message is cut here
OUTCOME_CHARS = 800  # how the run ended (its first line) in a state message; the whole of it is logged
TAG_PREFIXES = ("model:", "mode:", "failures:", "outcome:")  # the tags this module owns
WINDOW_PREFIX = "window="


class FinalState(str, enum.Enum):
    """The Prefect state a run ended in (its warehouse `status`, but for `skipped`)."""

    COMPLETED = "completed"
    FAILED = "failed"
    CRASHED = "crashed"
    CANCELLED = "cancelled"

    @property
    def title(self) -> str:
        return self.value.capitalize()


@dataclass(frozen=True)
class FailureNote:
    """One failure as the summary names it: its class and its reason in ettflow's words."""

    failure_class: str
    reason: str

    @property
    def text(self) -> str:
        reason = self.reason if len(self.reason) <= REASON_CHARS else self.reason[: REASON_CHARS - 3] + "..."
        return f"{self.failure_class}: {reason}" if reason else self.failure_class


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """A finished run, measured. `ett_pct`, `tts_s` and `wall_s` are None when nothing was
    measured (a skipped refresh, or a run that spooled nothing). `outcome`: a lineage outcome
    (published, gated, skipped, failed) or the final state of a run that did not get to record
    one (crashed, cancelled). `reason`: why it was gated, skipped, failed, crashed or cancelled."""

    run_id: str
    model: str
    mode: str
    state: FinalState
    outcome: str
    windows: tuple[str, ...] = ()
    ett_pct: float | None = None
    nof: int = 0
    tts_s: float | None = None
    wall_s: float | None = None
    components: Mapping[str, float] = field(default_factory=dict)  # exposed seconds per L2 component
    failures: tuple[FailureNote, ...] = ()
    reason: str | None = None

    @property
    def measured(self) -> bool:
        return self.ett_pct is not None

    def payload(self) -> dict[str, Any]:
        """The summary as plain data (an event's payload, a log record)."""
        return {"run_id": self.run_id, "model": self.model, "mode": self.mode, "state": self.state.value,
                "outcome": self.outcome, "windows": list(self.windows), "ett_pct": self.ett_pct, "nof": self.nof,
                "tts_s": self.tts_s, "wall_s": self.wall_s, "components": dict(self.components),
                "failures": [{"failure_class": f.failure_class, "reason": f.reason} for f in self.failures],
                "reason": self.reason}


def summarize(metrics: RunMetrics | None, *, run_id: str, model: str, mode: str, state: FinalState, outcome: str,
              windows: Sequence[str] = (), reason: str | None = None) -> RunSummary:
    """The summary of a run from its metrics (None: nothing was spooled). A skipped refresh
    keeps no ETT: it trained nothing (the report leaves it out of the means too)."""
    if metrics is None or outcome == Outcome.SKIPPED.value:
        return RunSummary(run_id=run_id, model=model, mode=mode, state=state, outcome=outcome,
                          windows=tuple(windows), reason=reason)
    return RunSummary(
        run_id=run_id, model=model, mode=mode, state=state, outcome=outcome, windows=tuple(windows),
        ett_pct=metrics.ett_pct, nof=metrics.nof, tts_s=metrics.tts_s, wall_s=metrics.wall_s,
        components=dict(metrics.components),
        failures=tuple(FailureNote(f.failure_class, f.reason) for f in metrics.failures), reason=reason)


def _failures_named(s: RunSummary, said: str) -> str | None:
    """The run's failures in ettflow's words, the first FAILURES_NAMED of them; a failure whose
    reason the outcome already says (or that says the outcome's) is not repeated."""
    def repeats(note: FailureNote) -> bool:
        a, b = note.reason.strip().lower(), said.strip().lower()
        return bool(a and b) and (a in b or b in a)

    notes = [f for f in s.failures if not repeats(f)]
    if not notes:
        return None
    more = f"; and {len(notes) - FAILURES_NAMED} more" if len(notes) > FAILURES_NAMED else ""
    return "; ".join(f.text for f in notes[:FAILURES_NAMED]) + more


def short_reason(reason: str | None) -> str:
    """How a run ended, as its state message says it: the first line, at most OUTCOME_CHARS
    (a full disk's error ran to 2,202 characters); `reason_is_cut` says when the rest goes to the
    run's log."""
    first = (reason or "").strip().split("\n", 1)[0]
    return first if len(first) <= OUTCOME_CHARS else first[:OUTCOME_CHARS - 1].rstrip() + "…"


def reason_is_cut(reason: str | None) -> bool:
    return bool(reason) and short_reason(reason) != (reason or "").strip()


def state_message(s: RunSummary) -> str:
    """The run's final state message (see the module docstring): the numbers first, so the UI's
    cut ("See More") never hides them; then how it ended (`short_reason`), then its failures."""
    if s.outcome == Outcome.SKIPPED.value:
        return short_reason(s.reason) or "skipped"
    if refused(s):  # nothing to measure: what refused it, first
        return f"refused: {short_reason(s.reason)}" if s.reason else "refused"
    if s.state is FinalState.COMPLETED and not s.measured and s.reason:  # e.g. a stopped run's anchor published
        return short_reason(s.reason)
    parts = [f"ETT {s.ett_pct:.1f}%", f"NoF {s.nof}", f"TTS {s.tts_s:.1f} s"] if s.measured \
        else ["no ETT: the run recorded no phase"]
    if s.outcome not in (Outcome.PUBLISHED.value, FinalState.COMPLETED.value):
        parts.append(f"{s.outcome}: {short_reason(s.reason)}" if s.reason else s.outcome)
    named = _failures_named(s, s.reason or "")
    if named:
        parts.append(named)
    return SEP.join(parts)


def window_span(windows: Sequence[str]) -> str:
    """`2024010100..2024010103 (4)`; one window: `2024010100`; none: empty."""
    names = [w.removeprefix(WINDOW_PREFIX) for w in windows]
    if not names:
        return ""
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]} ({len(names)})"


def run_name(model: str, mode: str, windows: Sequence[str] = ()) -> str:
    """`dlrm-optimized 2024010100..2024010103 (4)`; before the windows are known, `dlrm-optimized`."""
    span = window_span(windows)
    return f"{model}-{mode} {span}" if span else f"{model}-{mode}"


PHASES_NAMED = 3  # an attempt's longest phases named in the progress history


def progress_history(m: RunMetrics) -> list[str]:
    """What the run went through, one line per attempt, for the progress artifact once the run
    ended (the live progress lines are gone by then): when the attempt ran (seconds from the
    wall start), how it ended and its longest phases; then the work after the release:

    ``attempt 0, 0.0-38.0 s: failed (infrastructure: SIGKILL rank 0), recovered in 14.0 s; steps 15.0 s,
    pt2_compile 10.0 s, scheduling 5.0 s``."""
    publish = FailureClass.PUBLISH.value
    failures = {f.attempt: f for f in m.failures if f.failure_class != publish}
    lines = []
    for a in m.attempts:
        head = f"attempt {a.attempt}, {a.start - m.wall_start:.1f}-{a.end - m.wall_start:.1f} s"
        f = failures.get(a.attempt)
        how = "completed" if f is None else (
            f"failed ({f.failure_class}: {f.reason[:REASON_CHARS]})"
            + (f", recovered in {f.ttr_s:.1f} s" if f.recovered else ", not recovered"))
        longest = sorted(((s, p) for p, s in a.phase_raw_s.items() if s > 0), reverse=True)[:PHASES_NAMED]
        named = ", ".join(f"{'steps' if p == 'train_step' else p} {s:.1f} s" for s, p in longest)
        lines.append(f"{head}: {how}" + (f"; {named}" if named else ""))
    standalone_s = m.raw("publish_standalone")
    publish_failures = sum(f.failure_class == publish for f in m.failures)
    after = ([f"publish_standalone {standalone_s:.1f} s"] if standalone_s > 0 else []) + (
        [f"{publish_failures} failed publish tr{'y' if publish_failures == 1 else 'ies'}"] if publish_failures else [])
    if after:
        lines.append("after the release: " + ", ".join(after))
    return lines


def measured_name(s: RunSummary) -> str:
    """The run's name once it is measured, so the runs list shows its result without a click:
    `dlrm-optimized 2024010100..2024010103 (4) · ETT 42.6%`; `... · skipped`; `... · no ETT`."""
    if s.outcome == Outcome.SKIPPED.value:
        result = "skipped"
    elif refused(s):
        result = "refused"
    else:
        result = f"ETT {s.ett_pct:.1f}%" if s.measured else "no ETT"
    return SEP.join([run_name(s.model, s.mode, s.windows), result])


def refused(s: RunSummary) -> bool:
    """A run that failed before it recorded anything: refused (a parameter, the warehouse) before
    it claimed, reserved or trained: no failure of a training to count."""
    return s.state is FinalState.FAILED and not s.measured and s.outcome == FinalState.FAILED.value


def run_tags(s: RunSummary, existing: Iterable[str] = ()) -> list[str]:
    """The run's tags: its other tags (the deployment's) kept in order, then model, mode,
    failures and outcome (replacing older ones of this module); a refused run: `outcome:refused`
    and no failure count (issue 43: it was tagged `failures:0`)."""
    kept = [t for t in existing if not t.startswith(TAG_PREFIXES)]
    ours = [f"model:{s.model}", f"mode:{s.mode}", "outcome:refused"] if refused(s) else [
        f"model:{s.model}", f"mode:{s.mode}", f"failures:{s.nof}", f"outcome:{s.outcome}"]
    return [*dict.fromkeys(kept), *ours]


def description_head(s: RunSummary) -> str:
    """`ETT 91.2% · NoF 1 · Completed` (skipped: `skipped · Completed`), the start of every
    artifact description, so a card cut short still shows it."""
    if s.outcome == Outcome.SKIPPED.value:
        return SEP.join(["skipped", s.state.title])
    if not s.measured:
        return SEP.join(["no ETT", s.state.title])
    return SEP.join([f"ETT {s.ett_pct:.1f}%", f"NoF {s.nof}", s.state.title])


def failure_line(f: Failure) -> str:
    """How an attempt ended, for the log: class and reason first, where, then the raw detail."""
    article = "an" if f.failure_class.value[0] in "aeiou" else "a"
    where = ", ".join(x for x in (f"rank {f.rank}" if f.rank >= 0 else "", f"step {f.step}" if f.step is not None
                                  else "") if x)
    text = f"attempt {f.attempt if f.attempt is not None else '?'} ended with {article} {f.failure_class.value} failure"
    text += f": {f.reason}" if f.reason else ""
    text += f" ({where})" if where else ""
    detail = " ".join(f.detail.split())
    return f"{text}; detail: {detail}" if detail else text
