"""`DeltaSaves`'s row ledgers with a scripted tracker (the reads TorchRec's tracker would give,
each forgotten once read): the durable saves and the in-memory tier read the same tracker, and
each keeps every row since its own last save, whoever read the tracker in between."""

from __future__ import annotations

import torch

from ettflow.trainer.config import TrainerConfig
from ettflow.trainer.data.schema import criteo_schema
from ettflow.trainer.rank.delta_saves import DeltaSaves

T = "sparse_arch.embedding_bag_collection.embedding_bags.t0"


class ScriptedTracker:
    """What each read returns, in order (`get_unique_ids`), then nothing; `step` moves it on."""

    def __init__(self, reads: list[list[int]]) -> None:
        self.reads = [{T: torch.tensor(ids)} if ids else {} for ids in reads]
        self.steps = 0

    def get_unique_ids(self) -> dict[str, torch.Tensor]:
        return self.reads.pop(0) if self.reads else {}

    def step(self) -> None:
        self.steps += 1


def saves(tmp_path, reads: list[list[int]]) -> DeltaSaves:
    cfg = TrainerConfig(data_root=str(tmp_path), schema=criteo_schema(10), work_dir=str(tmp_path / "w"))
    return DeltaSaves(None, cfg, tracker=ScriptedTracker(reads))


def ids(rows) -> list[int]:
    return [] if rows is None or T not in rows else rows[T].tolist()


def test_memory_copies_between_durable_saves_take_no_row_from_the_durable_delta(tmp_path):
    s = saves(tmp_path, [[1, 2], [3], [2, 4], [5]])
    assert s.memory_rows() is None  # the first in-memory copy is whole (reads [1, 2])
    assert ids(s.memory_rows()) == [3]  # a delta copy: what was looked up since the whole one
    assert ids(s.memory_rows()) == [2, 4]
    # the durable delta holds every row since ITS last save (here: since the start), though the
    # memory copies read the tracker in between
    assert ids(s.durable_rows()) == [1, 2, 3, 4, 5]
    assert ids(s.memory_rows()) == [5]  # and the tier still gets what the durable read took
    s.ledger.committed()  # the durable delta committed
    assert ids(s.durable_rows()) == [] and s.tracker.steps == 6


def test_a_restore_makes_the_next_memory_copy_whole_and_forgets_the_rows_before_it(tmp_path):
    s = saves(tmp_path, [[1], [2], [3], [4]])
    assert s.memory_rows() is None and ids(s.memory_rows()) == [2]
    s.restored(None)  # a restore wrote every row: nothing tracked before it counts
    assert s.memory_rows() is None and ids(s.durable_rows()) == [4]
    s.off = "row-wise sharding"  # deltas off for the run: every copy is whole
    assert s.memory_rows() is None and s.memory_rows() is None
