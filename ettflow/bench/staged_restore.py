"""A warm start's restore from an anchor staged in memory, against the same restore from disk.

    PYTHONPATH=. python -m ettflow.bench.staged_restore [--reps 5] [--num-embeddings 20000 200000]

For each size, one process builds the bench's tables (criteo_schema(n): 26 tables of n rows,
dimension 16, here as plain EmbeddingBags in one unsharded process) and the DLRM's dense MLP,
trains one step with Adam (so every optimizer state exists) and saves a committed checkpoint
(`CheckpointManager`, sync). Then, interleaved `reps` times, a fresh state warm starts from it
(`load_parent`, what a rank's `checkpoint_restore` calls):

- disk: what a rank without a staged copy does: `verify` (size and sha256 of every file
  against the manifest), then DCP reads the files. The page cache holds the just-written
  anchor: the disk's best case (a fleet's anchor on remote storage is read cold);
- staged: `stage_anchor` (a pooled worker's part, while it prewarms: off the run's clock),
  then `load_parent(..., staged=)` (the run's part: the checked bytes, no read, no hashing).

A row's value is the median over reps, in seconds; `ratio` is disk over staged restore.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def _state(num_embeddings: int, seed: int):
    import torch
    from torch import nn

    from ettflow.trainer.checkpoint import TrainState
    from ettflow.trainer.data.schema import criteo_schema

    torch.manual_seed(seed)
    schema = criteo_schema(num_embeddings)
    model = nn.ModuleDict({
        "tables": nn.ModuleDict({f.name: nn.EmbeddingBag(f.num_embeddings, 16, mode="sum") for f in schema.sparse}),
        "dense": nn.Sequential(nn.Linear(len(schema.dense), 64), nn.ReLU(), nn.Linear(64, 16)),
    })
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loss = sum(t(torch.randint(0, t.num_embeddings, (32, 1))).sum() for t in model["tables"].values())
    (loss + model["dense"](torch.rand(32, len(schema.dense))).sum()).backward()
    opt.step()
    return TrainState(model=model, optimizers={"dense": opt})


def measure(num_embeddings: int, reps: int, root: Path) -> dict[str, float]:
    from ettflow.trainer.checkpoint import CheckpointConfig, CheckpointManager
    from ettflow.trainer.checkpoint.layout import final_dir
    from ettflow.trainer.checkpoint.staged_anchor import stage_anchor

    with CheckpointManager(CheckpointConfig(root=root / "anchor", mode="sync")) as mgr:
        mgr.save(1, _state(num_embeddings, 0))
    anchor = final_dir(root / "anchor", 1)
    nbytes = sum(f.stat().st_size for f in anchor.iterdir())
    disk, stage, staged = [], [], []
    with CheckpointManager(CheckpointConfig(root=root / "reader", mode="sync")) as reader:
        for _ in range(reps):
            fresh = _state(num_embeddings, 1)
            t0 = time.perf_counter()
            reader.load_parent(fresh, anchor)
            disk.append(time.perf_counter() - t0)
            fresh = _state(num_embeddings, 1)
            t0 = time.perf_counter()
            copy = stage_anchor(anchor, max_bytes=1 << 40, wait_s=0)
            stage.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            reader.load_parent(fresh, anchor, staged=copy)
            staged.append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in (("disk", disk), ("stage", stage), ("staged", staged))}
    return {"MB": nbytes / 1e6, "disk_restore_s": med["disk"], "staging_s_off_clock": med["stage"],
            "staged_restore_s": med["staged"], "ratio": med["disk"] / med["staged"]}


def main(argv: list[str] | None = None) -> int:
    import warnings

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--num-embeddings", type=int, nargs="+", default=[20_000, 200_000])
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    cols = ["MB", "disk_restore_s", "staging_s_off_clock", "staged_restore_s", "ratio"]
    print(f"{'rows/table':>10} " + " ".join(f"{c:>20}" for c in cols))
    for n in args.num_embeddings:
        with tempfile.TemporaryDirectory() as tmp:
            row = measure(n, args.reps, Path(tmp))
        print(f"{n:>10} " + " ".join(f"{row[c]:>20.3f}" for c in cols), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
