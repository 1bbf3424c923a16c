"""Sharded TorchRec state through CheckpointManager, on 2 gloo ranks (CPU).

A tiny DLRM (3 embedding tables, dim 8: two table-wise, one column-wise) in a
DistributedModelParallel with a fused Adagrad embedding optimizer and a dense Adam (two
set-ups, see `build`). One spawned run checks, for DTensor output and for ShardedTensor
output (through ShardedTensorStager): async save while training continues, async staging
(the save only hands off, the next step waits before backward, later updates never reach
the checkpoint, the second save through reused buffers), sync save, restore into
a fresh model (parameters and both optimizers' state equal to what was saved, step, cursor,
RNG), bitwise continuation, fallback past a torn newest checkpoint and past one whose data
file was overwritten in place (same size: only its sha256 tells), a forged `.metadata` refused
on every rank, a full disk on one rank (a typed storage error on every rank, nothing
committed) and the removal of a leftover `.tmp` folder at the next start.

The ranks assert nothing themselves: each records what it observes (`Record`: values,
comparisons, and the outcome of every call that must raise) in a JSON file, and the test
asserts on every rank's record in its own process once `mp.spawn` has returned.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers.forged import forge_metadata

WORLD = 2
BATCH = 4
TABLES = 3


def build(output_dtensor: bool):
    """The DLRM in one of two set-ups.

    output_dtensor=True: DTensor state, fused exact rowwise Adagrad from the sharder's
        fused_params, dense Adam in a KeyedOptimizerWrapper inside a CombinedOptimizer.
    output_dtensor=False: ShardedTensor state (ShardingEnv.from_process_group), Adagrad
        fused through apply_optimizer_in_backward, a plain torch Adam for the dense part.
    """
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingEnv
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

    from ettflow.trainer.checkpoint import TrainState

    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=20 + i, feature_names=[f"f{i}"])
        for i in range(TABLES)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=4,
        dense_arch_layer_sizes=[8],
        over_arch_layer_sizes=[8, 1],
    )
    pg = dist.group.WORLD
    if output_dtensor:
        fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
        sharder = EmbeddingBagCollectionSharder(fused_params=fused)
        env = ShardingEnv(WORLD, dist.get_rank(), pg, output_dtensor=True)
    else:
        apply_optimizer_in_backward(torch.optim.Adagrad, model.sparse_arch.parameters(), {"lr": 0.1})
        sharder = EmbeddingBagCollectionSharder()
        env = ShardingEnv.from_process_group(pg)
    constraints = {
        "t0": ParameterConstraints(sharding_types=["table_wise"]),
        "t1": ParameterConstraints(sharding_types=["table_wise"]),
        "t2": ParameterConstraints(sharding_types=["column_wise"]),
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=WORLD, compute_device="cpu"), constraints=constraints
    )
    plan = planner.collective_plan(model, [sharder], pg)
    dmp = DistributedModelParallel(model, env=env, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense_params = {k: v for k, v in dmp.named_parameters() if "embedding_bags" not in k}
    if output_dtensor:
        dense = KeyedOptimizerWrapper(dense_params, lambda params: torch.optim.Adam(params, lr=0.01))
        optimizers = {"all": CombinedOptimizer([dmp.fused_optimizer, dense])}
    else:
        optimizers = {"sparse": dmp.fused_optimizer, "dense": torch.optim.Adam(dense_params.values(), lr=0.01)}
    return TrainState(model=dmp, optimizers=optimizers)


def batch(step: int, rank: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(0, 3, (TABLES * BATCH,), generator=g)
    values = torch.cat(
        [torch.randint(0, 20, (int(lengths[i * BATCH : (i + 1) * BATCH].sum()),), generator=g) for i in range(TABLES)]
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(TABLES)], values=values, lengths=lengths)
    return torch.rand(BATCH, 4, generator=g), kjt, torch.randint(0, 2, (BATCH,), generator=g)


def train(state, steps: range, before_backward=None) -> None:
    """`before_backward`: called after each forward pass, before backward (the loop's hook
    for `CheckpointManager.wait_staged`: the fused optimizer updates inside backward)."""
    for s in steps:
        dense, kjt, label = batch(s, dist.get_rank())
        for opt in state.optimizers.values():
            opt.zero_grad()
        logits = state.model(dense, kjt).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, label.float())
        if before_backward is not None:
            before_backward()
        loss.backward()
        for opt in state.optimizers.values():
            opt.step()
        state.step = s + 1
        state.cursor = {"row": BATCH * (s + 1), "rank": dist.get_rank()}


def flat(obj, prefix: str = "") -> dict:
    """Every tensor (local shards of DTensor/ShardedTensor) and value, cloned, by path."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(obj, dict):
        return {k: v for key, sub in obj.items() for k, v in flat(sub, f"{prefix}/{key}").items()}
    if isinstance(obj, list):
        return {k: v for i, sub in enumerate(obj) for k, v in flat(sub, f"{prefix}/{i}").items()}
    if isinstance(obj, ShardedTensor):
        return {prefix: [s.tensor.clone() for s in obj.local_shards()]}
    if isinstance(obj, DTensor):
        local = obj.to_local()
        shards = local.local_shards() if hasattr(local, "local_shards") else [local]
        return {prefix: [t.clone() for t in shards]}
    if isinstance(obj, torch.Tensor):
        return {prefix: [obj.detach().clone()]}
    return {prefix: obj}


def full_state(state) -> dict:
    optim = {name: opt.state_dict() for name, opt in state.optimizers.items()}
    return flat({"model": state.model.state_dict(), "optim": optim})


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        if isinstance(a[k], list):
            if len(a[k]) != len(b[k]) or not all(map(torch.equal, a[k], b[k])):
                return False
        elif a[k] != b[k]:
            return False
    return True


def draws():
    return torch.rand(2).tolist(), np.random.rand(2).tolist(), random.random()


def gated_writer():
    """A FileSystemWriter class whose data write waits until its `gate` is set."""
    from torch.distributed.checkpoint import FileSystemWriter

    class GatedWriter(FileSystemWriter):
        gate = threading.Event()

        def write_data(self, plan, planner):
            assert self.gate.wait(timeout=120), "test gate never opened"
            return super().write_data(plan, planner)

    return GatedWriter


def full_disk_writer(failing_rank: int):
    """A FileSystemWriter that fails with ENOSPC on `failing_rank` (after writing part of a file)."""
    from torch.distributed.checkpoint import FileSystemWriter

    class FullDiskWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            if dist.get_rank() != failing_rank:
                return super().write_data(plan, planner)
            target = Path(str(self.path)) / f"__{failing_rank}_0.distcp"
            target.write_bytes(b"half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))

    return FullDiskWriter


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class Record:
    """What one rank observes, by name: written as JSON for the test, which asserts on it in
    its own process once `mp.spawn` returns (an assert in a spawned rank would fail where
    pytest can neither rewrite nor report it). `sub(name)` is a nested record."""

    def __init__(self) -> None:
        self.data: dict = {}

    def __setitem__(self, key: str, value) -> None:
        assert key not in self.data, f"{key} recorded twice"
        self.data[key] = value

    def sub(self, key: str) -> Record:
        child = Record()
        self[key] = child.data
        return child

    @contextmanager
    def raises(self, key: str, expected: type[BaseException]):
        """`pytest.raises(expected)` that records the outcome instead of asserting it: None when
        nothing was raised, else the exception's type, message, errno and filename. Any other
        exception propagates (and fails the rank)."""
        try:
            yield
        except expected as exc:
            self[key] = {"type": type(exc).__name__, "message": str(exc), "oserror": isinstance(exc, OSError),
                         "errno": getattr(exc, "errno", None), "filename": getattr(exc, "filename", None)}
        else:
            self[key] = None

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        tmp.replace(path)


def faults(root: Path, ckpt_pg, output_dtensor: bool, state, sync_mgr, at3: dict, at9: dict, rec: Record) -> None:
    """Integrity and storage faults on top of `scenario`: committed are step 3 and 9 (`state`
    is at 9), step 6 is torn."""
    import ettflow.trainer.checkpoint.manager as manager_mod
    from ettflow.trainer.checkpoint import (
        CheckpointConfig,
        CheckpointError,
        CheckpointManager,
        CheckpointStorageError,
    )
    from ettflow.trainer.checkpoint.layout import final_dir, tmp_dir

    rank = dist.get_rank()
    # same-size damage to a rank-1 data file of step 9: 64 KiB of 0xFF (the whole file when smaller)
    damaged = sorted(final_dir(root, 9).glob("__1_*.distcp"))[0]
    rec["damaged"] = damaged.name
    dist.barrier()
    if rank == 0:
        size = damaged.stat().st_size
        with open(damaged, "r+b") as f:
            f.write(b"\xff" * min(64 * 1024, size))
        rec["damaged_size"] = [size, damaged.stat().st_size]  # before, after
    dist.barrier()
    logs = ListHandler()
    logging.getLogger("ettflow.trainer.checkpoint").addHandler(logs)
    fresh = build(output_dtensor)
    restored = sync_mgr.restore_latest(fresh)
    logging.getLogger("ettflow.trainer.checkpoint").removeHandler(logs)
    rec["past_damage_step"] = restored.checkpoint.step
    rec["past_damage_is_at3"] = same(at3, full_state(fresh))
    rec["past_damage_logs"] = logs.messages  # rank 0 chooses (and says why)
    with rec.raises("load_damaged", CheckpointError):
        sync_mgr.load(build(output_dtensor), final_dir(root, 9))

    # a forged .metadata whose manifest was re-sealed to match: refused on every rank, unread
    marker = str(root / "code-ran")
    dist.barrier()
    if rank == 0:
        forge_metadata(final_dir(root, 3), marker)
    dist.barrier()
    with rec.raises("load_forged", CheckpointError):
        sync_mgr.load(build(output_dtensor), final_dir(root, 3))
    rec["forged_code_ran"] = Path(marker).exists()

    # a full disk on rank 1 during an async save: a storage error with the path on every rank
    async_mgr = CheckpointManager(CheckpointConfig(root=root, mode="async", keep_last=2), process_group=ckpt_pg)
    dist.barrier()  # every rank's manager started before a save (see `scenario`)
    plain_writer = manager_mod.FileSystemWriter
    manager_mod.FileSystemWriter = full_disk_writer(failing_rank=1)
    try:
        async_mgr.save(12, state)
    finally:
        manager_mod.FileSystemWriter = plain_writer
    with rec.raises("full_disk", CheckpointStorageError):
        async_mgr.wait()
    async_mgr.close()
    dist.barrier()
    rec["full_disk_left"] = [final_dir(root, 12).exists(), tmp_dir(root, 12).exists()]  # never torn
    rec["committed_after_full_disk"] = [i.step for i in sync_mgr.scan().committed]

    # a .tmp folder left by a crash is removed when the next manager starts (rank 0)
    if rank == 0:
        tmp_dir(root, 15).mkdir()
    dist.barrier()
    CheckpointManager(CheckpointConfig(root=root, mode="sync"), process_group=ckpt_pg).close()
    dist.barrier()
    rec["leftover_tmp_exists"] = tmp_dir(root, 15).exists()
    rec["step9_exists"] = final_dir(root, 9).exists()
    rec["state_still_at9"] = same(at9, full_state(state))


def scenario(root: Path, ckpt_pg, output_dtensor: bool, rec: Record) -> None:
    import ettflow.trainer.checkpoint.manager as manager_mod
    from ettflow.trainer.checkpoint import CheckpointConfig, CheckpointManager

    rank = dist.get_rank()
    state = build(output_dtensor)
    rec["state_kinds"] = sorted({type(v).__name__ for v in state.model.state_dict().values()})
    rec["optim_state_keys"] = sorted(flat({n: o.state_dict()["state"] for n, o in state.optimizers.items()}))

    # uninterrupted run: async save at 3 (training continues during the write), sync at 6
    train(state, range(3))
    at3 = full_state(state)
    async_mgr = CheckpointManager(CheckpointConfig(root=root, mode="async", keep_last=2), process_group=ckpt_pg)
    # a manager's start (rank 0) removes the .tmp folders under its root: every rank has started
    # its manager before any saves (in a run, the training steps' collectives order them; here
    # rank 1's save of step 6 was once removed as rank 0's new manager started: FileExistsError)
    dist.barrier()
    plain_writer = manager_mod.FileSystemWriter
    manager_mod.FileSystemWriter = writer = gated_writer()
    saved = async_mgr.save(3, state)
    manager_mod.FileSystemWriter = plain_writer
    draws3 = draws()
    train(state, range(3, 6))  # updates parameters and optimizer state in place
    rec["trained_on_is_at3"] = same(at3, full_state(state))
    rec["async_done_before_write"] = saved.done()  # save returned after staging; the write is held back
    writer.gate.set()
    done = async_mgr.wait()
    rec["async_committed"] = done.committed
    rec["async_blocking_end"], rec["async_background_start"] = saved.blocking_end, done.background_start
    rec["async_timing"] = {"blocking_s": saved.blocking_s, "background_s": done.background_s}
    async_mgr.close()
    at6 = full_state(state)
    sync_mgr = CheckpointManager(CheckpointConfig(root=root, mode="sync", keep_last=2), process_group=ckpt_pg)
    dist.barrier()  # as above
    rec["sync6_committed"] = sync_mgr.save(6, state).commit_result().committed
    draws6 = draws()
    train(state, range(6, 9))
    at9 = full_state(state)

    # restore the newest (step 6) into a fresh model, continue: bitwise the same run
    fresh = build(output_dtensor)
    restored = sync_mgr.restore_latest(fresh)
    rec["restore6"] = {"checkpoint_step": restored.checkpoint.step, "step": fresh.step, "cursor": fresh.cursor,
                       "checkpoint_cursor": dict(restored.checkpoint.cursors[rank]),
                       "is_at6": same(at6, full_state(fresh)), "draws": draws(), "draws_at6": draws6}
    train(fresh, range(6, 9))
    rec["continued_from6_is_at9"] = same(at9, full_state(fresh))

    # tear the newest checkpoint: the restart falls back to step 3 and reports step 6
    dist.barrier()
    if rank == 0:
        next(restored.checkpoint.path.glob("__1_*.distcp")).unlink()
    dist.barrier()
    rec["problems_after_tear"] = [[p.step, p.reason] for p in sync_mgr.scan().problems]
    fresh = build(output_dtensor)
    rec["restore3"] = {"checkpoint_step": sync_mgr.restore_latest(fresh).checkpoint.step,
                       "is_at3": same(at3, full_state(fresh)), "draws": draws(), "draws_at3": draws3}
    train(fresh, range(3, 9))
    rec["continued_from3_is_at9"] = same(at9, full_state(fresh))
    rec["sync9_committed"] = sync_mgr.save(9, fresh).commit_result().committed
    faults(root, ckpt_pg, output_dtensor, fresh, sync_mgr, at3, at9, rec.sub("faults"))
    sync_mgr.close()


def staged_handoff(root: Path, ckpt_pg, output_dtensor: bool, rec: Record) -> None:
    """Async staging: `save` only hands off; the next step waits for the copy before its
    backward pass (where the fused optimizer updates the tables); nothing of that step or
    later ones reaches the checkpoint. Two saves, so the second one goes through the reused
    host buffers and the reused staged ShardedTensors."""
    from ettflow.trainer.checkpoint import CheckpointConfig, CheckpointManager
    from ettflow.trainer.checkpoint.layout import final_dir

    state = build(output_dtensor)
    mgr = CheckpointManager(CheckpointConfig(root=root, mode="async", keep_last=3), process_group=ckpt_pg,
                            async_staging=True)
    train(state, range(2))
    expected = {}
    waits = []
    staged_async, trained_on_is_saved = [], []
    for step in (2, 4):
        expected[step] = full_state(state)
        staged_async.append(mgr.save(step, state).staged_async)
        train(state, range(step, step + 2), before_backward=lambda: waits.append(mgr.wait_staged()))
        trained_on_is_saved.append(same(expected[step], full_state(state)))  # trained on after the hand-off
    rec["staged_async"], rec["trained_on_is_saved"] = staged_async, trained_on_is_saved
    rec["waited_for"] = [w.step if w else None for w in waits]
    mgr.close()
    loaded_step, loaded_is_saved = [], []
    for step in (2, 4):
        fresh = build(output_dtensor)
        mgr_read = CheckpointManager(CheckpointConfig(root=root, mode="sync"), process_group=ckpt_pg)
        loaded_step.append(mgr_read.load(fresh, final_dir(root, step)).checkpoint.step)
        loaded_is_saved.append(same(expected[step], full_state(fresh)))
        mgr_read.close()
    rec["loaded_step"], rec["loaded_is_saved"] = loaded_step, loaded_is_saved


def worker(rank: int, tmp: str) -> None:
    """One rank: every set-up's scenario and staged hand-off, recorded in `<tmp>/rank<rank>.json`."""
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=WORLD)
    from ettflow.trainer.checkpoint import CheckpointConfig, CheckpointManager

    rec = Record()
    ckpt_pg = dist.new_group(backend="gloo")  # every rank, same order
    with rec.raises("no_group_of_its_own", ValueError):
        CheckpointManager(CheckpointConfig(root=f"{tmp}/x", mode="async"))
    for output_dtensor in (True, False):
        setup = rec.sub(f"output_dtensor={output_dtensor}")
        scenario(Path(tmp) / f"dtensor_{output_dtensor}", ckpt_pg, output_dtensor, setup)
        print(f"rank {rank} output_dtensor={output_dtensor} {setup.data['async_timing']}", flush=True)
        staged_handoff(Path(tmp) / f"staged_{output_dtensor}", ckpt_pg, output_dtensor, setup.sub("staged"))
    dist.barrier()
    dist.destroy_process_group()
    rec.save(Path(tmp) / f"rank{rank}.json")


# -- the test: what the ranks recorded, asserted here ---------------------------------------------


def assert_raised(outcome: dict | None, expected: str, pattern: str, where: str) -> dict:
    """The recorded `Record.raises` outcome is an `expected` (or a subclass) whose message
    matches `pattern` (re.search, as pytest.raises' match)."""
    assert outcome is not None, f"{where}: nothing raised, expected {expected} matching {pattern!r}"
    assert re.search(pattern, outcome["message"]), f"{where}: {outcome['type']}: {outcome['message']}"
    return outcome


def assert_scenario(rec: dict, rank: int, output_dtensor: bool) -> None:
    where = f"rank {rank}, output_dtensor={output_dtensor}"
    assert ("DTensor" if output_dtensor else "ShardedTensor") in rec["state_kinds"], (where, rec["state_kinds"])
    assert any("momentum1" in k or "sum" in k for k in rec["optim_state_keys"]), (where, rec["optim_state_keys"])
    # async save at 3: training went on (parameters and optimizer state moved in place) while
    # the write was held back; it committed afterwards, its background after its blocking part
    assert rec["trained_on_is_at3"] is False, where
    assert rec["async_done_before_write"] is False, where
    assert rec["async_committed"] is True, where
    assert rec["async_background_start"] >= rec["async_blocking_end"] - 1e-6, where
    assert rec["sync6_committed"] is True, where
    # the newest (6) restored into a fresh model: state, step, cursor, RNG; training on from it is bitwise
    r6 = rec["restore6"]
    assert r6["checkpoint_step"] == 6 and r6["step"] == 6, (where, r6)
    assert r6["cursor"] == {"row": BATCH * 6, "rank": rank} and r6["checkpoint_cursor"] == r6["cursor"], (where, r6)
    assert r6["is_at6"] is True and r6["draws"] == r6["draws_at6"], (where, r6)
    assert rec["continued_from6_is_at9"] is True, where
    # step 6 torn: reported, and the restart falls back to step 3 (state, RNG), then trains to 9 bitwise
    assert [(step, "storage file" in reason) for step, reason in rec["problems_after_tear"]] == [(6, True)], \
        (where, rec["problems_after_tear"])
    r3 = rec["restore3"]
    assert r3["checkpoint_step"] == 3 and r3["is_at3"] is True and r3["draws"] == r3["draws_at3"], (where, r3)
    assert rec["continued_from3_is_at9"] is True and rec["sync9_committed"] is True, where


def assert_faults(rec: dict, rank: int, output_dtensor: bool) -> None:
    where = f"rank {rank}, output_dtensor={output_dtensor}"
    damaged = rec["damaged"]
    if rank == 0:  # the damage kept the file's size: only its sha256 tells
        before, after = rec["damaged_size"]
        assert after == before, (where, rec["damaged_size"])
    # step 9 damaged: the restore falls back to step 3, and rank 0 (which chooses) says why
    assert rec["past_damage_step"] == 3 and rec["past_damage_is_at3"] is True, where
    if rank == 0:
        pattern = rf"checkpoint step 9 \(.*\): {re.escape(damaged)} sha256 mismatch.*: skipped, restoring step 3"
        assert any(re.search(pattern, m) for m in rec["past_damage_logs"]), (where, rec["past_damage_logs"])
    refused = assert_raised(rec["load_damaged"], "CheckpointError",
                            f"refusing to restore .*{re.escape(damaged)} sha256 mismatch",
                            f"{where}: load of the damaged step 9")
    assert refused["type"] == "RefusedCheckpointError", (where, refused)  # damage: a live restore falls back
    # a forged .metadata (manifest re-sealed to match) is refused on every rank, never unpickled
    assert_raised(rec["load_forged"], "CheckpointError", "not a type a DCP metadata file holds",
                  f"{where}: load of the forged step 3")
    assert rec["forged_code_ran"] is False, where
    # a full disk on rank 1: a typed storage error, with errno and path, on every rank; nothing committed
    full = assert_raised(rec["full_disk"], "CheckpointStorageError", "", f"{where}: save on a full disk")
    assert full["type"] == "CheckpointStorageError" and full["errno"] == errno.ENOSPC, (where, full)
    assert full["filename"].endswith("__1_0.distcp") and full["oserror"], (where, full)
    assert full["filename"] in full["message"], (where, full)
    assert rec["full_disk_left"] == [False, False], where  # neither step_12 nor its .tmp: never torn
    assert 12 not in rec["committed_after_full_disk"], (where, rec["committed_after_full_disk"])
    # a crash's leftover .tmp is removed when the next manager starts; the rest is untouched
    assert rec["leftover_tmp_exists"] is False and rec["step9_exists"] is True, where
    assert rec["state_still_at9"] is True, where


def assert_staged_handoff(rec: dict, rank: int, output_dtensor: bool) -> None:
    where = f"rank {rank}, output_dtensor={output_dtensor}: staged hand-off"
    assert rec["staged_async"] == [True, True], (where, rec)
    assert rec["trained_on_is_saved"] == [False, False], (where, rec)  # trained on right after the hand-off
    assert rec["waited_for"] == [2, None, 4, None], (where, rec)  # the next step waited for the copy, once
    assert rec["loaded_step"] == [2, 4] and rec["loaded_is_saved"] == [True, True], (where, rec)


@pytest.mark.timeout(240)
def test_sharded_dlrm_saves_async_and_sync_and_restores_bitwise():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(tmp,), nprocs=WORLD, join=True)
        records = [json.loads((Path(tmp) / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    for rank, rec in enumerate(records):
        assert_raised(rec["no_group_of_its_own"], "ValueError", "process group of its own",
                      f"rank {rank}: an async manager without a process group")
        for output_dtensor in (True, False):
            setup = rec[f"output_dtensor={output_dtensor}"]
            assert_scenario(setup, rank, output_dtensor)
            assert_faults(setup["faults"], rank, output_dtensor)
            assert_staged_handoff(setup["staged"], rank, output_dtensor)
