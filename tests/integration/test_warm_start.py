"""Warm start: a run restores model and optimizer state from its parent's anchor, from 2 ranks to 1.

1. Checkpoint level (spawned gloo ranks, no Ray): a sharded DLRM trained on 2 ranks is saved
   through CheckpointManager (`helpers.training`); one rank with its own sharding plan
   restores it with `load_parent` (DCP reshards), and every parameter and fused/dense
   optimizer tensor equals the saved one bit for bit; the per-rank step, cursor and RNG are
   not required.
2. Trainer level (the real trainer on Ray): a 1-rank run warm starts from a 2-rank run's
   anchor: the `checkpoint_restore` phase says source=parent, the restored state's
   fingerprint matches the parent anchor, the step counter starts at 0 with a fresh cursor at
   the start of its own window, and a kill inside the run restores the run's OWN checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ettflow.trainer.data.schema import criteo_schema
from ettflow.trainer.model import ModelConfig

from helpers.training import AnchorRun, build_sharded, train_and_anchor

SCHEMA = criteo_schema(64)
MODEL = ModelConfig(embedding_dim=4, dense_arch=(8, 4), over_arch=(8, 1))
WINDOWS = ("window=2024010100", "window=2024010101")
BATCH, STEPS = 32, 4


def _flat(obj, prefix=""):
    """Nested state dicts -> {dotted key: tensor} (ShardedTensors as themselves)."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj} if isinstance(obj, torch.Tensor) else {}


def _parent(root: Path) -> AnchorRun:
    """The 2-rank parent: STEPS steps of the first window, its anchor under `root/parent`."""
    return AnchorRun(root=str(root), name="parent", model=MODEL, schema=SCHEMA, windows=WINDOWS[:1],
                     batch_size=BATCH, world_size=2, steps=STEPS)


def _child_worker(rank: int, root: str) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ettflow.trainer.checkpoint import CheckpointConfig, CheckpointManager
    from ettflow.trainer.checkpoint.fingerprint import fingerprint_mismatches, state_fingerprint
    from ettflow.trainer.checkpoint.state import init_lazy_optimizer_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/pg1", rank=0, world_size=1)
    child = build_sharded(MODEL, SCHEMA)  # its own sharding plan, on 1 rank
    dmp, opt, state = child.dmp, child.opt, child.state
    init_lazy_optimizer_state(opt)  # the load template holds the dense optimizer's state
    anchor = _parent(Path(root)).anchor_dir()
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
    mp.spawn(train_and_anchor, args=(_parent(tmp_path),), nprocs=2, join=True)
    mp.spawn(_child_worker, args=(str(tmp_path),), nprocs=1, join=True)
    out = torch.load(tmp_path / "child.pt", weights_only=False)
    assert out["parent_world"] == 2 and out["moved"]
    # every tensor of the model and of both optimizers (26 tables: weights and Adagrad state)
    assert out["sparse"] >= 26 and out["optim"] >= 26 and out["bad"] == []
    # step and cursor are not taken from the parent: the new run starts its own
    assert out["step"] == 0 and out["cursor"] == {}
