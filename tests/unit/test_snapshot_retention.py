"""What a model's snapshot root keeps (`publish/retention.py`, the `prune-snapshots` task) and the
delta chain's bound (`delta_snapshot.REBASE_AFTER`), on snapshot folders written by hand:
manifests only, no model (a real chain's materialization: tests/integration/test_gate.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from ettflow.ett.lineage import LineageRecord, Outcome
from ettflow.ett.warehouse import Warehouse
from ettflow.publish.config import PublishError
from ettflow.publish.manifest import MANIFEST_FILE, SnapshotManifest
from ettflow.publish.retention import Snapshot, doomed_snapshots, read_snapshots, remove_snapshot, staging_folders
from ettflow.tasks.plan import plan_refresh

from helpers.plans import params


def write_snapshot(root: Path, name: str, *, base: str | None = None) -> Path:
    """A snapshot folder holding only its manifest (a delta on `root/base` when given) and its
    timeline picture beside it."""
    folder = root / name
    folder.mkdir(parents=True)
    manifest = SnapshotManifest(run_id=name, step=1, path=str(folder), created_at=0.0, model={}, schema={}, data={},
                                source={}, quantization={}, signature={}, validation={}, metrics={}, timings_s={},
                                versions={}, delta={"base": str((root / base).resolve())} if base else {})
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest.to_dict()))
    (root / f"{name}.ett-timeline.png").write_bytes(b"png")
    return folder


def test_retention_keeps_the_last_snapshots_the_current_one_and_every_base_their_deltas_need():
    # r2 and r3 are deltas down to r1; r5 a delta on r4; "hand" was published by hand (no lineage)
    snapshots = {"r0": Snapshot(), "r1": Snapshot(), "r2": Snapshot(base="r1"), "r3": Snapshot(base="r2"),
                 "r4": Snapshot(), "r5": Snapshot(base="r4"), "hand": Snapshot()}
    names = ["r6-no-folder", "r5", "r5", "r4", "r3", "r2", "r1", "r0"]  # newest first; r6 published nothing
    lineage = [(name, True) for name in names]  # all published
    # keep 1 (r5, and r4 its base); r3 current (and r2, r1 its chain); only r0 goes
    assert doomed_snapshots(snapshots, lineage, keep=1, protected={"r5", "r3"}) == ["r0"]
    assert doomed_snapshots(snapshots, lineage, keep=1, protected={"r5"}) == ["r0", "r1", "r2", "r3"]
    assert doomed_snapshots(snapshots, lineage, keep=2, protected=set()) == ["r0", "r1", "r2", "r3"]
    assert doomed_snapshots(snapshots, lineage, keep=3, protected=set()) == ["r0"]  # r3's chain
    assert doomed_snapshots(snapshots, [], keep=1, protected=set()) == []  # nothing of the model's own
    # gated snapshots (never served) do not count towards `keep`: r4 and r5 gated, r3 is the last published
    gated = [(name, name not in ("r4", "r5")) for name in names]
    assert doomed_snapshots(snapshots, gated, keep=1, protected={"r5"}) == ["r0"]  # r5 this run's, r3 kept
    # a snapshot the lineage does not name keeps its base: "hand" published as a delta on r0
    by_hand = {**snapshots, "hand": Snapshot(base="r0")}
    assert doomed_snapshots(by_hand, lineage, keep=1, protected={"r5", "r3"}) == []
    # a kept snapshot whose manifest cannot be read: its chain is unknown, nothing goes
    unread = {**snapshots, "r5": Snapshot(readable=False)}
    assert doomed_snapshots(unread, lineage, keep=1, protected=set()) == []
    assert doomed_snapshots({**snapshots, "hand": Snapshot(readable=False)}, lineage, keep=1, protected=set()) == []
    # one that is not kept goes like any other
    unread = {**snapshots, "r0": Snapshot(readable=False)}
    assert doomed_snapshots(unread, lineage, keep=1, protected={"r5", "r3"}) == ["r0"]
    # a base that is gone (removed by hand) ends the walk
    assert doomed_snapshots({"r5": Snapshot(base="r4"), "r3": Snapshot()}, [("r5", True), ("r3", True)], keep=1,
                            protected=set()) == ["r3"]


def test_the_snapshot_root_is_read_and_a_snapshot_removed_with_its_picture(tmp_path):
    root = tmp_path / "snap"
    write_snapshot(root, "a")
    write_snapshot(root, "b", base="a")
    (write_snapshot(root, "c") / MANIFEST_FILE).write_text("{not json")
    (write_snapshot(root, "d") / MANIFEST_FILE).write_text("[]")  # JSON, not a manifest
    (root / "not-a-snapshot").mkdir()
    for name in (".a.tmp-1-0", ".z.old-2-1", ".backup.old-2023", ".cache"):  # the last two are not a publish's
        (root / name).mkdir()
    (root / "current").write_text("{}")
    assert read_snapshots(root) == {"a": Snapshot(), "b": Snapshot(base="a"), "c": Snapshot(readable=False),
                                    "d": Snapshot(readable=False)}
    assert [p.name for p in staging_folders(root)] == [".a.tmp-1-0", ".z.old-2-1"]
    remove_snapshot(root, "a")
    remove_snapshot(root, "gone")  # already removed: nothing to do
    assert not (root / "a").exists() and not (root / "a.ett-timeline.png").exists()
    assert [p.name for p in staging_folders(root)] == [".a.tmp-1-0", ".z.old-2-1"]  # nothing half-removed left
    assert (root / "b").is_dir() and (root / "b.ett-timeline.png").exists()
    assert read_snapshots(tmp_path / "none") == {} and staging_folders(tmp_path / "none") == []


def test_prune_snapshots_removes_only_what_the_policy_dooms_and_stale_staging(tmp_path, flow_data):
    from ettflow.publish.current import current_file
    from ettflow.tasks.retention import ABANDONED_AFTER_S, PrunedSnapshots, apply_snapshot_retention

    url = f"sqlite:///{tmp_path / 'w.db'}"
    plan = plan_refresh(params(flow_data, tmp_path, warehouse_url=url, keep_snapshots=1), run_id="now")
    root = plan.snapshot_root
    for name, base in (("a", None), ("b", "a"), ("c", None), ("now", None), ("by-hand", None)):
        write_snapshot(root, name, base=base)
    with Warehouse.open(url) as wh:
        for t, (run, outcome) in enumerate((("a", Outcome.PUBLISHED), ("b", Outcome.PUBLISHED),
                                            ("c", Outcome.GATED), ("now", Outcome.GATED))):
            wh.record_lineage(LineageRecord(model="dlrm", run_id=run, windows=("w",), outcome=outcome,
                                            snapshot=str(root / run), created_at=t, finished_at=t))
    current_file(root).write_text(json.dumps({"snapshot": "b", "path": str(root / "b"), "anchor": None,
                                              "moved_at": 1.0}))
    old = time.time() - ABANDONED_AFTER_S - 60
    for stale in (root / ".x.tmp-1-0", root / ".y.tmp-1-1"):
        (stale / "part").mkdir(parents=True)
    for p in (root / ".x.tmp-1-0" / "part", root / ".x.tmp-1-0"):
        os.utime(p, (old, old))  # .y is a publish under way: kept
    # keep 1: this run's; b is current, a its base; c goes; by-hand is not the model's refresh
    assert apply_snapshot_retention(plan) == PrunedSnapshots(removed=["c"], kept=4, staging=1, unreadable=[])
    assert sorted(p.name for p in root.iterdir()) == [
        ".y.tmp-1-1", "a", "a.ett-timeline.png", "b", "b.ett-timeline.png", "by-hand", "by-hand.ett-timeline.png",
        "current", "now", "now.ett-timeline.png"]
    # an unreadable manifest kept by the policy (by-hand: not the model's) blocks every removal, and says so
    (root / "by-hand" / MANIFEST_FILE).write_text("{torn")
    write_snapshot(root, "c")
    assert apply_snapshot_retention(plan) == PrunedSnapshots(removed=[], kept=5, staging=0, unreadable=["by-hand"])
    # an unreadable `current`: nothing is removed (the task says so)
    current_file(root).write_text("{torn")
    with pytest.raises(PublishError, match="current"):
        apply_snapshot_retention(plan)
    assert (root / "c").is_dir()


def test_a_delta_on_a_base_deep_in_its_chain_or_on_a_broken_chain_is_refused_for_a_full_snapshot(tmp_path):
    """A base REBASE_AFTER deltas deep gives a full snapshot (the chain's new base: a continuous
    refresh publishing delta after delta reached MAX_CHAIN and failed every publish after it);
    so does a base whose chain cannot be read (a link gone, a loop), refused before any model
    is read."""
    from ettflow.publish.delta_snapshot import (
        MAX_CHAIN,
        REBASE_AFTER,
        DeltaSnapshotRefused,
        NewBase,
        delta_depth,
        write_delta_snapshot,
    )

    root = tmp_path / "snap"
    write_snapshot(root, "d0")
    for i in range(1, REBASE_AFTER + 1):
        write_snapshot(root, f"d{i}", base=f"d{i - 1}")
    assert [delta_depth(root / f"d{i}") for i in (0, 1, REBASE_AFTER)] == [0, 1, REBASE_AFTER]
    never_read = tmp_path / "new-model.pt"  # does not exist: the refusal comes first

    def delta_on(base: str) -> None:
        write_delta_snapshot(root / base, never_read, tmp_path / "pack", rebuilt=tmp_path / "rebuilt.pt")

    with pytest.raises(NewBase, match=f"{REBASE_AFTER} deltas deep"):
        delta_on(f"d{REBASE_AFTER}")
    write_snapshot(root, "orphan", base="gone")
    with pytest.raises(DeltaSnapshotRefused, match="cannot be materialized") as refused:
        delta_on("orphan")
    assert not isinstance(refused.value, NewBase)
    write_snapshot(root, "loop", base="loop")
    with pytest.raises(PublishError, match=f"over {MAX_CHAIN}"):
        delta_depth(root / "loop")
    with pytest.raises(DeltaSnapshotRefused, match="cannot be materialized"):
        delta_on("loop")


def test_the_publish_task_says_how_a_snapshot_asked_to_be_a_delta_was_stored():
    from ettflow.tasks.publish import stored_as

    assert stored_as({}) is None  # full, as asked
    assert stored_as({"base": "/s/r1", "base_run_id": "r1", "changed_rows": 5, "rows": 1664, "bytes": 900,
                      "full_bytes": 8000}) == ("stored as a delta on r1: 5 of 1664 rows changed, 900 bytes against "
                                               "8000 for the full module")
    assert stored_as({"refused": "the base is 16 deltas deep", "new_base": True}) == \
        "stored full: the base is 16 deltas deep"
    assert stored_as({"refused": "the base cannot be materialized (x)", "new_base": False}) == \
        "stored full, not as a delta: the base cannot be materialized (x)"


def test_a_prune_that_fails_leaves_the_refresh_as_it_ended(tmp_path, flow_data, monkeypatch, caplog):
    """Retention runs after the lineage is recorded: whatever stops it (a bug, the disk) is a
    warning with what stopped it, never the run's failure (a published refresh stays published)."""
    import logging

    from ettflow.tasks import retention

    plan = plan_refresh(params(flow_data, tmp_path), run_id="now")
    monkeypatch.setattr(retention, "get_run_logger", lambda: logging.getLogger("ettflow.test"))

    def broken(plan, refreshes):
        raise ValueError("too many values to unpack (expected 2)")

    def disk(plan, refreshes):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(retention, "model_lineage", lambda plan: [])
    for name, fails in (("apply_snapshot_retention", broken), ("apply_retention", disk)):
        monkeypatch.setattr(retention, name, fails)
    with caplog.at_level(logging.WARNING, logger="ettflow.test"):
        assert retention.prune_snapshots.fn(plan) == [] and retention.prune_checkpoints.fn(plan) == []
    snapshots, checkpoints = (r.getMessage() for r in caplog.records)
    assert "prune-snapshots: model dlrm: stopped by Traceback" in snapshots and "ValueError: too many" in snapshots
    assert checkpoints == ("prune-checkpoints: model dlrm: stopped by OSError: [Errno 5] Input/output error; the "
                           "next refresh prunes again")
