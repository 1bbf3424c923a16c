"""A rank's checkpoint tiers behind one interface, and the restore ladder over them.

A tier is one place a rank's state is saved to and restored from (`ett.checkpoint_tier.
CheckpointTier` names it for the metric core too). `Checkpointing` holds its tiers in one list,
fastest restore first: the in-memory copies (`host_memory_tier.py`, when the run has a keeper and
`switches.memory_checkpoint`), then the durable checkpoints (`durable_tier.py`: DCP with its delta
chain; always there, always last: it survives the whole job). A third tier (a peer's host, a
local disk) is one more class with the same methods, placed in that list by its restore speed.

Every tier:
- `save(step, cursor, loss=, since=)` saves and returns the seconds the loop was blocked,
  recorded as the tier's blocking phase (`checkpoint_save_blocking`, `memory_save_blocking`);
  the loop keeps them per tier (`loop.TierSchedule`) to choose the tier's interval;
- `before_update()` runs before a step changes the parameters (a staged save's copy must end);
- `wait()` ends the last save (durable: committed on every rank);
- `latest_step()` is the newest step it can restore on this rank (None: none);
- `restore(point)` restores `point` (a `protocol.RestorePoint`) into the shared train state and
  returns a `RestoreReport`, or raises `TierMiss` with the reason it cannot;
- `background_s()` is the longest background part of its saves so far (None: one still running);
- `abandon()` drops what is in flight after a peer's failure; `close()` frees it.

The ladder (`climb`): a restore starts at the tier the point names and goes down the list; each
tier's answer is agreed by every rank (`all_ok` on the control group), so all ranks restore the
same tier: one rank's miss sends every rank one tier lower, with the first miss in the report.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ettflow.ett.checkpoint_tier import CheckpointTier
from ettflow.ett.spool import SpoolWriter
from ettflow.trainer.config import TrainerConfig
from ettflow.trainer.data.windows import Cursor
from ettflow.trainer.protocol import RestorePoint
from ettflow.trainer.rank.restore_report import RestoreReport

if TYPE_CHECKING:
    import torch

    from ettflow.trainer.checkpoint import TrainState
    from ettflow.trainer.collectives import Groups
    from ettflow.trainer.rank.delta_saves import DeltaSaves

log = logging.getLogger("ettflow.trainer")


class TierMiss(Exception):
    """This tier holds no usable copy of the point asked for (missing, damaged, unreachable)."""


@dataclass
class TierContext:
    """What every tier of one rank shares, replaced in place when a live recovery rebuilds the
    rank (`Checkpointing.rebind`): the attempt's config and spool, the train state over the
    current sharded module and optimizers, the groups, the delta tracker (with
    `switches.delta_checkpoint`) and the dense parameters a save checks for finite values."""

    config: TrainerConfig
    rank: int
    rec: SpoolWriter
    train_state: TrainState | None = None
    groups: Groups | None = None
    deltas: DeltaSaves | None = None
    dense_named: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    def set_position(self, step: int, cursor: Cursor | None) -> TrainState:
        """The train state, at `step` and `cursor`, as a save writes it."""
        assert self.train_state is not None, "the tiers are used before prepare_state"
        self.train_state.step, self.train_state.cursor = step, (cursor or Cursor()).to_dict()
        return self.train_state


class RankTier(Protocol):
    """One checkpoint tier of a rank (see the module docstring)."""

    kind: CheckpointTier

    def bind(self) -> None:
        """(Re)built on the context's current train state and groups (start, live recovery)."""

    def save(self, step: int, cursor: Cursor | None, *, loss: float | None = None,
             since: float | None = None) -> float: ...

    def before_update(self) -> None: ...

    def wait(self) -> None: ...

    def latest_step(self) -> int | None: ...

    def restore(self, point: RestorePoint) -> RestoreReport: ...

    def background_s(self) -> float | None: ...

    def abandon(self) -> None: ...

    def close(self) -> None: ...


class NoTierHolds(Exception):
    """No tier from the point's down holds it on every rank; `problems`: each tier's miss."""

    def __init__(self, point: RestorePoint, problems: Sequence[tuple[CheckpointTier, str]]) -> None:
        self.point, self.problems = point, tuple(problems)
        said = "; ".join(f"{kind}: {why}" for kind, why in self.problems)
        super().__init__(f"no checkpoint tier holds step {point.step} on every rank ({said})")


RESTORE_ORDER = (CheckpointTier.MEMORY, CheckpointTier.DURABLE)  # fastest restore first; durable last


def climb(tiers: Sequence[RankTier], point: RestorePoint, all_ok: Callable[[bool], bool]) -> RestoreReport:
    """Restore `point` from the first tier, at or below the one it names (`RESTORE_ORDER`), that
    every rank can restore (`all_ok`: True when every rank's argument is True). Every rank makes
    the same calls whatever tiers it has: a tier this rank lacks is a miss it agrees on. The
    report answers `point` and carries the first miss (`memory_problem`) when a lower tier
    served. Raises NoTierHolds when none does."""
    held = {t.kind: t for t in tiers}
    problems: list[tuple[CheckpointTier, str]] = []
    ladder = RESTORE_ORDER[RESTORE_ORDER.index(point.source):]
    for kind in ladder:
        tier, report, miss = held.get(kind), None, None
        if tier is None:
            miss = f"this rank has no {kind} tier"
        else:
            try:
                report = tier.restore(point)
            except TierMiss as exc:
                miss = str(exc)
        if all_ok(miss is None):
            assert report is not None
            return report.at(point, memory_problem=problems[0][1] if problems else None)
        why = miss or "a peer's copy failed its check"
        problems.append((kind, why))
        if kind is not ladder[-1]:
            log.warning("%s copy of step %d not usable (%s): every rank restores the next tier", kind, point.step, why)
    raise NoTierHolds(point, problems)
