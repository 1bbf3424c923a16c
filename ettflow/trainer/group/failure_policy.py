"""What to do after a failure: the driver asks a `FailurePolicy`, which answers a `FailureDecision`.

The policy sees the failure and the run's failure history (every earlier failure of the run,
also those of earlier tries of the train task, read from the spool: one budget per run). The
default policy, `DefaultFailurePolicy`:

    class                                     decision
    data (a bad file)                         RAISE at once: a restart reads the same file
    any class, budget spent                   RAISE: more than `max_failures` failures in the run
    user, numerics                            RESTART from the previous checkpoint once; RAISE when
                                              the same class fails again at the same step, or
                                              before the run made progress past that step
                                              (not retried blindly)
    infrastructure, preemption, storage,
    orchestrator                              RESTART while the budget lasts
    publish                                   RAISE: publishing is retried by its own task,
                                              never by retraining

A failure's step is the training step it happened at; unknown (None) counts as no progress.
Pure: no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ettflow.ett.failures import Failure, FailureClass


class FailureDecision(str, enum.Enum):
    """The policy's answer to one failure."""

    RESTART = "restart"  # tear down, start the next attempt from the latest checkpoint
    RAISE = "raise"  # stop the run: `TrainingFailed`

    def __str__(self) -> str:
        return self.value


class FailurePolicy(Protocol):
    def decide(self, failure: Failure, history: Sequence[Failure]) -> FailureDecision:
        """The decision for `failure`, given every earlier failure of the run (oldest first)."""
        ...

    def explain(self, failure: Failure, history: Sequence[Failure]) -> str:
        """One line: the rule behind `decide`'s answer (for messages and logs)."""
        ...


RETRIED_ONCE = (FailureClass.USER, FailureClass.NUMERICS)


@dataclass(frozen=True, kw_only=True)
class DefaultFailurePolicy:
    """The stated default policy (module docstring). `max_failures`: how many failures a run
    may recover from; the next one stops it."""

    max_failures: int = 3

    def __post_init__(self) -> None:
        if self.max_failures < 0:
            raise ValueError(f"max_failures must be >= 0, got {self.max_failures}")

    def decide(self, failure: Failure, history: Sequence[Failure]) -> FailureDecision:
        return self._rule(failure, history)[0]

    def explain(self, failure: Failure, history: Sequence[Failure]) -> str:
        return self._rule(failure, history)[1]

    def _rule(self, failure: Failure, history: Sequence[Failure]) -> tuple[FailureDecision, str]:
        klass = failure.failure_class
        if klass is FailureClass.DATA:
            return FailureDecision.RAISE, "a data failure is not retried: fix or remove the file and run again"
        if klass is FailureClass.PUBLISH:
            return FailureDecision.RAISE, "a publish failure is retried by the publish task, not by retraining"
        count = len(history) + 1
        if count > self.max_failures:
            return FailureDecision.RAISE, f"{count} failures exceed the budget of {self.max_failures}"
        if klass in RETRIED_ONCE:
            repeated = repeated_without_progress(failure, history)
            if repeated is not None:
                at = "an unknown step" if repeated.step is None else f"step {repeated.step}"
                return FailureDecision.RAISE, (
                    f"{klass} failed again with no progress past {at} (attempt {repeated.attempt}): "
                    "not retried blindly; fix the cause and run again")
            return FailureDecision.RESTART, f"{klass}: restart once from the previous checkpoint"
        return FailureDecision.RESTART, f"{klass}: restart ({count} of {self.max_failures} failures)"


def repeated_without_progress(failure: Failure, history: Sequence[Failure]) -> Failure | None:
    """The latest earlier failure of the same class, when the run made no progress past its
    step since (no later failure, this one included, happened at a later step); else None."""
    same = [i for i, f in enumerate(history) if f.failure_class is failure.failure_class]
    if not same:
        return None
    earlier = history[same[-1]]
    steps = [f.step for f in (*history[same[-1] + 1:], failure) if f.step is not None]
    if earlier.step is None or not steps or max(steps) <= earlier.step:
        return earlier
    return None


def failure_counts(failures: Sequence[Failure]) -> str:
    """'infrastructure x2, user x1', in order of first occurrence."""
    counts: dict[str, int] = {}
    for f in failures:
        counts[f.failure_class.value] = counts.get(f.failure_class.value, 0) + 1
    return ", ".join(f"{klass} x{n}" for klass, n in counts.items())
