"""A plain torch model (two Linear layers) with Adam in a TrainState, and one training step of
it that also moves every RNG (as data loading would): the smallest state a checkpoint tier
saves and restores, without TorchRec or a process group."""

from __future__ import annotations

import random

import numpy as np
import torch

from ettflow.trainer.checkpoint import TrainState


def plain_state(width: int = 3, dtype=torch.float32) -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 1)).to(dtype)
    return TrainState(model=model, optimizers={"dense": torch.optim.Adam(model.parameters(), lr=0.1)})


def plain_step(state: TrainState, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    opt = state.optimizers["dense"]
    opt.zero_grad()
    dtype = next(state.model.parameters()).dtype
    state.model(torch.randn(2, 4, generator=g).to(dtype)).square().sum().backward()
    opt.step()
    torch.rand(1), random.random(), np.random.rand()  # the RNG moves on, as data loading would move it
    state.step, state.cursor = step + 1, {"row": 2 * (step + 1)}
