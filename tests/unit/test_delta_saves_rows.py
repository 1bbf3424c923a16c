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


def test_an_async_delta_takes_its_rows_at_the_capture_and_gives_them_back_when_it_does_not_commit(tmp_path,
                                                                                                  monkeypatch):
    """Issue 44: an async delta's rows leave the ledger when it is captured (what is touched while
    it is written goes to the next save), come back when it does not commit, and become the head
    when it does; a state that cannot be a delta turns deltas off, its rows kept for the base."""
    from ettflow.trainer.checkpoint.delta import CapturedDelta, DeltaCommit
    from ettflow.trainer.checkpoint.delta_chain import Link
    from ettflow.trainer.rank import delta_saves

    monkeypatch.setattr(delta_saves, "capture", lambda state, *, step, parent, parent_digest, touched: CapturedDelta(
        step, parent, parent_digest, {"rows": touched[T]}, {}))
    s = saves(tmp_path, [[1, 2], [3], [4], [5], [6]])
    s.links = [Link(step=5, kind="base", digest="d5")]
    s.head = s.links[0]
    captured, taken = s.start(10, None)
    assert (captured.step, captured.parent, captured.parent_digest, ids(taken)) == (10, 5, "d5", [1, 2])
    assert ids(s.durable_rows()) == [3]  # touched while it is written: the next save's
    failed = DeltaCommit(step=10, parent=5, committed=False, error="rank 1: OSError: disk full")
    assert s.finished(captured, taken, failed, rank=0) is failed
    assert ids(s.durable_rows()) == [1, 2, 3, 4] and s.head.step == 5  # back in the ledger; the head stays
    captured, taken = s.start(10, None)
    assert ids(taken) == [1, 2, 3, 4, 5]  # again, with what the tracker saw since
    done = DeltaCommit(step=10, parent=5, committed=True, digest="d10", bytes=123)
    s.finished(captured, taken, done, rank=0)
    assert (s.head.step, s.head.kind, s.head.parent, s.head.parent_digest, s.head.digest) == (10, "delta", 5, "d5",
                                                                                            "d10")
    assert ids(s.durable_rows()) == [6] and s.choose()[0] == "delta"
    captured, taken = s.start(15, None)
    s.finished(captured, taken, DeltaCommit(step=15, parent=10, committed=False, unsupported=True,
                                            error="t0 is sharded by rows"), rank=0)
    assert s.off is not None and s.choose()[0] == "base" and ids(s.durable_rows()) == [6]


def test_an_in_memory_copy_records_the_link_the_durable_chain_goes_on_from_and_every_row_since(tmp_path,
                                                                                             monkeypatch):
    """Issue 44: a copy taken while a base is written names that base (whether or not its commit
    was seen yet: ranks see it at different moments); one taken while a delta is written names the
    delta's parent and holds the delta's rows too (it may not commit); a restore of the copy that
    every rank agrees on makes the next delta hold those rows and every row touched after it."""
    from ettflow.trainer.checkpoint import CommitResult
    from ettflow.trainer.checkpoint.delta import CapturedDelta, DeltaCommit
    from ettflow.trainer.rank import delta_saves

    monkeypatch.setattr(delta_saves, "capture", lambda state, *, step, parent, parent_digest, touched: CapturedDelta(
        step, parent, parent_digest, {"rows": touched[T]}, {}))
    monkeypatch.setattr(delta_saves, "commit_digest", lambda path: f"digest of {path}")
    s = saves(tmp_path, [[1], [2, 3], [4], [5], [6], [7], [8]])
    assert s.chain_resume() is None  # no durable save yet: a restore's next save is a base
    s.base_started(5)
    pending = s.chain_resume()  # reads [2, 3]: the base at 5 holds [1]
    assert [(x.step, x.kind, x.digest) for x in pending.links] == [(5, "base", "")]
    assert list(pending.rows[T]) == [2, 3] and pending.intact()
    s.base_committed(CommitResult(step=5, committed=True, path=str(tmp_path / "step_5"), nbytes=100,
                                    background_start=0.0, background_end=0.0))
    seen = s.chain_resume()  # reads [4]
    assert [(x.step, x.digest) for x in seen.links] == [(5, f"digest of {tmp_path / 'step_5'}")]
    assert list(seen.rows[T]) == [2, 3, 4]
    captured, taken = s.start(10, None)  # reads [5]: the delta of 10 takes [2, 3, 4, 5]
    writing = s.chain_resume()  # reads [6]
    assert [x.step for x in writing.links] == [5] and list(writing.rows[T]) == [2, 3, 4, 5, 6]
    s.finished(captured, taken, DeltaCommit(step=10, parent=5, committed=True, digest="d10", bytes=9), rank=0)
    after = s.chain_resume()  # reads [7]
    assert [(x.step, x.kind) for x in after.links] == [(5, "base"), (10, "delta")]
    assert list(after.rows[T]) == [6, 7]

    s.restored(None)  # a restore of the copy `writing` (reads [8], forgotten) ...
    assert s.chain_resume() is None
    s.resumed(writing.links, dict(writing.rows))  # ... that every rank agreed to resume
    assert s.head.step == 5 and s.choose()[0] == "delta"
    assert ids(s.durable_rows()) == [2, 3, 4, 5, 6]
    assert s.memory_rows() is None  # the next in-memory copy is whole


def test_a_copy_s_chain_record_is_used_only_when_its_link_is_committed_on_disk_as_recorded(tmp_path):
    """`ChainResume.on_disk`: the link must be committed with the digest recorded (a base whose
    commit was not seen gets the marker's digest and its bytes); a missing or re-saved link, or a
    damaged record, gives None (the next save is a base)."""
    import numpy as np

    from ettflow.trainer.checkpoint.chain_resume import ChainResume
    from ettflow.trainer.checkpoint.delta_chain import Link
    from ettflow.trainer.checkpoint.layout import COMMITTED, delta_dir, final_dir

    base, delta = final_dir(tmp_path, 5), delta_dir(tmp_path, 10)
    for folder, digest in ((base, "d5"), (delta, "d10")):
        folder.mkdir(parents=True)
        (folder / "rank-0.bin").write_bytes(b"x" * 64)
        (folder / COMMITTED).write_text(digest + "\n")
    rows = {T: torch.tensor([3, 1])}
    pending = ChainResume.of((Link(step=5, kind="base"),), rows)
    assert pending.on_disk(tmp_path) == (Link(step=5, kind="base", bytes=64 + 3, digest="d5"),)
    chain = (Link(step=5, kind="base", digest="d5"), Link(step=10, kind="delta", parent=5, digest="d10"))
    assert ChainResume.of(chain, rows).on_disk(tmp_path) == chain
    assert ChainResume.of((Link(step=5, kind="base", digest="other"),), rows).on_disk(tmp_path) is None  # saved again
    assert ChainResume.of((Link(step=15, kind="base"),), rows).on_disk(tmp_path) is None  # never committed
    damaged = ChainResume.of(chain, rows)
    damaged.rows[T][0] = 7
    assert not damaged.intact() and damaged.on_disk(tmp_path) is None
    assert np.array_equal(ChainResume.of(chain, rows).rows[T], [3, 1])


class OneRank:
    """The checkpoint group of a single rank (what `commit_captured` calls on it)."""

    rank, world_size = 0, 1

    def all_gather(self, value):
        return [value]

    def broadcast_from_first(self, value):
        return value


def test_a_delta_that_a_full_disk_stops_is_a_storage_failure_naming_its_path(tmp_path, monkeypatch):
    """A delta's write that hits ENOSPC fails as storage (errno and path kept across the ranks'
    agreement), as a full save's does, never as the user's code (the fault matrix saw `user`
    once deltas were on: the failure budget then stops the run as a repeated user error)."""
    import errno

    from ettflow.ett.failures import FailureClass
    from ettflow.trainer.checkpoint import delta
    from ettflow.trainer.checkpoint.config import CheckpointStorageError
    from ettflow.trainer.checkpoint.delta import CapturedDelta, commit_captured
    from ettflow.trainer.classify import failure_from_exception

    def full(folder, rank, tensors, meta):
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / f"rank-{rank}.bin"))

    monkeypatch.setattr(delta, "write_pack", full)
    commit = commit_captured(tmp_path, CapturedDelta(10, 5, "d5", {}, {}), OneRank())
    assert not commit.committed and commit.errno == errno.ENOSPC
    assert commit.error_path.endswith("delta_0000000010.tmp/rank-0.bin"), commit.error_path
    error = commit.failure()
    assert isinstance(error, CheckpointStorageError) and "delta checkpoint of step 10 failed" in str(error)
    assert failure_from_exception(error, rank=0).failure_class is FailureClass.STORAGE
    other = commit_captured(tmp_path, CapturedDelta(15, 10, "d10", {}, {}, problem="rank 0: ValueError: x"), OneRank())
    assert other.errno is None and type(other.failure()).__name__ == "CheckpointError"
