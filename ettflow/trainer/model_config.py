"""The DLRM's configuration, without torch: what a flow's process needs to plan a run (its
parameters, the compile cache's key) imports this, not `trainer.model` (torch and TorchRec
cost a deployment run's process seconds of its TTS before its first task)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from .data.schema import FeatureSchema


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    embedding_dim: int = 16
    dense_arch: Sequence[int] = (64, 16)  # last layer == embedding_dim
    over_arch: Sequence[int] = (64, 32, 1)  # last layer == 1 (the logit)
    dense_lr: float = 1e-2
    sparse_lr: float = 5e-2
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense_arch", tuple(self.dense_arch))
        object.__setattr__(self, "over_arch", tuple(self.over_arch))
        if self.embedding_dim <= 0:
            raise ValueError(f"embedding_dim must be > 0, got {self.embedding_dim}")
        if not self.dense_arch or self.dense_arch[-1] != self.embedding_dim:
            raise ValueError(
                f"dense_arch must end with embedding_dim={self.embedding_dim} (the interaction "
                f"needs dense and sparse vectors of one size), got {self.dense_arch}"
            )
        if not self.over_arch or self.over_arch[-1] != 1:
            raise ValueError(f"over_arch must end with 1 (one logit), got {self.over_arch}")
        if any(n <= 0 for n in (*self.dense_arch, *self.over_arch)):
            raise ValueError("layer sizes must be positive")
        if self.dense_lr <= 0 or self.sparse_lr <= 0:
            raise ValueError("learning rates must be > 0")

    def fingerprint(self, schema: FeatureSchema) -> str:
        """Stable id of what the compiled graphs depend on (for the compile-cache key)."""
        blob = json.dumps({"model": asdict(self), "schema": schema.to_dict()}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]
