"""A model's failure history -> the inputs of its checkpoint interval: failure rate, save cost.

`estimate(history, model=M, now=t)` reads the warehouse's per-run summaries (`RunHistory`,
built by `failure_history_db.read_history`) and returns a `HistoryEstimate`:

- the failure rate per hour of training for each failure class that costs replay
  (`FailureClass.replays_training`: every class but publish). Training hours are a run's
  exposed `effective_training` + `wasted_training` seconds (the time its ranks were in the
  training loop, where a failure costs replay).
- the save-blocking time (CSBT) per checkpoint tier (`CheckpointTier`): the mean over the model's
  saves, a save's blocking being the longest of its ranks' (the loop waits for all of them).
  The history holds durable saves only (`failure_history_db.TIER_OF_KIND`); the in-memory
  tier's copies are not archived as saves, and a run chooses their interval from the blocking
  it measures itself (trainer/rank/loop.py).
- the detection time (failure -> detected) and the restore time (`checkpoint_restore` of a
  recovery attempt), means over the model's failures and recoveries;
- the training time per new step and the new steps per window (to size the next refresh).

The rate is a Gamma-Poisson posterior. For each class c the prior is Gamma(alpha0 = r_c x S,
beta0 = S): r_c is the fleet's rate (every OTHER model's failures of class c over their
training hours, in the window; `EstimateConfig.default_rate_per_h` when the fleet has no
hours) and S (`prior_hours`) is how many hours of evidence the prior weighs. With k_c failures
in T hours of the model's own training, the posterior is Gamma(alpha0 + k_c, S + T) and its
mean is

    rate_c = (r_c S + k_c) / (S + T) = (1 - w) r_c + w k_c / T,   w = T / (S + T),

so a new model starts at the fleet's rate and moves to its own as hours accumulate (w -> 1).
The classes share S + T, so the total is Gamma(sum alpha_c, S + T) too. Only runs started in
the window (`window_s` before `now`) count, the model's and the fleet's, so a model whose
hardware got worse reaches its new rate once the window holds only new runs. Skipped runs
(nothing trained) are left out. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .checkpoint_tier import CheckpointTier
from .failures import FailureClass

HOUR_S = 3600.0
REPLAY_CLASSES: tuple[FailureClass, ...] = tuple(c for c in FailureClass if c.replays_training)


@dataclass(frozen=True, kw_only=True)
class RunHistory:
    """What one archived run tells about its model's failures and saves."""

    run_id: str
    model: str
    wall_start: float  # epoch seconds
    training_s: float  # exposed effective + wasted training: the hours failures are counted over
    effective_training_s: float = 0.0
    effective_steps: int = 0
    windows: int | None = None  # data windows trained (lineage), when known
    failures: tuple[FailureClass, ...] = ()  # one per failed attempt
    detection_s: tuple[float, ...] = ()  # failed -> detected, per failure
    restore_s: tuple[float, ...] = ()  # checkpoint_restore of each recovery attempt
    saves: Mapping[CheckpointTier, tuple[float, ...]] = field(default_factory=dict)  # blocking s per save
    # TTR of each recovered failure by how it recovered: a spare that was ready when the rank was
    # lost took its place, or every rank restarted (a spare started only at the loss: in neither)
    ttr_ready_spare_s: tuple[float, ...] = ()
    ttr_restart_s: tuple[float, ...] = ()
    spare_start_s: tuple[float, ...] = ()  # spares started at a loss: request to ready (on the recovery's path)

    def __post_init__(self) -> None:
        if not (self.training_s >= 0 and math.isfinite(self.training_s)):
            raise ValueError(f"run {self.run_id}: training_s must be >= 0, got {self.training_s!r}")
        object.__setattr__(self, "failures", tuple(FailureClass.parse(c) for c in self.failures))


@dataclass(frozen=True, kw_only=True)
class EstimateConfig:
    window_s: float = 14 * 24 * HOUR_S  # runs started this long before `now` count
    prior_hours: float = 1.0  # S: the weight of the fleet's rate, in hours of the model's training
    # the prior when no other model trained in the window: about one failure per 10 h of training
    default_rate_per_h: Mapping[FailureClass, float] = field(
        default_factory=lambda: {FailureClass.INFRASTRUCTURE: 0.1})

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0 seconds, got {self.window_s!r}")
        if not self.prior_hours > 0:
            raise ValueError(f"prior_hours must be > 0 (the fleet prior's weight), got {self.prior_hours!r}")
        for c, r in self.default_rate_per_h.items():
            if not FailureClass.parse(c).replays_training or not r >= 0:
                raise ValueError(f"default_rate_per_h needs rates >= 0 of replaying classes, got {c}: {r!r}")


@dataclass(frozen=True)
class ClassRate:
    """The posterior of one class: Gamma(alpha, beta) per hour of training."""

    failure_class: FailureClass
    prior_rate_per_h: float  # r_c
    own_failures: int  # k_c
    alpha: float
    beta_h: float

    @property
    def rate_per_h(self) -> float:
        return self.alpha / self.beta_h

    @property
    def sd_per_h(self) -> float:
        return math.sqrt(self.alpha) / self.beta_h


@dataclass(frozen=True, kw_only=True)
class HistoryEstimate:
    """A model's estimated interval inputs (see the module docstring)."""

    model: str
    now: float
    window_s: float
    runs: int  # the model's runs in the window
    own_hours: float  # T
    prior_hours: float  # S
    fleet_hours: float  # the other models' training hours in the window (0: the default prior)
    classes: tuple[ClassRate, ...]
    save_blocking_s: Mapping[CheckpointTier, float]  # mean CSBT per tier with saves in the window
    saves: Mapping[CheckpointTier, int]
    detection_s: float | None
    restore_s: float | None
    step_s: float | None  # effective training seconds per new step
    steps_per_window: float | None
    steps_per_run: float | None  # mean new steps of the model's runs that trained
    ttr_ready_spare_s: float | None = None  # mean TTR of recoveries by a spare ready at the loss
    ttr_restart_s: float | None = None  # mean TTR of recoveries that restarted every rank
    recoveries: int = 0  # how many recoveries those means are over
    spare_start_s: float | None = None  # mean start of a spare started at a loss (what a held one saves)
    spare_starts: int = 0

    @property
    def rate_per_h(self) -> float:
        return sum(c.rate_per_h for c in self.classes)

    @property
    def rate_per_s(self) -> float:
        return self.rate_per_h / HOUR_S

    @property
    def own_weight(self) -> float:
        """w = T / (S + T): how much of the rate is the model's own."""
        return self.own_hours / (self.own_hours + self.prior_hours)

    @property
    def own_failures(self) -> int:
        return sum(c.own_failures for c in self.classes)

    @property
    def has_history(self) -> bool:
        """The model's own save cost and step time are known: no probe save is needed."""
        return CheckpointTier.DURABLE in self.save_blocking_s and self.step_s is not None

    def rate_of(self, failure_class: FailureClass | str) -> float:
        wanted = FailureClass.parse(failure_class)
        return next((c.rate_per_h for c in self.classes if c.failure_class is wanted), 0.0)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def fleet_rates(history: Sequence[RunHistory], *, model: str, since: float,
                config: EstimateConfig) -> tuple[dict[FailureClass, float], float]:
    """Per class, the other models' failures per training hour in the window, and their hours;
    the configured default (and 0 hours) when they trained nothing there."""
    others = [r for r in history if r.model != model and r.wall_start >= since]
    hours = sum(r.training_s for r in others) / HOUR_S
    if hours <= 0:
        return {FailureClass.parse(c): float(r) for c, r in config.default_rate_per_h.items()}, 0.0
    counts = {c: 0 for c in REPLAY_CLASSES}
    for r in others:
        for c in r.failures:
            if c.replays_training:
                counts[c] += 1
    return {c: k / hours for c, k in counts.items()}, hours


def estimate(history: Sequence[RunHistory], *, model: str, now: float,
             config: EstimateConfig | None = None) -> HistoryEstimate:
    """The model's interval inputs at time `now` from the runs of every model (`history`)."""
    config = config or EstimateConfig()
    since = now - config.window_s
    prior, fleet_hours = fleet_rates(history, model=model, since=since, config=config)
    own = sorted((r for r in history if r.model == model and since <= r.wall_start <= now),
                 key=lambda r: r.wall_start)
    own_hours = sum(r.training_s for r in own) / HOUR_S
    s = config.prior_hours
    classes = []
    for c in REPLAY_CLASSES:
        k = sum(f is c for r in own for f in r.failures)
        r_c = prior.get(c, 0.0)
        if k or r_c:
            classes.append(ClassRate(c, r_c, k, alpha=r_c * s + k, beta_h=s + own_hours))
    blocking: dict[CheckpointTier, float] = {}
    saves: dict[CheckpointTier, int] = {}
    for tier in CheckpointTier:
        samples = [b for r in own for b in r.saves.get(tier, ())]
        if samples:
            blocking[tier], saves[tier] = sum(samples) / len(samples), len(samples)
    steps = sum(r.effective_steps for r in own)
    sized = [r for r in own if r.windows]
    return HistoryEstimate(
        model=model, now=now, window_s=config.window_s, runs=len(own), own_hours=own_hours, prior_hours=s,
        fleet_hours=fleet_hours, classes=tuple(classes), save_blocking_s=blocking, saves=saves,
        detection_s=_mean([d for r in own for d in r.detection_s]),
        restore_s=_mean([d for r in own for d in r.restore_s]),
        step_s=sum(r.effective_training_s for r in own) / steps if steps else None,
        steps_per_window=(sum(r.effective_steps for r in sized) / sum(r.windows for r in sized)
                          if sized and sum(r.effective_steps for r in sized) else None),
        steps_per_run=_mean([r.effective_steps for r in own if r.effective_steps]),
        ttr_ready_spare_s=_mean([t for r in own for t in r.ttr_ready_spare_s]),
        ttr_restart_s=_mean([t for r in own for t in r.ttr_restart_s]),
        recoveries=sum(len(r.ttr_ready_spare_s) + len(r.ttr_restart_s) for r in own),
        spare_start_s=_mean([t for r in own for t in r.spare_start_s]),
        spare_starts=sum(len(r.spare_start_s) for r in own),
    )
