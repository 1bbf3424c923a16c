"""Wasted-training model and the checkpoint interval that minimizes it.

WTT(interval) = UTT + NoS x CSBT for a job that trains L seconds, fails F times (or at a
rate, F = rate x L) and blocks CSBT seconds per save:

- NoS: saves taken, one at every interval boundary strictly inside the job;
- UTT: expected unsaved training lost to the failures. A failure strikes uniformly in the
  training time and loses the work since the last save: with n full intervals of length tau
  and a last segment r = L - n tau, E[loss] = (n tau^2 + r^2) / (2 L) per failure.

The numeric minimum of this model is searched directly (it is piecewise smooth in tau), and
the classic closed forms are reported beside it: Young (sqrt(2 C M)) and Daly's higher order
estimate, with M = L / F the mean time between failures. Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class WasteModel:
    job_s: float  # training time L
    save_blocking_s: float  # CSBT
    failures: float | None = None  # F per job, or
    failure_rate_per_s: float | None = None  # lambda, F = lambda x L

    def __post_init__(self) -> None:
        if not (self.job_s > 0 and math.isfinite(self.job_s)):
            raise ValueError(f"job_s must be a positive number of seconds, got {self.job_s!r}")
        if not (self.save_blocking_s >= 0 and math.isfinite(self.save_blocking_s)):
            raise ValueError(f"save_blocking_s must be >= 0 seconds, got {self.save_blocking_s!r}")
        if (self.failures is None) == (self.failure_rate_per_s is None):
            raise ValueError("give exactly one of failures (per job) or failure_rate_per_s")
        value = self.failures if self.failures is not None else self.failure_rate_per_s
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"failure count or rate must be >= 0, got {value!r}")

    @property
    def expected_failures(self) -> float:
        if self.failures is not None:
            return self.failures
        return self.failure_rate_per_s * self.job_s

    @property
    def mtbf_s(self) -> float:
        f = self.expected_failures
        return self.job_s / f if f > 0 else math.inf

    def saves(self, interval_s: float) -> int:
        return max(0, math.ceil(self.job_s / interval_s) - 1)

    def unsaved_s(self, interval_s: float) -> float:
        n = math.floor(self.job_s / interval_s)
        r = self.job_s - n * interval_s
        return self.expected_failures * (n * interval_s**2 + r**2) / (2 * self.job_s)

    def wasted_s(self, interval_s: float) -> float:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        return self.unsaved_s(interval_s) + self.saves(interval_s) * self.save_blocking_s


def young_interval(save_blocking_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * save_blocking_s * mtbf_s)


def daly_interval(save_blocking_s: float, mtbf_s: float) -> float:
    c, m = save_blocking_s, mtbf_s
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c


@dataclass(frozen=True)
class IntervalChoice:
    interval_s: float  # numeric minimum of the model
    expected_wasted_s: float  # WTT at that interval
    saves: int
    young_s: float
    daly_s: float
    no_checkpoint_wasted_s: float  # WTT with no save at all, for scale


def optimal_interval(model: WasteModel, *, min_interval_s: float | None = None) -> IntervalChoice:
    """The interval minimizing WTT. Candidates: a log grid, the points tau = L / k where the
    number of saves changes, then a golden-section refinement around the best."""
    L = model.job_s
    lo = min_interval_s if min_interval_s is not None else max(L * 1e-6, 1e-3)
    if model.expected_failures == 0 or model.save_blocking_s == 0:
        best = L if model.expected_failures == 0 else lo
    else:
        grid = [lo * (L / lo) ** (i / 400) for i in range(401)]
        grid += [L / k for k in range(1, min(10_000, int(L / lo)) + 1)]
        best = min(grid, key=model.wasted_s)
        a, b = best / 1.05, min(best * 1.05, L)
        g = (math.sqrt(5) - 1) / 2
        for _ in range(60):
            c, d = b - g * (b - a), a + g * (b - a)
            if model.wasted_s(c) <= model.wasted_s(d):
                b = d
            else:
                a = c
        refined = (a + b) / 2
        if model.wasted_s(refined) < model.wasted_s(best):
            best = refined
    mtbf = model.mtbf_s
    return IntervalChoice(
        interval_s=best,
        expected_wasted_s=model.wasted_s(best),
        saves=model.saves(best),
        young_s=young_interval(model.save_blocking_s, mtbf) if math.isfinite(mtbf) else math.inf,
        daly_s=daly_interval(model.save_blocking_s, mtbf) if math.isfinite(mtbf) else math.inf,
        no_checkpoint_wasted_s=model.wasted_s(L),
    )
