"""The durable tier verified while the memory tier serves a recovery (trainer/group/durable_audit.py):
real checkpoints written by the CheckpointManager, one damaged, found and recorded once. The
recovery itself (driver, keeper, ranks) runs in e2e/test_trainer_faults.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ettflow.ett.archive import damage_tags
from ettflow.ett.spool import read_spool
from ettflow.trainer.checkpoint import CheckpointConfig, CheckpointManager, TrainState
from ettflow.trainer.checkpoint.layout import final_dir
from ettflow.trainer.group.durable_audit import MEMORY_RECOVERY, DurableAudit

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def saved(root, steps) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    state = TrainState(model=model, optimizers={"dense": torch.optim.SGD(model.parameters(), lr=0.1)})
    mgr = CheckpointManager(CheckpointConfig(root=root, mode="sync", keep_last=5))
    for step in steps:
        state.step = step
        mgr.save(step, state)


def test_a_damaged_durable_checkpoint_is_recorded_once_with_what_a_restart_would_restore(tmp_path, caplog):
    root, spool = tmp_path / "checkpoints", tmp_path / "spool"
    saved(root, (5, 10))
    shard = next(final_dir(root, 10).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-3])  # cut short after its commit
    audit = DurableAudit(root, spool, "run-a")
    with caplog.at_level("WARNING", logger="ettflow.trainer"):
        assert audit.start(attempt=1, served_step=12)
        audit.join()
        assert [p.step for p in audit.check(attempt=2, served_step=14)] == []  # once per run
    (marker,) = [e for e in read_spool(spool, "run-a").events if e.phase == "checkpoint_damaged"]
    assert (marker.attempt, marker.info.damaged_step, marker.info.restored_step) == (1, 10, 5)
    assert marker.info.noticed == MEMORY_RECOVERY and marker.info.file == shard.name
    assert "durable checkpoint step 10 is damaged" in caplog.text and "a restart would restore step 5" in caplog.text
    assert damage_tags([marker]) == {"checkpoint_damaged": [{
        "attempt": 1, "damaged_step": 10, "restored_step": 5, "file": shard.name, "noticed": MEMORY_RECOVERY}]}


def test_intact_checkpoints_and_a_save_still_writing_are_no_damage(tmp_path):
    root, spool = tmp_path / "checkpoints", tmp_path / "spool"
    saved(root, (5, 10))
    (root / "step_0000000015.tmp").mkdir()  # a background save not committed yet
    assert DurableAudit(root, spool, "run-b").check(attempt=1, served_step=16) == []
    assert not (spool / "run-b").exists()
