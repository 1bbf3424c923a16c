"""When the warm pool prewarms a model's next workers and how long it holds them unclaimed: a
typed decision, pure (no clock, no Ray), that the pool's service applies (`pool_service.py`).

Every slot-second a prewarmed worker waits is capacity held for nobody yet; the run that takes
it saves at most its prewarm (the worker is ready when the run starts instead of starting then).
So the pool holds just what can pay:

- `JUST_IN_TIME` (the deployment's next run is scheduled): prewarm starts at the scheduled
  time minus the model's measured prewarm (`PrewarmEstimate.lead_s`: its mean, two standard
  deviations, and a margin), nothing is held from the release until then, and an unclaimed
  worker is released `margin_s` after the scheduled time (the run did not come).
- `KEEP_ALIVE` (no schedule: an ad hoc run, the UI's Run, back-to-back refreshes): prewarm at
  once and hold each ready worker for the break-even keep-alive, the cold start it would save
  (ski rental: holding no longer than that never costs more than twice what the best choice in
  hindsight would have, and a run that comes in time saves its whole cold start), bounded by
  `max_keep_alive_s`;
- `NONE` (no schedule, and the model's recent gaps from a release to its next run say a worker
  would mostly expire first: fewer than half of them within the prewarm plus the keep-alive):
  nothing is prewarmed; the next run starts its own (the gaps are a small histogram of the
  model's arrivals, as Azure Functions' keep-alive policy keeps one per application).

The model's prewarm duration is measured by the pool on its own workers (requested -> ready);
with none measured yet, `default_prewarm_s` stands in and the reason says so.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_PREWARM_S = 20.0  # a worker's prewarm before any is measured (imports, dense build, compile cache load)
SAMPLES_KEPT = 20  # the newest prewarm durations (and release -> next run gaps) per model the rules read
HIT_SHARE = 0.5  # keep-alive prewarms only when at least this share of the model's recent gaps would find it


class HoldRule(str, enum.Enum):
    JUST_IN_TIME = "just-in-time"
    KEEP_ALIVE = "keep-alive"
    NONE = "none"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class PrewarmEstimate:
    """A model's prewarm duration: mean and standard deviation over `samples` measured ones
    (0: none yet, the mean is the default)."""

    mean_s: float
    sd_s: float
    samples: int

    @classmethod
    def of(cls, durations: Sequence[float], *, default_s: float = DEFAULT_PREWARM_S) -> PrewarmEstimate:
        got = [float(d) for d in durations if math.isfinite(d) and d >= 0][-SAMPLES_KEPT:]
        if not got:
            return cls(mean_s=default_s, sd_s=0.0, samples=0)
        return cls(mean_s=statistics.fmean(got), sd_s=statistics.pstdev(got) if len(got) > 1 else 0.0,
                   samples=len(got))

    def lead_s(self, margin_s: float) -> float:
        """How long before a run its prewarm starts: mean + 2 sd + margin."""
        return self.mean_s + 2.0 * self.sd_s + margin_s

    def describe(self) -> str:
        if not self.samples:
            return f"prewarm {self.mean_s:.1f} s (default: none measured yet)"
        return f"prewarm {self.mean_s:.1f} +/- {self.sd_s:.1f} s over {self.samples} measured"


@dataclass(frozen=True)
class HoldDecision:
    """`rule`; `start_at`: when to start prewarming (<= now: at once); `release_at`: an
    unclaimed worker is released then (just in time), or `keep_alive_s` after it is ready (keep
    alive); `reason`: the numbers, for `ettflow pool status` and the ledger."""

    rule: HoldRule
    start_at: float
    reason: str
    release_at: float | None = None
    keep_alive_s: float | None = None

    def starts_now(self, now: float) -> bool:
        return self.rule is not HoldRule.NONE and self.start_at <= now

    def expired(self, now: float, *, ready_at: float | None) -> bool:
        """Whether an unclaimed worker held under this decision is released at `now`."""
        if self.release_at is not None:
            return now > self.release_at
        return ready_at is not None and self.keep_alive_s is not None and now - ready_at > self.keep_alive_s


def decide_hold(now: float, next_run_at: float | None, estimate: PrewarmEstimate, *, margin_s: float,
                max_keep_alive_s: float, gaps: Sequence[float] = ()) -> HoldDecision:
    """The hold for a model's next run (see the module docstring); `gaps`: the model's recent
    seconds from a release to its next run's request for workers."""
    if next_run_at is not None:
        lead = estimate.lead_s(margin_s)
        start = max(now, next_run_at - lead)
        ahead = next_run_at - now
        return HoldDecision(
            rule=HoldRule.JUST_IN_TIME, start_at=start, release_at=next_run_at + margin_s,
            reason=(f"next scheduled run in {ahead:.0f} s; {estimate.describe()}: prewarm starts {lead:.0f} s "
                    f"before it, unclaimed workers released {margin_s:.0f} s after it"))
    keep = min(estimate.mean_s, max_keep_alive_s)
    recent = [g for g in gaps if math.isfinite(g) and g >= 0][-SAMPLES_KEPT:]
    window = estimate.mean_s + keep  # a run that comes later than this finds the worker released
    if recent:
        hits = sum(g <= window for g in recent)
        if hits < HIT_SHARE * len(recent):
            return HoldDecision(
                rule=HoldRule.NONE, start_at=now,
                reason=(f"no scheduled run; {hits} of the model's last {len(recent)} runs came within the "
                        f"{window:.0f} s a prewarmed worker is kept (median gap {statistics.median(recent):.0f} s): "
                        "nothing prewarmed"))
    return HoldDecision(
        rule=HoldRule.KEEP_ALIVE, start_at=now, keep_alive_s=keep,
        reason=(f"no scheduled run; {estimate.describe()}: each ready worker is held {keep:.1f} s, the cold "
                "start it would save (break-even)"))
