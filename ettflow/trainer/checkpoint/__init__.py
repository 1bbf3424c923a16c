"""Checkpoints a restart can trust: DCP saves (sync, or async with host-memory staging) of
the sharded TorchRec model, its fused and dense optimizer state, the step, the data cursor
and RNG state, committed only once complete, every file checksummed (sha256), verified
before a restore and read without running code from the folder. See `manager.py`."""

from ettflow.lazy import lazy_getattr

# `verify` is also a submodule's name: imported here, so the package's attribute is the function
# (a lazy name would be shadowed by the submodule once anything imports it). It needs no torch.
from ettflow.trainer.checkpoint.verify import CheckpointInfo, verify  # noqa: E402

# The other names resolve on first use (PEP 562), so a process that only reads a checkpoint's anchor or
# catalog (a flow's, which plans and checks runs) does not import torch and DCP for it.
_WHERE = {
    "CheckpointConfig": "ettflow.trainer.checkpoint.config",
    "CheckpointError": "ettflow.trainer.checkpoint.config",
    "CheckpointManager": "ettflow.trainer.checkpoint.manager",
    "CheckpointProblem": "ettflow.trainer.checkpoint.catalog",
    "CheckpointScan": "ettflow.trainer.checkpoint.catalog",
    "CheckpointStorageError": "ettflow.trainer.checkpoint.config",
    "CommitResult": "ettflow.trainer.checkpoint.results",
    "RestoreResult": "ettflow.trainer.checkpoint.results",
    "SaveResult": "ettflow.trainer.checkpoint.results",
    "ShardedTensorStager": "ettflow.trainer.checkpoint.staging",
    "StagingWait": "ettflow.trainer.checkpoint.results",
    "TornCheckpointError": "ettflow.trainer.checkpoint.config",
    "TrainState": "ettflow.trainer.checkpoint.state",
    "init_lazy_optimizer_state": "ettflow.trainer.checkpoint.state",
    "make_stager": "ettflow.trainer.checkpoint.staging",
}


__getattr__ = lazy_getattr(__name__, globals(), _WHERE)


__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointProblem",
    "CheckpointScan",
    "CheckpointStorageError",
    "CommitResult",
    "RestoreResult",
    "SaveResult",
    "ShardedTensorStager",
    "StagingWait",
    "TornCheckpointError",
    "TrainState",
    "init_lazy_optimizer_state",
    "make_stager",
    "verify",
]
