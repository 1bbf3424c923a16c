"""What a checkpoint holds: model, optimizer, step, data cursor and RNG state.

`TrainState` turns these into the state dict DCP saves, and restores them from one:

    {"model": model.state_dict(),        # DMP: DTensor/ShardedTensor for sharded tables
     "optim": {name: optimizer.state_dict()},  # fused embedding + dense optimizers
     "rank_<r>": bytes}                  # pickled {"step", "cursor", "rng"} of rank r

Per-rank state lives under a per-rank key: DCP de-duplicates equal keys across ranks (a
replicated dense parameter is written once), which would otherwise keep one rank's data
cursor and RNG state and lose the others'. It is one opaque leaf, not a nested dict: a rank's
load template lacks the other ranks' keys (and the fused optimizer state of tables it does
not hold), and on such "missing" keys DCP's load planner retries with its pre-2.4 flattening,
which turns a dict without tensors into a single key and then fails with "Missing key in
checkpoint state_dict: rank_<r>". A leaf flattens the same both ways.

Optimizer state that is created lazily (Adam's moments appear at the first step) is
initialized before the load template is built, so the template holds every tensor the
checkpoint has and DCP can load into it in place.
"""

from __future__ import annotations

import json
import pickle
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ettflow.trainer.checkpoint.config import CheckpointError


def capture_rng() -> bytes:
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return pickle.dumps(states)


def restore_rng(blob: bytes) -> None:
    states = pickle.loads(blob)
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        if len(states["cuda"]) != torch.cuda.device_count():
            raise CheckpointError(
                f"checkpoint holds CUDA RNG state for {len(states['cuda'])} devices, this "
                f"process sees {torch.cuda.device_count()}: restore on the same device layout"
            )
        torch.cuda.set_rng_state_all(states["cuda"])


def _leaf_optimizers(optimizer: Any) -> list[Any]:
    inner = getattr(optimizer, "optimizers", None)  # torchrec CombinedOptimizer
    if not isinstance(inner, list):
        return [optimizer]
    leaves: list[Any] = []
    for _, sub in inner:
        leaves.extend(_leaf_optimizers(sub))
    return leaves


def init_lazy_optimizer_state(optimizer: Any) -> None:
    """Create the state a dense optimizer makes at its first step (a step on zero
    gradients), so a load template contains it. Fused embedding optimizers (torchrec
    FusedOptimizer) hold their state in the kernel from the start and are skipped.

    The step may move parameters (weight decay): call this before loading the model."""
    from torchrec.optim.fused import FusedOptimizer

    for opt in _leaf_optimizers(optimizer):
        if isinstance(opt, FusedOptimizer):
            continue
        params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        missing = [p for p in params if not opt.state.get(p)]
        if not missing:
            continue
        saved = {p: p.grad for p in params}
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        for p, g in saved.items():
            p.grad = g


@dataclass(kw_only=True, eq=False)
class TrainState:
    """The training state a checkpoint saves and a restart restores.

    model: the (DistributedModelParallel) model.
    optimizers: its optimizers by name, e.g. {"sparse": dmp.fused_optimizer, "dense": adam};
        torchrec KeyedOptimizers (CombinedOptimizer, KeyedOptimizerWrapper) or plain
        torch optimizers over replicated parameters.
    step: the last completed training step; set by a restore.
    cursor: this rank's data cursor (JSON-serializable, it also goes into the manifest);
        set by a restore.
    """

    model: nn.Module
    optimizers: Mapping[str, Any]
    step: int = 0
    cursor: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise TypeError(f"TrainState.model must be an nn.Module, got {type(self.model)}")
        if not isinstance(self.optimizers, Mapping) or not self.optimizers:
            raise TypeError(
                "TrainState.optimizers must be a non-empty mapping of name -> optimizer, e.g. "
                f"{{'sparse': dmp.fused_optimizer, 'dense': adam}}, got {self.optimizers!r}"
            )
        for key, opt in self.optimizers.items():
            missing = [n for n in ("state_dict", "load_state_dict", "param_groups") if not hasattr(opt, n)]
            if not isinstance(key, str) or missing:
                raise TypeError(
                    f"TrainState.optimizers[{key!r}] must be an optimizer under a str name "
                    f"(missing {missing}), got {type(opt)}"
                )

    def cursor_json(self) -> str:
        try:
            return json.dumps(dict(self.cursor), sort_keys=True)
        except TypeError as e:
            raise CheckpointError(
                f"TrainState.cursor must be JSON-serializable ({e}); store plain values, "
                "e.g. dataclasses.asdict(cursor)"
            ) from e

    def _tensors(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optim": {name: opt.state_dict() for name, opt in self.optimizers.items()},
        }

    def to_state_dict(self, *, step: int, rank: int) -> dict[str, Any]:
        mine = {"step": step, "cursor": self.cursor_json(), "rng": capture_rng()}
        return {**self._tensors(), f"rank_{rank}": pickle.dumps(mine)}

    def load_template(self, *, rank: int) -> dict[str, Any]:
        for opt in self.optimizers.values():
            init_lazy_optimizer_state(opt)
        return {**self._tensors(), f"rank_{rank}": b""}

    def apply(self, loaded: Mapping[str, Any], *, rank: int) -> None:
        """Restore from a template DCP loaded into (tensors were loaded in place)."""
        self.model.load_state_dict(loaded["model"])
        for name, opt in self.optimizers.items():
            opt.load_state_dict(loaded["optim"][name])
        mine = pickle.loads(loaded[f"rank_{rank}"])
        self.step = int(mine["step"])
        self.cursor = json.loads(mine["cursor"])
        restore_rng(mine["rng"])
