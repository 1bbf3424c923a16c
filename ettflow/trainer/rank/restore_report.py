"""`RestoreReport`: what one rank's restore read, decided once by `Checkpointing` and recorded
as the attributes of its `checkpoint_restore` event (`to_attrs`; the spool's names)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ettflow.ett.checkpoint_tier import RestoreSource
from ettflow.trainer.protocol import RestorePoint


@dataclass(frozen=True, kw_only=True)
class ChainRead:
    """A durable chain read past its base: the base's step, each delta's step, the rows they set."""

    base_step: int
    deltas: tuple[int, ...]
    rows: int


@dataclass(frozen=True, kw_only=True)
class RestoreReport:
    """`source`: where the state came from (`RestoreSource`); `step`: the step it is at (None:
    a warm start, which starts at 0); `path`: the checkpoint folder read (None: memory);
    `cursor`: the data cursor it resumes at (own checkpoints); `chain`: deltas applied on the
    base; an elastic restart's `resharded_from` world size; a warm start's parent `parent_step`,
    `parent_world_size` and the restored state's `fingerprint`; `world_size`: this attempt's
    ranks (resharded or warm started). A live recovery's or full restart's `point` (the driver's
    choice), the in-memory copies' `memory_deltas` applied, or the `memory_problem` that sent
    every rank to the durable tier instead."""

    source: RestoreSource
    step: int | None = None
    path: str | None = None
    cursor: tuple[int, ...] | None = None
    chain: ChainRead | None = None
    resharded_from: int | None = None
    world_size: int | None = None
    parent_step: int | None = None
    parent_world_size: int | None = None
    fingerprint: str | None = None
    point: RestorePoint | None = None
    memory_deltas: int | None = None
    memory_problem: str | None = None
    chain_resumed: int | None = None  # a memory restore: the durable chain's link the next delta builds on
    # a warm start on a worker that staged an anchor ahead (`staged_anchor.py`): whether it read
    # the parent from memory, else why not (None: nothing was staged)
    staged: bool | None = None
    staged_miss: str | None = None

    def at(self, point: RestorePoint, *, memory_problem: str | None = None) -> RestoreReport:
        """This restore as the answer to `point` (and why its memory copies were not used)."""
        return replace(self, point=point, memory_problem=memory_problem)

    def to_attrs(self) -> dict[str, Any]:
        """The `checkpoint_restore` attributes (absent: not part of this restore)."""
        out: dict[str, Any] = self.point.spool_attrs() if self.point is not None else {}
        out["source"] = self.source
        optional = {"step": self.step, "path": self.path,
                    "cursor": list(self.cursor) if self.cursor is not None else None,
                    "resharded_from": self.resharded_from, "world_size": self.world_size,
                    "parent_step": self.parent_step, "parent_world_size": self.parent_world_size,
                    "fingerprint": self.fingerprint, "memory_deltas": self.memory_deltas,
                    "chain_resumed": self.chain_resumed,
                    "memory_problem": self.memory_problem, "staged": self.staged, "staged_miss": self.staged_miss}
        out.update({k: v for k, v in optional.items() if v is not None})
        if self.chain is not None:
            out.update(base_step=self.chain.base_step, deltas=list(self.chain.deltas), delta_rows=self.chain.rows)
        return out
