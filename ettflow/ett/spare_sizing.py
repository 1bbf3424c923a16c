"""How many hot spares a run holds: each one only when its expected saving exceeds what it holds.

A spare is a trainer slot held for the whole run so that a lost rank is replaced in seconds
(live recovery) instead of every rank restarting. For a run of expected wall `W` seconds on
`world_size` slots, with `N` expected failures (the model's failure rate x its expected
training, from the same history the checkpoint interval reads, plus the failures the run's
parameters script), the first spare saves

    N x (TTR without a spare - TTR with one) x world_size   slot-seconds

(every slot waits through a recovery) and costs `W x slots_per_spare` slot-seconds. A spare
is used again after a hand-off (the next one prepares in `replace_s`), so a k-th spare only
saves for a failure that comes while the one before it is being replaced: its saving is the
first's times p^(k-1), p = 1 - exp(-rate x replace_s). Spares are held, one by one, while
their saving exceeds their cost (at most `max_spares`).

With no spare held a CPU placement still recovers live: a spare is started when a rank is
lost (TTR adds its start); a GPU placement holds no spare device and restarts every rank.
The TTRs come from the fleet simulator's recovery model (`simulate.spare_inputs`), whose
replications this closed form predicts: `tests/unit/test_simulate.py` checks that it holds the
number of spares they find best, so the decision and `ettflow simulate` price spares alike.

Shared spares (`size_shared_spares`): on a cluster whose pool (trainer/group/pool_service.py)
serves every run of a model, the pool holds the model's spares instead of each run holding its
own, and a spare serves whichever run loses a rank first. Each training run brings its share
(`SpareShare`: per second it trains, the slot-seconds a ready spare is expected to save it, and
its failure rate); per second held, the first spare saves the sum of the shares and
costs `slots_per_spare`, the k-th saves the first's times p^(k-1) with p from the summed
failure rate. For one run it holds what `size_spares` holds (both sides divided by the wall);
two runs whose own spares would each not pay may together pay one.

Defaults, stated where they are used (`SpareInputs`): with no history, `DEFAULT_RATE_PER_H`;
the TTRs are this machine's measured ones (BENCHMARKS.md, live recovery on against off) until
the model's own are measured; likewise a spare's start at a loss (`DEFAULT_REPLACE_S`) until
the model's spares started at a loss are (the failure history's `spare_start_s`). Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

RULE = "spare-by-saving"  # a spare held ahead of a failure because its expected saving pays
SHARED = "spare-shared"  # held by the cluster's pool while a model's runs train, for whichever loses a rank
AT_LOSS = "spare-at-loss"  # none held: a spare started when a rank was lost, its start part of the recovery
DEFAULT_RATE_PER_H = 1.0  # failures per hour of training, a model with no history (the history's prior)
DEFAULT_TTR_WITH_S = 2.0  # a lost rank replaced by a ready spare (BENCHMARKS.md: 1.5-2.2 s measured)
DEFAULT_TTR_WITHOUT_S = 10.0  # every rank restarted (BENCHMARKS.md: 8.4-22 s measured)
DEFAULT_REPLACE_S = 10.0  # a spare's start and prewarm after a hand-off
DEFAULT_WALL_S = 60.0  # a run's wall when its history cannot say


@dataclass(frozen=True, kw_only=True)
class SpareInputs:
    """What the decision reads; `sources` says where each number came from (for the reason)."""

    world_size: int
    wall_s: float
    rate_per_s: float  # failures per second of the run
    scripted_failures: int = 0  # failures the run's parameters inject (known ahead)
    ttr_with_s: float = DEFAULT_TTR_WITH_S
    ttr_without_s: float = DEFAULT_TTR_WITHOUT_S
    replace_s: float = DEFAULT_REPLACE_S
    slots_per_spare: float = 1.0
    sources: str = ""

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.wall_s < 0 or self.rate_per_s < 0 or self.scripted_failures < 0:
            raise ValueError(f"spare sizing inputs out of range: {self}")

    @property
    def expected_failures(self) -> float:
        return self.rate_per_s * self.wall_s + self.scripted_failures


@dataclass(frozen=True, kw_only=True)
class SpareDecision:
    """`spares`: how many the run holds; the numbers behind it, in slot-seconds (a shared
    decision, `rule` SHARED: per second held, and `expected_failures` per second)."""

    spares: int
    expected_failures: float
    saving_slot_s: tuple[float, ...]  # the k-th spare's expected saving, k = 1..max_spares
    cost_slot_s: float  # one spare held for the run's wall
    reason: str
    rule: str = RULE

    def beside(self, own: SpareDecision) -> SpareDecision:
        """This shared decision as a run's plan: its reason also gives the run's own decision
        (its inputs and their sources), which its share was priced from."""
        return replace(self, reason=f"{self.reason}; this run alone: {own.reason}")

    def to_attrs(self) -> dict[str, Any]:
        """The run's `spare_plan` marker attributes (and its ETT artifact's row)."""
        return {"rule": self.rule, "spares": self.spares, "expected_failures": round(self.expected_failures, 4),
                "saving_slot_s": [round(s, 2) for s in self.saving_slot_s], "cost_slot_s": round(self.cost_slot_s, 2),
                "reason": self.reason}


def size_spares(inputs: SpareInputs, *, max_spares: int = 1) -> SpareDecision:
    """The spares a run holds (see the module docstring)."""
    n = inputs.expected_failures
    gain = max(inputs.ttr_without_s - inputs.ttr_with_s, 0.0)
    first = n * gain * inputs.world_size
    p = 1.0 - math.exp(-inputs.rate_per_s * inputs.replace_s)
    savings = tuple(first * p ** k for k in range(max_spares))
    cost = inputs.wall_s * inputs.slots_per_spare
    held = 0
    while held < max_spares and savings[held] > cost:
        held += 1
    first_s = savings[0] if savings else 0.0
    verdict = "pays" if held else "does not pay"
    reason = (f"{n:.3g} expected failure(s) x {gain:.1f} s saved each x {inputs.world_size} slots = "
              f"{first_s:.1f} slot-s against {cost:.1f} slot-s held: a spare {verdict}"
              + (f" ({inputs.sources})" if inputs.sources else ""))
    return SpareDecision(spares=held, expected_failures=n, saving_slot_s=savings, cost_slot_s=cost, reason=reason)


@dataclass(frozen=True, kw_only=True)
class SpareShare:
    """One training run's part in its model's shared spares, per second it trains."""

    run_id: str
    saving_per_s: float  # slot-seconds a ready spare saves it: N x (TTR without - TTR with) x world_size / wall
    failures_per_s: float  # its failure rate: what a used spare's replacement risks (as `size_spares`'s p)
    replace_s: float = DEFAULT_REPLACE_S
    slots_per_spare: float = 1.0

    def __post_init__(self) -> None:
        if self.saving_per_s < 0 or self.failures_per_s < 0 or self.replace_s < 0 or self.slots_per_spare <= 0:
            raise ValueError(f"spare share out of range: {self}")

    @classmethod
    def of(cls, run_id: str, inputs: SpareInputs) -> SpareShare:
        """The share of a run whose own decision reads `inputs` (its expected failures over its wall)."""
        wall = max(inputs.wall_s, 1e-9)
        gain = max(inputs.ttr_without_s - inputs.ttr_with_s, 0.0)
        return cls(run_id=run_id, saving_per_s=inputs.expected_failures * gain * inputs.world_size / wall,
                   failures_per_s=inputs.rate_per_s, replace_s=inputs.replace_s,
                   slots_per_spare=inputs.slots_per_spare)


def size_shared_spares(shares: Sequence[SpareShare], *, max_spares: int = 1) -> SpareDecision:
    """The spares a pool holds for the runs of one model training now (module docstring): the
    decision's savings and cost are slot-seconds per second held."""
    first = sum(s.saving_per_s for s in shares)
    rate = sum(s.failures_per_s for s in shares)
    replace_s = max((s.replace_s for s in shares), default=DEFAULT_REPLACE_S)
    cost = max((s.slots_per_spare for s in shares), default=1.0)
    p = 1.0 - math.exp(-rate * replace_s)
    savings = tuple(first * p ** k for k in range(max_spares))
    held = 0
    while held < max_spares and savings[held] > cost:
        held += 1
    verdict = f"{held} shared spare(s) pay" if held else "a shared spare does not pay"
    reason = (f"{len(shares)} run(s) training: {first:.3g} slot-s saved per s held against {cost:g} slot(s): "
              f"{verdict}")
    return SpareDecision(spares=held, expected_failures=rate, saving_slot_s=savings, cost_slot_s=cost,
                         reason=reason, rule=SHARED)


@dataclass(frozen=True, kw_only=True)
class SharedHold:
    """A run's part of one shared spare's hold: `slots` (its fraction of the spare's slot) from
    `start` to `end`; `used`: the spare replaced a rank (of whichever run) at its end, else it
    was released unused there. The run records it as its own `spare_start` (`ett.capacity`)."""

    holding_id: str
    start: float
    end: float
    slots: float
    used: bool
    cpus: float = 0.0
    gpus: float = 0.0

    def to_attrs(self) -> dict[str, Any]:
        """The `spare_start` attributes of this part (`event_attrs.SpareAttrs`)."""
        ended = {"taken_at": self.end} if self.used else {"released_at": self.end}
        return {"pooled": True, "used": self.used, **ended, "slots": round(self.slots, 6), "rule": SHARED,
                "cpus": self.cpus, "gpus": self.gpus}


def split_shared_hold(log: Sequence[tuple[float, dict[str, float]]], start: float, end: float,
                      skip: frozenset[str] | set[str] = frozenset()) -> dict[str, list[tuple[float, float, float]]]:
    """Each run's (from, to, fraction of the spare) of a shared spare held over [start, end]:
    `log` lists, oldest first, each change of the model's sharing runs (when, and each run's
    saving per second from then); over each span the spare is split by those savings (equally
    when they are all 0). Runs in `skip` were accounted already (they left before the end).
    The fractions of every run over a span sum to 1: the hold is counted once, never dropped."""
    out: dict[str, list[tuple[float, float, float]]] = {}
    for i, (at, shares) in enumerate(log):
        upto = log[i + 1][0] if i + 1 < len(log) else end
        lo, hi = max(at, start), min(upto, end)
        if hi <= lo or not shares:
            continue
        total = sum(shares.values())
        for run, saving in shares.items():
            if run not in skip:
                share = saving / total if total > 0 else 1.0 / len(shares)
                out.setdefault(run, []).append((lo, hi, share))
    return out
