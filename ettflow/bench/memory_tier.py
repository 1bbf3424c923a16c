"""What a memory save blocks, beside a durable async and a sync DCP save, on the bench's model.

    PYTHONPATH=. python -m ettflow.bench.memory_tier [--reps 5] [--num-embeddings 20000]

Two Ray actors (the ranks) build the bench's default model (`jobs.trainer_config`:
criteo_schema(20_000), embedding_dim 16, 2 gloo ranks: model.py's sharded DLRM with fused
Adagrad and dense Adam, one trained step so every optimizer state exists) and save it,
interleaved, `reps` times each way:

- memory: `MemoryTier.save` (the host copy) and its background part (checksum, hand-off to
  the run's keeper, which puts the copy into the object store as its own object);
- async: `CheckpointManager(mode="async").save` (DCP staging) and its background write+commit;
- sync: `CheckpointManager(mode="sync").save` (the whole write and commit).

Beside them, the hand-off options the memory tier chose between (`memory_tier.py`): the rank's
own `ray.put` (the lower bound, but the object dies with the rank), the keeper keeping the
bytes in its heap, and the keeper's own object store object (what the tier does); and the
restores: own host copy, the keeper's copy, the durable checkpoint. A row's value is the
median over reps of the slower rank's seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

RUN_ID = "bench-memory-tier"


class HeapKeeper:
    """The alternative keeper: holds each copy's bytes in its own heap (numpy copies)."""

    def __init__(self) -> None:
        self.copies: dict = {}

    def store(self, meta: dict, arrays: list) -> None:
        import numpy as np

        self.copies[(meta["rank"], meta["step"] % 2)] = [np.array(a, copy=True) for a in arrays]  # 2 per rank


class BenchRank:
    def __init__(self, rank: int, world_size: int, init_file: str, root: str, num_embeddings: int) -> None:
        import torch

        from ettflow.trainer.checkpoint import CheckpointConfig, CheckpointManager, TrainState
        from ettflow.trainer.checkpoint.memory_tier import MemoryTier
        from ettflow.trainer.checkpoint.state_keeper import find_keeper
        from ettflow.trainer.collectives import Groups
        from ettflow.trainer.data.batch import synthetic_batch
        from ettflow.trainer.data.schema import criteo_schema
        from ettflow.trainer.model import (
            DenseStep,
            ModelConfig,
            build_dlrm,
            dense_optimizer,
            dense_parameters,
            shard,
        )

        torch.set_num_threads(1)
        cpu = torch.device("cpu")
        groups = Groups.form(cpu, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        self.rank, self.world_size = rank, world_size
        schema, config = criteo_schema(num_embeddings), ModelConfig()
        dmp = shard(build_dlrm(config, schema, device=cpu), config, groups.training)
        dense_opt = dense_optimizer(dmp, config)
        batch = synthetic_batch(schema, 256, seed=rank)
        loss, _ = DenseStep(dmp.module)(batch.dense, dmp.module.sparse_arch(batch.sparse), batch.labels)
        loss.backward()
        groups.training.average_grads(dense_parameters(dmp))
        dense_opt.step()
        self.state = TrainState(model=dmp, optimizers={"sparse": dmp.fused_optimizer, "dense": dense_opt},
                                cursor={"row": 0})
        ckpt_pg = groups.checkpoint.pg
        self.async_mgr = CheckpointManager(CheckpointConfig(root=f"{root}/async", mode="async", keep_last=2),
                                           process_group=ckpt_pg)
        self.sync_mgr = CheckpointManager(CheckpointConfig(root=f"{root}/sync", mode="sync", keep_last=2),
                                          process_group=ckpt_pg)
        self.tier = MemoryTier(find_keeper(RUN_ID), rank, world_size)

    def save(self, kind: str, step: int) -> dict:
        if kind == "memory":
            blocking = self.tier.save(step, self.state)
            done = self.tier.wait()
            return {"blocking_s": blocking, "background_s": done.background_s, "ok": done.ok,
                    "nbytes": done.nbytes}
        manager = self.async_mgr if kind == "async" else self.sync_mgr
        result = manager.save(step, self.state)
        commit = manager.wait() or result.commit_result()
        return {"blocking_s": result.blocking_s, "background_s": commit.background_s, "ok": commit.committed,
                "nbytes": commit.nbytes}

    def hand_off(self, how: str, keeper, step: int) -> float:
        """Seconds to hand the current host copy over `how` (checksum excluded)."""
        import ray

        from ettflow.trainer.checkpoint.memory_copy import CopyMeta, byte_view

        arrays = [byte_view(t) for t in self.tier._host.buffers.values()]
        meta = CopyMeta(step=step, rank=self.rank, world_size=self.world_size, cursor={},
                        nbytes=sum(a.nbytes for a in arrays), layout=())
        start = time.perf_counter()
        if how == "own put":
            ref = ray.put(arrays)
            del ref
        else:
            ray.get(keeper.store.remote(meta, arrays))
        return time.perf_counter() - start

    def checksum_s(self) -> float:
        from ettflow.trainer.checkpoint.memory_copy import byte_view, checksum, layout_of

        host = self.tier._host.buffers
        start = time.perf_counter()
        checksum(layout_of(host), [byte_view(t) for t in host.values()])
        return time.perf_counter() - start

    def restore(self, how: str, step: int) -> float:
        start = time.perf_counter()
        if how == "durable":
            self.sync_mgr.load(self.state, self.sync_mgr.latest())
        else:
            if how == "memory (keeper)":
                self.tier._local = None  # as a process that has no copy of its own: a spare
            where = self.tier.restore(self.state, step)["where"]
            assert where == ("local" if how == "memory (own copy)" else "keeper"), where
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--num-embeddings", type=int, default=20_000)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from ettflow.trainer.checkpoint.state_keeper import HAND_OFFS, StateKeeper, start_keeper
    from ettflow.trainer.group.ray_group import ensure_ray

    ensure_ray()
    keeper = start_keeper(RUN_ID)  # held: the keeper lives while the driver holds its handle
    with tempfile.TemporaryDirectory(prefix="ettflow-bench-memory-") as tmp:
        ranks = [ray.remote(BenchRank).options(num_cpus=1).remote(
            r, args.world_size, f"{tmp}/pg", f"{tmp}/ckpt", args.num_embeddings) for r in range(args.world_size)]

        def on_all(method: str, *a) -> list:
            return ray.get([getattr(r, method).remote(*a) for r in ranks])

        rows: dict[str, list[float]] = {}
        background: dict[str, list[float]] = {}
        nbytes: dict[str, int] = {}
        step = 0
        for _ in range(args.reps):
            for kind in ("memory", "async", "sync"):
                step += 1
                out = on_all("save", kind, step)
                assert all(o["ok"] for o in out), out
                rows.setdefault(kind, []).append(max(o["blocking_s"] for o in out))
                background.setdefault(kind, []).append(max(o["background_s"] for o in out))
                nbytes[kind] = sum(o["nbytes"] for o in out) if kind == "memory" else out[0]["nbytes"]
        heap = ray.remote(HeapKeeper).options(num_cpus=0, max_concurrency=HAND_OFFS).remote()
        reput = ray.remote(StateKeeper).options(num_cpus=0, max_concurrency=HAND_OFFS).remote()
        hand: dict[str, list[float]] = {}
        for i in range(args.reps):
            for how, other in (("own put", None), ("keeper heap", heap), ("keeper object", reput)):
                hand.setdefault(how, []).append(max(on_all("hand_off", how, other, 10_000 + i)))
            hand.setdefault("checksum (sha256)", []).append(max(on_all("checksum_s")))
        last_memory = max(s for s in range(1, step + 1) if (s - 1) % 3 == 0)
        restores: dict[str, list[float]] = {}
        for _ in range(args.reps):
            for how in ("memory (own copy)", "memory (keeper)", "durable"):
                if how == "memory (own copy)":
                    on_all("save", "memory", last_memory)  # the own copy again (the keeper row cleared it)
                restores.setdefault(how, []).append(max(on_all("restore", how, last_memory)))

    med = statistics.median
    sync_s = med(rows["sync"])
    print(f"\nmemory tier vs DCP saves: criteo_schema({args.num_embeddings}), dim 16, {args.world_size} ranks, "
          f"{args.reps} reps, medians of the slower rank (s)")
    print(f"{'save':<10}{'blocking_s':>12}{'x sync':>9}{'background_s':>14}{'bytes':>14}")
    for kind in ("memory", "async", "sync"):
        print(f"{kind:<10}{med(rows[kind]):>12.4f}{med(rows[kind]) / sync_s:>9.3f}{med(background[kind]):>14.4f}"
              f"{nbytes[kind]:>14,}")
    print(f"\n{'memory hand-off (one rank copy)':<34}{'seconds':>10}")
    for how, values in hand.items():
        print(f"{how:<34}{med(values):>10.4f}")
    print(f"\n{'restore':<22}{'seconds':>10}")
    for how, values in restores.items():
        print(f"{how:<22}{med(values):>10.4f}")
    for actor in (*ranks, keeper):
        ray.kill(actor)


if __name__ == "__main__":
    main()
