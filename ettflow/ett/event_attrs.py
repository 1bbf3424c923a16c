"""The typed attributes of phase events: one frozen class per kind of event that code reads.

A spool record's `attrs` is JSON written by whoever recorded the event (a rank, the driver, a
task); this module is the one place that reads it by key. `attrs_of(phase, attrs)` (and
`PhaseEvent.info`, which calls it once per event) returns the class its phase maps to
(`KINDS`), each field read by its own name with its default, a value of the wrong type read as
absent (a reader never fails on an attribute: the event itself was validated by `events.py`).
Phases no code reads have `NoAttrs`.

Writers still pass keyword attributes (`SpoolWriter.record(..., step=3)`); the field names here
are those keywords, so a rename is one place on each side.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import cache
from typing import Any

from .checkpoint_tier import RestoreSource
from .failures import Failure, FailureClass


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _str(value: Any) -> str | None:
    return None if value is None else str(value)


def _source(value: Any) -> RestoreSource | None:
    try:
        return RestoreSource(value)
    except ValueError:
        return None


def _nodes(value: Any) -> tuple[str, ...] | None:
    return tuple(str(n) for n in value) if isinstance(value, list | tuple) else None


# a field's annotation (as text: annotations are postponed) -> how its value is read
_READERS = {"int | None": _int, "float | None": _float, "str | None": _str, "bool": bool,
            "RestoreSource | None": _source, "tuple[str, ...] | None": _nodes}


@dataclass(frozen=True, kw_only=True)
class EventAttrs:
    """Base: `parse` reads each field of the subclass by its name."""

    @classmethod
    def parse(cls, attrs: Mapping[str, Any]) -> EventAttrs:
        values = {}
        for f, read in _fields(cls):
            if f in attrs and attrs[f] is not None:
                value = read(attrs[f])
                if value is not None:
                    values[f] = value
        return cls(**values)


@cache
def _fields(cls: type[EventAttrs]) -> tuple[tuple[str, Any], ...]:
    return tuple((f.name, _READERS[f.type]) for f in fields(cls))


@dataclass(frozen=True, kw_only=True)
class NoAttrs(EventAttrs):
    """A phase whose attributes no code reads."""


@dataclass(frozen=True, kw_only=True)
class StepAttrs(EventAttrs):
    """`train_step`: the step's number, its loss and examples (its cursors: `PhaseEvent.cursor_*`)."""

    step: int | None = None
    loss: float | None = None
    examples: int | None = None


@dataclass(frozen=True, kw_only=True)
class SchedulingAttrs(EventAttrs):
    """`scheduling` and `spare_handoff`: the attempt's ranks and their nodes (the driver's), or a
    task's stage that ended the run there (a skip: `stage`, `outcome`, `reason`)."""

    world_size: int | None = None
    nodes: tuple[str, ...] | None = None
    stage: str | None = None
    outcome: str | None = None
    reason: str | None = None
    handed: bool = True  # `spare_handoff`: a spare took the lost rank (False: every rank restarted)


@dataclass(frozen=True, kw_only=True)
class FailureAttrs(EventAttrs):
    """`failure` and `failure_detected` markers: the failure as `Failure.to_attrs` wrote it
    (`failure()` reads it back), the scripted item that fired, who stopped a process."""

    failure_class: str | None = None
    failed_rank: int | None = None
    step: int | None = None
    reason: str | None = None
    detail: str | None = None
    path: str | None = None
    node: str | None = None
    hang: bool = False
    injected: bool = False
    secondary: bool = False
    owner_lost: bool = False
    fault_index: int | None = None
    process_stopped: bool = False
    task: str | None = None

    def failure(self, attempt: int | None = None) -> Failure:
        """The typed failure (no class: infrastructure; no rank: -1, the caller knows it)."""
        return Failure(failure_class=FailureClass.parse(self.failure_class or "infrastructure"),
                       rank=self.failed_rank if self.failed_rank is not None else -1, attempt=attempt,
                       step=self.step, reason=self.reason or "", detail=self.detail or "", path=self.path,
                       node=self.node, injected=self.injected, secondary=self.secondary, hang=self.hang,
                       owner_lost=self.owner_lost)


@dataclass(frozen=True, kw_only=True)
class FaultAttrs(EventAttrs):
    """`fault_injected` and `fault_unfired` markers: the scripted item's index."""

    fault_index: int | None = None


@dataclass(frozen=True, kw_only=True)
class RestoreAttrs(EventAttrs):
    """`checkpoint_restore`: where the state came from, at which step, or why it failed."""

    source: RestoreSource | None = None
    step: int | None = None
    path: str | None = None
    bytes: int | None = None
    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class FallbackAttrs(EventAttrs):
    """`checkpoint_fallback`: a damaged checkpoint skipped and the older step restored instead."""

    damaged_step: int | None = None
    restored_step: int | None = None
    file: str | None = None
    noticed: str | None = None  # `checkpoint_damaged`: what found it (nothing was restored from it)


@dataclass(frozen=True, kw_only=True)
class SaveAttrs(EventAttrs):
    """A checkpoint save (`checkpoint_save_blocking`, `checkpoint_save_background`) or the anchor.
    `handed_off`: a rank's anchor handed to the driver in host memory (`path`: the folder the
    driver seals, `anchor_seal`), not written by the rank."""

    step: int | None = None
    path: str | None = None
    bytes: float | None = None  # an int as written; the warehouse row keeps a whole float too
    handed_off: bool = False


@dataclass(frozen=True, kw_only=True)
class SpareAttrs(EventAttrs):
    """`spare_start`: a spare or pooled worker held for the run. `for_rank`: the rank a pooled
    worker became (None: a spare); `taken_at` when a run took it; `used` False: released
    unused at `released_at`; what it held (`gpus`, `cpus`, `rss_bytes`, `slots`); `rule`: why it
    was held (the pool's hold rule, or a spare's sizing)."""

    for_rank: int | None = None
    pooled: bool = False
    taken_at: float | None = None
    used: bool = True
    released_at: float | None = None
    gpus: float | None = None
    cpus: float | None = None
    rss_bytes: float | None = None
    rule: str | None = None
    slots: float | None = None  # trainer slots it held (None: one, a worker; the simulator's node: several)


@dataclass(frozen=True, kw_only=True)
class PublishAttrs(EventAttrs):
    """A publish try (`publish`, `publish_standalone`): how it ended (`outcome`: published, gated,
    failed, or withdrawn: the run had lost its claims, no failure of its own), its snapshot or error."""

    outcome: str | None = None
    snapshot: str | None = None
    error: str | None = None
    injected: bool = False


@dataclass(frozen=True, kw_only=True)
class CompileRestoreAttrs(EventAttrs):
    """`compile_cache_restore`: its miss (None: a hit) and why; `pooled`: met by the prewarm of
    the pooled worker the rank is (before the run: a zero-length record of it), and `repair`
    what became of the damaged archive then (`trainer.protocol.Repair`'s value)."""

    miss: str | None = None
    reason: str | None = None
    pooled: bool = False
    repair: str | None = None


@dataclass(frozen=True, kw_only=True)
class SparePlanAttrs(EventAttrs):
    """`spare_plan`: the spares the run holds, by their expected saving (`ett.spare_sizing`)."""

    rule: str | None = None
    spares: int | None = None
    expected_failures: float | None = None
    cost_slot_s: float | None = None
    reason: str | None = None


KINDS: dict[str, type[EventAttrs]] = {
    "train_step": StepAttrs,
    "scheduling": SchedulingAttrs,
    "spare_handoff": SchedulingAttrs,
    "failure": FailureAttrs,
    "failure_detected": FailureAttrs,
    "operator_stop": FailureAttrs,  # its `reason`: who stopped the run
    "claims_lost": FailureAttrs,  # its `reason`: the `ClaimsLost`'s words
    "fault_injected": FaultAttrs,
    "fault_unfired": FaultAttrs,
    "checkpoint_restore": RestoreAttrs,
    "checkpoint_fallback": FallbackAttrs,
    "checkpoint_damaged": FallbackAttrs,  # `restored_step`: what a restart would restore instead
    "checkpoint_save_blocking": SaveAttrs,
    "checkpoint_save_background": SaveAttrs,
    "anchor_checkpoint": SaveAttrs,
    "anchor_seal": SaveAttrs,
    "spare_start": SpareAttrs,
    "publish": PublishAttrs,
    "publish_standalone": PublishAttrs,
    "compile_cache_restore": CompileRestoreAttrs,
    "spare_plan": SparePlanAttrs,
}


def attrs_of(phase: str, attrs: Mapping[str, Any]) -> EventAttrs:
    """An event's attributes as its phase's class (`NoAttrs` for a phase no code reads)."""
    return KINDS.get(phase, NoAttrs).parse(attrs)
