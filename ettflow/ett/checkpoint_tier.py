"""The checkpoint tiers, one vocabulary for the trainer and the metric core.

A tier is where a checkpoint lives, with its own save cost and its own interval: `DURABLE`, a
committed checkpoint folder (DCP, a base with its deltas; it survives the whole job), and
`MEMORY`, each rank's copy in host memory held by a keeper that outlives the rank (it survives
a rank, not the keeper). The history (`failure_history`) measures each tier's save blocking,
a live recovery's restore point names the tier it reads (`trainer.protocol.RestorePoint`).

`RestoreSource` is where one rank's restore came from, as its `checkpoint_restore` event says
(`source`): its run's own durable checkpoint, the parent refresh's anchor (a warm start), or
the in-memory tier. Both are `str` enums: a spool attribute keeps the text.
"""

from __future__ import annotations

import enum


class CheckpointTier(str, enum.Enum):
    DURABLE = "durable"  # a committed checkpoint folder (DCP; trainer/checkpoint/)
    MEMORY = "memory"  # the in-memory tier (trainer/checkpoint/memory_tier.py)

    def __str__(self) -> str:
        return self.value


class RestoreSource(str, enum.Enum):
    OWN = "own"  # the run's own latest durable checkpoint (a restart)
    PARENT = "parent"  # the parent refresh's anchor (a warm start)
    MEMORY = "memory"  # the in-memory tier's copies (a live recovery, or a restart from memory)

    def __str__(self) -> str:
        return self.value

    @property
    def tier(self) -> CheckpointTier:
        return CheckpointTier.MEMORY if self is RestoreSource.MEMORY else CheckpointTier.DURABLE
