"""What a checkpoint holds: model, optimizer, step, data cursor and RNG state.

`TrainState` turns these into the state dict DCP saves, and restores them from one:

    {"model": model.state_dict(),            # DMP: DTensor/ShardedTensor for sharded tables
     "optim": {name: optimizer.state_dict()},     # fused embedding + dense optimizers
     "rank_<r>_state": uint8 tensor,         # UTF-8 JSON: {"step", "cursor", "rng": python, numpy}
     "rank_<r>_rng_torch": uint8 tensor,     # torch.get_rng_state()
     "rank_<r>_rng_cuda": uint8 tensor}      # torch.cuda.get_rng_state_all(), stacked (with CUDA)

Nothing is pickled: every per-rank value is a tensor that DCP writes and reads as raw data,
and the non-tensor part is JSON text inside one, so loading a checkpoint runs no code from it
(see `reading.py` for the rest of DCP's reading).

Per-rank state lives under per-rank keys: DCP de-duplicates equal keys across ranks (a
replicated dense parameter is written once), which would otherwise keep one rank's data
cursor and RNG state and lose the others'. They are top-level tensor leaves, not a nested
dict: a rank's load template lacks the other ranks' keys (and the fused optimizer state of
tables it does not hold), and on such "missing" keys DCP's load planner retries with its
pre-2.4 flattening; a top-level leaf flattens the same both ways. Their sizes vary (the JSON
length), so the load template takes them from the checkpoint's DCP metadata.

Optimizer state that is created lazily (Adam's moments appear at the first step) is
initialized before the load template is built, so the template holds every tensor the
checkpoint has and DCP can load into it in place.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ettflow.trainer.checkpoint.config import CheckpointError


def rank_keys(rank: int) -> dict[str, str]:
    """The state dict keys of one rank's own state, by role (state, rng_torch, rng_cuda)."""
    return {role: f"rank_{rank}_{role}" for role in ("state", "rng_torch", "rng_cuda")}


def json_tensor(value: Any) -> torch.Tensor:
    """`value` as UTF-8 JSON text in a uint8 tensor."""
    return torch.frombuffer(bytearray(json.dumps(value, sort_keys=True).encode()), dtype=torch.uint8)


def tensor_json(tensor: torch.Tensor) -> Any:
    """The value `json_tensor` stored (JSON parsing only: no code runs)."""
    if tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise CheckpointError(f"per-rank state must be a 1-d uint8 tensor of JSON text, got {tensor.dtype} "
                              f"{tuple(tensor.shape)}")
    try:
        return json.loads(bytes(tensor.numpy()).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"per-rank state is not JSON text ({e})") from e


def capture_rng() -> tuple[dict[str, Any], torch.Tensor, torch.Tensor | None]:
    """(python and numpy states as JSON values, torch CPU state, CUDA states or None)."""
    version, internal, gauss = random.getstate()
    name, key, pos, has_gauss, cached = np.random.get_state()
    plain = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss},
        "numpy": {"bit_generator": name, "key": key.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
    }
    cuda = torch.stack(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else None
    return plain, torch.get_rng_state(), cuda


def restore_rng(plain: Mapping[str, Any], cpu: torch.Tensor, cuda: torch.Tensor | None) -> None:
    try:
        py, npy = plain["python"], plain["numpy"]
        random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"]))
        np.random.set_state((str(npy["bit_generator"]), np.asarray(npy["key"], dtype=np.uint32), int(npy["pos"]),
                             int(npy["has_gauss"]), float(npy["cached_gaussian"])))
        torch.set_rng_state(cpu)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"the checkpoint's RNG state is malformed ({type(e).__name__}: {e})") from e
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(cuda))


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
        plain, rng_torch, rng_cuda = capture_rng()
        keys = rank_keys(rank)
        mine = {keys["state"]: json_tensor({"step": step, "cursor": json.loads(self.cursor_json()), "rng": plain}),
                keys["rng_torch"]: rng_torch}
        if rng_cuda is not None:
            mine[keys["rng_cuda"]] = rng_cuda
        return {**self._tensors(), **mine}

    def load_template(self, *, rank: int, saved: Mapping[str, Any]) -> dict[str, Any]:
        """The state dict DCP loads into: this state's own tensors, and empty per-rank
        tensors sized from `saved` (the checkpoint's `Metadata.state_dict_metadata`)."""
        for opt in self.optimizers.values():
            init_lazy_optimizer_state(opt)
        keys = rank_keys(rank)
        wanted = [keys["state"], keys["rng_torch"]]
        if keys["rng_cuda"] in saved and torch.cuda.is_available():
            wanted.append(keys["rng_cuda"])
        mine: dict[str, Any] = {}
        for key in wanted:
            meta = saved.get(key)
            size = getattr(meta, "size", None)
            if size is None or getattr(meta.properties, "dtype", None) != torch.uint8:
                raise CheckpointError(
                    f"the checkpoint has no uint8 tensor {key} (rank {rank}'s step, cursor and RNG state): it "
                    "was written by another ettflow or for another world size; restore a checkpoint of this job"
                )
            mine[key] = torch.empty(size, dtype=torch.uint8)
        if keys["rng_cuda"] in mine and mine[keys["rng_cuda"]].shape[0] != torch.cuda.device_count():
            raise CheckpointError(
                f"checkpoint holds CUDA RNG state for {mine[keys['rng_cuda']].shape[0]} devices, this "
                f"process sees {torch.cuda.device_count()}: restore on the same device layout"
            )
        return {**self._tensors(), **mine}

    def weights_template(self) -> dict[str, Any]:
        """The state dict a warm start loads into: model and optimizer state only, no
        per-rank step, cursor or RNG (`CheckpointManager.load_parent`)."""
        for opt in self.optimizers.values():
            init_lazy_optimizer_state(opt)
        return self._tensors()

    def apply_weights(self, loaded: Mapping[str, Any]) -> None:
        """Restore model and optimizer state from a template DCP loaded into (warm start)."""
        self.model.load_state_dict(loaded["model"])
        for name, opt in self.optimizers.items():
            opt.load_state_dict(loaded["optim"][name])

    def apply(self, loaded: Mapping[str, Any], *, rank: int) -> None:
        """Restore from a template DCP loaded into (tensors were loaded in place)."""
        keys = rank_keys(rank)
        mine = tensor_json(loaded[keys["state"]])
        if not isinstance(mine, dict) or not isinstance(mine.get("step"), int) \
                or not isinstance(mine.get("cursor"), dict) or not isinstance(mine.get("rng"), dict):
            raise CheckpointError(f"{keys['state']} must hold {{'step': int, 'cursor': dict, 'rng': dict}}, "
                                  f"got {str(mine)[:200]}")
        self.model.load_state_dict(loaded["model"])
        for name, opt in self.optimizers.items():
            opt.load_state_dict(loaded["optim"][name])
        self.step = mine["step"]
        self.cursor = mine["cursor"]
        restore_rng(mine["rng"], loaded[keys["rng_torch"]], loaded.get(keys["rng_cuda"]))
