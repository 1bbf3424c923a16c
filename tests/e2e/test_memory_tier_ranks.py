"""The in-memory checkpoint tier on the real stack at tiny sizes, under the e2e lock: two Ray
actors train the project's sharded DLRM (TorchRec DMP on gloo, fused Adagrad, dense Adam) and
save to memory; a restore is bitwise the saved state and training continues bitwise; rank 1 is
SIGKILLed and rank 0 ends, their copies stay in the keeper, and two spare processes restore
them into freshly built models (bitwise, and training on from them is bitwise the first run);
a corrupted copy is refused. (The tier's pure parts: tests/unit/test_memory_copy.py; against a
real keeper in this process: tests/integration/test_memory_tier.py.)
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time

import numpy as np
import pytest
import torch

from ettflow.trainer.checkpoint import TrainState
from ettflow.trainer.checkpoint.memory_tier import MemoryCopyError, MemoryTier

import helpers.state_fingerprint
from helpers.state_fingerprint import fingerprint

pytestmark = pytest.mark.slow

WORLD = 2


class Rank:
    """One trainer-like process: the project's model (model.py), sharded on gloo, and a MemoryTier."""

    def __init__(self) -> None:
        torch.set_num_threads(1)

    def pid(self) -> int:
        return os.getpid()

    def join(self, init_file: str, rank: int, run_id: str) -> None:
        import torch.distributed as dist

        from ettflow.trainer.checkpoint.state_keeper import find_keeper

        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
        self.rank = rank
        self.tier = MemoryTier(find_keeper(run_id), rank, WORLD)

    def build(self) -> None:
        import torch.distributed as dist

        from ettflow.trainer.collectives import training_group
        from ettflow.trainer.data.schema import criteo_schema
        from ettflow.trainer.model import DenseStep, ModelConfig, build_dlrm, dense_optimizer, shard

        self.schema = criteo_schema(20)
        config = ModelConfig(embedding_dim=4, dense_arch=(8, 4), over_arch=(8, 1))
        dmp = shard(build_dlrm(config, self.schema, device=torch.device("cpu")), config,
                    training_group(dist.group.WORLD, torch.device("cpu")))
        self.dense_opt = dense_optimizer(dmp, config)
        self.step_fn = DenseStep(dmp.module)
        self.state = TrainState(model=dmp, optimizers={"sparse": dmp.fused_optimizer, "dense": self.dense_opt})

    def train(self, start: int, stop: int) -> None:
        import torch.distributed as dist

        from ettflow.trainer.collectives import training_group
        from ettflow.trainer.data.batch import synthetic_batch
        from ettflow.trainer.model import dense_parameters

        params = dense_parameters(self.state.model)
        group = training_group(dist.group.WORLD, torch.device("cpu"))
        for s in range(start, stop):
            batch = synthetic_batch(self.schema, 8, seed=1000 * s + self.rank)
            self.dense_opt.zero_grad(set_to_none=True)
            embedded = self.state.model.module.sparse_arch(batch.sparse)
            loss, _ = self.step_fn(batch.dense, embedded, batch.labels)
            loss.backward()
            group.average_grads(params)
            self.dense_opt.step()
            torch.rand(1), random.random(), np.random.rand()
            self.state.step, self.state.cursor = s + 1, {"row": 16 * (s + 1)}

    def save(self, step: int) -> bool:
        self.tier.save(step, self.state)
        return self.tier.wait().ok

    def fingerprint(self) -> dict[str, str]:
        return fingerprint(self.state)

    def restore(self, step: int, source_rank: int | None = None) -> dict:
        try:
            return self.tier.restore(self.state, step, source_rank=source_rank)
        except MemoryCopyError as e:
            return {"error": str(e)}


def _ranks(n: int) -> list:
    import ray

    # tests/ is not on the workers' path: this module and the helper it calls travel by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(helpers.state_fingerprint)
    return [ray.remote(Rank).options(num_cpus=1, max_restarts=0).remote() for _ in range(n)]


def _on_all(actors: list, method: str, *args) -> list:
    import ray

    return ray.get([getattr(a, method).remote(*args) for a in actors])


@pytest.mark.timeout(600)
def test_sharded_dlrm_restores_from_memory_and_a_spare_takes_a_killed_ranks_copy(ray_session, tmp_path):
    import ray

    from ettflow.trainer.checkpoint.state_keeper import start_keeper

    keeper = start_keeper("memtier-e2e")
    ranks = _ranks(WORLD)
    ray.get([r.join.remote(str(tmp_path / "pg1"), i, "memtier-e2e") for i, r in enumerate(ranks)])
    _on_all(ranks, "build")
    _on_all(ranks, "train", 0, 2)
    assert _on_all(ranks, "save", 2) == [True, True]
    at2 = _on_all(ranks, "fingerprint")
    _on_all(ranks, "train", 2, 4)
    assert _on_all(ranks, "save", 4) == [True, True]
    at4 = _on_all(ranks, "fingerprint")
    _on_all(ranks, "train", 4, 7)
    at7 = _on_all(ranks, "fingerprint")
    assert at7[0] != at4[0] and at7[1] != at4[1]
    assert any(k.startswith("optim/sparse/") for k in at4[0]), "the fused embedding optimizer state is covered"
    assert ray.get(keeper.inventory.remote()) == {0: [2, 4], 1: [2, 4]}
    assert ray.get(keeper.latest_common.remote(WORLD)) == 4

    # restore the newest copy (each rank's own, in host memory): bitwise step 4; training from
    # it is bitwise the same run (the live tensors, fused optimizer state included, were restored)
    restored = _on_all(ranks, "restore", 4)
    assert [(r["where"], r["step"], r["cursor"]) for r in restored] == [("local", 4, {"row": 64})] * WORLD
    assert _on_all(ranks, "fingerprint") == at4
    _on_all(ranks, "train", 4, 7)
    assert _on_all(ranks, "fingerprint") == at7
    assert [r["where"] for r in _on_all(ranks, "restore", 2)] == ["keeper"] * WORLD  # older: from the keeper
    assert _on_all(ranks, "fingerprint") == at2

    # SIGKILL rank 1 (the process that saved its copies), then end rank 0: the keeper keeps their copies
    pid = ray.get(ranks[1].pid.remote())
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    ray.kill(ranks[0], no_restart=True)
    assert ray.get(keeper.inventory.remote()) == {0: [2, 4], 1: [2, 4]}

    # two spare processes take the ranks' places: fresh models, each rank's copy from the keeper
    group = _ranks(WORLD)
    ray.get([r.join.remote(str(tmp_path / "pg2"), i, "memtier-e2e") for i, r in enumerate(group)])
    _on_all(group, "build")
    assert _on_all(group, "fingerprint") != at4
    back = ray.get([r.restore.remote(4, i) for i, r in enumerate(group)])
    assert [(b["where"], b["source_rank"], b["step"]) for b in back] == [("keeper", 0, 4), ("keeper", 1, 4)]
    assert _on_all(group, "fingerprint") == at4
    _on_all(group, "train", 4, 7)
    assert _on_all(group, "fingerprint") == at7

    # a corrupted copy is refused (the caller falls back to the durable checkpoint), nothing changed
    ray.get(keeper.corrupt.remote(1, 2))
    refused = ray.get(group[1].restore.remote(2, 1))
    assert "in-memory copy of rank 1 at step 2 is damaged: checksum" in refused["error"], refused
    assert ray.get(group[1].fingerprint.remote()) == at7[1]
    for actor in (*group, keeper):
        ray.kill(actor, no_restart=True)
