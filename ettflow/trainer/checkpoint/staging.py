"""Staging the state into host memory for an async save, with PyTorch's DefaultStager.

DCP's `async_save` stages with `DefaultStager`, whose copy calls `data_ptr()` on every
tensor; a TorchRec ShardedTensor (the default output of a sharded EmbeddingBagCollection and
its fused optimizer) rejects that ("torch function 'data_ptr' ... not supported for
ShardedTensor"). Two ways past it:

- DTensor state: build the DMP with `ShardingEnv(world_size, rank, pg, output_dtensor=True)`.
  Weights and fused optimizer state are then DTensors over a LocalShardsWrapper, which
  DefaultStager copies natively (the preferred path).
- `ShardedTensorStager`: DefaultStager plus ShardedTensor support. It hands DefaultStager
  each ShardedTensor's local shard tensors and rebuilds a ShardedTensor around the staged
  copies (global metadata re-pointed at the CPU), so models built without DTensor output
  also save asynchronously. DTensor state passes through it unchanged.

Staging is synchronous (`use_async_staging=False`): the save returns once the copy is done,
so the training loop may update parameters right after it.
"""

from __future__ import annotations

import copy
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from ettflow.trainer import _torch_compat as compat
from ettflow.trainer.checkpoint.config import CheckpointError

Shard, ShardedTensor = compat.sharded_tensor_types()  # from torch's private _shard package
Path_ = tuple[Any, ...]


def _strip(obj: Any, path: Path_, found: dict[Path_, ShardedTensor]) -> Any:
    """Copy of the dict/list structure with each ShardedTensor replaced by its local shard
    tensors (a list); records where each ShardedTensor was."""
    if isinstance(obj, ShardedTensor):
        found[path] = obj
        return [shard.tensor for shard in obj.local_shards()]
    if isinstance(obj, dict):
        return {k: _strip(v, (*path, k), found) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_strip(v, (*path, i), found) for i, v in enumerate(obj)]
    return obj


def _rebuild(original: ShardedTensor, staged: list[torch.Tensor]) -> ShardedTensor:
    metadata = copy.deepcopy(original.metadata())
    for shard_md in metadata.shards_metadata:
        shard_md.placement = compat.cpu_placement(shard_md.placement)
    if staged:
        metadata.tensor_properties.pin_memory = staged[0].is_pinned()
        metadata.tensor_properties.requires_grad = staged[0].requires_grad
    shards = []
    for shard, tensor in zip(original.local_shards(), staged, strict=True):
        shard_md = copy.deepcopy(shard.metadata)
        shard_md.placement = compat.cpu_placement(shard_md.placement)
        shards.append(Shard(tensor, shard_md))
    return compat.sharded_tensor_like(original, shards, metadata)


class ShardedTensorStager(DefaultStager):
    """DefaultStager that also stages TorchRec ShardedTensors (see the module docstring)."""

    def stage(self, state_dict: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        found: dict[Path_, ShardedTensor] = {}
        stripped = _strip(state_dict, (), found)
        staged = super().stage(stripped, **kwargs)
        if isinstance(staged, Future):
            raise CheckpointError(
                "ShardedTensorStager needs synchronous staging: build it with "
                "StagingOptions(use_async_staging=False) (what make_stager does)"
            )
        for path, original in found.items():
            parent = staged
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = _rebuild(original, parent[path[-1]])
        return staged


def make_stager() -> ShardedTensorStager:
    """A stager for this host: pinned memory and non-blocking copies with an accelerator,
    plain host memory on a CPU-only host; staging completes before `async_save` returns."""
    accel = torch.accelerator.is_available()
    return ShardedTensorStager(
        StagingOptions(
            use_pinned_memory=accel,
            use_shared_memory=False,  # only the process-based checkpointer needs it
            use_async_staging=False,
            use_non_blocking_copy=accel,
        )
    )
