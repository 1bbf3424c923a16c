"""One rank's in-memory copy, pure: what it holds, its host buffers, its checksum, its restore.

- `local_tensors`: every tensor a rank needs to come back exactly: the model's state (a
  ShardedTensor contributes its local shard tensors, a DTensor its local tensors), both
  optimizers' state tensors (values such as lr are config and stay), and the rank's step,
  cursor and RNG state (RANK_STATE: JSON text as a uint8 tensor, as in state.py; RNG_TORCH,
  RNG_CUDA).
- `HostCopy`: host buffers allocated at the first capture and reused after, so a save is one
  memcpy per tensor.
- `checksum`: sha256 over the layout (names, dtypes, shapes as JSON) and the raw bytes.
- `apply`: restores a copy IN PLACE (copy_ into the live tensors: modules, optimizers and a
  compiled step stay the same objects) after checking that names, dtypes and shapes match
  exactly; otherwise `MemoryCopyError` says what differs, and nothing is changed.
- `CopyMeta`: the JSON-able metadata of a copy (step, rank, world_size, cursor, nbytes, layout,
  checksum), and beside it (not in its JSON) the durable chain's record for a restore of the
  copy (`chain_resume.ChainResume`: links and row ids, with its own digest). A payload is a
  list of uint8 arrays in layout order: raw tensor bytes, nothing else, so restoring one runs
  no code from it.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from ettflow.trainer.checkpoint.chain_resume import ChainResume

from ettflow.trainer import _torch_compat as compat
from ettflow.trainer.checkpoint.config import CheckpointError
from ettflow.trainer.checkpoint.state import (
    TrainState,
    capture_rng,
    init_lazy_optimizer_state,
    json_tensor,
    restore_rng,
    tensor_json,
)

RANK_STATE, RNG_TORCH, RNG_CUDA = "rank/state", "rank/rng_torch", "rank/rng_cuda"
Layout = tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, dtype, shape) per tensor, in payload order


class MemoryCopyError(CheckpointError):
    """An in-memory copy is missing, damaged (checksum) or does not fit the model it is
    restored into: restore the durable checkpoint instead."""


# -- what a copy holds (pure) ------------------------------------------------------------------


def _flatten(obj: Any, path: str, out: dict[str, torch.Tensor]) -> None:
    _, sharded_tensor = compat.sharded_tensor_types()
    if isinstance(obj, Mapping):
        for key, sub in obj.items():
            _flatten(sub, f"{path}/{key}", out)
    elif isinstance(obj, (list, tuple)):
        for i, sub in enumerate(obj):
            _flatten(sub, f"{path}/{i}", out)
    elif isinstance(obj, sharded_tensor):
        for shard in obj.local_shards():
            out[f"{path}@{','.join(map(str, shard.metadata.shard_offsets))}"] = shard.tensor
    elif isinstance(obj, torch.Tensor) and hasattr(obj, "to_local"):  # DTensor
        local = obj.to_local()
        shards = local.local_shards() if hasattr(local, "local_shards") else [local]
        for i, t in enumerate(shards):
            out[f"{path}#{i}"] = t
    elif isinstance(obj, torch.Tensor):
        out[path] = obj


def live_tensors(train_state: TrainState) -> dict[str, torch.Tensor]:
    """The live model and optimizer tensors by name (the objects training updates)."""
    out: dict[str, torch.Tensor] = {}
    _flatten(train_state.model.state_dict(), "model", out)
    for name, opt in train_state.optimizers.items():
        _flatten(opt.state_dict(), f"optim/{name}", out)
    return out


def local_tensors(train_state: TrainState, *, step: int, rank: int) -> dict[str, torch.Tensor]:
    """Every tensor `rank` needs to come back exactly at `step`: `live_tensors`, and the
    rank's step, cursor and RNG state (RANK_STATE: JSON text as uint8; RNG_TORCH, RNG_CUDA)."""
    plain, rng_torch, rng_cuda = capture_rng()
    out = live_tensors(train_state)
    cursor = json.loads(train_state.cursor_json())
    out[RANK_STATE] = json_tensor({"step": step, "cursor": cursor, "rng": plain, "rank": rank})
    out[RNG_TORCH] = rng_torch
    if rng_cuda is not None:
        out[RNG_CUDA] = rng_cuda
    return out


def layout_of(tensors: Mapping[str, torch.Tensor]) -> Layout:
    return tuple((name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in tensors.items())


def _mismatch(expected: Layout, found: Layout) -> list[str]:
    """What differs between two layouts, in words (empty when they are equal as sets)."""
    want, have = {n: (d, s) for n, d, s in expected}, {n: (d, s) for n, d, s in found}
    problems = [f"missing {n}" for n in sorted(want.keys() - have.keys())]
    problems += [f"unexpected {n}" for n in sorted(have.keys() - want.keys())]
    problems += [f"{n}: copy has {have[n][0]} {list(have[n][1])}, model has {want[n][0]} {list(want[n][1])}"
                 for n in sorted(want.keys() & have.keys()) if want[n] != have[n]]
    return problems


def apply(train_state: TrainState, tensors: Mapping[str, torch.Tensor], *, rank: int) -> tuple[int, dict]:
    """Restore `train_state` in place from a copy (copy_ into the live tensors), after checking
    that names, dtypes and shapes match exactly; returns (step, cursor) and sets both on
    `train_state`. Raises MemoryCopyError when the copy does not fit, having changed nothing
    but creating the optimizers' lazy state (zeros, as a DCP load template does)."""
    for opt in train_state.optimizers.values():
        init_lazy_optimizer_state(opt)  # a fresh model's Adam has no moments before its first step
    live = live_tensors(train_state)
    copied = {n: t for n, t in tensors.items() if n not in (RANK_STATE, RNG_TORCH, RNG_CUDA)}
    problems = _mismatch(layout_of(live), layout_of(copied))
    problems += [f"missing {n}" for n in (RANK_STATE, RNG_TORCH) if n not in tensors]
    if RNG_CUDA in tensors and torch.cuda.is_available() and tensors[RNG_CUDA].shape[0] != torch.cuda.device_count():
        problems.append(f"{RNG_CUDA}: copy has {tensors[RNG_CUDA].shape[0]} devices, "
                        f"this process sees {torch.cuda.device_count()}")
    mine = tensor_json(tensors[RANK_STATE]) if RANK_STATE in tensors else {}
    if not isinstance(mine, dict) or not isinstance(mine.get("step"), int) \
            or not isinstance(mine.get("cursor"), dict) or not isinstance(mine.get("rng"), dict):
        problems.append(f"{RANK_STATE} must hold {{'step': int, 'cursor': dict, 'rng': dict}}")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise MemoryCopyError(f"rank {rank}: the in-memory copy does not fit this model ({len(live)} tensors): "
                              f"{shown}")
    with torch.no_grad():
        for name, target in live.items():
            target.copy_(tensors[name])
    restore_rng(mine["rng"], tensors[RNG_TORCH].clone(), tensors.get(RNG_CUDA))
    train_state.step, train_state.cursor = mine["step"], mine["cursor"]
    return mine["step"], mine["cursor"]


class HostCopy:
    """Host buffers for a rank's tensors, allocated at the first capture and reused after (a
    buffer is reallocated only when its tensor's shape or dtype changed: the JSON text of the
    rank's state). `pin`: page-locked buffers for device-to-host copies."""

    def __init__(self, *, pin: bool = False) -> None:
        self.pin = pin
        self.buffers: dict[str, torch.Tensor] = {}

    def capture(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        fresh: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            buf = self.buffers.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)
            buf.copy_(t.detach(), non_blocking=self.pin)
            fresh[name] = buf
        if self.pin:
            torch.accelerator.synchronize()
        self.buffers = fresh
        return fresh


def byte_view(t: torch.Tensor) -> np.ndarray:
    """A contiguous host tensor's bytes as a uint8 array (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def checksum(layout: Layout, arrays: list[np.ndarray], signed: Mapping[str, Any] | None = None) -> str:
    """sha256 of the layout (as JSON), then `signed` (the copy's metadata a restore applies beside
    its tensors: `CopyMeta.signed`, as canonical JSON), then every array's bytes, in layout order."""
    h = hashlib.sha256(json.dumps([list(e) for e in layout]).encode())
    if signed is not None:
        h.update(json.dumps(signed, sort_keys=True).encode())
    for a in arrays:
        h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return h.hexdigest()


def tensors_of(layout: Layout, arrays: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """The tensors a payload holds (views of its arrays; read-only, never written)."""
    if len(layout) != len(arrays):
        raise MemoryCopyError(f"the copy's payload has {len(arrays)} arrays, its layout {len(layout)}")
    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # object-store arrays are read-only
        for (name, dtype, shape), a in zip(layout, arrays, strict=True):
            kind = getattr(torch, dtype, None)
            if not isinstance(kind, torch.dtype):
                raise MemoryCopyError(f"{name}: unknown dtype {dtype!r}")
            out[name] = torch.from_numpy(a).view(kind).reshape(shape)
    return out


@dataclass(frozen=True, kw_only=True)
class CopyMeta:
    """What a copy is: the metadata the keeper stores beside the payload (`to_json`: as JSON)."""

    step: int
    rank: int
    world_size: int
    cursor: dict
    nbytes: int
    layout: Layout
    checksum: str | None = None
    # a delta copy: the step of the rank's copy it applies to, and `delta.capture_delta`'s meta
    # (the dense optimizers' param groups); None: a whole copy
    parent: int | None = None
    delta: dict | None = None
    # what the durable delta chain goes on from when this copy is restored (None: a base next)
    resume: ChainResume | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("step", "rank", "world_size", "nbytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise MemoryCopyError(f"CopyMeta.{name} must be an int >= 0, got {value!r}")
        if not 0 <= self.rank < max(self.world_size, 1) or not isinstance(self.cursor, dict):
            raise MemoryCopyError(f"CopyMeta: rank {self.rank} of {self.world_size}, cursor {self.cursor!r}")
        if (self.parent is None) != (self.delta is None) or (
                self.parent is not None and not (isinstance(self.parent, int) and 0 <= self.parent < self.step)):
            raise MemoryCopyError(f"CopyMeta: a delta copy names an earlier parent step and its delta meta, a whole "
                                  f"copy neither (step {self.step}, parent {self.parent!r})")

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "rank": self.rank, "world_size": self.world_size, "cursor": self.cursor,
                "nbytes": self.nbytes, "checksum": self.checksum, "layout": [list(e) for e in self.layout],
                "parent": self.parent, "delta": self.delta}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CopyMeta:
        try:
            layout = tuple((str(n), str(d), tuple(int(x) for x in s)) for n, d, s in data["layout"])
            return cls(step=data["step"], rank=data["rank"], world_size=data["world_size"], cursor=data["cursor"],
                       nbytes=data["nbytes"], layout=layout, checksum=data["checksum"], parent=data.get("parent"),
                       delta=data.get("delta"))
        except (KeyError, TypeError, ValueError) as e:
            raise MemoryCopyError(f"malformed copy metadata ({type(e).__name__}: {e})") from e

    def signed(self) -> dict[str, Any]:
        """What the checksum covers besides the layout and the bytes: every field a restore reads
        (a delta's optimizer param groups are applied as they are; `resume` is the restorer's note)."""
        return {"step": self.step, "rank": self.rank, "world_size": self.world_size, "cursor": self.cursor,
                "nbytes": self.nbytes, "parent": self.parent, "delta": self.delta}

    def with_checksum(self, arrays: list[np.ndarray]) -> CopyMeta:
        return replace(self, checksum=checksum(self.layout, arrays, self.signed()))

    def verify(self, arrays: list[np.ndarray]) -> None:
        """Raise MemoryCopyError unless `arrays` and this metadata are what its checksum names."""
        found = checksum(self.layout, arrays, self.signed())
        if self.checksum is None or found != self.checksum:
            raise MemoryCopyError(f"in-memory copy of rank {self.rank} at step {self.step} is damaged: checksum "
                                  f"{found[:16]}... != recorded {str(self.checksum)[:16]}...")
