"""A refresh's checkpoint interval, chosen before training from its model's history.

`plan_interval(estimate, windows=n, max_steps=m)` sizes the refresh (its expected training
time L: the model's new steps per window x n windows, capped at `max_steps`, x its seconds
per step) and runs the optimizer on the estimated inputs:

    optimal_interval(WasteModel(job_s=L, save_blocking_s=CSBT_durable,
                                failure_rate_per_s=rate), min_interval_s=step_s)

The interval is given to the trainer in steps (rounded, at least 1); the expected wasted
training is the model's at that rounded interval. Where it comes from (`IntervalSource`):

- HISTORY: the model has its own save cost and step time in the window: no probe save;
- PROBE: it has none (a new model): the trainer's first save is a probe that measures them,
  and the interval after it uses the estimated failure rate (the fleet's, for a new model;
  with no training hours anywhere, none: the trainer's guess per job);
- FIXED: the refresh set `checkpoint_every_steps`; the estimate is recorded beside it.

`PlannedInterval.to_attrs` is what the run stores (a `checkpoint_interval` spool marker, and
the `checkpoint_interval` tag of its warehouse row) and what the ETT artifact shows. Pure.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .checkpoint_interval import WasteModel, optimal_interval
from .checkpoint_tier import CheckpointTier
from .failure_history import HistoryEstimate

TAG = "checkpoint_interval"  # the warehouse tag and the spool marker's phase


class IntervalSource(str, enum.Enum):
    HISTORY = "history"
    PROBE = "probe"
    FIXED = "fixed"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, kw_only=True)
class PlannedInterval:
    source: IntervalSource
    rate_per_h: float | None = None  # estimated failures per training hour (all replaying classes)
    save_blocking_s: float | None = None  # estimated CSBT (durable tier)
    step_s: float | None = None
    job_s: float | None = None  # expected training time of the refresh
    interval_s: float | None = None  # the optimizer's interval
    interval_steps: int | None = None  # what the trainer uses
    expected_wasted_s: float | None = None  # WTT expected at interval_steps
    own_weight: float | None = None  # T / (S + T) of the rate
    own_hours: float | None = None
    runs: int | None = None  # the model's runs in the estimate's window
    detection_s: float | None = None
    restore_s: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "source", IntervalSource(self.source))

    def to_attrs(self) -> dict[str, Any]:
        return {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, Any]) -> PlannedInterval:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in attrs.items() if k in names})

    def lines(self) -> list[str]:
        """Human lines for the ETT artifact and logs."""
        def num(v: float | None, unit: str = "s", digits: int = 2) -> str:
            return "-" if v is None else f"{v:.{digits}f} {unit}".rstrip()
        out = [f"checkpoint interval: {self.source.value}"
               + (f", every {self.interval_steps} steps ({num(self.interval_s)})" if self.interval_steps else "")]
        if self.rate_per_h is not None:
            out.append(f"failure rate {self.rate_per_h:.3g}/h of training (own weight {self.own_weight or 0:.2f}, "
                       f"{self.runs or 0} runs, {self.own_hours or 0:.3g} h)")
        if self.save_blocking_s is not None:
            out.append(f"save blocking {num(self.save_blocking_s, digits=3)}; step {num(self.step_s, digits=4)}; "
                       f"expected training {num(self.job_s, digits=1)}")
        if self.expected_wasted_s is not None:
            out.append(f"expected wasted training {num(self.expected_wasted_s)}")
        return out


def expected_steps(estimate: HistoryEstimate, *, windows: int | None, max_steps: int | None) -> float | None:
    """New steps the refresh will train: per window x windows (else the model's mean per run),
    capped at `max_steps`."""
    if windows and estimate.steps_per_window:
        steps = estimate.steps_per_window * windows
    else:
        steps = estimate.steps_per_run
    if steps is None:
        return float(max_steps) if max_steps else None
    return min(steps, float(max_steps)) if max_steps else steps


def plan_interval(estimate: HistoryEstimate | None, *, windows: int | None, max_steps: int | None,
                  fixed_steps: int | None = None) -> PlannedInterval:
    """The refresh's interval (see the module docstring); `estimate` None: nothing known."""
    if estimate is None:
        return PlannedInterval(source=IntervalSource.FIXED if fixed_steps else IntervalSource.PROBE,
                               interval_steps=fixed_steps)
    # no training hours at all (no fleet, no own runs): the rate is not known; the trainer keeps
    # its guess per job (`TrainerConfig.expected_failures`), which errs towards more saves
    evidence = estimate.own_hours > 0 or estimate.fleet_hours > 0
    known = dict(rate_per_h=estimate.rate_per_h if evidence else None, own_weight=estimate.own_weight,
                 own_hours=estimate.own_hours,
                 runs=estimate.runs, detection_s=estimate.detection_s, restore_s=estimate.restore_s,
                 save_blocking_s=estimate.save_blocking_s.get(CheckpointTier.DURABLE), step_s=estimate.step_s)
    steps = expected_steps(estimate, windows=windows, max_steps=max_steps)
    if not estimate.has_history or not steps or not evidence:
        if fixed_steps:
            return PlannedInterval(source=IntervalSource.FIXED, interval_steps=fixed_steps, **known)
        return PlannedInterval(source=IntervalSource.PROBE, **known)
    step_s, csbt = estimate.step_s, estimate.save_blocking_s[CheckpointTier.DURABLE]
    model = WasteModel(job_s=steps * step_s, save_blocking_s=csbt, failure_rate_per_s=estimate.rate_per_s)
    if fixed_steps:
        return PlannedInterval(source=IntervalSource.FIXED, job_s=model.job_s, interval_s=fixed_steps * step_s,
                               interval_steps=fixed_steps, expected_wasted_s=model.wasted_s(fixed_steps * step_s),
                               **known)
    choice = optimal_interval(model, min_interval_s=step_s)
    interval_steps = max(1, round(choice.interval_s / step_s)) if math.isfinite(choice.interval_s) else None
    return PlannedInterval(source=IntervalSource.HISTORY, job_s=model.job_s, interval_s=choice.interval_s,
                           interval_steps=interval_steps,
                           expected_wasted_s=model.wasted_s(interval_steps * step_s), **known)
