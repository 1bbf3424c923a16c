"""The in-memory checkpoint tier (memory_copy.py, memory_tier.py, state_keeper.py).

Pure checks first (a plain torch model, no processes): what a copy holds, the in-place
restore and its refusals, the reused host buffers, checksums, the keeper's bookkeeping. Then
with the session's Ray: a MemoryTier in this process against a real keeper (local and keeper
restores, a corrupted copy, a dead keeper). Then the real stack at tiny sizes, under the e2e
lock: two Ray actors train the project's sharded DLRM (TorchRec DMP on gloo, fused Adagrad,
dense Adam) and save to memory; a restore is bitwise the saved state and training continues
bitwise; rank 1 is SIGKILLed and rank 0 ends, their copies stay in the keeper, and two spare
processes restore them into freshly built models (bitwise, and training on from them is
bitwise the first run); a corrupted copy is refused.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import signal
import sys
import time

import numpy as np
import pytest
import torch

from ettflow.trainer.checkpoint import CheckpointError, TrainState
from ettflow.trainer.checkpoint.memory_copy import (
    RANK_STATE,
    RNG_TORCH,
    CopyMeta,
    HostCopy,
    apply,
    byte_view,
    checksum,
    layout_of,
    local_tensors,
    tensors_of,
)
from ettflow.trainer.checkpoint.memory_tier import MemoryCopyError, MemoryTier
from ettflow.trainer.checkpoint.state_keeper import CopyIndex, keeper_name

pytestmark = pytest.mark.filterwarnings("ignore")


# -- independent of the module under test: every tensor and RNG state, hashed by path ----------


def _walk(obj, path: str, out: dict) -> None:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, f"{path}/{k}", out)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _walk(v, f"{path}/{i}", out)
    elif isinstance(obj, ShardedTensor):
        for s in obj.local_shards():
            _walk(s.tensor, f"{path}@{s.metadata.shard_offsets}", out)
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().contiguous()
        out[path] = f"{t.dtype}{list(t.shape)}:" + hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest()
    else:
        out[path] = repr(obj)


def fingerprint(state: TrainState) -> dict[str, str]:
    out: dict[str, str] = {}
    _walk(state.model.state_dict(), "model", out)
    for name, opt in state.optimizers.items():
        _walk(opt.state_dict(), f"optim/{name}", out)
    out["rng"] = repr((torch.get_rng_state().tolist(), random.getstate(), np.random.get_state()[1].tolist()))
    return out


# -- pure: a plain model and Adam ----------------------------------------------------------------


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


def test_a_copy_restores_in_place_bitwise_and_refuses_what_does_not_fit():
    state = plain_state()
    for s in range(2):
        plain_step(state, s)
    saved = fingerprint(state)
    host = HostCopy().capture(local_tensors(state, step=2, rank=0))
    assert sorted(n for n in host if not n.startswith("model/")) == [
        "optim/dense/state/0/exp_avg", "optim/dense/state/0/exp_avg_sq", "optim/dense/state/0/step",
        "optim/dense/state/1/exp_avg", "optim/dense/state/1/exp_avg_sq", "optim/dense/state/1/step",
        "optim/dense/state/2/exp_avg", "optim/dense/state/2/exp_avg_sq", "optim/dense/state/2/step",
        "optim/dense/state/3/exp_avg", "optim/dense/state/3/exp_avg_sq", "optim/dense/state/3/step",
        RNG_TORCH, RANK_STATE]
    params = [id(p) for p in state.model.parameters()]
    moments = [id(v) for s in state.optimizers["dense"].state.values() for v in s.values()]
    for s in range(2, 5):
        plain_step(state, s)
    assert fingerprint(state) != saved

    assert apply(state, host, rank=0) == (2, {"row": 4})
    assert fingerprint(state) == saved and (state.step, state.cursor) == (2, {"row": 4})
    assert [id(p) for p in state.model.parameters()] == params  # in place: the same objects
    assert [id(v) for s in state.optimizers["dense"].state.values() for v in s.values()] == moments

    # into a fresh model (Adam has no moments yet): the lazy state is made, then filled
    fresh = plain_state()
    apply(fresh, host, rank=0)
    assert fingerprint(fresh) == saved

    # shapes, dtypes and names must match exactly; a refused copy changes nothing
    for other, why in ((plain_state(width=5), "model/0.weight: copy has float32 [3, 4], model has float32 [5, 4]"),
                       (plain_state(dtype=torch.float64), "model/0.bias: copy has float32 [3], model has float64 [3]")):
        plain_step(other, 0)  # its optimizer state exists (a refusal may create a fresh model's lazy state)
        before = fingerprint(other)
        with pytest.raises(MemoryCopyError, match=rf"rank 1: the in-memory copy does not fit .*{re.escape(why)}"):
            apply(other, host, rank=1)
        assert fingerprint(other) == before
    with pytest.raises(MemoryCopyError,
                       match="missing model/1.bias; unexpected model/x; missing rank/state; rank/state must hold"):
        apply(fresh, {**{k: v for k, v in host.items() if k not in ("model/1.bias", RANK_STATE)},
                      "model/x": torch.zeros(1)}, rank=0)
    assert issubclass(MemoryCopyError, CheckpointError)


def test_host_buffers_are_reused_and_the_checksum_covers_bytes_and_layout():
    state = plain_state()
    plain_step(state, 0)
    copier = HostCopy()
    first = copier.capture(local_tensors(state, step=1, rank=0))
    pointers = {n: t.data_ptr() for n, t in first.items() if n != RANK_STATE}  # JSON text: its length varies
    plain_step(state, 1)
    second = copier.capture(local_tensors(state, step=2, rank=0))
    assert {n: t.data_ptr() for n, t in second.items() if n != RANK_STATE} == pointers
    assert torch.equal(second["model/0.weight"], state.model[0].weight)

    layout = layout_of(second)
    arrays = [byte_view(t) for t in second.values()]
    meta = CopyMeta(step=2, rank=0, world_size=1, cursor={"row": 4}, nbytes=sum(a.size for a in arrays),
                    layout=layout).with_checksum(arrays)
    assert CopyMeta.from_json(meta.to_json()) == meta
    meta.verify(arrays)
    assert {n: torch.equal(t, second[n]) for n, t in tensors_of(layout, arrays).items()} == dict.fromkeys(second, True)
    damaged = [a.copy() for a in arrays]
    damaged[0][5] ^= 1
    with pytest.raises(MemoryCopyError, match="in-memory copy of rank 0 at step 2 is damaged: checksum"):
        meta.verify(damaged)
    renamed = (("model/other", *layout[0][1:]), *layout[1:])
    assert checksum(renamed, arrays) != meta.checksum
    with pytest.raises(MemoryCopyError, match="malformed copy metadata"):
        CopyMeta.from_json({**meta.to_json(), "layout": [["x", "float32"]]})
    with pytest.raises(MemoryCopyError, match="unknown dtype 'pickle'"):
        tensors_of((("x", "pickle", (1,)),), [np.zeros(4, np.uint8)])


def _meta(rank: int, step: int, world_size: int = 2) -> dict:
    return {"rank": rank, "step": step, "world_size": world_size}


def test_the_keeper_index_keeps_the_newest_two_per_rank_and_finds_the_newest_common_step():
    index = CopyIndex()
    assert index.latest_common(2) is None
    assert index.store(_meta(0, 10), "a") == [] and index.store(_meta(1, 10), "b") == []
    assert index.store(_meta(0, 20), "c") == [] and index.latest_common(2) == 10  # rank 1 has no 20 yet
    assert index.store(_meta(0, 30), "d") == [10]
    assert index.inventory() == {0: [20, 30], 1: [10]} and index.latest_common(2) is None
    assert index.store(_meta(1, 20), "e") == [] and index.latest_common(2) == 20
    assert index.store(_meta(1, 30), "f") == [10] and index.latest_common(2) == 30
    assert index.latest_common(1) is None  # copies of 2 ranks do not restore a 1-rank job
    index.store(_meta(0, 40, world_size=1), "g")
    assert index.latest_common(1) == 40 and index.latest_common(2) == 30
    assert index.get(1, 30) == (_meta(1, 30), "f") and index.get(1, 10) is None
    assert keeper_name("r1") == "ettflow-keeper-r1"
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        CopyIndex(keep=0)


# -- with Ray: a MemoryTier in this process and a real keeper --------------------------------------


def test_memory_tier_saves_to_the_keeper_restores_and_refuses_damaged_or_missing_copies(ray_session):
    import ray

    from ettflow.trainer.checkpoint.state_keeper import find_keeper, start_keeper

    keeper = start_keeper("memtier-unit")
    assert find_keeper("memtier-unit")._actor_id == keeper._actor_id
    done = []
    tier = MemoryTier(keeper, 0, 1, on_done=done.append)
    state = plain_state()
    marks = {}
    for s in range(4):
        plain_step(state, s)
        assert tier.save(s + 1, state) >= 0
        marks[s + 1] = fingerprint(state)
    tier.wait()
    outcomes = [(r.step, r.ok, r.nbytes > 0, r.end >= r.start) for r in done]
    assert outcomes == [(s, True, True, True) for s in range(1, 5)]
    assert ray.get(keeper.inventory.remote()) == {0: [3, 4]} and tier.latest_common() == 4

    plain_step(state, 4)
    restored = tier.restore(state, 4)
    assert (restored["where"], restored["step"], restored["cursor"]) == ("local", 4, {"row": 8})
    assert fingerprint(state) == marks[4]
    assert tier.restore(state, 3)["where"] == "keeper" and fingerprint(state) == marks[3]
    with pytest.raises(MemoryCopyError, match=r"holds no copy of rank 0 at step 2 \(it holds steps \[3, 4\]\)"):
        tier.restore(state, 2)
    ray.get(keeper.corrupt.remote(0, 3))
    with pytest.raises(MemoryCopyError, match="copy of rank 0 at step 3 is damaged"):
        tier.restore(state, 3)
    assert fingerprint(state) == marks[3]  # refused before anything was copied

    ray.kill(keeper, no_restart=True)  # the keeper is gone: saves go on, restores say why
    plain_step(state, 3)
    tier.save(5, state)
    assert not tier.wait().ok and done[-1].error
    with pytest.raises(MemoryCopyError, match="copy of rank 0 at step 3 is unreachable"):
        tier.restore(state, 3)
    assert tier.restore(state, 5)["where"] == "local"  # its own copy needs no keeper
    tier.close()


# -- the real stack: the project's sharded DLRM on 2 gloo ranks, in Ray actors ----------------------

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

        from ettflow.trainer.data.schema import criteo_schema
        from ettflow.trainer.model import DenseStep, ModelConfig, build_dlrm, dense_optimizer, shard

        self.schema = criteo_schema(20)
        config = ModelConfig(embedding_dim=4, dense_arch=(8, 4), over_arch=(8, 1))
        dmp = shard(build_dlrm(config, self.schema, device=torch.device("cpu")), config, dist.group.WORLD,
                    torch.device("cpu"))
        self.dense_opt = dense_optimizer(dmp, config)
        self.step_fn = DenseStep(dmp.module)
        self.state = TrainState(model=dmp, optimizers={"sparse": dmp.fused_optimizer, "dense": self.dense_opt})

    def train(self, start: int, stop: int) -> None:
        import torch.distributed as dist

        from ettflow.trainer.data.batch import synthetic_batch
        from ettflow.trainer.model import dense_parameters, sync_dense_grads

        params = dense_parameters(self.state.model)
        for s in range(start, stop):
            batch = synthetic_batch(self.schema, 8, seed=1000 * s + self.rank)
            self.dense_opt.zero_grad(set_to_none=True)
            embedded = self.state.model.module.sparse_arch(batch.sparse)
            loss, _ = self.step_fn(batch.dense, embedded, batch.labels)
            loss.backward()
            sync_dense_grads(params, dist.group.WORLD)
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

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not on the workers' path
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
