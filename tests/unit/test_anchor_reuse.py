"""Which stopped refresh's sealed anchor the next refresh publishes instead of training
(`tasks/anchor_reuse.reusable_anchor`, issue 42 #2), with the folder check scripted."""

from __future__ import annotations

from types import SimpleNamespace

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
