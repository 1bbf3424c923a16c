"""Checkpoints a restart can trust: DCP saves (sync, or async with host-memory staging) of
the sharded TorchRec model, its fused and dense optimizer state, the step, the data cursor
and RNG state, committed only once complete, every file checksummed (sha256), verified
before a restore and read without running code from the folder. See `manager.py`."""

from ettflow.trainer.checkpoint.catalog import CheckpointProblem, CheckpointScan
from ettflow.trainer.checkpoint.config import (
    CheckpointConfig,
    CheckpointError,
    CheckpointStorageError,
    TornCheckpointError,
)
from ettflow.trainer.checkpoint.manager import CheckpointManager
from ettflow.trainer.checkpoint.results import CommitResult, RestoreResult, SaveResult, StagingWait
from ettflow.trainer.checkpoint.staging import ShardedTensorStager, make_stager
from ettflow.trainer.checkpoint.state import TrainState, init_lazy_optimizer_state
from ettflow.trainer.checkpoint.verify import CheckpointInfo, verify

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
