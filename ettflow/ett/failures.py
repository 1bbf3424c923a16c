"""Failures as values: what ended an attempt, as a type every layer shares.

A `Failure` says which class of fault ended one attempt, on which rank, at which training
step (when known), with a short reason in ettflow's words and the raw detail (a Ray or
torch message) beside it. Classes decide what happens next (the driver's `FailurePolicy`)
and who owns the fix; nobody parses a message to find them.

Pure: no I/O. The spool stores a failure as the `failure_class`, `failed_rank`, `step`,
`reason`, `detail` (and `path`, `node` when known) attributes of a `failure` / `failure_detected` marker
(`Failure.to_attrs`; read back by `event_attrs.FailureAttrs.failure`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class FailureClass(str, enum.Enum):
    """Why an attempt ended. The value is what the spool and the warehouse store."""

    INFRASTRUCTURE = "infrastructure"  # a process or node died, a peer was lost, a hang
    PREEMPTION = "preemption"  # the scheduler took the devices back (SIGTERM with a grace period)
    USER = "user"  # an exception in model or training code
    DATA = "data"  # the data broke a declared contract (a bad file, a bad column)
    NUMERICS = "numerics"  # non-finite loss or parameters
    STORAGE = "storage"  # the disk or the object store failed (ENOSPC, EIO, ...)
    ORCHESTRATOR = "orchestrator"  # the driver or the flow's process died (a crashed run)
    PUBLISH = "publish"  # publishing failed; never costs training replay

    def __str__(self) -> str:  # formats as its value: "infrastructure", not "FailureClass..."
        return self.value

    @property
    def owner(self) -> str:
        """Who can fix it: the owners of the six L2 components, plus `orchestrator`."""
        return _OWNERS[self]

    @property
    def replays_training(self) -> bool:
        """True when the failure costs training replay (every class but publish)."""
        return self is not FailureClass.PUBLISH

    @classmethod
    def parse(cls, value: str | FailureClass) -> FailureClass:
        try:
            return cls(value)
        except ValueError:
            known = ", ".join(c.value for c in cls)
            raise ValueError(f"unknown failure class {value!r}; expected one of {known}") from None


_OWNERS = {
    FailureClass.INFRASTRUCTURE: "scheduler",
    FailureClass.PREEMPTION: "scheduler",
    FailureClass.USER: "trainer",
    FailureClass.DATA: "data",
    FailureClass.NUMERICS: "trainer",
    FailureClass.STORAGE: "storage",
    FailureClass.ORCHESTRATOR: "scheduler",
    FailureClass.PUBLISH: "publishing",
}

FAILURE_CLASSES: tuple[str, ...] = tuple(c.value for c in FailureClass)


@dataclass(frozen=True, kw_only=True)
class Failure:
    """One failure of one attempt.

    rank: the rank that failed first (-1: the driver or the flow, not a rank).
    step: the training step it happened at, when known (the step being trained).
    reason: one line in ettflow's words ("rank 1 killed at step 16").
    detail: the raw text from Ray, torch or the OS, for the log; never parsed.
    path: the file or folder involved (storage and data failures).
    node: the Ray node that was lost, when the failure is a lost node (its id).
    injected: a scripted fault (`fail_at`).
    secondary: a consequence of another rank's failure (a collective lost its peer): never
        taken as an attempt's cause while the cause itself is known.
    hang: the watchdog found the rank hung (or a scripted hang fired): the time up to the
        detection is the hang's (`ett.timeline`), not work lost in flight.
    owner_lost: the rank's process was ended by Ray because the actor that owned it (the
        cluster's pool, which started it prewarmed) died. The driver found this cause itself: the
        ranks' own markers (Ray's SIGTERM, which a rank takes for a preemption) are its
        consequence, so the detection types the attempt (`classify.on_lost_owner`).
    """

    failure_class: FailureClass
    rank: int = -1
    attempt: int | None = None
    step: int | None = None
    reason: str = ""
    detail: str = ""
    path: str | None = None
    node: str | None = None
    injected: bool = False
    secondary: bool = False
    hang: bool = False
    owner_lost: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "failure_class", FailureClass.parse(self.failure_class))

    @property
    def summary(self) -> str:
        """`infrastructure: rank 1 killed at step 16`."""
        return f"{self.failure_class.value}: {self.reason}" if self.reason else self.failure_class.value

    def to_attrs(self) -> dict[str, Any]:
        """The spool attributes of a failure marker."""
        out: dict[str, Any] = {"failure_class": self.failure_class.value, "failed_rank": self.rank,
                               "reason": self.reason[:500]}
        if self.step is not None:
            out["step"] = self.step
        if self.detail:
            out["detail"] = self.detail[:1000]
        if self.path:
            out["path"] = self.path
        if self.node:
            out["node"] = self.node
        if self.injected:
            out["injected"] = True
        if self.secondary:
            out["secondary"] = True
        if self.hang:
            out["hang"] = True
        if self.owner_lost:
            out["owner_lost"] = True
        return out


class FailureError(RuntimeError):
    """An exception that carries a typed `Failure` (raised by a rank or a task, so the class
    survives Ray and Prefect without anyone reading the message)."""

    def __init__(self, failure: Failure) -> None:
        self.failure = failure
        super().__init__(failure.summary)

    def __reduce__(self):  # picklable across Ray with its failure
        return (type(self), (self.failure,))
