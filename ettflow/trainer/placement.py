"""Where an attempt's ranks go on a Ray cluster, and how many run when capacity shrank.

`Placement` is the run's choice: the placement group's strategy (one bundle per rank), whether
a restart may run with fewer ranks (`min_world_size`: elastic), and how long an attempt waits
for its placement (`capacity_wait_s`; the wait is the attempt's `scheduling` phase).

    strategy       bundles (one per rank)
    PACK           on as few nodes as possible (one machine: the default)
    SPREAD         over the nodes, best effort (several ranks per node when nodes are few)
    STRICT_SPREAD  each on a node of its own (needs world_size nodes)

How many ranks an attempt asks for (`attempt_world_size`): the run's `world_size` when the
cluster's live nodes can hold that many bundles (`ranks_that_fit`); otherwise, on a restart with
`min_world_size` set, the most that fit, but never fewer than `min_world_size` (with less
room than that it asks for `min_world_size` and waits); the restart restores the
checkpoint at that world size: DCP reshards the model and optimizer state, and the data cursor
is the same on every rank, see `trainer/data/pipeline.py`. Otherwise `world_size`, and the
attempt waits for capacity up to `capacity_wait_s`. A first attempt always asks for
`world_size`: elastic is for a run that lost capacity, not a way to start small.

Pure: the live nodes' resources are passed in (`ray_group.live_nodes` reads them).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


class PlacementStrategy(str, enum.Enum):
    """Ray's placement group strategies; the value is what Ray takes."""

    PACK = "PACK"
    SPREAD = "SPREAD"
    STRICT_SPREAD = "STRICT_SPREAD"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: str | PlacementStrategy) -> PlacementStrategy:
        try:
            return cls(value)
        except ValueError:
            known = ", ".join(s.value for s in cls)
            raise ValueError(f"unknown placement strategy {value!r}; expected one of {known}") from None


@dataclass(frozen=True, kw_only=True)
class Placement:
    """strategy: see the module docstring. min_world_size: a restart may run with this many
    ranks or more when the cluster lost capacity (None: never fewer than world_size, the
    restart waits). capacity_wait_s: the bound on an attempt's wait for its placement; past it
    the attempt fails as `infrastructure`."""

    strategy: PlacementStrategy = PlacementStrategy.PACK
    min_world_size: int | None = None
    capacity_wait_s: float = 600.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", PlacementStrategy.parse(self.strategy))
        if self.min_world_size is not None and (isinstance(self.min_world_size, bool)
                                                or not isinstance(self.min_world_size, int)
                                                or self.min_world_size < 1):
            raise ValueError(f"min_world_size must be an int >= 1 or None, got {self.min_world_size!r}")
        if not self.capacity_wait_s > 0:
            raise ValueError(f"capacity_wait_s must be > 0 seconds, got {self.capacity_wait_s!r}")

    def check(self, world_size: int) -> None:
        """Refuse a placement that cannot hold `world_size` ranks by its own rules."""
        if self.min_world_size is not None and self.min_world_size > world_size:
            raise ValueError(f"min_world_size ({self.min_world_size}) must be <= world_size ({world_size})")

    @property
    def elastic(self) -> bool:
        return self.min_world_size is not None


def ranks_that_fit(nodes: Sequence[Mapping[str, float]], bundle: Mapping[str, float],
                   strategy: PlacementStrategy) -> int:
    """How many bundles the nodes (each one's total resources) can hold under `strategy`:
    STRICT_SPREAD puts at most one on a node, PACK and SPREAD as many as each node holds."""
    if not bundle or any(v <= 0 for v in bundle.values()):
        raise ValueError(f"a bundle needs positive resources, got {dict(bundle)}")
    total = 0
    for node in nodes:
        held = min(math.floor(node.get(key, 0.0) / need + 1e-9) for key, need in bundle.items())
        total += min(held, 1) if strategy is PlacementStrategy.STRICT_SPREAD else held
    return total


def attempt_world_size(placement: Placement, world_size: int, fit: int, *, restart: bool) -> int:
    """The ranks an attempt asks for, given `fit` (`ranks_that_fit` on the live nodes); see
    the module docstring."""
    if fit >= world_size or not restart or placement.min_world_size is None:
        return world_size
    return max(fit, placement.min_world_size)


@dataclass
class SpareBundles:
    """A GPU placement's bundles by index: rank r in `of_rank[r]` (at first bundle r), the next
    spare in `spare` (at first bundle `world_size`, when the placement reserved one; None: no
    spare bundle). A spare holds its device from its start (its own bundle), so after a
    hand-off (`hand_off`) the spare's bundle is the rank's, and the failed rank's bundle (its
    device, freed with its process) is where the next spare starts."""

    of_rank: list[int]
    spare: int | None

    @classmethod
    def plan(cls, world_size: int, *, spare: bool) -> SpareBundles:
        return cls(of_rank=list(range(world_size)), spare=world_size if spare else None)

    @property
    def total(self) -> int:
        """Bundles to reserve."""
        return len(self.of_rank) + (self.spare is not None)

    def hand_off(self, rank: int) -> int:
        """The spare takes `rank`: returns the bundle the next spare starts in."""
        if self.spare is None:
            raise ValueError("this placement has no spare bundle")
        self.of_rank[rank], self.spare = self.spare, self.of_rank[rank]
        return self.spare
