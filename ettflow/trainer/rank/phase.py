"""The phase of a rank's process (its `TrainerActor`) and the moves it may make.

    IDLE ──prewarm──> PREWARMED ──train / join──> TRAINING ──> FINISHED
      └──────────────train──────────────────────>    │  ^
                                                      v  │ rejoin
                                         FAILED <── PARKED (kept through a peer's failure)

A rank actor starts IDLE: a rank before `train`, or a spare or pooled worker before `prewarm`
(spare.py). `train` starts from IDLE or PREWARMED (a pooled worker trains from what it
prepared); `join` (a spare takes a failed rank's place) only from PREWARMED; `rejoin` (a
survivor goes on) only from PARKED. An attempt that fails leaves the rank PARKED when its
session kept its state for a live recovery (live_recovery.py), else FAILED; one that ends
leaves it FINISHED. FINISHED and FAILED are final: the group tears such an actor down. Any
other move raises `PhaseError`, naming the call, so a driver that asks a rank for the wrong
thing (a rejoin of a rank that closed, a join of a spare that never prepared) learns it at once.
"""

from __future__ import annotations

from enum import Enum


class RankPhase(str, Enum):
    IDLE = "idle"
    PREWARMED = "prewarmed"
    TRAINING = "training"
    PARKED = "parked"
    FINISHED = "finished"
    FAILED = "failed"


MOVES: dict[RankPhase, frozenset[RankPhase]] = {
    RankPhase.IDLE: frozenset({RankPhase.PREWARMED, RankPhase.TRAINING}),
    RankPhase.PREWARMED: frozenset({RankPhase.TRAINING}),
    RankPhase.TRAINING: frozenset({RankPhase.PARKED, RankPhase.FINISHED, RankPhase.FAILED}),
    RankPhase.PARKED: frozenset({RankPhase.TRAINING}),
    RankPhase.FINISHED: frozenset(),
    RankPhase.FAILED: frozenset(),
}


class PhaseError(RuntimeError):
    """A call that the rank's phase does not allow."""

    def __init__(self, who: str, call: str, phase: RankPhase, allowed: tuple[RankPhase, ...]) -> None:
        self.phase, self.call = phase, call
        need = " or ".join(p.value for p in allowed) or "no phase"
        super().__init__(f"{who} cannot {call}: it is {phase.value}, and {call} needs a rank that is {need}")


class RankLifecycle:
    """The phase of one rank's process; `enter` moves it, checked against `MOVES`."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.phase = RankPhase.IDLE

    def enter(self, to: RankPhase, call: str) -> None:
        """Move to `to` for `call` (its name shows in the error), or raise `PhaseError`."""
        if to not in MOVES[self.phase]:
            raise PhaseError(self.who, call, self.phase, tuple(p for p, nexts in MOVES.items() if to in nexts))
        self.phase = to

    def require(self, call: str, *phases: RankPhase) -> None:
        """Raise `PhaseError` unless the rank is in one of `phases` (a call that moves nothing)."""
        if self.phase not in phases:
            raise PhaseError(self.who, call, self.phase, phases)
