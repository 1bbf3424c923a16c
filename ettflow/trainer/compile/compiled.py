"""The one place the trainer calls torch.compile: inductor, static shapes by default.

The batch size is fixed, so `dynamic=False` (each new shape is a recompile, counted by
`CompileStats.recompiles`) keeps the graphs the compile cache stores exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def compile_module(fn_or_module: F, *, dynamic: bool = False, fullgraph: bool = False) -> F:
    """torch.compile with the inductor backend. `fullgraph=True` turns a graph break into an
    error instead of a silent split (the dense forward has none)."""
    if not callable(fn_or_module):
        raise TypeError(
            f"compile_module takes a function or an nn.Module, got {type(fn_or_module).__name__}"
        )
    return torch.compile(fn_or_module, backend="inductor", dynamic=dynamic, fullgraph=fullgraph)
