"""The one place the trainer calls torch.compile: inductor, static shapes by default.

The batch size is fixed, so `dynamic=False` (each new shape is a recompile, counted by
`CompileStats.recompiles`) keeps the graphs the compile cache stores exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from ..config import TrainerConfig
    from ..data.batch import Batch

F = TypeVar("F", bound=Callable[..., Any])


def compile_module(fn_or_module: F, *, dynamic: bool = False, fullgraph: bool = False) -> F:
    """torch.compile with the inductor backend. `fullgraph=True` turns a graph break into an
    error instead of a silent split (the dense forward has none)."""
    if not callable(fn_or_module):
        raise TypeError(
            f"compile_module takes a function or an nn.Module, got {type(fn_or_module).__name__}"
        )
    return torch.compile(fn_or_module, backend="inductor", dynamic=dynamic, fullgraph=fullgraph)


def compile_dense_step(dense_step: torch.nn.Module, batch: Batch, config: TrainerConfig,
                       device: torch.device) -> torch.nn.Module:
    """`dense_step` compiled by one forward and backward on `batch` with random embeddings;
    nothing is updated (its gradients are dropped). A rank's `pt2_compile` and a spare's prewarm.
    With the compile cache, the process's compile settings apply in this thread (`cache.py`) and
    inductor's CPU ISA check is made once per host (`vec_isa.py`). A compile that fails where the
    archive gave dynamo a stored frame is tried once more without it (`drop_stored_frames`):
    torch lets some errors of a frame it cannot install escape `torch.compile`, and every restart
    would restore the same archive and fail the same way."""
    from .process_cache import apply_compile_settings, drop_stored_frames

    apply_compile_settings(config)  # in this thread's context (process_cache.py says why)
    try:
        return _compiled_by_one_step(dense_step, batch, config, device)
    except Exception as e:
        if not drop_stored_frames(config, e):
            raise
    return _compiled_by_one_step(dense_step, batch, config, device)


def _compiled_by_one_step(dense_step: torch.nn.Module, batch: Batch, config: TrainerConfig,
                          device: torch.device) -> torch.nn.Module:
    compiled = compile_module(dense_step)
    b = batch.to(device)
    n_sparse, dim = len(config.schema.sparse), config.model.embedding_dim
    embedded = torch.randn(b.batch_size, n_sparse, dim, device=device, requires_grad=True)
    loss, _ = compiled(b.dense, embedded, b.labels)
    loss.backward()
    for p in dense_step.parameters():
        p.grad = None
    return compiled
