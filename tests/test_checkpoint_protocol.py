"""Commit protocol, verification, retention and async behaviour of CheckpointManager, in one
process (no process group: DCP runs with no_dist). The sharded TorchRec state is covered by
test_checkpoint_torchrec.py."""

from __future__ import annotations

import json
import random
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import ettflow.trainer.checkpoint.manager as manager_mod
from ettflow.trainer.checkpoint import (
    CheckpointConfig,
    CheckpointError,
    CheckpointManager,
    TornCheckpointError,
    TrainState,
    verify,
)
from ettflow.trainer.checkpoint.layout import COMMITTED, DCP_METADATA, MANIFEST, final_dir
from ettflow.trainer.checkpoint.verify import _canonical_sha

# DCP warns that it saves "in a single process" without a process group: that is the point.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def make_state(seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    return TrainState(model=model, optimizers={"dense": torch.optim.Adam(model.parameters(), lr=0.01)})


def train(state: TrainState, steps: range) -> None:
    for s in steps:
        g = torch.Generator().manual_seed(s)
        x, y = torch.rand(8, 4, generator=g), torch.rand(8, 1, generator=g)
        state.optimizers["dense"].zero_grad()
        nn.functional.mse_loss(state.model(x), y).backward()
        state.optimizers["dense"].step()
        state.step = s + 1
        state.cursor = {"row": 8 * (s + 1)}


def snapshot(state: TrainState) -> dict:
    optim = state.optimizers["dense"].state_dict()["state"]
    return {
        "model": {k: v.clone() for k, v in state.model.state_dict().items()},
        "optim": {i: {k: v.clone() for k, v in st.items()} for i, st in optim.items()},
    }


def assert_same(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["optim"].keys() == b["optim"].keys()
    for i in a["optim"]:
        for k in a["optim"][i]:
            assert torch.equal(a["optim"][i][k], b["optim"][i][k]), (i, k)


def manager(root: Path, mode: str = "sync", **kw) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(root=root, mode=mode, **kw))


def test_config_rejects_bad_values_and_says_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="mode must be one of"):
        CheckpointConfig(root=tmp_path, mode="fast")
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        CheckpointConfig(root=tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="root must be a folder path"):
        CheckpointConfig(root="  ")
    with pytest.raises(TypeError):
        CheckpointConfig(tmp_path)  # keyword-only
    with pytest.raises(TypeError, match="optimizers must be a non-empty mapping"):
        TrainState(model=nn.Linear(1, 1), optimizers=torch.optim.SGD(nn.Linear(1, 1).parameters()))
    with pytest.raises(CheckpointError, match="JSON-serializable"):
        state = make_state()
        state.cursor = {"at": object()}
        manager(tmp_path).save(1, state)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_save_and_load_restores_model_optimizer_step_cursor_and_rng(tmp_path, mode):
    state = make_state()
    train(state, range(3))
    saved = snapshot(state)
    with manager(tmp_path, mode) as mgr:
        result = mgr.save(3, state)
        draws = (torch.rand(3), np.random.rand(3), random.random())
        train(state, range(3, 5))  # moves on after the save
        done = result.commit_result()
        assert done.committed and done.path == final_dir(tmp_path, 3) and done.nbytes > 0
        assert result.blocking_s >= 0 and done.background_s >= 0
        assert done.background_start >= result.blocking_end - 1e-6

        fresh = make_state(seed=1)
        assert not fresh.optimizers["dense"].state  # Adam's state is lazy: restore creates it
        restored = mgr.restore_latest(fresh)
    assert restored.checkpoint.step == 3 and restored.duration_s >= 0
    assert restored.checkpoint.cursors == ({"row": 24},)
    assert fresh.step == 3 and fresh.cursor == {"row": 24}
    assert_same(saved, snapshot(fresh))
    assert torch.equal(draws[0], torch.rand(3))
    assert np.array_equal(draws[1], np.random.rand(3))
    assert draws[2] == random.random()
    # continuing from the restore is bitwise the uninterrupted run
    train(fresh, range(3, 5))
    assert_same(snapshot(state), snapshot(fresh))


class GatedWriter(manager_mod.FileSystemWriter):
    """A FileSystemWriter whose data write waits for `gate` (or fails when `fail` is set)."""

    gate = threading.Event()
    fail = False

    def write_data(self, plan, planner):
        assert self.gate.wait(timeout=60), "test gate never opened"
        if GatedWriter.fail:
            raise OSError("disk full (scripted)")
        return super().write_data(plan, planner)


@pytest.fixture
def gated(monkeypatch):
    GatedWriter.gate = threading.Event()
    GatedWriter.fail = False
    monkeypatch.setattr(manager_mod, "FileSystemWriter", GatedWriter)
    yield GatedWriter
    GatedWriter.gate.set()


def test_async_save_returns_after_staging_and_commits_in_the_background(tmp_path, gated):
    events = []
    state = make_state()
    train(state, range(2))
    saved = snapshot(state)
    mgr = CheckpointManager(CheckpointConfig(root=tmp_path, mode="async"), on_commit=events.append)
    result = mgr.save(2, state)
    # the write is held back by the gate: save returned before it, nothing is committed yet
    assert not result.done()
    assert mgr.latest() is None and not final_dir(tmp_path, 2).exists()
    with torch.no_grad():  # training mutates the parameters while the write is pending
        for p in state.model.parameters():
            p.add_(1.0)
    gated.gate.set()
    done = mgr.wait()
    assert done.committed and events == [done] and done.background_end >= done.background_start
    assert mgr.latest().step == 2
    fresh = make_state(seed=3)
    mgr.load(fresh, final_dir(tmp_path, 2))
    assert_same(saved, snapshot(fresh))  # the staged copy, not the later mutation
    mgr.close()


def test_failed_async_write_is_raised_once_and_never_committed(tmp_path, gated):
    mgr = manager(tmp_path, "async")
    state = make_state()
    gated.fail = True
    gated.gate.set()
    mgr.save(1, state)
    with pytest.raises(CheckpointError, match="step 1 failed: .*disk full"):
        mgr.wait()
    assert mgr.latest() is None
    gated.fail = False
    assert mgr.save(2, state).commit_result().committed  # the next save still works
    mgr.close()
    assert [i.step for i in mgr.scan().committed] == [2]


def _remove_committed(path: Path) -> None:
    (path / COMMITTED).unlink()


def _delete_storage_file(path: Path) -> None:
    next(path.glob("*.distcp")).unlink()


def _truncate_storage_file(path: Path) -> None:
    f = next(path.glob("*.distcp"))
    f.write_bytes(f.read_bytes()[:-7])


def _delete_dcp_metadata(path: Path) -> None:
    (path / DCP_METADATA).unlink()


def _edit_manifest(path: Path) -> None:
    m = json.loads((path / MANIFEST).read_text())
    m["step"] = 999
    (path / MANIFEST).write_text(json.dumps(m))


@pytest.mark.parametrize(
    ("tear", "reason"),
    [
        (_remove_committed, "no COMMITTED marker"),
        (_delete_storage_file, r"storage file __0_0.distcp is missing"),
        (_truncate_storage_file, r"has \d+ bytes, the manifest recorded \d+"),
        (_delete_dcp_metadata, r"storage file .metadata is missing"),
        (_edit_manifest, "does not match its own sha256"),
    ],
)
def test_torn_checkpoint_is_reported_and_the_previous_one_is_used(tmp_path, tear, reason, caplog):
    state = make_state()
    mgr = manager(tmp_path, keep_last=3)
    train(state, range(1))
    mgr.save(1, state)
    before = snapshot(state)
    train(state, range(1, 2))
    mgr.save(2, state)
    tear(final_dir(tmp_path, 2))
    (tmp_path / "step_0000000003.tmp").mkdir()  # a save that crashed before committing

    found = mgr.scan()
    assert [i.step for i in found.committed] == [1]
    problems = {p.step: p.reason for p in found.problems}
    assert set(problems) == {2, 3}
    assert re.search(reason, problems[2]), problems[2]
    assert "never committed" in problems[3]
    with caplog.at_level("WARNING"):
        assert mgr.latest().step == 1
    assert str(final_dir(tmp_path, 2)) in caplog.text

    with pytest.raises(CheckpointError, match="refusing to restore .*torn or partial"):
        mgr.load(make_state(), final_dir(tmp_path, 2))
    fresh = make_state(seed=5)
    assert mgr.restore_latest(fresh).checkpoint.step == 1
    assert_same(before, snapshot(fresh))


def test_checksums_catch_a_flipped_byte_that_sizes_miss(tmp_path):
    for checksum, root in ((False, tmp_path / "sizes"), (True, tmp_path / "sha")):
        mgr = manager(root, checksum_data_files=checksum)
        mgr.save(1, make_state())
        f = next(final_dir(root, 1).glob("*.distcp"))
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
        if checksum:
            with pytest.raises(TornCheckpointError, match="does not match its sha256"):
                verify(final_dir(root, 1))
        else:
            assert verify(final_dir(root, 1)).step == 1


def test_keep_last_k_deletes_older_checkpoints_and_stale_folders(tmp_path):
    mgr = manager(tmp_path, keep_last=2)
    state = make_state()
    (tmp_path / "step_0000000000.tmp").mkdir()  # left by a crashed attempt
    for step in range(1, 6):
        mgr.save(step, state)
        kept = sorted(p.name for p in tmp_path.iterdir())
        assert kept == [final_dir(tmp_path, s).name for s in range(max(1, step - 1), step + 1)]
    # a replayed step (restart from an older checkpoint) replaces the folder it finds
    mgr.save(5, state)
    assert [i.step for i in mgr.scan().committed] == [4, 5]


def test_restore_refuses_a_checkpoint_of_another_world_size(tmp_path):
    mgr = manager(tmp_path)
    mgr.save(1, make_state())
    path = final_dir(tmp_path, 1)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest.pop("manifest_sha256")
    manifest["world_size"] = 2
    digest = _canonical_sha(manifest)
    (path / MANIFEST).write_text(json.dumps({**manifest, "manifest_sha256": digest}))
    (path / COMMITTED).write_text(digest)
    with pytest.raises(CheckpointError, match="written by 2 ranks, this job has 1"):
        mgr.load(make_state(), path)
