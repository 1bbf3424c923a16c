"""Commit protocol, verification, retention and async behaviour of CheckpointManager, in one
process (no process group: DCP runs with no_dist). The sharded TorchRec state is covered by
test_checkpoint_torchrec.py."""

from __future__ import annotations

import errno
import importlib
import json
import os
import pickle
import random
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import ettflow.trainer.checkpoint.manager as manager_mod
import ettflow.trainer.checkpoint.staging as staging_mod
from ettflow.trainer.checkpoint import (
    CheckpointConfig,
    CheckpointError,
    CheckpointManager,
    CheckpointStorageError,
    TornCheckpointError,
    TrainState,
    make_stager,
    verify,
)
from ettflow.trainer.checkpoint.layout import COMMITTED, DCP_METADATA, MANIFEST, final_dir
from ettflow.trainer.checkpoint.verify import _canonical_sha

from helpers.forged import forge_metadata

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
        # Python's generator as a whole state, read at once: the suite's worker holds threads of
        # earlier tests that may draw from it (a draw compared after the restore failed once in
        # the suite, 1 of 4 runs, never alone), and a state read at once leaves them no window
        py_state = random.getstate()
        draws = (torch.rand(3), np.random.rand(3))
        train(state, range(3, 5))  # moves on after the save
        done = result.commit_result()
        assert done.committed and done.path == final_dir(tmp_path, 3) and done.nbytes > 0
        assert result.blocking_s >= 0 and done.background_s >= 0
        assert done.background_start >= result.blocking_end - 1e-6

        fresh = make_state(seed=1)
        assert not fresh.optimizers["dense"].state  # Adam's state is lazy: restore creates it
        restored = mgr.restore_latest(fresh)
        assert random.getstate() == py_state
    assert restored.checkpoint.step == 3 and restored.duration_s >= 0
    assert restored.checkpoint.cursors == ({"row": 24},)
    assert fresh.step == 3 and fresh.cursor == {"row": 24}
    assert_same(saved, snapshot(fresh))
    assert torch.equal(draws[0], torch.rand(3))
    assert np.array_equal(draws[1], np.random.rand(3))
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


@pytest.fixture
def gated_staging(monkeypatch):
    """Async staging whose copy (DCP's `DefaultStager._stage`, on the staging thread) starts only
    when `gate` is set: the save cannot finish staging before the test looks (holding the
    rebuild after the copy instead raced with a copy that ended before `stage` returned)."""
    gate = threading.Event()
    copy = staging_mod.ShardedTensorStager._stage

    def held(self, state_dict, **kwargs):
        assert gate.wait(timeout=60), "test gate never opened"
        return copy(self, state_dict, **kwargs)

    monkeypatch.setattr(staging_mod.ShardedTensorStager, "_stage", held)
    yield gate
    gate.set()


def test_async_staging_hands_off_and_an_update_after_wait_staged_never_reaches_the_checkpoint(
        tmp_path, gated_staging):
    state = make_state()
    train(state, range(2))
    saved = snapshot(state)
    mgr = CheckpointManager(CheckpointConfig(root=tmp_path, mode="async"), async_staging=True)
    result = mgr.save(2, state)
    # save returned while the copy is still held back: only the hand-off blocked
    assert result.staged_async and not result.staged() and not result.done()
    gated_staging.set()
    waited = mgr.wait_staged()
    assert waited.step == 2 and waited.end >= waited.start and result.staged()
    assert mgr.wait_staged() is None  # one wait per staged save
    train(state, range(2, 3))  # backward and Adam step mutate parameters and moments in place
    with torch.no_grad():
        for p in state.model.parameters():
            p.add_(1.0)
    assert mgr.wait().committed
    fresh = make_state(seed=3)
    mgr.load(fresh, final_dir(tmp_path, 2))
    assert_same(saved, snapshot(fresh))  # the staged copy, none of the later updates
    # the next save stages into the same host buffers and saves the new values
    saved3 = snapshot(state)
    mgr.save(3, state)
    assert mgr.wait_staged().step == 3
    train(state, range(3, 4))
    mgr.close()
    fresh = make_state(seed=4)
    mgr.load(fresh, final_dir(tmp_path, 3))
    assert_same(saved3, snapshot(fresh))


def test_sync_staging_has_nothing_to_wait_for_and_async_staging_needs_async_mode(tmp_path):
    state = make_state()
    mgr = manager(tmp_path, "async")
    result = mgr.save(1, state)
    assert not result.staged_async and result.staged() and mgr.wait_staged() is None
    mgr.close()
    with pytest.raises(ValueError, match="async_staging needs CheckpointConfig\\(mode='async'\\)"):
        CheckpointManager(CheckpointConfig(root=tmp_path, mode="sync"), async_staging=True)


@pytest.mark.parametrize("async_staging", [False, True])
def test_the_stager_reuses_its_host_buffers_from_one_save_to_the_next(async_staging):
    weights = torch.arange(1000, dtype=torch.float32)
    stager = make_stager(async_staging=async_staging)

    def stage() -> torch.Tensor:
        staged = stager.stage({"w": weights})
        return (staged.result() if async_staging else staged)["w"]

    first = stage()
    weights.add_(1.0)
    second = stage()
    stager.close()
    assert second.data_ptr() == first.data_ptr()  # the same buffer, no new allocation
    assert torch.equal(second, torch.arange(1000, dtype=torch.float32) + 1)  # holding the new copy
    assert second.data_ptr() != weights.data_ptr()


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


def test_every_file_is_checksummed_and_a_flipped_byte_is_caught(tmp_path):
    mgr = manager(tmp_path)
    mgr.save(1, make_state())
    path = final_dir(tmp_path, 1)
    listed = json.loads((path / MANIFEST).read_text())["files"]
    on_disk = sorted(p.name for p in path.iterdir() if p.name not in (MANIFEST, COMMITTED))
    assert sorted(listed) == on_disk and DCP_METADATA in listed and any(n.endswith(".distcp") for n in listed)
    assert all(len(entry["sha256"]) == 64 for entry in listed.values())
    f = next(path.glob("*.distcp"))
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(TornCheckpointError, match=r"__0_0.distcp sha256 mismatch") as caught:
        verify(path)
    assert caught.value.file == "__0_0.distcp"


def make_wide_state(seed: int = 0) -> TrainState:
    """A model whose DCP data file is well over 64 KiB (the fault matrix overwrites 64 KiB)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))
    return TrainState(model=model, optimizers={"dense": torch.optim.Adam(model.parameters(), lr=0.01)})


def overwrite_64k(f: Path) -> None:
    """Same-size damage: 64 KiB of 0xFF over the start of the file (what the user ran)."""
    size = f.stat().st_size
    with open(f, "r+b") as out:
        out.write(b"\xff" * min(64 * 1024, size))
    assert f.stat().st_size == size


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_same_size_damage_to_a_data_file_falls_back_to_the_previous_checkpoint(tmp_path, mode, caplog):
    state = make_wide_state()
    train_wide = [torch.rand(8, 128, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    with manager(tmp_path, mode) as mgr:
        state.model(train_wide[0]).sum().backward()
        state.optimizers["dense"].step()
        mgr.save(20, state)
        mgr.wait()
        at20 = snapshot(state)
        state.model(train_wide[1]).sum().backward()
        state.optimizers["dense"].step()
        mgr.save(40, state)
        mgr.wait()
    f = final_dir(tmp_path, 40) / "__0_0.distcp"
    assert f.stat().st_size > 64 * 1024
    overwrite_64k(f)

    mgr = manager(tmp_path)
    found = mgr.scan()
    assert [i.step for i in found.committed] == [20]
    (problem,) = found.problems
    assert (problem.step, problem.file, problem.fallback) == (40, "__0_0.distcp", 20)
    with caplog.at_level("WARNING"):
        fresh = make_wide_state(seed=9)
        assert mgr.restore_latest(fresh).checkpoint.step == 20
    assert re.search(r"checkpoint step 40 \(.*step_0000000040\): __0_0.distcp sha256 mismatch.*: skipped, "
                     r"restoring step 20", caplog.text), caplog.text
    assert_same(at20, snapshot(fresh))
    with pytest.raises(CheckpointError, match="refusing to restore .*__0_0.distcp sha256 mismatch"):
        mgr.load(make_wide_state(), final_dir(tmp_path, 40))


@pytest.mark.parametrize("resealed", [False, True])
def test_a_tampered_metadata_file_is_refused_before_it_is_unpickled(tmp_path, resealed):
    mgr = manager(tmp_path / "ckpt")
    mgr.save(1, make_state())
    path = final_dir(tmp_path / "ckpt", 1)
    marker = tmp_path / "code-ran"
    forge_metadata(path, marker, resealed=resealed)
    if resealed:  # the checksums match: the restricted reader still refuses the forged pickle
        assert verify(path).step == 1
        expected = r"refusing to read .*\.metadata: (io|builtins)\.open is not a type a DCP metadata file holds"
    else:  # the checksum check comes first: the file is never opened as a pickle
        assert [p.file for p in mgr.scan().problems] == [DCP_METADATA]
        expected = r"refusing to restore .*\.metadata (sha256 mismatch|has \d+ bytes)"
    with pytest.raises(CheckpointError, match=expected):
        mgr.load(make_state(), path)
    assert not marker.exists()


def test_per_rank_state_is_json_and_tensors_and_loads_without_pickle(tmp_path, monkeypatch):
    import ettflow.trainer.checkpoint.state as state_mod
    from ettflow.trainer.checkpoint.reading import read_dcp_metadata

    source = Path(state_mod.__file__).read_text()
    assert "pickle" not in vars(state_mod) and "import pickle" not in source
    state = make_state()
    train(state, range(2))
    random.random()  # python and numpy RNG states must round-trip through JSON exactly
    np.random.normal()
    saved = snapshot(state)
    mgr = manager(tmp_path)
    mgr.save(2, state)
    py_state = random.getstate()  # (a whole state, read at once: see the test above)
    draws = (torch.rand(2), np.random.rand(2))
    meta = read_dcp_metadata(final_dir(tmp_path, 2)).state_dict_metadata
    assert {k for k in meta if k.startswith("rank_")} == {"rank_0_state", "rank_0_rng_torch"}
    assert all(meta[k].properties.dtype == torch.uint8 for k in ("rank_0_state", "rank_0_rng_torch"))

    def no_pickle(*args, **kwargs):
        raise AssertionError("pickle used while restoring a checkpoint")

    weights_only = []
    real_load = torch.load

    def checked_load(*args, **kwargs):
        weights_only.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(pickle, "load", no_pickle)
    monkeypatch.setattr(pickle, "loads", no_pickle)
    monkeypatch.setattr(torch, "load", checked_load)
    fresh = make_state(seed=4)
    mgr.restore_latest(fresh)
    assert random.getstate() == py_state
    monkeypatch.undo()
    assert weights_only and set(weights_only) == {True}  # tensors and the optimizer's param_groups
    assert fresh.step == 2 and fresh.cursor == {"row": 16}
    assert_same(saved, snapshot(fresh))
    assert torch.equal(draws[0], torch.rand(2)) and np.array_equal(draws[1], np.random.rand(2))


def test_leftover_tmp_folders_are_removed_at_the_next_start_and_committed_ones_kept(tmp_path, caplog):
    mgr = manager(tmp_path)
    mgr.save(1, make_state())
    (tmp_path / "step_0000000002.tmp").mkdir()
    (tmp_path / "step_0000000002.tmp" / "__0_0.distcp").write_bytes(b"x" * 100)
    (tmp_path / "step_0000000000.trash").mkdir()
    with caplog.at_level("DEBUG"):  # routine after a kill: logged, not on the console
        manager(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [final_dir(tmp_path, 1).name]
    assert verify(final_dir(tmp_path, 1)).step == 1
    assert "removing " + str(tmp_path / "step_0000000002.tmp") in caplog.text
    assert "removing " + str(tmp_path / "step_0000000000.trash") in caplog.text


def _fail_in_write(monkeypatch, path_holder: list) -> None:
    class FullDiskWriter(manager_mod.FileSystemWriter):
        def write_data(self, plan, planner):
            target = Path(str(self.path)) / "__0_0.distcp"
            target.write_bytes(b"half")  # what a full disk leaves: part of a file
            path_holder.append(str(target))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))

    monkeypatch.setattr(manager_mod, "FileSystemWriter", FullDiskWriter)


def _fail_in_seal(monkeypatch, path_holder: list) -> None:
    verify_mod = importlib.import_module("ettflow.trainer.checkpoint.verify")  # the package exports `verify`

    def full_disk(path, text):
        path_holder.append(str(path))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(verify_mod, "atomic_write_text", full_disk)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("fail", [_fail_in_write, _fail_in_seal])
def test_a_full_disk_is_a_storage_error_with_the_path_and_never_looks_committed(tmp_path, monkeypatch, mode, fail):
    state = make_state()
    mgr = manager(tmp_path, mode)
    mgr.save(1, state)
    mgr.wait()
    failed_path: list[str] = []
    fail(monkeypatch, failed_path)
    with pytest.raises(CheckpointStorageError) as caught:
        mgr.save(2, state)
        mgr.wait()
    error = caught.value
    assert isinstance(error, OSError) and isinstance(error, CheckpointError)
    assert error.errno == errno.ENOSPC and error.filename == failed_path[0]
    assert failed_path[0] in str(error) and "step 2" in str(error)
    # never torn: no folder of step 2 at all (the .tmp one is removed), step 1 untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == [final_dir(tmp_path, 1).name]
    assert [i.step for i in mgr.scan().committed] == [1]
    monkeypatch.undo()
    assert mgr.save(3, state).commit_result().committed  # space came back: saves work again
    mgr.close()
    copy = pickle.loads(pickle.dumps(error))  # crosses Ray with errno and path
    assert (type(copy), copy.errno, copy.filename) == (CheckpointStorageError, errno.ENOSPC, failed_path[0])


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
