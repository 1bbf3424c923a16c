"""Scripted faults inside a rank: a real SIGKILL, an exception, a hang (at a step, or in an
init stage), or a preemption (a real SIGTERM the rank sends itself), at a given step.

The rank records the `failure` marker (durably, through the spool) at the instant the fault
fires, with the item's `fault_index`, so lost in-flight work is measured from a known time and
later attempts know the item fired. Faults scripted by time (`FailAt.after_s`) are sent by the
driver, which kills the rank's process from outside and records the same marker. The `nan`
fault is carried out by the training loop (it poisons a parameter; `numerics.py` records it).
The `corrupt` fault is not a failure: from its step on, the loop has the rank's in-memory copies
corrupted in the keeper and records a `fault_injected` marker with the item's index.
The `preempt` fault sends SIGTERM and lets training go on: the rank's preemption handling
(`preemption.py`) records the marker, with the item's index, where it stops. A `hang`'s marker
only says when the hang began: the driver never reads it as a detection (`hides_hang`), it
must find the hang through the watchdog like a real one.

A rank carries a due fault out with `rank/fault_fire.fire` (the rank's side: a preemption goes
through its handler); this module is what both sides share.

Once per run: before each attempt, the items that already fired anywhere in the run are
dropped (`pending_faults`), so a restart that replays a step does not fire its fault again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

from ettflow.ett.events import FAILURE, FAULT_INJECTED, PhaseEvent
from ettflow.ett.failures import Failure, FailureClass, FailureError
from ettflow.ett.spool import SpoolWriter, read_spool

from .config import FailAt, TrainerConfig

KIND_CLASS = {"kill": FailureClass.INFRASTRUCTURE, "hang": FailureClass.INFRASTRUCTURE,
              "raise": FailureClass.USER, "nan": FailureClass.NUMERICS, "preempt": FailureClass.PREEMPTION}


class InjectedFailure(FailureError):
    """Raised by a scripted `raise` fault: stands for a bug in model or data code (class user)."""


def due(failures: Sequence[FailAt], *, attempt: int, rank: int, step: int) -> FailAt | None:
    """The pending item that fires on `rank` before `step` in `attempt`, if any."""
    for f in failures:
        if f.step == step and f.rank == rank and (f.attempt is None or f.attempt == attempt):
            return f
    return None


def due_in_phase(failures: Sequence[FailAt], *, attempt: int, rank: int, phase: str) -> FailAt | None:
    """The pending `hang` item that fires on `rank` in init stage `phase` in `attempt`, if any."""
    for f in failures:
        if f.phase == phase and f.rank == rank and (f.attempt is None or f.attempt == attempt):
            return f
    return None


def is_scripted_hang(failures: Sequence[FailAt], fault_index: int | None) -> bool:
    """A `failure` marker written by a scripted hang (by its item's index, the marker's `fault_index`)."""
    return fault_index is not None and any(f.index == fault_index and f.kind == "hang" for f in failures)


def injected_failure(fault: FailAt, *, rank: int, attempt: int, step: int | None) -> Failure:
    """The failure a fired item stands for."""
    at = f"at step {step}" if step is not None else f"after {fault.after_s} s"
    if fault.phase:
        at = f"in {fault.phase}" + (f" at step {step}" if step is not None else "")
    who = "the driver" if rank < 0 else f"rank {rank}"  # the driver's process: a kill while it seals the anchor
    cls = FailureClass.ORCHESTRATOR if rank < 0 else KIND_CLASS[fault.kind]  # the driver is the run's process
    return Failure(failure_class=cls, rank=rank, attempt=attempt, step=step,
                   reason=f"injected {fault.kind} of {who} {at}", injected=True, hang=fault.kind == "hang")


def record_fired(fault: FailAt, recorder: SpoolWriter, *, rank: int, step: int | None,
                 at: float | None = None) -> Failure:
    """Record that `fault` fired on `rank`: the `failure` marker, with the item's index."""
    failure = injected_failure(fault, rank=rank, attempt=recorder.attempt, step=step)
    recorder.mark(FAILURE, at, **failure.to_attrs(), fault_index=fault.index)
    return failure


def fired_faults(failures: Sequence[FailAt], events: Iterable[PhaseEvent]) -> set[int]:
    """Indexes of the items that fired in the run: a `failure` marker with their `fault_index`,
    or (the `nan` fault, whose marker the numerics check writes) an injected failure of the
    item's class on its rank at its step."""
    fired: set[int] = set()
    unindexed: list[PhaseEvent] = []
    for ev in events:
        if ev.phase == FAULT_INJECTED and ev.info.fault_index is not None:  # not a failure (corrupt)
            fired.add(ev.info.fault_index)
        if ev.phase != FAILURE:
            continue
        if ev.info.fault_index is not None:
            fired.add(ev.info.fault_index)
        elif ev.info.injected:
            unindexed.append(ev)
    for f in failures:
        for ev in unindexed:
            rank = ev.info.failed_rank if ev.info.failed_rank is not None else ev.rank
            if (f.step is not None and ev.info.step == f.step and rank == f.rank
                    and f.kind in KIND_CLASS and ev.info.failure_class == KIND_CLASS[f.kind].value):
                fired.add(f.index)
    return fired


def pending(failures: Sequence[FailAt], fired: set[int]) -> tuple[FailAt, ...]:
    return tuple(f for f in failures if f.index not in fired)


def pending_faults(config: TrainerConfig, spool_root: Path | str, run_id: str) -> TrainerConfig:
    """`config` with the items that already fired in the run (read from its spool) dropped:
    what the next attempt's ranks and driver may still fire."""
    if not config.failures or not (Path(spool_root) / run_id).is_dir():
        return config
    # only the markers: a recovery reads this on its clock, and the steps are most of the spool
    events = read_spool(spool_root, run_id, phases=frozenset({FAILURE, FAULT_INJECTED})).events
    return replace(config, failures=pending(config.failures, fired_faults(config.failures, events)))
