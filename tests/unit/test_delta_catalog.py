"""Delta checkpoints in a checkpoint root (issue 28): what the scan verifies, which chain a
restore reads, what retention keeps and deletes, what the driver's choice by name sees. Real
folders: bases saved by `CheckpointManager` (one process), deltas packed and sealed by
`delta.py` (their tensors do not matter here)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from ettflow.trainer.checkpoint import CheckpointConfig, CheckpointManager, TrainState
from ettflow.trainer.checkpoint.catalog import prune, remove_uncommitted, scan
from ettflow.trainer.checkpoint.delta import commit_digest, seal_delta, write_pack
from ettflow.trainer.checkpoint.layout import delta_dir, final_dir
from ettflow.trainer.group.restore_choice import newest_committed

# DCP warns that it saves "in a single process" without a process group: that is the point.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def base(root: Path, step: int) -> Path:
    model = nn.Linear(3, 2)
    state = TrainState(model=model, optimizers={"dense": torch.optim.SGD(model.parameters(), lr=0.1)},
                       cursor={"at": step})
    with CheckpointManager(CheckpointConfig(root=root, mode="sync", keep_last=100)) as manager:
        manager.save(step, state)
    return final_dir(root, step)


def delta(root: Path, step: int, parent: Path) -> Path:
    tmp, final = delta_dir(root, step, tmp=True), delta_dir(root, step)
    write_pack(tmp, 0, {"rows": torch.arange(4.0)}, {"cursor": {"at": step}})
    seal_delta(tmp, step=step, parent=int(parent.name.split("_")[1]), parent_digest=commit_digest(parent),
               world_size=1)
    tmp.replace(final)
    return final


def damage(folder: Path) -> None:
    part = folder / "rank-0.bin"
    data = bytearray(part.read_bytes())
    data[0] ^= 0xFF
    part.write_bytes(bytes(data))


def root_with_two_chains(root: Path) -> Path:
    """base 5 <- delta 10 <- delta 15 <- delta 20 (damaged); base 25 <- delta 30."""
    b5 = base(root, 5)
    d15 = delta(root, 15, delta(root, 10, b5))
    damage(delta(root, 20, d15))
    delta(root, 30, base(root, 25))
    return root


def test_the_scan_verifies_deltas_and_the_chain_is_the_newest_whole_one(tmp_path):
    root = root_with_two_chains(tmp_path / "ckpt")
    found = scan(root)
    assert [c.step for c in found.committed] == [5, 25] and [d.step for d in found.deltas] == [10, 15, 30]
    ((step, why),) = found.damaged_deltas
    assert step == 20 and "rank-0.bin sha256 mismatch" in why
    chain = found.chain(1)
    assert (chain.base.step, [d.step for d in chain.deltas], chain.step, chain.skipped) == (25, [30], 30, None)
    assert chain.cursors == ({"at": 30},)
    assert found.chain(2).step == 25  # deltas of another world size are not used: their base is
    (problem,) = found.problems
    assert problem.damaged and problem.step == 20 and problem.fallback == 30
    assert newest_committed(root) == (30, str(delta_dir(root, 30)))  # the driver's choice, by name


def test_without_the_newer_chain_a_damaged_delta_falls_back_to_its_parent(tmp_path):
    root = root_with_two_chains(tmp_path / "ckpt")
    shutil.rmtree(final_dir(root, 25))
    chain = scan(root).chain(1)
    assert (chain.base.step, [d.step for d in chain.deltas]) == (5, [10, 15])
    assert chain.skipped == 30 and chain.why == "the chain of step 30 needs step 25, which is not there"


def test_retention_keeps_the_newest_steps_and_every_link_they_need(tmp_path):
    keep2 = root_with_two_chains(tmp_path / "keep2")
    deleted = {p.name for p in prune(keep2, keep_last=2)}  # 25 and 30: the older chain goes, damage and all
    assert deleted == {"step_0000000005", "delta_0000000010", "delta_0000000015", "delta_0000000020"}
    assert sorted(p.name for p in keep2.iterdir()) == ["delta_0000000030", "step_0000000025"]
    keep3 = root_with_two_chains(tmp_path / "keep3")
    assert prune(keep3, keep_last=3) == []  # 15 is kept, so are 10 and 5; the damaged 20 stays to be looked at
    assert scan(keep3).chain(1).step == 30


def test_a_delta_a_kill_left_uncommitted_is_removed_at_the_next_start(tmp_path):
    root = root_with_two_chains(tmp_path / "ckpt")
    write_pack(delta_dir(root, 35, tmp=True), 0, {"rows": torch.zeros(2)}, {"cursor": {}})
    assert [p.name for p in remove_uncommitted(root)] == ["delta_0000000035.tmp"]
    assert scan(root).chain(1).step == 30


def test_a_damaged_checkpoint_is_marked_once_per_attempt_however_often_a_restore_scans_it(tmp_path):
    """A full restart's rank 0 scans at its start and again when the in-memory point it was
    sent to falls to the durable tier: one `checkpoint_fallback` marker per damaged folder and
    attempt, a new attempt's writer marks it again."""
    from ettflow.ett.spool import SpoolWriter, read_spool
    from ettflow.trainer.checkpoint.catalog import CheckpointProblem, CheckpointScan
    from ettflow.trainer.checkpoint.latest import mark_fallbacks

    torn = CheckpointProblem(path=tmp_path / "delta_0000000015", step=15, reason="sha256 mismatch", file="rank-0.bin")
    found = CheckpointScan(committed=(), problems=(torn,))
    first = SpoolWriter(tmp_path / "spool", "r", 1, 0)
    mark_fallbacks(first, found)
    mark_fallbacks(first, found)
    first.close()
    second = SpoolWriter(tmp_path / "spool", "r", 2, 0)
    mark_fallbacks(second, found)
    second.close()
    marks = [(e.attempt, e.attrs["damaged_step"]) for e in read_spool(tmp_path / "spool", "r").events
             if e.phase == "checkpoint_fallback"]
    assert marks == [(1, 15), (2, 15)]
