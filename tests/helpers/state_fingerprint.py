"""A fingerprint of a training state that is independent of the code under test: every tensor
(local shards of a ShardedTensor by their offsets) and the RNG states, hashed by path.
Two fingerprints are equal when the model, the optimizers' state and the RNGs are bitwise
equal."""

from __future__ import annotations

import hashlib
import random
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from ettflow.trainer.checkpoint import TrainState


def _walk(obj, path: str, out: dict) -> None:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, f"{path}/{k}", out)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _walk(v, f"{path}/{i}", out)
    elif isinstance(obj, ShardedTensor):
        for s in obj.local_shards():
            _walk(s.tensor, f"{path}@{s.metadata.shard_offsets}", out)
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().contiguous()
        out[path] = f"{t.dtype}{list(t.shape)}:" + hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest()
    else:
        out[path] = repr(obj)


def fingerprint(state: TrainState) -> dict[str, str]:
    out: dict[str, str] = {}
    _walk(state.model.state_dict(), "model", out)
    for name, opt in state.optimizers.items():
        _walk(opt.state_dict(), f"optim/{name}", out)
    out["rng"] = repr((torch.get_rng_state().tolist(), random.getstate(), np.random.get_state()[1].tolist()))
    return out
