"""Staging the state into host memory for an async save, with PyTorch's DefaultStager.

DCP's `async_save` stages with `DefaultStager`, whose copy calls `data_ptr()` on every
tensor; a TorchRec ShardedTensor (the default output of a sharded EmbeddingBagCollection and
its fused optimizer) rejects that ("torch function 'data_ptr' ... not supported for
ShardedTensor"). Two ways past it:

- DTensor state: build the DMP with `ShardingEnv(world_size, rank, pg, output_dtensor=True)`.
  Weights and fused optimizer state are then DTensors over a LocalShardsWrapper, which
  DefaultStager copies natively. The trainer cannot use it: torchrec 1.8 fails
  `DTensor.from_local` when a rank holds no shard of a table (a [0, 0] local shard).
- `ShardedTensorStager`: DefaultStager plus ShardedTensor support. It hands DefaultStager
  each ShardedTensor's local shard tensors and rebuilds a ShardedTensor around the staged
  copies (global metadata re-pointed at the CPU): inline with synchronous staging, on the
  staging thread once the copy is done with asynchronous staging. DTensor state passes
  through it unchanged.

Two ways to stage (`make_stager(async_staging=...)`):

- synchronous (`use_async_staging=False`): `stage` returns the staged state dict once the
  copy is done, so the caller may update parameters right after it.
- asynchronous (`use_async_staging=True`): `stage` hands the copy to DefaultStager's
  staging thread and returns a Future of the staged state dict at once; the caller must not
  mutate a saved tensor before that Future is done (`CheckpointManager.wait_staged`). DCP's
  write waits for it, in its own thread.

Buffers are reused: DefaultStager's `StateDictStager` caches the CPU storage it made for
each source storage (a weak map keyed by the source `UntypedStorage`, whose Python object
lives as long as the tensor), and the next stage of the same source copies into it
(`cached_storage.copy_`) instead of allocating. The trainer's state lives in long-lived
storages (TBE weights and fused optimizer state, dense parameters and Adam state), so after
the first save of a stager only the per-save RNG and JSON tensors (a few KiB) are
allocated; the first save pays the allocation (page faults: on this CPU host about ten times
the copy). Reusing one stager for every save of a manager is what makes that work, and it is
safe because a manager never stages while an earlier staged copy is still being written
(`CheckpointManager.save` waits for the previous save first). Pinned host memory and
non-blocking copies need an accelerator (on a CPU-only host the copy is a memcpy into the
cached buffers); shared memory is only for DCP's process-based checkpointer.

What asynchronous staging leaves on a CPU-only host: StateDictStager copies with
`UntypedStorage.copy_`, which holds the GIL for the whole memcpy (about 4 ms for the
trainer's two 16 MB TBE storages), so the training thread waits for the GIL while the
staging thread copies, in `save` or in the next forward pass. The copy's CPU time moves, it
does not disappear; with an accelerator the copy is a device-to-host DMA into pinned buffers
on the staging stream, and overlaps for real.
"""

from __future__ import annotations

import copy
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.utils.weak import WeakIdKeyDictionary

from ettflow.trainer import _torch_compat as compat

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


def _layout(tensors: list[torch.Tensor]) -> tuple[tuple[int, int, tuple[int, ...], tuple[int, ...]], ...]:
    return tuple((t.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride())) for t in tensors)


def _rebuild(original: ShardedTensor, staged: list[torch.Tensor]) -> ShardedTensor:
    """A ShardedTensor over the staged copies of `original`'s local shards, its global
    metadata re-pointed at the CPU."""
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
    """DefaultStager that also stages TorchRec ShardedTensors (see the module docstring).

    The staged ShardedTensor of a source ShardedTensor is built once and reused while its
    shards are staged into the same cached buffers (same address, offset, shape and stride),
    which is every save after the first: its metadata is a deep copy of the source's, about
    3 ms of Python for the trainer's 39 ShardedTensors, paid once instead of every save."""

    def __init__(self, config: StagingOptions) -> None:
        super().__init__(config)
        self._rebuilt = WeakIdKeyDictionary()  # source ShardedTensor -> (staged layout, staged ShardedTensor)

    def stage(self, state_dict: dict[str, Any], **kwargs: Any) -> dict[str, Any] | Future[dict[str, Any]]:
        found: dict[Path_, ShardedTensor] = {}
        stripped = _strip(state_dict, (), found)
        staged = super().stage(stripped, **kwargs)
        if not isinstance(staged, Future):
            return self._rebuild_all(staged, found)
        done: Future[dict[str, Any]] = Future()

        def finish(copied: Future[dict[str, Any]]) -> None:  # on the staging thread, after the copy
            try:
                done.set_result(self._rebuild_all(copied.result(), found))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the staging
                done.set_exception(e)

        staged.add_done_callback(finish)
        return done

    def _rebuild_all(self, staged: dict[str, Any], found: dict[Path_, ShardedTensor]) -> dict[str, Any]:
        for path, original in found.items():
            parent = staged
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = self._staged_sharded(original, parent[path[-1]])
        return staged

    def _staged_sharded(self, original: ShardedTensor, staged: list[torch.Tensor]) -> ShardedTensor:
        layout = _layout(staged)
        cached = self._rebuilt.get(original)
        if cached is not None and cached[0] == layout:
            return cached[1]  # its shards are views of these very buffers, which hold this copy
        rebuilt = _rebuild(original, staged)
        self._rebuilt[original] = (layout, rebuilt)
        return rebuilt

    def close(self) -> None:
        super().close()
        self._rebuilt.clear()


def staging_options(*, async_staging: bool, accelerator: bool) -> StagingOptions:
    """DCP's staging options for this host: pinned buffers and non-blocking copies only with
    an accelerator, no shared memory (the thread-based checkpointer does not need it)."""
    return StagingOptions(
        use_pinned_memory=accelerator,
        use_shared_memory=False,
        use_async_staging=async_staging,
        use_non_blocking_copy=accelerator,
    )


def make_stager(*, async_staging: bool = False) -> ShardedTensorStager:
    """A stager for this host (see `staging_options`); with `async_staging` the copy runs on
    the stager's own thread and `async_save` returns before it is done."""
    return ShardedTensorStager(
        staging_options(async_staging=async_staging, accelerator=torch.accelerator.is_available())
    )
