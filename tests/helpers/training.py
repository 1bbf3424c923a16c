"""A small training run on spawned gloo ranks (no Ray, no trainer), saved as an anchor: the
parent checkpoint of the publish, gate and warm-start tests.

    run = AnchorRun(root=str(tmp_path), name="parent", model=MODEL, schema=SCHEMA,
                    windows=(WINDOW,), batch_size=32, world_size=2, steps=4)
    mp.spawn(train_and_anchor, args=(run,), nprocs=run.world_size, join=True)
    anchor = run.anchor_dir()  # <root>/<name>/step_<N>: committed, and marked by write_anchor

Each rank builds the project's sharded DLRM (`build_sharded`: `build_dlrm` + `shard` on the
world group, CPU), trains on its part of the `DataPipeline` batches of `windows` (`DenseStep`,
the training group's `average_grads`, dense Adam; the fused embedding optimizer updates in backward), saves
through a sync `CheckpointManager` on a process group of its own, and rank 0 marks the
checkpoint as an anchor (`write_anchor`: run id, step, cursor, world size, model, schema and
the trained windows). What the tests differ in is a field of `AnchorRun`; a test that needs
the trained model once more (before the process group goes) passes `after`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class AnchorRun:
    """One run: data under `<root>/data`, the checkpoints under `<root>/<name>` (`name` is
    also the anchor's run id), the process group's rendezvous file `<root>/pg-<name>`.

    `steps`: stop after this many steps; None: every batch of `windows`, `epochs` times."""

    root: str
    name: str
    model: Any  # ettflow.trainer.model.ModelConfig
    schema: Any  # ettflow.trainer.data.schema.FeatureSchema
    windows: tuple[str, ...]
    batch_size: int
    world_size: int = 1
    steps: int | None = None
    epochs: int = 1

    @property
    def checkpoints(self) -> Path:
        return Path(self.root) / self.name

    def anchor_dir(self, step: int | None = None) -> Path:
        """The anchor checkpoint (`step`: default `steps`, else the one committed step)."""
        if step is None and self.steps is None:
            (found,) = self.checkpoints.glob("step_*")
            return found
        from ettflow.trainer.checkpoint.layout import final_dir

        return final_dir(self.checkpoints, self.steps if step is None else step)


@dataclass
class Sharded:
    """A rank's sharded DLRM and what trains it."""

    dmp: Any  # torchrec DistributedModelParallel
    step_fn: Any  # ettflow.trainer.model.DenseStep
    opt: torch.optim.Optimizer  # the dense Adam
    state: Any  # ettflow.trainer.checkpoint.TrainState over the fused and the dense optimizer


def build_sharded(model, schema) -> Sharded:
    """The project's DLRM, sharded on the world group (CPU), with its dense optimizer."""
    from ettflow.trainer.checkpoint import TrainState
    from ettflow.trainer.collectives import training_group
    from ettflow.trainer.model import DenseStep, build_dlrm, dense_optimizer, shard

    cpu = torch.device("cpu")
    dmp = shard(build_dlrm(model, schema, device=cpu), model, training_group(dist.group.WORLD, cpu))
    opt = dense_optimizer(dmp, model)
    state = TrainState(model=dmp, optimizers={"sparse": dmp.fused_optimizer, "dense": opt})
    return Sharded(dmp=dmp, step_fn=DenseStep(dmp.module), opt=opt, state=state)


def train(rank: int, run: AnchorRun, sharded: Sharded) -> tuple[int, Any]:
    """Train as `run` says; (steps taken, the data cursor after the last batch)."""
    from ettflow.trainer.collectives import training_group
    from ettflow.trainer.data.pipeline import DataConfig, DataPipeline
    from ettflow.trainer.model import dense_parameters

    params = dense_parameters(sharded.dmp)
    group = training_group(dist.group.WORLD, torch.device("cpu"))
    data = DataPipeline(DataConfig(root=f"{run.root}/data", schema=run.schema, batch_size=run.batch_size,
                                   rank=rank, world_size=run.world_size, windows=run.windows))
    step, cursor = 0, None
    for _ in range(run.epochs):
        for batch in data.batches():
            sharded.opt.zero_grad(set_to_none=True)
            loss, _ = sharded.step_fn(batch.dense, sharded.dmp.module.sparse_arch(batch.sparse), batch.labels)
            loss.backward()
            group.average_grads(params)
            sharded.opt.step()
            step, cursor = step + 1, batch.cursor_end
            if step == run.steps:
                return step, cursor
    return step, cursor


def train_and_anchor(rank: int, run: AnchorRun,
                     after: Callable[[int, AnchorRun, Sharded, Path], None] | None = None) -> None:
    """One rank of `run` (an `mp.spawn` target): train, save, mark the anchor (rank 0); then
    `after(rank, run, sharded, anchor)` on every rank (a module-level function: it is pickled),
    while the process group is still up."""
    from ettflow.trainer.checkpoint import CheckpointConfig, CheckpointManager
    from ettflow.trainer.checkpoint.anchor import write_anchor
    from ettflow.trainer.checkpoint.layout import final_dir

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{run.root}/pg-{run.name}", rank=rank,
                            world_size=run.world_size)
    ckpt_pg = dist.new_group(backend="gloo")  # every rank, same order
    sharded = build_sharded(run.model, run.schema)
    step, cursor = train(rank, run, sharded)
    manager = CheckpointManager(CheckpointConfig(root=str(run.checkpoints), mode="sync"), process_group=ckpt_pg)
    dist.barrier()  # rank 0's manager cleans the root's .tmp folders as it starts: before any rank saves
    sharded.state.step, sharded.state.cursor = step, cursor.to_dict()
    manager.save(step, sharded.state)
    manager.close()
    anchor = final_dir(run.checkpoints, step)
    if rank == 0:
        write_anchor(anchor, {"run_id": run.name, "step": step, "cursor": cursor.to_dict(),
                              "world_size": run.world_size, "model": asdict(run.model),
                              "schema": run.schema.to_dict(), "windows": list(run.windows)})
    if after is not None:
        after(rank, run, sharded, anchor)
    dist.barrier()
    dist.destroy_process_group()
