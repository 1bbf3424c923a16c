"""What one rank builds during init and trains with: a typed record, filled stage by stage.

Each field is set by one init stage (`SET_BY` names it). A field starts unset; reading it
before its stage ran raises `StateNotReady`, which names the field and the stage, instead
of a bare `KeyError` from inside a Ray actor (in concurrent init, a missing `needs` edge of
the stage graph shows up as exactly this error). Fields with a meaningful "nothing" (no
held-out data, an eager step, no evaluation at start) are set to None by their stage, or
start as None when no stage has to run for them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torchrec.distributed import DistributedModelParallel

    from ettflow.trainer.collectives import Groups
    from ettflow.trainer.data.batch import Batch
    from ettflow.trainer.data.pipeline import DataPipeline
    from ettflow.trainer.model import DenseStep
    from ettflow.trainer.protocol import Evaluation
    from ettflow.trainer.rank.checkpointing import Checkpointing
    from ettflow.trainer.rank.compile_plugin import CompilePlugin

# The init stage that sets each stage-bound field (see session.py for the stage graph).
SET_BY: dict[str, str] = {
    "device": "device_init",
    "groups": "process_group_init",
    "data": "preproc_creation",
    "eval_data": "preproc_creation",
    "dmp": "train_module_creation",
    "dense_step": "train_module_creation",
    "dense_opt": "train_module_creation",
    "checkpointing": "init_plugins",
    "compiler": "init_plugins",
    "batches": "get_first_batch_data",
    "first_batch": "get_first_batch_data",
}


class StateNotReady(RuntimeError):
    """A field of the rank state was read before the init stage that sets it had run."""

    def __init__(self, name: str, stage: str) -> None:
        self.field, self.stage = name, stage
        super().__init__(
            f"rank state {name!r} was read before init stage {stage!r} set it: the stage that reads it "
            f"must list {stage!r} in its needs (trainer/rank/session.py, TrainerSession.stages)")


@dataclass(eq=False, repr=False)
class RankState:
    """One rank's live objects.

    device: the rank's torch device. groups: its process groups, training (gloo or nccl),
    control and checkpoint (gloo), and every collective ettflow calls (`trainer/collectives.py`). data / eval_data: the
    training and held-out pipelines (eval_data None: no held-out windows). dmp: the sharded
    DLRM; dense_step: its dense part as one module; dense_opt: the dense optimizer.
    checkpointing: its checkpoints (durable and in memory) and restores; compiler: the compile
    cache around PT2's compile. batches: the training batch iterator,
    started at the resume cursor; first_batch: its first batch, already taken (None: no
    data left). compiled_step: the compiled dense step (None: train eagerly). eval_start:
    held-out metrics before training (None: not evaluated at start).
    """

    device: torch.device = field(init=False)
    groups: Groups = field(init=False)
    data: DataPipeline = field(init=False)
    eval_data: DataPipeline | None = field(init=False)
    dmp: DistributedModelParallel = field(init=False)
    dense_step: DenseStep = field(init=False)
    dense_opt: torch.optim.Optimizer = field(init=False)
    checkpointing: Checkpointing = field(init=False)
    compiler: CompilePlugin = field(init=False)
    batches: Iterator[Batch] = field(init=False)
    first_batch: Batch | None = field(init=False)
    compiled_step: nn.Module | None = None  # set by pt2_compile
    eval_start: Evaluation | None = None  # set by pre_train (eval_at_start)

    def __getattr__(self, name: str) -> Any:
        # only called when the attribute is missing: an unset stage-bound field
        stage = SET_BY.get(name)
        if stage is None:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}")
        raise StateNotReady(name, stage)

    def is_set(self, name: str) -> bool:
        """True once the field has a value (for cleanup, which runs whatever init reached)."""
        if name not in _FIELDS:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}")
        return name in self.__dict__

    def __repr__(self) -> str:
        parts = [f"{name}={type(self.__dict__[name]).__name__}" for name in _FIELDS if name in self.__dict__]
        return f"RankState({', '.join(parts)})"


_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(RankState))
