"""Typed event attributes (`ett/event_attrs.py`): each phase's attributes read once, by name,
into its class; a value of the wrong type reads as absent; nothing outside the spool's parser
reads an event's attributes by string key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import ettflow
from ettflow.ett.checkpoint_tier import CheckpointTier, RestoreSource
from ettflow.ett.event_attrs import KINDS, FailureAttrs, NoAttrs, RestoreAttrs, SpareAttrs, StepAttrs
from ettflow.ett.events import PHASES, PhaseEvent
from ettflow.ett.failures import Failure, FailureClass

PACKAGE = Path(ettflow.__file__).parent
PARSER = {"ett/events.py", "ett/event_attrs.py"}  # the event's own validation, and the typed attributes


def event(phase: str, **attrs) -> PhaseEvent:
    return PhaseEvent(run_id="r", attempt=0, rank=0, phase=phase, start=1.0, end=1.0 if phase in (
        "failure", "failure_detected", "checkpoint_fallback") else 2.0, attrs=attrs)


def test_each_phase_s_attributes_are_its_class_read_once():
    step = event("train_step", step=7, loss=0.5, examples=64, cursor_start=[0, 0, 0], cursor_end=[0, 0, 64])
    assert step.info == StepAttrs(step=7, loss=0.5, examples=64) and step.info is step.info
    spare = event("spare_start", for_rank=1, taken_at=3, used=False, gpus=1)
    assert spare.info == SpareAttrs(for_rank=1, taken_at=3.0, used=False, gpus=1.0)
    assert event("spare_start").info.used  # a spare is used unless its event says it was released unused
    restore = event("checkpoint_restore", source="parent", step=10, path="/c/10")
    assert restore.info == RestoreAttrs(source=RestoreSource.PARENT, step=10, path="/c/10")
    assert restore.info.source.tier is CheckpointTier.DURABLE and RestoreSource.MEMORY.tier is CheckpointTier.MEMORY
    assert event("device_init", anything=1).info == NoAttrs()


def test_a_value_of_the_wrong_type_reads_as_absent():
    bad = event("spare_start", for_rank="1", taken_at=float("nan"), gpus=True, rss_bytes="big")
    assert bad.info == SpareAttrs()
    assert event("checkpoint_restore", source="elsewhere", step=1.5).info == RestoreAttrs()


@pytest.mark.parametrize("failure", [
    Failure(failure_class=FailureClass.INFRASTRUCTURE, rank=1, attempt=2, step=16, reason="rank 1: killed",
            detail="SIGKILL", injected=True),
    Failure(failure_class=FailureClass.STORAGE, rank=0, attempt=0, step=None, reason="disk full",
            path="/c/5", node="n1", secondary=True, hang=True),
])
def test_a_failure_marker_reads_back_the_failure_it_was_written_from(failure):
    marker = event("failure", **failure.to_attrs())
    assert marker.info.failure(failure.attempt) == failure
    assert FailureAttrs.parse(failure.to_attrs()).failure(failure.attempt) == failure
    assert FailureAttrs().failure().failure_class is FailureClass.INFRASTRUCTURE and FailureAttrs().failure().rank == -1


def test_every_typed_phase_is_a_phase():
    assert set(KINDS) <= PHASES


def test_nothing_outside_the_parser_reads_attributes_by_key():
    pattern = re.compile(r"\.attrs\.get\(|\battrs\[")
    found = [f"{path.relative_to(PACKAGE)}:{n}" for path in sorted(PACKAGE.rglob("*.py"))
             if str(path.relative_to(PACKAGE)) not in PARSER
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == [], "read an event's attributes through `PhaseEvent.info` (ett/event_attrs.py)"
