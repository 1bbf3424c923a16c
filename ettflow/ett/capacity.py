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

- `flow_prestart`: the run's own flow process, started by a Prefect worker ahead of the
  run's scheduled time (prefetch) and waiting for it. It holds no trainer slot (a CPU
  process of the worker's host), so it is reported beside the slot-seconds (`prestart_s`),
  not in them.

A worker is one trainer slot (on a GPU cluster it holds a device; on CPU its process and
memory). Capacity-inclusive ETT = effective slot-seconds over the slot-seconds held:

    effective_s x slots / (wall_s x slots + held_s)

It equals the per-run ETT when nothing was held for the run, and is never above it.

The ledger (`Holding`, the warehouse's `held_capacity` table) lists every such holding with
what it held (slots, GPUs, CPUs, memory), for whom, whether it was used, and why it ended:
a run's own (`holdings_of_run`, from its events) and what the cluster's pool released that
no run took (prewarmed for a next run that did not come in time: `run_id` None, pure cost).
Each line names the rule that held it (the pool's just-in-time or keep-alive, a spare's
spare-by-saving, spare-at-loss or spare-shared (a run's fractional part of a spare the cluster's
pool held for its model's runs training at once), the worker's prefetch) and its outcome, used or released
unused (`held_by_rule`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .event_attrs import SpareAttrs
from .events import PhaseEvent

SPARE_START = "spare_start"
FLOW_PRESTART = "flow_prestart"
PLACED = ("scheduling", "spare_handoff")  # the driver's events that say how many ranks an attempt runs


@dataclass(frozen=True)
class HeldCapacity:
    """Slot-seconds held for a run outside its own slots (see the module docstring)."""

    slots: int  # the run's trainer slots (its largest attempt)
    pooled_s: float  # pooled workers that became its ranks, before its wall began
    spare_s: float  # spares held for it, used or not
    unused_spare_s: float  # of `spare_s`: spares that never replaced a rank (cost)
    prestart_s: float = 0.0  # the run's flow process, held before its submission (no slot)

    @property
    def held_s(self) -> float:
        return self.pooled_s + self.spare_s


def held_capacity(events: Sequence[PhaseEvent], wall_start: float, wall_end: float) -> HeldCapacity:
    """What the run's `spare_start` events say was held for it (see the module docstring)."""
    ranks = {ev.rank for ev in events if ev.rank >= 0}
    slots = max(len(ranks), max((ev.info.world_size for ev in events if ev.rank < 0 and ev.phase in PLACED
                                 and ev.info.world_size is not None), default=0))
    pooled = spare = unused = 0.0
    prestart = sum(max(0.0, ev.end - ev.start) for ev in events if ev.phase == FLOW_PRESTART)
    for ev in events:
        if ev.phase != SPARE_START:
            continue
        requested, a = ev.start, ev.info
        n = _or(a.slots, 1.0)
        if a.for_rank is not None:
            taken = _or(a.taken_at, ev.end)
            pooled += n * max(0.0, min(taken, wall_start) - requested)
            continue
        if a.used and a.taken_at is not None:
            spare += n * max(0.0, a.taken_at - requested)
        elif not a.used:
            held = n * max(0.0, _or(a.released_at, wall_end) - requested)
            spare += held
            unused += held
        else:  # a used spare recorded before `taken_at` existed: its prewarm, at least
            spare += n * max(0.0, ev.end - requested)
    return HeldCapacity(slots=max(slots, 1), pooled_s=pooled, spare_s=spare, unused_spare_s=unused,
                        prestart_s=prestart)


def capacity_ett_pct(effective_s: float, wall_s: float, held: HeldCapacity) -> float:
    """Effective slot-seconds over the slot-seconds held by the run and for it, in %."""
    denominator = wall_s * held.slots + held.held_s
    return 100.0 * effective_s * held.slots / denominator if denominator > 0 else 0.0


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


# what a holding was (`Holding.kind`)
POOLED_RANK = "pooled_rank"  # a pooled worker a run took for a rank (held until its wall began)
SPARE = "spare"  # a hot spare of a run, used or not
FLOW_PROCESS = "flow_process"  # the run's flow process, started ahead of its scheduled time
UNCLAIMED_WORKER = "unclaimed_worker"  # a pooled worker no run took: released by the pool
UNCLAIMED_KEEPER = "unclaimed_keeper"  # an in-memory checkpoint keeper no run took
ORPHANED = "orphaned"  # a pooled worker or keeper a run took, left running when its process died
KINDS = (POOLED_RANK, SPARE, FLOW_PROCESS, UNCLAIMED_WORKER, UNCLAIMED_KEEPER, ORPHANED)


@dataclass(frozen=True, kw_only=True)
class Holding:
    """One line of the held-capacity ledger: something held for a run (or for a next run
    that never took it) outside the run's own slots, from `requested_at` to `released_at`.
    `slots`: trainer slots it held (a worker 1, a keeper or a flow process 0); `gpus`, `cpus`:
    what its bundle reserved (a pooled worker on CPU reserves no CPU of Ray's, but runs a
    process); `memory_bytes`: its process's resident memory when last seen (None: unknown)."""

    holding_id: str
    model: str
    kind: str
    run_id: str | None  # the run it was for (None: nobody took it)
    used: bool
    requested_at: float
    released_at: float
    reason: str  # taken, replaced_rank, released_unused, expired, until_scheduled, reshaped, stopped, failed, waited,
    # owner_died
    slots: float = 1.0
    gpus: float = 0.0
    cpus: float = 0.0
    memory_bytes: int | None = None
    rule: str = ""  # why it was held: the pool's hold rule (just-in-time, keep-alive) or a spare's sizing
    for_rank: int | None = None  # a pooled worker's: the rank it became (the ETT artifact names it)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Holding.kind must be one of {KINDS}, got {self.kind!r}")
        if self.released_at < self.requested_at:
            raise ValueError(f"holding {self.holding_id} ends ({self.released_at}) before it began "
                             f"({self.requested_at})")

    @property
    def held_s(self) -> float:
        return self.released_at - self.requested_at

    def row(self) -> dict[str, Any]:
        return {**asdict(self), "held_s": self.held_s}


def holdings_of_run(run_id: str, model: str, events: Sequence[PhaseEvent], wall_start: float,
                    wall_end: float) -> list[Holding]:
    """The ledger lines a run's events give (the same spans `held_capacity` sums)."""
    out = []
    for ev in events:
        if ev.phase not in (SPARE_START, FLOW_PRESTART):
            continue
        a = ev.info if ev.phase == SPARE_START else SpareAttrs()
        common = {"holding_id": f"{run_id}:{ev.attempt}:{ev.rank}:{ev.seq}", "model": model, "run_id": run_id,
                  "requested_at": ev.start, "gpus": _or(a.gpus, 0.0), "cpus": _or(a.cpus, 0.0),
                  "memory_bytes": _int(a.rss_bytes), "rule": a.rule or "", "slots": _or(a.slots, 1.0)}
        if ev.phase == FLOW_PRESTART:
            out.append(Holding(kind=FLOW_PROCESS, used=True, released_at=ev.end, reason="waited",
                               **{**common, "cpus": 1.0, "slots": 0.0}))
        elif a.for_rank is not None:
            taken = _or(a.taken_at, ev.end)
            out.append(Holding(kind=POOLED_RANK, used=True, released_at=max(ev.start, min(taken, wall_start)),
                               reason="taken", for_rank=a.for_rank, **common))
        elif not a.used:
            out.append(Holding(kind=SPARE, used=False, released_at=max(ev.start, _or(a.released_at, wall_end)),
                               reason="released_unused", **common))
        else:
            out.append(Holding(kind=SPARE, used=True, released_at=max(ev.start, _or(a.taken_at, ev.end)),
                               reason="replaced_rank", **common))
    return out


@dataclass(frozen=True)
class HeldByKind:
    """The ledger summed for one model: seconds and resource-seconds held, and what of it no
    run used (unused spares, unclaimed pool workers)."""

    model: str
    holdings: int
    held_s: float
    slot_s: float
    gpu_s: float
    cpu_s: float
    gib_s: float  # memory, GiB x seconds, where it was measured
    unused_slot_s: float


def held_by_model(holdings: Sequence[Holding]) -> list[HeldByKind]:
    """Sum the ledger per model (sorted by model)."""
    out = []
    for model in sorted({h.model for h in holdings}):
        mine = [h for h in holdings if h.model == model]
        out.append(HeldByKind(
            model, len(mine), sum(h.held_s for h in mine), sum(h.held_s * h.slots for h in mine),
            sum(h.held_s * h.gpus for h in mine), sum(h.held_s * h.cpus for h in mine),
            sum((h.held_s * h.memory_bytes / 2**30 for h in mine if h.memory_bytes), 0.0),
            sum((h.held_s * h.slots for h in mine if not h.used), 0.0)))
    return out


# what a holding's outcome was: a run used it (a pooled rank, a spare that replaced a rank, a
# prefetched flow process that ran its run) or it ended with nobody using it (pure cost)
USED = "used"
UNUSED = "released unused"
# the rule of a holding whose line has none: a flow process is held by the Prefect worker's
# prefetch (its own setting, not a rule of ettflow's); older lines were written before rules
KIND_RULE = {FLOW_PROCESS: "worker-prefetch"}
UNRECORDED = "unrecorded"


def rule_of(h: Holding) -> str:
    """Why `h` was held: its own rule, else its kind's (`KIND_RULE`), else `UNRECORDED`."""
    return h.rule or KIND_RULE.get(h.kind, UNRECORDED)


def outcome_of(h: Holding) -> str:
    return USED if h.used else UNUSED


@dataclass(frozen=True)
class HeldByRule:
    """The ledger summed per model, kind, rule and outcome: what each rule held and whether a
    run used it."""

    model: str
    kind: str
    rule: str
    outcome: str
    holdings: int
    held_s: float
    slot_s: float


def held_by_rule(holdings: Sequence[Holding]) -> list[HeldByRule]:
    """Sum the ledger per (model, kind, rule, outcome), sorted by those."""
    groups: dict[tuple[str, str, str, str], list[Holding]] = {}
    for h in holdings:
        groups.setdefault((h.model, h.kind, rule_of(h), outcome_of(h)), []).append(h)
    return [HeldByRule(*key, holdings=len(hs), held_s=sum(h.held_s for h in hs),
                       slot_s=sum(h.held_s * h.slots for h in hs))
            for key, hs in sorted(groups.items())]


def _int(value: object) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
