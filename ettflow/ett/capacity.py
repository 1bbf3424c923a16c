"""Capacity held on a run's behalf outside its own slots, and the capacity-inclusive ETT.

The per-run ETT follows the study: effective training over the run's wall (submission to
release). A fleet also pays for what it holds *for* a run outside that: trainer workers a
warm pool prepared before the run and the run then took for its ranks, and hot spares, used
or not. Each such worker records a `spare_start` event (off the clock) from its request:

- `for_rank` set: a pooled worker became that rank; held from its request until it was
  taken (`taken_at`), as far as that lies before the run's wall began (after, it is one of
  the run's own slots).
- otherwise a spare: held from its request until it was taken to replace a rank
  (`used`, `taken_at`) or, never used, until it was released (`released_at`). An unused spare
  is pure cost.

A worker is one trainer slot (on a GPU cluster it holds a device; on CPU its process and
memory). Capacity-inclusive ETT = effective slot-seconds over the slot-seconds held:

    effective_s x slots / (wall_s x slots + held_s)

It equals the per-run ETT when nothing was held for the run, and is never above it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .events import PhaseEvent

SPARE_START = "spare_start"


@dataclass(frozen=True)
class HeldCapacity:
    """Slot-seconds held for a run outside its own slots (see the module docstring)."""

    slots: int  # the run's trainer slots (its largest attempt)
    pooled_s: float  # pooled workers that became its ranks, before its wall began
    spare_s: float  # spares held for it, used or not
    unused_spare_s: float  # of `spare_s`: spares that never replaced a rank (cost)

    @property
    def held_s(self) -> float:
        return self.pooled_s + self.spare_s


def held_capacity(events: Sequence[PhaseEvent], wall_start: float, wall_end: float) -> HeldCapacity:
    """What the run's `spare_start` events say was held for it (see the module docstring)."""
    ranks = {ev.rank for ev in events if ev.rank >= 0}
    slots = max(len(ranks), max((int(ev.attrs.get("world_size", 0)) for ev in events if ev.rank < 0
                                 and isinstance(ev.attrs.get("world_size"), int)), default=0))
    pooled = spare = unused = 0.0
    for ev in events:
        if ev.phase != SPARE_START:
            continue
        requested = ev.start
        if ev.attrs.get("for_rank") is not None:
            taken = _num(ev.attrs.get("taken_at"), ev.end)
            pooled += max(0.0, min(taken, wall_start) - requested)
            continue
        if ev.attrs.get("used", True) and ev.attrs.get("taken_at") is not None:
            spare += max(0.0, _num(ev.attrs["taken_at"], ev.end) - requested)
        elif not ev.attrs.get("used", True):
            held = max(0.0, _num(ev.attrs.get("released_at"), wall_end) - requested)
            spare += held
            unused += held
        else:  # a used spare recorded before `taken_at` existed: its prewarm, at least
            spare += max(0.0, ev.end - requested)
    return HeldCapacity(slots=max(slots, 1), pooled_s=pooled, spare_s=spare, unused_spare_s=unused)


def capacity_ett_pct(effective_s: float, wall_s: float, held: HeldCapacity) -> float:
    """Effective slot-seconds over the slot-seconds held by the run and for it, in %."""
    denominator = wall_s * held.slots + held.held_s
    return 100.0 * effective_s * held.slots / denominator if denominator > 0 else 0.0


def _num(value: object, default: float) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default
