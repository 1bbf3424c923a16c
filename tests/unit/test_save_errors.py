"""A failed save's storage cause: the OSError behind it, else the file system's own state (a
writer that lost the errno: torch's zip writer on a full disk raises a RuntimeError)."""

from __future__ import annotations

import errno
from collections import namedtuple

from ettflow.trainer.checkpoint import save_errors
from ettflow.trainer.checkpoint.config import CheckpointStorageError

Usage = namedtuple("Usage", "total used free")


def test_an_oserror_behind_the_failure_names_its_errno_and_file(tmp_path):
    try:
        try:
            raise OSError(errno.EIO, "Input/output error", str(tmp_path / "f"))
        except OSError as inner:
            raise RuntimeError("write failed") from inner
    except RuntimeError as outer:
        assert save_errors.storage_error_of(outer, tmp_path) == (errno.EIO, str(tmp_path / "f"))


def test_an_errnoless_failure_on_a_full_file_system_is_enospc_on_the_folder(tmp_path, monkeypatch):
    cut_short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    folder = tmp_path / "step_10.tmp" / "not-yet"  # not made yet: its nearest parent's file system counts
    monkeypatch.setattr(save_errors.shutil, "disk_usage", lambda p: Usage(10 << 30, 10 << 30, 4096))
    assert save_errors.storage_error_of(cut_short, folder) == (errno.ENOSPC, str(folder))
    err = save_errors.save_error("checkpoint of step 10: DCP write failed", cut_short, folder)
    assert isinstance(err, CheckpointStorageError)
    report = save_errors.failure_report("DCP write failed on rank 0", cut_short, folder, "{}")
    assert report[1:3] == (errno.ENOSPC, str(folder))
    monkeypatch.setattr(save_errors.shutil, "disk_usage", lambda p: Usage(10 << 30, 1 << 30, 9 << 30))
    assert save_errors.storage_error_of(cut_short, folder) is None  # room left: not a storage fault
    assert type(save_errors.save_error("x", cut_short, folder)).__name__ == "CheckpointError"
