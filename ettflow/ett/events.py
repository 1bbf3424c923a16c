"""Phase events: the only interface between the trainer and the metric.

A `PhaseEvent` says that one rank of one attempt of one run spent [start, end] (epoch
seconds) in one phase. Markers (failure, detection, submission) are instants: start == end.
Training steps carry the data cursor they started and ended at in `attrs`.

Pure: no I/O here. `PhaseEvent.from_dict` is what readers of spools and warehouses call, so
a bad record is rejected with the field and the event named.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from .event_attrs import EventAttrs, attrs_of
from .failures import FAILURE_CLASSES  # the classes live with the Failure type

# The six L2 components, in sweep priority (highest first). They partition the wall clock.
COMPONENTS: tuple[str, ...] = (
    "effective_training",
    "wasted_training",
    "pt2_compile",
    "trainer_init",
    "scheduling",
    "shutdown",
)
UNATTRIBUTED = "unattributed"
# Every L2 bucket in the order every table and picture shows it: the components in sweep
# priority, then the time no event covers. Colours: `ett.palette.COLOURS`.
L2_ORDER: tuple[str, ...] = (*COMPONENTS, UNATTRIBUTED)

# Who can fix a regression in each component.
OWNERS: dict[str, str] = {
    "scheduling": "scheduler",
    "trainer_init": "trainer",
    "pt2_compile": "compiler",
    "effective_training": "trainer",
    "wasted_training": "storage",
    "shutdown": "publishing",
}

INIT_STAGES: tuple[str, ...] = (
    "device_init",
    "process_group_init",
    "preproc_creation",
    "train_module_creation",
    "init_plugins",
    "pre_train",
    "get_first_batch_data",
)

TRAIN_STEP = "train_step"  # effective or wasted, decided by the data cursor
SUBMITTED = "submitted"  # marker: the job was submitted (wall clock starts)
FAILURE = "failure"  # marker: the fault happened (kill, exception, start of a hang)
FAILURE_DETECTED = "failure_detected"  # marker: the driver noticed (TTR starts)
DATA_STALL = "data_stall"  # a step's fetch that waited on the data pipeline (`trainer.step_clock`)
CHECKPOINT_INTERVAL = "checkpoint_interval"  # marker: the interval planned and its inputs (ett.interval_plan)
SPARE_PLAN = "spare_plan"  # marker: the spares the run holds and why (ett.spare_sizing)
FAULT_INJECTED = "fault_injected"  # marker: a scripted fault that is not a failure fired (its fault_index)
FAULT_UNFIRED = "fault_unfired"  # marker: a scripted fault the run ended without reaching (its fault_index)
CHECKPOINT_FALLBACK = "checkpoint_fallback"  # marker: a damaged checkpoint skipped, an older step restored
# marker: a damaged durable checkpoint found while the memory tier served a recovery (nothing restored
# from it yet: a restart would restore the older step it names, `trainer.group.durable_audit`)
CHECKPOINT_DAMAGED = "checkpoint_damaged"
# marker: an operator stopped the run (a cancel from Prefect's UI or CLI): what its ranks mark
# from then on in that attempt is the stop, not a failure (`ett.timeline.operator_stops`)
OPERATOR_STOP = "operator_stop"
# marker, off the clock: a try of the run lost its window claims (taken for dead while it stood
# still: `lineage.ClaimsLost`, its `reason`); a flow retry of the run ends failed at once
CLAIMS_LOST = "claims_lost"
# a publish try, on the devices (the baseline's) or on the CPU after their release; its `outcome` says how it ended
PUBLISH_PHASES: tuple[str, ...] = ("publish", "publish_standalone")
# evidence, not time: a rank's process was not running for a while (SIGSTOP, a frozen VM, a starved
# host): its heartbeat thread woke late and the process used almost no CPU in between (`rank_heartbeat`)
PROCESS_PAUSED = "process_paused"
# derived by the sweep (`ett.timeline`): the part of a training step beyond what its rank's recent
# steps took, when above the stall bound, owned by the evidence: a paused process (the host), else the rank
STEP_STALL = "step_stall"
HOST_STALL = "host_stall"
HANG = "hang"  # derived: a hung attempt's time from its last finished work to the watchdog's detection
# wasted training that no checkpoint interval can change (the interval table leaves it out)
NOT_INTERVAL_WASTE: tuple[str, ...] = (DATA_STALL, STEP_STALL, HOST_STALL, HANG)

# phase -> the component its time belongs to. None: the phase is informational (a marker,
# or work in the background that the critical path does not wait for).
PHASE_COMPONENT: dict[str, str | None] = {
    "scheduling": "scheduling",
    "ray_start": "scheduling",  # a local Ray started for the run (no cluster to join): on its clock
    **{stage: "trainer_init" for stage in INIT_STAGES},
    "checkpoint_restore": "trainer_init",
    "compile_cache_restore": "pt2_compile",
    "pt2_compile": "pt2_compile",
    "compile_cache_save": "pt2_compile",
    TRAIN_STEP: None,  # resolved per step to effective_training or wasted_training
    "checkpoint_save_blocking": "wasted_training",
    "memory_save_blocking": "wasted_training",  # the in-memory tier's copy the loop waits for
    "lost_in_flight": "wasted_training",
    DATA_STALL: "wasted_training",  # devices held, nothing trained: the step waited for its batch
    # live recovery (survivors keep running, a warm spare takes the failed rank): its phases
    "spare_handoff": "scheduling",  # the driver gives the failed rank's place to a spare
    "process_group_rebuild": "trainer_init",  # survivors and spare form a new process group
    "module_reshard": "trainer_init",  # the sharded module rebuilt on the new group (dense part kept)
    "anchor_checkpoint": "shutdown",
    "evaluation": "shutdown",  # held-out evaluation after training, devices still held
    "publish": "shutdown",  # publishing while the trainer still holds its devices
    "shutdown": "shutdown",
    "checkpoint_save_background": None,
    "memory_save_background": None,  # the in-memory copy handed to the keeper, overlapping training
    "spare_start": None,  # a new spare starting in the background, off the critical path
    PROCESS_PAUSED: None,  # evidence for the owner of a stalled step, never time of its own
    "flow_prestart": None,  # the run's flow process, started by the worker ahead of its scheduled time (held for it)
    "publish_standalone": None,  # on CPU after the devices were released
    "anchor_seal": None,  # the anchor written and sealed from host memory by the driver, after the release
    SUBMITTED: None,
    FAILURE: None,
    FAILURE_DETECTED: None,
    CHECKPOINT_INTERVAL: None,
    SPARE_PLAN: None,
    FAULT_INJECTED: None,
    FAULT_UNFIRED: None,
    CHECKPOINT_FALLBACK: None,
    CHECKPOINT_DAMAGED: None,
    OPERATOR_STOP: None,
    CLAIMS_LOST: None,
}
PHASES: frozenset[str] = frozenset(PHASE_COMPONENT)
MARKERS: frozenset[str] = frozenset({SUBMITTED, FAILURE, FAILURE_DETECTED, CHECKPOINT_INTERVAL, SPARE_PLAN,
                                     FAULT_INJECTED, FAULT_UNFIRED, CHECKPOINT_FALLBACK, CHECKPOINT_DAMAGED,
                                     OPERATOR_STOP, CLAIMS_LOST})
# Informational phases neither claim time nor stretch the wall clock.
OFF_CLOCK: frozenset[str] = frozenset({"publish_standalone", "checkpoint_save_background", "memory_save_background",
                                       "spare_start", "flow_prestart", "anchor_seal", PROCESS_PAUSED, CLAIMS_LOST})

# Phases whose owner is not their component's owner (derived phases included).
PHASE_OWNERS: dict[str, str] = {
    "preproc_creation": "data",
    "get_first_batch_data": "data",
    "process_group_init": "scheduler",
    "compile_cache_restore": "compiler",
    "compile_cache_save": "compiler",
    "checkpoint_restore": "storage",
    "checkpoint_save_blocking": "storage",
    "checkpoint_save_background": "storage",
    "memory_save_blocking": "storage",
    "memory_save_background": "storage",
    "process_group_rebuild": "scheduler",
    "spare_start": "scheduler",
    "flow_prestart": "scheduler",
    "anchor_checkpoint": "storage",
    "anchor_seal": "storage",
    "publish": "publishing",
    "publish_standalone": "publishing",
    "train_step": "trainer",
    "train_step_replay": "storage",
    "lost_in_flight": "storage",
    DATA_STALL: "data",
    "failed_startup": "trainer",
    STEP_STALL: "trainer",  # the rank: its process ran, its step did not end
    HOST_STALL: "host",  # the process was not running (stopped, frozen, starved of CPU)
    PROCESS_PAUSED: "host",
    HANG: "trainer",
}


# Phases the sweep derives, and the component each belongs to.
DERIVED_COMPONENT: dict[str, str] = {
    TRAIN_STEP: "effective_training",
    "train_step_replay": "wasted_training",
    "failed_startup": "trainer_init",
    STEP_STALL: "wasted_training",
    HOST_STALL: "wasted_training",
    HANG: "wasted_training",
}


def component_of(phase: str) -> str | None:
    return PHASE_COMPONENT.get(phase) or DERIVED_COMPONENT.get(phase)


def owner_of(name: str) -> str | None:
    """Who can fix time lost in a component or phase."""
    if name in OWNERS:
        return OWNERS[name]
    if name in PHASE_OWNERS:
        return PHASE_OWNERS[name]
    component = component_of(name)
    return OWNERS.get(component) if component else None



REQUIRED_FIELDS: tuple[str, ...] = ("run_id", "attempt", "rank", "phase", "start", "end")

Cursor = tuple[int, ...]


class EventError(ValueError):
    """A phase event that cannot be used; the message names the field and the event."""


def cursor_of(value: Any, *, what: str, where: object = None) -> Cursor:
    """A data cursor as a comparable tuple of ints: an int, or a sequence such as
    (window, file, row). `where`, when given, ends the error message (' in <where>')."""
    if type(value) is int:
        return (value,)
    if type(value) in (list, tuple) and value and all(type(v) is int for v in value):
        return tuple(value)  # the common shapes, checked without the generic path below
    if not isinstance(value, bool) and isinstance(value, int):
        return (value,)
    if isinstance(value, Sequence) and not isinstance(value, (str, bool)) and value:
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return tuple(value)
    suffix = "" if where is None else f" in {where}"
    raise EventError(f"{what}{suffix} must be an int or a sequence of ints, got {value!r}")


class _Described:
    """An event's description for an error message, formatted only when one is raised."""

    __slots__ = ("event",)

    def __init__(self, event: PhaseEvent) -> None:
        self.event = event

    def __str__(self) -> str:
        return self.event.describe()


@dataclass(frozen=True, kw_only=True)
class PhaseEvent:
    run_id: str
    attempt: int
    rank: int  # -1 for the driver
    phase: str
    start: float
    end: float
    attrs: Mapping[str, Any] = field(default_factory=dict)
    seq: int | None = None  # position in its spool file; part of the warehouse key

    def __post_init__(self) -> None:
        where = _Described(self)  # formatted only into an error message (a step is recorded per step)
        if not isinstance(self.run_id, str) or not self.run_id:
            raise EventError(f"field 'run_id' must be a non-empty string in {where}")
        for name in ("attempt", "rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise EventError(f"field '{name}' must be an int, got {value!r} in {where}")
        if self.attempt < 0 or self.rank < -1:
            raise EventError(f"fields 'attempt' >= 0 and 'rank' >= -1 required in {where}")
        if self.phase not in PHASES:
            raise EventError(
                f"field 'phase' has unknown phase {self.phase!r} in {where}; "
                f"known phases: {', '.join(sorted(PHASES))}"
            )
        for name in ("start", "end"):
            value = getattr(self, name)
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not math.isfinite(value)
            ):
                raise EventError(f"field '{name}' must be a finite number, got {value!r} in {where}")
        if self.end < self.start:
            raise EventError(
                f"field 'end' ({self.end}) is before 'start' ({self.start}) in {where}"
            )
        if self.phase in MARKERS and self.end != self.start:
            raise EventError(f"field 'end' must equal 'start' for marker phase in {where}")
        if not isinstance(self.attrs, Mapping):
            raise EventError(f"field 'attrs' must be a mapping in {where}")
        if self.phase == TRAIN_STEP:
            cursors = []
            for name in ("cursor_start", "cursor_end"):
                if name not in self.attrs:
                    raise EventError(f"field 'attrs.{name}' is missing in {where}")
                cursors.append(cursor_of(self.attrs[name], what=f"field 'attrs.{name}'", where=where))
            if cursors[1] < cursors[0]:
                raise EventError(f"field 'attrs.cursor_end' is before 'cursor_start' in {where}")
        if self.phase in (FAILURE, FAILURE_DETECTED):
            klass = self.attrs.get("failure_class", "infrastructure")
            if klass not in FAILURE_CLASSES:
                raise EventError(
                    f"field 'attrs.failure_class' is {klass!r} in {where}; "
                    f"expected one of {', '.join(FAILURE_CLASSES)}"
                )

    def describe(self) -> str:
        seq = "" if self.seq is None else f" seq={self.seq}"
        return (
            f"event(run={getattr(self, 'run_id', '?')!r} attempt={getattr(self, 'attempt', '?')} "
            f"rank={getattr(self, 'rank', '?')} phase={getattr(self, 'phase', '?')!r}{seq})"
        )

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def component(self) -> str | None:
        return PHASE_COMPONENT[self.phase]

    @cached_property
    def info(self) -> EventAttrs:
        """The attributes as its phase's typed class (`event_attrs`), parsed once."""
        return attrs_of(self.phase, self.attrs)

    @property
    def cursor_start(self) -> Cursor:
        return cursor_of(self.attrs["cursor_start"], what="cursor_start")

    @property
    def cursor_end(self) -> Cursor:
        return cursor_of(self.attrs["cursor_end"], what="cursor_end")

    def to_dict(self) -> dict[str, Any]:
        out = {
            "run_id": self.run_id,
            "attempt": self.attempt,
            "rank": self.rank,
            "phase": self.phase,
            "start": self.start,
            "end": self.end,
            "attrs": dict(self.attrs),
        }
        if self.seq is not None:
            out["seq"] = self.seq
        return out

    @classmethod
    def from_dict(cls, record: Mapping[str, Any], *, where: str = "") -> PhaseEvent:
        """Build an event from a plain record, naming the missing field and the event."""
        if not isinstance(record, Mapping):
            raise EventError(f"event record must be an object, got {type(record).__name__} {where}")
        missing = [name for name in REQUIRED_FIELDS if name not in record]
        if missing:
            label = {k: record[k] for k in REQUIRED_FIELDS if k in record}
            raise EventError(
                f"field '{missing[0]}' is missing in event {label} {where}".rstrip()
            )
        try:
            return cls(
                run_id=record["run_id"],
                attempt=record["attempt"],
                rank=record["rank"],
                phase=record["phase"],
                start=record["start"],
                end=record["end"],
                attrs=record.get("attrs") or {},
                seq=record.get("seq"),
            )
        except EventError as exc:
            raise EventError(f"{exc} {where}".rstrip()) from None


def marker(phase: str, *, run_id: str, attempt: int, rank: int, at: float, **attrs: Any) -> PhaseEvent:
    """An instant event (submission, failure, detection)."""
    return PhaseEvent(run_id=run_id, attempt=attempt, rank=rank, phase=phase, start=at, end=at, attrs=attrs)
