"""The trainer's devices for one run, from reservation to release.

`TrainerLease` is what `reserve_trainer` returns: the Ray placement for the next attempt,
already reserved (its wait is the run's scheduling phase). The driver asks it for each
attempt's group (`group_for`): the first is the reserved one, later ones (restarts after a
failure) are reserved by the driver itself. When the run publishes on its devices
(`publish_in_trainer`, the baseline's), a group whose ranks all finished is not torn down
when the driver says so: the devices stay held through the anchor checkpoint and publishing
until `release()`, which tears the group down and records that held time as `shutdown`.
Otherwise nothing after training needs the devices (the anchor is written by the ranks, or
sealed by the driver from host memory, and published on the CPU): the group is torn down when
the driver says so, and the driver's `shutdown` ends at that release. A failed attempt's group
is torn down at once, as the driver asks.
A held group passes its group's layout on (`PlacedGroup`: the attempt's world size, which an
elastic restart may make smaller than the run's, and each rank's node).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ettflow.ett.failures import Failure
from ettflow.ett.spare_sizing import SpareDecision
from ettflow.tasks.run_spool import RunRecorder
from ettflow.trainer.group.driver import LiveGroup, OwnedGroup, PlacedGroup, ReleasingGroup, WorkerGroup
from ettflow.trainer.protocol import PollStatus

log = logging.getLogger("ettflow.tasks")


class HeldGroup:
    """A worker group whose successful teardown waits for the lease's release."""

    def __init__(self, group: WorkerGroup, attempt: int, world_size: int, *, reserved: bool = False,
                 hold: bool = True) -> None:
        """`hold`: a trained group keeps its devices until `release()` (publishing on them)."""
        self.group, self.attempt, self.requested_world_size = group, attempt, world_size
        self.reserved, self.hold = reserved, hold
        self.finished: set[int] = set()
        self.held_since: float | None = None  # the driver's teardown, deferred
        self.released = False

    @property
    def world_size(self) -> int:
        """The ranks of this attempt: the group's when it knows (after reserve), else the run's."""
        return self.group.world_size if isinstance(self.group, PlacedGroup) else self.requested_world_size

    @property
    def placement(self) -> tuple[str, ...]:
        return self.group.placement if isinstance(self.group, PlacedGroup) else ()

    @property
    def released_at(self) -> float | None:
        """When the group gave its devices back (None: not yet, or its group does not say)."""
        return self.group.released_at if self.released and isinstance(self.group, ReleasingGroup) else None

    def reserve(self) -> None:
        if not self.reserved:
            self.group.reserve()
            self.reserved = True

    def launch(self) -> None:
        self.group.launch()

    # live recovery: the held group continues into the next attempt (trainer/rank/live_recovery.py)
    def training_started(self) -> None:
        if isinstance(self.group, LiveGroup):
            self.group.training_started()

    def prepare_live(self, failure: Failure) -> Any:
        return self.group.prepare_live(failure) if isinstance(self.group, LiveGroup) else None

    def hand_off(self, attempt: int, failure: Failure) -> None:
        if not isinstance(self.group, LiveGroup):
            raise TypeError(f"{type(self.group).__name__} cannot recover live")
        self.group.hand_off(attempt, failure)
        self.attempt, self.finished = attempt, set()

    def resume(self, point: Any) -> None:
        self.group.resume(point)

    def poll(self, timeout_s: float) -> PollStatus:
        status = self.group.poll(timeout_s)
        self.finished.update(status.finished)
        return status

    def owner_cause(self, failure: Failure) -> Failure:
        return self.group.owner_cause(failure) if isinstance(self.group, OwnedGroup) else failure

    def kill(self, rank: int) -> None:
        self.group.kill(rank)

    def preempt(self) -> None:
        self.group.preempt()

    def teardown(self) -> None:
        if self.hold and len(self.finished) == self.world_size and not self.released:
            self.held_since = time.time()  # trained: hold the devices until release()
            return
        self.release()

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.group.teardown()


class TrainerLease:
    def __init__(self, *, run_id: str, spool_root: Path | str, world_size: int,
                 make_group: Callable[[int], WorkerGroup], first_attempt: int,
                 end_run: Callable[[], None] | None = None, hold_after_training: bool = True) -> None:
        """`end_run`: frees what the run keeps across its attempts (its in-memory checkpoint
        keeper), called once by `release`. `hold_after_training`: a trained group keeps its
        devices until `release` (the run publishes on them); False: released at its teardown."""
        self.run_id, self.spool_root, self.world_size = run_id, Path(spool_root), world_size
        self.make_group = make_group
        self.end_run = end_run
        self.first_attempt = first_attempt
        self.hold_after_training = hold_after_training
        self.groups: list[HeldGroup] = []
        self._reserved: HeldGroup | None = None

    def reserve(self) -> None:
        """Reserve the first attempt's group now (placement + rank processes up)."""
        group = HeldGroup(self.make_group(self.first_attempt), self.first_attempt, self.world_size,
                          hold=self.hold_after_training)
        self.groups.append(group)
        group.reserve()
        self._reserved = group

    def shared_spares(self) -> SpareDecision | None:
        """The reserved group's shared-spare decision (`RayWorkerGroup.shared_spares`: the
        cluster's pool holds the model's spares), None where the run holds its own."""
        group = self._reserved.group if self._reserved is not None else None
        return getattr(group, "shared_spares", None)  # a group with no cluster pool (scripted, local) has none

    @property
    def has_reserved(self) -> bool:
        """A group is reserved and no attempt has used it yet."""
        return self._reserved is not None and not self._reserved.released

    def group_for(self, attempt: int) -> HeldGroup:
        """The driver's group factory."""
        if self._reserved is not None and attempt == self._reserved.attempt and not self._reserved.released:
            group, self._reserved = self._reserved, None
            return group
        group = HeldGroup(self.make_group(attempt), attempt, self.world_size, hold=self.hold_after_training)
        self.groups.append(group)
        return group

    @property
    def holding(self) -> HeldGroup | None:
        """The group that trained to the end and still holds its devices."""
        return next((g for g in reversed(self.groups) if g.held_since is not None and not g.released), None)

    def release(self) -> float:
        """Tear down every group still up; record the time held after training as shutdown.
        Idempotent. Returns the seconds the devices were held after the driver was done."""
        held = self.holding
        for group in self.groups:
            if not group.released:
                try:
                    group.release()
                except Exception:  # noqa: BLE001 - release the rest; Ray reclaims a dead driver's actors
                    log.exception("tearing down attempt %d failed", group.attempt)
        if self.end_run is not None:
            end, self.end_run = self.end_run, None
            try:
                end()
            except Exception:  # noqa: BLE001 - Ray reclaims it with the driver process
                log.exception("ending run %s's resources failed", self.run_id)
        if held is None or held.held_since is None:
            return 0.0
        now = time.time()
        RunRecorder(self.spool_root, self.run_id).record(held.attempt, "shutdown", held.held_since, now,
                         failed=False, stage="release_trainer")
        return now - held.held_since
