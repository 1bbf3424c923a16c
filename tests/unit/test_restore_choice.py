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
