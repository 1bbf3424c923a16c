"""The probe's dense models (`probe_cold_warm.build_dense_forward`), at a module's top level:
dynamo's caching precompile (compile/cache.py) stores a frame's guards with the types they name,
and torch 2.13 refuses (TypeError, the compile fails) a class defined inside a function. Imported
only where the probe compiles: it imports torch, and TorchRec where it is installed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# `size` below is a probe_cold_warm.DenseSize, which imports this module where it compiles
DenseSize = Any

try:
    from torchrec.models.dlrm import DenseArch, InteractionArch, OverArch
except ImportError:  # a bare GPU host: the plain-torch layers below
    DenseArch = InteractionArch = OverArch = None


def _pairs(size: DenseSize) -> int:
    return (size.sparse + 1) * size.sparse // 2


class _TorchRecDenseForward(nn.Module):
    """TorchRec's DLRM DenseArch, InteractionArch and OverArch: logits [B] from dense [B,
    dense_in] and embedded [B, F, D]."""

    def __init__(self, size: DenseSize) -> None:
        super().__init__()
        self.dense_arch = DenseArch(size.dense_in, list(size.dense_arch))
        self.inter_arch = InteractionArch(num_sparse_features=size.sparse)
        self.over_arch = OverArch(size.dim + _pairs(size), list(size.over_arch))

    def forward(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        x = self.inter_arch(dense_features=self.dense_arch(dense), sparse_features=embedded)
        return self.over_arch(x).squeeze(-1)


DenseForward = _TorchRecDenseForward if DenseArch is not None else None


def _mlp(sizes: list[int], *, last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class PlainDenseForward(nn.Module):
    """The same in plain torch: DenseArch (Linear + ReLU layers), the pairwise-dot
    InteractionArch, OverArch (Linear + ReLU, the last layer linear)."""

    def __init__(self, size: DenseSize) -> None:
        super().__init__()
        self.dense_arch = _mlp([size.dense_in, *size.dense_arch], last_relu=True)
        self.over_arch = _mlp([size.dim + _pairs(size), *size.over_arch], last_relu=False)
        self.register_buffer("triu", torch.triu_indices(size.sparse + 1, size.sparse + 1, offset=1),
                             persistent=False)

    def forward(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        d = self.dense_arch(dense)
        combined = torch.cat([d.unsqueeze(1), embedded], dim=1)
        inter = torch.bmm(combined, combined.transpose(1, 2))[:, self.triu[0], self.triu[1]]
        return self.over_arch(torch.cat([d, inter], dim=1)).squeeze(-1)
