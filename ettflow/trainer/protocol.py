"""The values that cross a process boundary in the trainer (driver <-> rank actors, spares and
pooled workers): frozen dataclasses, pickled by Ray as they are, so that no side reads a dict
by string key or parses a message.

- `RestorePoint`: where a live recovery resumes (the driver picks it, every rank restores it);
  its tier is a `RestoreTier`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class RestoreTier(str, Enum):
    """Where a live recovery's restore point is read from (a str, so spool attributes keep it as text)."""

    MEMORY = "memory"  # the in-memory tier (checkpoint/memory_tier.py)
    DURABLE = "durable"  # a committed checkpoint folder

    def __str__(self) -> str:
        return self.value


MEMORY, DURABLE = RestoreTier.MEMORY, RestoreTier.DURABLE


@dataclass(frozen=True, kw_only=True)
class RestorePoint:
    """Where a live recovery resumes: `step`, from the in-memory tier (`source` MEMORY) or
    from the durable checkpoint at `path` (`source` DURABLE)."""

    step: int
    source: RestoreTier
    path: str | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "source", RestoreTier(self.source))
        except ValueError:
            raise ValueError(f"RestorePoint.source must be {MEMORY.value!r} or {DURABLE.value!r}, "
                             f"got {self.source!r}") from None
        if self.step < 0:
            raise ValueError(f"RestorePoint.step must be >= 0, got {self.step}")
        if self.source is DURABLE and not self.path:
            raise ValueError("a durable RestorePoint names its checkpoint folder (path)")

    def spool_attrs(self) -> dict[str, Any]:
        """The point as the restore's spool attributes."""
        return {"restore_step": self.step, "restore_tier": self.source.value,
                **({"path": self.path} if self.path else {})}
