"""Where a recovery resumes (`trainer/group/restore_choice.py`): a live recovery takes the newer
tier (memory wins a tie); a restart of every rank takes the in-memory copy only when it is
newer than the durable checkpoint (issue 26 #9), never a copy of the start."""

from __future__ import annotations

from ettflow.trainer.checkpoint.layout import final_dir, tmp_dir
from ettflow.trainer.group.restore_choice import choose_restore_point, newest_committed, restart_point
from ettflow.trainer.protocol import DURABLE, MEMORY, RestorePoint


def test_a_live_recovery_takes_the_newer_tier_and_memory_wins_a_tie():
    assert choose_restore_point(12, 10, "/c/10") == RestorePoint(step=12, source=MEMORY)
    assert choose_restore_point(10, 10, "/c/10") == RestorePoint(step=10, source=MEMORY)
    assert choose_restore_point(8, 10, "/c/10") == RestorePoint(step=10, source=DURABLE, path="/c/10")
    assert choose_restore_point(None, None, None) is None


def test_a_full_restart_takes_memory_only_when_it_is_newer_than_disk():
    assert restart_point(285, 200) == RestorePoint(step=285, source=MEMORY)  # the case
    assert restart_point(12, None) == RestorePoint(step=12, source=MEMORY)
    assert restart_point(200, 200) is None  # the same step: the durable checkpoint, read as before
    assert restart_point(150, 200) is None
    assert restart_point(0, None) is None  # a copy of the start: a cold or warm start is the same
    assert restart_point(None, 200) is None  # no keeper, or it is gone


def test_the_newest_committed_folder_is_found_by_name(tmp_path):
    assert newest_committed(tmp_path / "missing") is None
    for folder in (final_dir(tmp_path, 5), final_dir(tmp_path, 10), tmp_dir(tmp_path, 15)):
        folder.mkdir()
    assert newest_committed(tmp_path) == (10, str(final_dir(tmp_path, 10)))  # a .tmp is not committed


def test_a_restore_s_report_is_its_checkpoint_restore_attributes():
    from ettflow.ett.checkpoint_tier import RestoreSource
    from ettflow.trainer.rank.restore_report import ChainRead, RestoreReport

    memory = RestorePoint(step=12, source=MEMORY)
    assert RestoreReport(source=RestoreSource.MEMORY, step=12, point=memory, memory_deltas=2).to_attrs() == {
        "restore_step": 12, "restore_tier": "memory", "source": "memory", "step": 12, "memory_deltas": 2}
    durable = RestoreReport(source=RestoreSource.OWN, step=15, path="/c/10", chain=ChainRead(
        base_step=10, deltas=(15,), rows=7)).at(memory, memory_problem="checksum")
    assert durable.to_attrs() == {"restore_step": 12, "restore_tier": "memory", "source": "own", "step": 15,
                                  "path": "/c/10", "base_step": 10, "deltas": [15], "delta_rows": 7,
                                  "memory_problem": "checksum"}
    own = RestoreReport(source=RestoreSource.OWN, step=10, path="/c/10", cursor=(0, 1, 64))
    assert own.to_attrs() == {"source": "own", "step": 10, "path": "/c/10", "cursor": [0, 1, 64]}
    warm = RestoreReport(source=RestoreSource.PARENT, path="/p/20", parent_step=20, parent_world_size=4,
                         world_size=2, fingerprint="ab12")
    assert warm.to_attrs() == {"source": "parent", "path": "/p/20", "parent_step": 20, "parent_world_size": 4,
                               "world_size": 2, "fingerprint": "ab12"}
    assert warm.to_attrs()["source"] is RestoreSource.PARENT  # the enum, written as its text
