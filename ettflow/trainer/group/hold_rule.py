"""When the warm pool prewarms a model's next workers and how long it holds them unclaimed: a
typed decision, pure (no clock, no Ray), that the pool's service applies (`pool_service.py`).

Every slot-second a prewarmed worker waits is capacity held for nobody yet; the run that takes
it saves what its ranks would have spent starting (`StartSaving`: the model's measured start of
runs whose ranks started cold, less that of runs whose ranks came from the pool), on each of
its slots. So the pool prewarms only when that pays, in slot-seconds, as the capacity-inclusive
ETT counts them (ett/capacity.py: a pooled worker is one slot from its request to its take):

    saving = the run's slots x the start saved   >   cost = workers x the hold each is expected to have

- `JUST_IN_TIME` (the deployment's next run is scheduled): prewarm starts at the scheduled
  time minus the model's measured prewarm (`PrewarmEstimate.lead_s`: its mean, two standard
  deviations, and a margin), nothing is held from the release until then, and an unclaimed
  worker is released `margin_s` after the scheduled time (the run did not come). Each worker's
  expected hold is the lead.
- `KEEP_ALIVE` (no schedule: an ad hoc run, the UI's Run, back-to-back refreshes): prewarm at
  once and hold each ready worker for the break-even keep-alive, its share of the saving (ski
  rental: holding no longer than that never costs more than twice what the best choice in
  hindsight would have), bounded by `max_keep_alive_s`. The expected hold and the share of
  runs that find a ready worker come from the model's recent gaps from a release to its next
  run (a small histogram per model, as Azure Functions' keep-alive policy keeps one per
  application): a run that comes before the prewarm is done finds nothing ready, and one that
  comes after the keep-alive finds it released; with no gaps yet, the next run is assumed to
  come as the worker is ready.
- `NONE`: the saving does not exceed the cost under the rule that applies (or nothing would
  be held long enough to be taken): nothing is prewarmed; the next run starts its own ranks.
  The reason gives both numbers.

The model's prewarm duration is measured by the pool on its own workers (requested -> ready);
with none measured yet, `default_prewarm_s` stands in and the reason says so. The start a run
saves is measured by the group at each release (`StartSample`: from asking for its ranks to
its training loop starting, all ranks cold or all pooled); with no cold start measured the
prewarm stands in for it, and with no pooled start measured a pooled run is assumed to save
at most its prewarm.

That assumption alone would never let the pool learn: a pooled start is measured only when the
pool prewarms, which it never would (at most the prewarm saved, never more than a worker
holds), however long the cold start (the study's fleet: 2,050 s of cold compile). So a
scheduled run whose model has a cold start measured and no pooled start yet may be prewarmed
just in time to measure one (`explore`, which the pool grants a model `MAX_EXPLORATIONS`
times while none is measured): it is when the whole cold start saved would pay the hold, the
optimistic bound, and the reason says that it is a measurement. The run that takes the workers
reports its pooled start; from then on the measured numbers decide.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

MAX_EXPLORATIONS = 2  # just-in-time prewarms a model gets to measure a pooled start (see the docstring)
DEFAULT_PREWARM_S = 20.0  # a worker's prewarm before any is measured (imports, dense build, compile cache load)
SAMPLES_KEPT = 20  # the newest prewarm durations (and release -> next run gaps) per model the rules read


def newest(samples: Sequence[float]) -> list[float]:
    """The newest SAMPLES_KEPT of a model's measured seconds, the unusable (not finite, negative) left out."""
    return [float(x) for x in samples if math.isfinite(x) and x >= 0][-SAMPLES_KEPT:]


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
        got = newest(durations)
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
class StartSaving:
    """What the pool's workers save the run that takes them: the model's mean start with cold
    ranks less its mean start with pooled ones (see the module docstring for what stands in
    for either while it is unmeasured)."""

    cold_s: float | None
    warm_s: float | None
    cold_samples: int = 0
    warm_samples: int = 0

    @classmethod
    def of(cls, cold: Sequence[float], warm: Sequence[float]) -> StartSaving:
        def mean(xs: Sequence[float]) -> tuple[float | None, int]:
            got = newest(xs)
            return (statistics.fmean(got) if got else None), len(got)

        (c, nc), (w, nw) = mean(cold), mean(warm)
        return cls(cold_s=c, warm_s=w, cold_samples=nc, warm_samples=nw)

    def per_run_s(self, prewarm: PrewarmEstimate) -> float:
        """Wall seconds a run whose ranks are all pooled starts sooner."""
        if self.cold_s is None:
            return prewarm.mean_s
        if self.warm_s is None:
            return min(self.cold_s, prewarm.mean_s)
        return max(self.cold_s - self.warm_s, 0.0)

    def describe(self, prewarm: PrewarmEstimate) -> str:
        saved = self.per_run_s(prewarm)
        if self.cold_s is None:
            return f"start saved {saved:.1f} s (the prewarm's: no cold start measured yet)"
        if self.warm_s is None:
            return (f"start saved {saved:.1f} s (cold start {self.cold_s:.1f} s over {self.cold_samples}, "
                    "at most the prewarm: no pooled start measured yet)")
        return (f"start saved {saved:.1f} s (cold {self.cold_s:.1f} s over {self.cold_samples}, pooled "
                f"{self.warm_s:.1f} s over {self.warm_samples})")


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
    explore: bool = False  # held to measure a pooled start, which nothing measured yet

    def starts_now(self, now: float) -> bool:
        return self.rule is not HoldRule.NONE and self.start_at <= now

    def expired(self, now: float, *, ready_at: float | None) -> bool:
        """Whether an unclaimed worker held under this decision is released at `now`."""
        if self.release_at is not None:
            return now > self.release_at
        return ready_at is not None and self.keep_alive_s is not None and now - ready_at > self.keep_alive_s


def decide_hold(now: float, next_run_at: float | None, estimate: PrewarmEstimate, *, margin_s: float,
                max_keep_alive_s: float, gaps: Sequence[float] = (), saving: StartSaving = StartSaving(None, None),
                slots: int = 1, workers: int = 1, explore: bool = False) -> HoldDecision:
    """The hold for a model's next run (see the module docstring): `gaps`, the model's recent
    seconds from a release to its next run's request for workers; `saving`, its measured
    starts; `slots`, the next run's ranks; `workers`, how many the pool would prewarm for it
    (its ranks and spares); `explore`, whether a scheduled run may be prewarmed to measure a
    pooled start when none is (the pool's count of such holds decides)."""
    slots, workers = max(int(slots), 1), max(int(workers), 1)
    value = slots * saving.per_run_s(estimate)  # slot-seconds the run's ranks do not spend starting
    saves = f"{slots} rank(s) x {saving.describe(estimate)} = {value:.0f} slot-s"
    if next_run_at is not None:
        lead = estimate.lead_s(margin_s)
        ahead = next_run_at - now
        cost = workers * lead
        # no pooled start measured: prewarmed to measure one where the whole cold start saved would pay
        exploring = value <= cost and explore and saving.warm_s is None and saving.cold_s is not None \
            and slots * saving.cold_s > cost
        if value <= cost and not exploring:
            return HoldDecision(
                rule=HoldRule.NONE, start_at=now,
                reason=(f"next scheduled run in {ahead:.0f} s; a just-in-time prewarm would hold {workers} x "
                        f"{lead:.0f} s ({estimate.describe()}, margin {margin_s:.0f} s) = {cost:.0f} slot-s to save "
                        f"{saves}: nothing prewarmed"))
        if exploring:
            why = (f"no pooled start measured yet: prewarmed to measure one ({estimate.describe()}: prewarm starts "
                   f"{lead:.0f} s before it, {workers} x {lead:.0f} = {cost:.0f} slot-s held, less than the "
                   f"{slots} rank(s) x {saving.cold_s:.1f} s cold start = {slots * saving.cold_s:.0f} slot-s it "
                   "may save)")
        else:
            why = (f"{estimate.describe()}: prewarm starts {lead:.0f} s before it ({workers} x {lead:.0f} = "
                   f"{cost:.0f} slot-s held to save {saves})")
        return HoldDecision(
            rule=HoldRule.JUST_IN_TIME, start_at=max(now, next_run_at - lead), release_at=next_run_at + margin_s,
            explore=exploring,
            reason=f"next scheduled run in {ahead:.0f} s; {why}, unclaimed workers released {margin_s:.0f} s after it")
    keep = min(value / workers, max_keep_alive_s)  # break-even: a worker's wait costs at most its share
    ready = estimate.mean_s
    recent = newest(gaps) or [ready]
    taken = [ready <= g <= ready + keep for g in recent]  # the run found a ready worker
    hits = sum(taken)
    held = statistics.fmean(g if t else ready + keep for g, t in zip(recent, taken))  # per worker
    expected_value, cost = value * hits / len(recent), workers * held
    seen = (f"{hits} of the model's last {len(recent)} runs came while a worker would be ready "
            f"({ready:.0f}-{ready + keep:.0f} s after the release)" if gaps else
            "no runs seen yet: the next assumed to come as the workers are ready")
    if expected_value <= cost or keep <= 0:
        return HoldDecision(
            rule=HoldRule.NONE, start_at=now,
            reason=(f"no scheduled run; {seen}; prewarming {workers} would hold about {cost:.0f} slot-s to save "
                    f"{expected_value:.0f} of {saves}: nothing prewarmed"))
    return HoldDecision(
        rule=HoldRule.KEEP_ALIVE, start_at=now, keep_alive_s=keep,
        reason=(f"no scheduled run; {seen}; {estimate.describe()}: each ready worker is held {keep:.1f} s "
                f"(break-even: its share of {saves}); expected {cost:.0f} slot-s held for {expected_value:.0f} saved"))
