"""Delta checkpoints on 2 gloo ranks (issue 28): base + deltas restores bitwise what a full
checkpoint of the same step holds, model and both optimizers, and a damaged delta falls back to
the previous good point.

The tiny DLRM of test_checkpoint_torchrec.py (table-wise and column-wise tables, Adagrad fused
in backward, a dense Adam), TorchRec's tracker on its DMP. Each rank trains 12 steps: a base
(a DCP checkpoint through `CheckpointManager`) at step 4, deltas at 8 and 12 (`delta.py`), and
keeps its full state at 8 and 12 in memory. A fresh model restores the base and applies the
deltas; the state must equal the one at 12 bit for bit. Then delta 12's data is damaged: its
verify refuses it, `restore_chain` stops at 8, and base + delta 8 equals the state at 8.
The ranks record what they observe (`Record`) and the test asserts in its own process.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_checkpoint_torchrec import WORLD, Record, build, full_state, same, train


def differ(a: dict, b: dict) -> list[str]:
    """The paths whose values differ (for the failure message)."""
    out = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        if isinstance(a[k], list) and isinstance(b[k], list):
            if len(a[k]) != len(b[k]) or not all(map(torch.equal, a[k], b[k])):
                out.append(k)
        elif a[k] != b[k]:
            out.append(k)
    return out


def _save_delta(root: Path, state, tracker, ledger, *, step: int, parent: Path):
    """The delta of `step` on the committed `parent` folder, every rank; its commit."""
    from ettflow.trainer.checkpoint.delta import commit_digest, touched_rows, write_delta
    from ettflow.trainer.checkpoint.group import CheckpointGroup

    state.step = step
    commit = write_delta(root, step=step, parent=int(parent.name.split("_")[1]), parent_digest=commit_digest(parent),
                         state=state, touched=ledger.add(touched_rows(tracker)),
                         group=CheckpointGroup(dist.group.WORLD, mode="sync"))
    assert commit.committed, commit.error
    ledger.committed()
    return commit


def _restore(root: Path, base: Path, deltas: list[Path]):
    """A fresh model: the base through CheckpointManager, then each delta in order."""
    from ettflow.trainer.checkpoint import CheckpointConfig, CheckpointManager
    from ettflow.trainer.checkpoint.delta import apply_chain

    state = build(output_dtensor=False)
    manager = CheckpointManager(CheckpointConfig(root=root, mode="sync"), process_group=dist.group.WORLD)
    manager.load(state, base)
    apply_chain(state, deltas, dist.get_rank())
    manager.close()
    return state


def worker(rank: int, tmp: str) -> None:
    from ettflow.trainer.checkpoint import CheckpointConfig, CheckpointManager, TornCheckpointError
    from ettflow.trainer.checkpoint.delta import RowLedger, delta_folder, enable_tracker, verify_delta
    from ettflow.trainer.checkpoint.delta_chain import Link, restore_chain

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=WORLD)
    rec = Record()
    root = Path(tmp) / "checkpoints"
    state = build(output_dtensor=False)
    tracker, ledger = enable_tracker(state.model), RowLedger()
    manager = CheckpointManager(CheckpointConfig(root=root, mode="sync", keep_last=5), process_group=dist.group.WORLD)
    train(state, range(0, 4))
    manager.save(4, state)
    base = manager.latest().path
    from ettflow.trainer.checkpoint.delta import touched_rows

    touched_rows(tracker)  # the base holds every row: the next delta starts from it
    train(state, range(4, 8))
    rec["delta_8_bytes"] = _save_delta(root, state, tracker, ledger, step=8, parent=base).bytes
    at_8 = full_state(state)
    train(state, range(8, 12))
    rec["delta_12_bytes"] = _save_delta(root, state, tracker, ledger, step=12, parent=delta_folder(root, 8)).bytes
    at_12 = full_state(state)
    manager.close()
    rec["base_bytes"] = sum(f.stat().st_size for f in base.iterdir() if f.is_file())

    restored = _restore(root, base, [delta_folder(root, 8), delta_folder(root, 12)])
    rec["base_and_deltas_equal_step_12"] = same(full_state(restored), at_12)
    rec["differ_12"] = differ(full_state(restored), at_12)
    rec["keys_12"] = sorted(at_12)
    only_base = _restore(root, base, [])
    rec["base_alone_equals_step_12"] = same(full_state(only_base), at_12)  # the deltas carry something

    # rank 1's part of delta 12 damaged in place (same size): refused, the chain stops at 8
    dist.barrier()
    if rank == 0:
        part = delta_folder(root, 12) / "rank-1.bin"
        data = bytearray(part.read_bytes())
        data[len(data) // 2] ^= 0xFF
        part.write_bytes(bytes(data))
    dist.barrier()
    damaged = {}
    for step in (8, 12):
        try:
            verify_delta(delta_folder(root, step))
        except TornCheckpointError as exc:
            damaged[step] = str(exc)
    rec["damaged"] = {str(k): v for k, v in damaged.items()}
    links = [Link(step=4, kind="base", bytes=rec.data["base_bytes"]), Link(step=8, kind="delta", parent=4),
             Link(step=12, kind="delta", parent=8)]
    plan = restore_chain(links, damaged=damaged)
    rec["plan"] = {"steps": [link.step for link in plan.links], "skipped": plan.skipped, "why": plan.why}
    fallback = _restore(root, base, [delta_folder(root, link.step) for link in plan.links[1:]])
    rec["fallback_equals_step_8"] = same(full_state(fallback), at_8)
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(rec.data))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_base_and_deltas_restore_bitwise_and_a_damaged_delta_falls_back_to_the_previous_good_point():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(tmp,), nprocs=WORLD, join=True)
        records = [json.loads((Path(tmp) / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    for rank, rec in enumerate(records):
        where = f"rank {rank}"
        assert any("/optim/sparse/" in k for k in rec["keys_12"]) and any("/optim/dense/" in k for k in rec["keys_12"])
        assert rec["base_and_deltas_equal_step_12"], (where, rec["differ_12"])
        assert not rec["base_alone_equals_step_12"], where
        assert list(rec["damaged"]) == ["12"] and "rank-1.bin sha256 mismatch" in rec["damaged"]["12"], (where, rec)
        assert rec["plan"] == {"steps": [4, 8], "skipped": 12, "why": rec["plan"]["why"]}
        assert rec["plan"]["why"].startswith("its chain's step 12 is damaged"), rec["plan"]
        assert rec["fallback_equals_step_8"], where
    sizes = records[0]
    print(f"\nbase {sizes['base_bytes']} bytes; deltas {sizes['delta_8_bytes']}, {sizes['delta_12_bytes']} bytes")
