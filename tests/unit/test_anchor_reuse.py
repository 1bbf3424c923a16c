"""Which stopped refresh's sealed anchor the next refresh publishes instead of training
(`tasks/anchor_reuse.reusable_anchor`, issue 42 #2), with the folder check scripted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ettflow.ett.lineage import LineageRecord, Outcome
from ettflow.tasks.anchor_reuse import reusable_anchor

WINDOWS = ("window=2024010100", "window=2024010101")


def plan(windows=WINDOWS, parent: str | None = "p0"):
    return SimpleNamespace(run_id="this", trainer=SimpleNamespace(windows=windows),
                           parent=SimpleNamespace(run_id=parent) if parent else None)


def record(run_id: str, outcome=Outcome.FAILED, *, windows=WINDOWS, parent: str | None = "p0",
           anchor: str | None = "/a") -> LineageRecord:
    return LineageRecord(model="dlrm", run_id=run_id, windows=windows, outcome=outcome, parent_run_id=parent,
                         anchor=None if anchor is None else f"{anchor}/{run_id}")


def test_the_newest_stopped_refresh_of_the_same_windows_and_parent_is_reused():
    ok = lambda anchor, p: True  # noqa: E731 - the folder's own check, scripted
    records = [record("old"), record("new")]
    assert reusable_anchor(plan(), records, ok).run_id == "new"
    # each condition alone rules a record out
    assert reusable_anchor(plan(), [record("x", Outcome.PUBLISHED)], ok) is None  # not stopped: published
    assert reusable_anchor(plan(), [record("x", anchor=None)], ok) is None  # stopped before its anchor
    assert reusable_anchor(plan(), [record("x", windows=WINDOWS[:1])], ok) is None  # other windows
    assert reusable_anchor(plan(), [record("x", parent="p1")], ok) is None  # another parent's state
    assert reusable_anchor(plan(parent=None), [record("x")], ok) is None  # a cold start's plan
    assert reusable_anchor(plan(parent=None), [record("x", parent=None)], ok).run_id == "x"
    assert reusable_anchor(plan(windows=None), [record("x")], ok) is None  # no windows claimed
    # a flow retry of the run itself: its train task resumes its anchor, and its row is archived once
    assert reusable_anchor(plan(), [record("this")], ok) is None


def test_an_anchor_that_fails_its_check_is_passed_over_for_an_older_one():
    checked = []

    def publishable(anchor, p):
        checked.append(anchor)
        return anchor.endswith("/old")

    assert reusable_anchor(plan(), [record("old"), record("damaged")], publishable).run_id == "old"
    assert checked == ["/a/damaged", "/a/old"]


def test_a_crashed_run_s_anchor_is_reused_its_parent_read_from_the_anchor():
    """A run killed outright after sealing its anchor (while it published): its record, settled
    by another process (`ett.archive.sealed_anchor`), names the anchor but not the parent, which
    the anchor's own check decides (`_publishable`: its parent checkpoint is the plan's). So does
    a failed or cancelled run's record settled from outside it (FAILED, no parent)."""
    ok = lambda anchor, p: True  # noqa: E731
    crashed = record("killed", Outcome.CRASHED, parent=None)
    assert reusable_anchor(plan(), [crashed], ok).run_id == "killed"
    assert reusable_anchor(plan(), [crashed], lambda anchor, p: False) is None  # another parent's anchor
    assert reusable_anchor(plan(), [record("killed", Outcome.CRASHED, parent="p1")], ok) is None
    assert reusable_anchor(plan(), [record("killed", Outcome.CRASHED, anchor=None, parent=None)], ok) is None
    assert reusable_anchor(plan(), [record("settled", parent=None)], ok).run_id == "settled"
    assert reusable_anchor(plan(parent=None), [crashed], ok).run_id == "killed"  # a cold plan: the anchor decides


def test_the_anchor_a_killed_run_sealed_is_read_from_its_events():
    from ettflow.ett.archive import sealed_anchor
    from ettflow.ett.events import PhaseEvent

    def event(phase, end, **attrs):
        return PhaseEvent(run_id="r", attempt=0, rank=0 if phase != "anchor_seal" else -1, phase=phase,
                          start=end - 1, end=end, attrs=attrs)

    # a rank's hand-off names the folder the driver is to seal (`loop.py`): not written yet
    handed = event("anchor_checkpoint", 10.0, step=8, path="/w/runs/r/checkpoints/step_8", handed_off=True,
                   bytes=10)
    sealed = event("anchor_seal", 12.0, step=8, path="/w/runs/r/checkpoints/step_8", bytes=10)
    failed = event("anchor_seal", 13.0, step=8, failed=True, tries=3)
    assert sealed_anchor([handed, sealed, failed]) == "/w/runs/r/checkpoints/step_8"
    assert sealed_anchor([handed, failed]) is None  # the seal failed (or its driver was killed during it)
    assert sealed_anchor([handed]) is None
    in_trainer = event("anchor_checkpoint", 9.0, step=8, path="/w/runs/r/checkpoints/step_8")
    assert sealed_anchor([event("train_step", 5.0, cursor_start=[0, 0], cursor_end=[0, 1]), in_trainer]) == \
        "/w/runs/r/checkpoints/step_8"
    assert sealed_anchor([]) is None


def test_an_anchor_trained_with_another_batch_or_step_cap_is_not_reused(tmp_path):
    """A stopped run's anchor stands for the plan's training only if it trained with the plan's
    batch size a rank and `max_steps` (`anchor.json`'s `trained_with`): a user who stopped a
    64-step run and asks for every batch of the windows gets them trained, not the 64 steps. A
    marker that does not say (an older ettflow) is not reused either."""
    from ettflow.tasks.anchor_reuse import trained_otherwise
    from ettflow.trainer.checkpoint.anchor import AnchorFormatError, AnchorInfo, TrainedWith, load_anchor, write_anchor
    from ettflow.trainer.data.schema import criteo_schema
    from ettflow.trainer.model_config import ModelConfig

    def info(trained):
        return AnchorInfo(run_id="stopped", step=64, world_size=2, model=ModelConfig(), schema=criteo_schema(10),
                          trained_with=trained)

    def asks(batch, cap):
        return SimpleNamespace(trainer=SimpleNamespace(batch_size=batch, max_steps=cap))

    assert trained_otherwise(info(TrainedWith(128, 64)), asks(128, 64)) is None
    assert trained_otherwise(info(TrainedWith(128, None)), asks(128, None)) is None
    assert trained_otherwise(info(TrainedWith(128, 64)), asks(128, None)) == (
        "it trained with batch 128, max_steps 64; this refresh asks batch 128, max_steps None")
    assert "batch 256" in trained_otherwise(info(TrainedWith(128, 64)), asks(256, 64))
    assert "older ettflow" in trained_otherwise(info(None), asks(128, 64))
    # the marker keeps it: written and read back
    write_anchor(tmp_path, info(TrainedWith(128, 64)))
    assert load_anchor(tmp_path).trained_with == TrainedWith(128, 64)
    write_anchor(tmp_path, info(None))
    assert load_anchor(tmp_path).trained_with is None
    with pytest.raises(AnchorFormatError, match="trained_with"):
        AnchorInfo.from_json({**info(None).to_json(), "trained_with": {"max_steps": 3}})
