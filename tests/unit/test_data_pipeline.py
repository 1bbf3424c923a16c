"""The DPP: exact resume from a cursor, deterministic sharding, fixed batches, fast batch."""

import json
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ettflow.trainer.data.batch import synthetic_batch
from ettflow.trainer.data.pipeline import DataConfig, DataPipeline, full_batches
from ettflow.trainer.data.prefetch import Prefetcher
from ettflow.trainer.data.schema import DataError, FeatureSchema, SparseFeature
from ettflow.trainer.data.windows import Cursor

# row_id is a sparse feature with a table larger than any id, so it comes through unchanged
# and tells which rows a batch holds.
SCHEMA = FeatureSchema(
    dense=("d0", "d1"),
    sparse=(SparseFeature(name="row_id", num_embeddings=2**40),
            SparseFeature(name="city", num_embeddings=7),
            SparseFeature(name="tags", num_embeddings=5, multi_valued=True)),
    label="y",
)
FILE_ROWS = [[13, 0, 8], [21], [5, 17]]  # rows per part file, per window (one empty file)


def write_windows(root, file_rows=FILE_ROWS, first_id=0, first_window=0):
    rng = np.random.default_rng(first_id)
    rid = first_id
    for w, files in enumerate(file_rows):
        folder = root / f"window-{w + first_window:04d}"
        folder.mkdir(parents=True)
        for f, n in enumerate(files):
            ids = np.arange(rid, rid + n)
            rid += n
            tags = [None if i % 7 == 3 else [f"t{j}" for j in range(i % 4)] for i in ids]
            pq.write_table(pa.table({
                "row_id": pa.array(ids, type=pa.int64()),
                "d0": pa.array(rng.normal(size=n)),
                "d1": pa.array(ids % 5, mask=ids % 6 == 0, type=pa.int64()),
                "city": pa.array([f"c{i % 11}" for i in ids], mask=ids % 9 == 4,
                                 type=pa.string()),
                "tags": pa.array(tags, type=pa.list_(pa.string())),
                "y": pa.array(ids % 2 == 0),
            }), folder / f"part-{f}.parquet", row_group_size=4)
    return rid


def pipeline(root, batch_size=4, rank=0, world_size=1, **kw):
    return DataPipeline(DataConfig(root=root, schema=SCHEMA, batch_size=batch_size, rank=rank,
                                   world_size=world_size, **kw))


def rows(batches):
    return [int(v) for b in batches for v in b.sparse["row_id"].values()]


@pytest.fixture
def root(tmp_path):
    write_windows(tmp_path)
    return tmp_path


def test_rows_come_in_order_in_fixed_batches_and_the_ragged_end_is_dropped(root):
    p = pipeline(root, batch_size=4)
    batches = list(p)
    assert p.index.total_rows == 64 and p.num_batches() == len(batches) == full_batches(64, 4)
    assert rows(batches) == list(range(64))
    p5 = pipeline(root, batch_size=5)
    assert p5.num_batches() == 12 and rows(p5) == list(range(60))  # 4 rows dropped
    assert p5.end_cursor() == Cursor(window=2, file=1, row=13)  # row 60 = 42 + 5 + 13
    assert all(b.batch_size == 5 for b in p5)


@pytest.mark.parametrize("world_size, k", [(1, 0), (1, 3), (1, 7), (2, 1), (3, 2)])
def test_resume_from_a_saved_cursor_is_exact(root, world_size, k):
    for rank in range(world_size):
        full = list(pipeline(root, rank=rank, world_size=world_size).batches())
        first = pipeline(root, rank=rank, world_size=world_size).batches()
        head = [next(first) for _ in range(k)]
        saved = json.dumps(head[-1].cursor_end.to_dict()) if head else None
        restored = Cursor.from_dict(json.loads(saved)) if saved else None
        tail = list(pipeline(root, rank=rank, world_size=world_size).batches(start=restored))
        assert rows(head) + rows(tail) == rows(full)  # no row twice, none skipped
        assert len(head) + len(tail) == len(full)


def test_resume_with_prefetch_and_another_world_size(root):
    p1 = pipeline(root, batch_size=3)
    head = list(p1.batches())[:5]
    after = head[-1].cursor_end
    ranks = [list(pipeline(root, batch_size=3, rank=r, world_size=2).batches(after, prefetch=2))
             for r in range(2)]
    seen = rows(head) + sorted(rows(ranks[0]) + rows(ranks[1]))
    assert seen == list(range(len(seen))) and len(seen) == 15 + 6 * (49 // 6)


def test_ranks_read_disjoint_rows_and_run_the_same_steps(root):
    ws, bs = 3, 4
    per_rank = [list(pipeline(root, bs, r, ws)) for r in range(ws)]
    steps = {len(b) for b in per_rank}
    assert steps == {pipeline(root, bs, 0, ws).num_batches()} == {full_batches(64, bs, ws)}
    ids = [set(rows(b)) for b in per_rank]
    assert not (ids[0] & ids[1]) and not (ids[0] & ids[2]) and not (ids[1] & ids[2])
    assert set().union(*ids) == set(range(steps.pop() * bs * ws))
    # the cursor after a step is the same on every rank, and it only moves forward
    ends = [[b.cursor_end for b in batches] for batches in per_rank]
    assert ends[0] == ends[1] == ends[2]
    assert [c.as_tuple() for c in ends[0]] == sorted(c.as_tuple() for c in ends[0])


def test_a_refresh_continues_from_the_last_cursor_into_new_windows(tmp_path):
    n = write_windows(tmp_path, [[10], [7]])
    first = pipeline(tmp_path, batch_size=4)
    trained = rows(first)
    end = first.end_cursor()
    assert trained == list(range(16)) and end == Cursor(window=1, file=0, row=6)
    write_windows(tmp_path, [[9]], first_id=1000, first_window=2)  # a new hour arrives
    ids = rows(pipeline(tmp_path, batch_size=4).batches(start=end))
    assert ids == [16, 1000, 1001, 1002, 1003, 1004, 1005, 1006]
    assert n == 17


def test_ids_are_reduced_into_their_tables_and_lists_are_jagged(root):
    batches = list(pipeline(root, batch_size=8))
    for b in batches:
        assert b.sparse["city"].values().max() < 7 and b.sparse["tags"].values().max() < 5
        assert b.sparse["city"].lengths().tolist().count(0) == sum(
            1 for i in b.sparse["row_id"].values().tolist() if i % 9 == 4)
    tag_lengths = torch.cat([b.sparse["tags"].lengths() for b in batches]).tolist()
    assert tag_lengths == [0 if i % 7 == 3 else i % 4 for i in range(64)]
    again = list(pipeline(root, batch_size=8))
    assert torch.equal(again[3].sparse.values(), batches[3].sparse.values())  # stable hash
    assert batches[0].labels.tolist() == [1.0, 0.0] * 4
    assert batches[0].dense[0, 1] == 0.0  # null dense reads as 0


def test_synthetic_batch_has_exactly_the_layout_of_a_real_batch(root):
    real = next(iter(pipeline(root, batch_size=8)))
    fake = synthetic_batch(SCHEMA, 8)
    assert fake.sparse.keys() == real.sparse.keys() == list(SCHEMA.sparse_names)
    for a, b in [(fake.dense, real.dense), (fake.labels, real.labels),
                 (fake.sparse.lengths(), real.sparse.lengths())]:
        assert a.dtype == b.dtype and a.shape == b.shape
    assert fake.sparse.values().dtype == real.sparse.values().dtype == torch.int64
    assert fake.sparse.lengths().dtype == torch.int32 and fake.sparse.stride() == 8
    assert fake.sparse["row_id"].lengths().tolist() == [1] * 8
    assert len(set(synthetic_batch(SCHEMA, 64).sparse["tags"].lengths().tolist())) > 1
    moved = real.to("cpu")
    assert moved.cursor_end == real.cursor_end and torch.equal(moved.dense, real.dense)


def test_a_file_broken_after_the_check_stops_the_run_naming_it(root):
    p = pipeline(root, batch_size=4)
    victim = root / "window-0001" / "part-0.parquet"
    victim.write_bytes(b"not parquet any more")
    it = p.batches(prefetch=2)
    assert len(rows([next(it) for _ in range(5)])) == 20  # window 0 still trains
    with pytest.raises(DataError, match=str(victim)):
        list(it)


def test_null_labels_are_an_error_naming_the_column(tmp_path):
    (tmp_path / "w").mkdir()
    pq.write_table(pa.table({"row_id": [1, 2], "d0": [0.0, 1.0], "d1": [1, 2], "city": ["a", "b"],
                             "tags": [["x"], ["y"]], "y": pa.array([1, None])}),
                   tmp_path / "w" / "p.parquet")
    with pytest.raises(DataError, match="'y' has 1 null values"):
        list(pipeline(tmp_path, batch_size=2))


def test_a_cursor_into_a_changed_file_is_refused(root):
    with pytest.raises(DataError, match="points at row 99"):
        pipeline(root).num_batches(Cursor(window=0, file=0, row=99))


def test_prefetch_overlaps_warm_up_and_close_stops_it():
    made = []

    def slow():
        for i in range(100):
            made.append(i)
            time.sleep(0.01)
            yield i

    pf = Prefetcher(slow(), depth=3)
    time.sleep(0.2)
    assert len(made) >= 3  # warmed up before anyone asked
    assert [next(pf) for _ in range(5)] == list(range(5))
    pf.close()
    count = len(made)
    time.sleep(0.1)
    assert len(made) <= count + 1 and not pf._thread.is_alive()
    with pytest.raises(StopIteration):
        next(pf)


def _recording_reads(p):
    reads, real = [], p._read

    def read(chunk):
        reads.append((chunk.part.path.parent.name, chunk.part.path.name, chunk.group,
                       threading.current_thread().name))
        return real(chunk)

    p._read = read
    return reads


# the fixture's row groups (4 rows each): window 0's part-0 has 4, part-2 2; window 1's part-0 6;
# window 2's part-0 2 and part-1 5 (part-1 of window 0 is empty: never read)
ROW_GROUPS = 4 + 2 + 6 + 2 + 5


def test_a_prefetched_stream_reads_its_next_row_group_ahead_and_yields_the_same_rows(root):
    p = pipeline(root, batch_size=4)
    reads = _recording_reads(p)
    it = p.batches(prefetch=1)
    assert rows([next(it)]) == list(range(4))  # window 0's first file, its first row group: half way (all of it)
    deadline = time.monotonic() + 10
    while len(reads) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    # the next row group is read by the read-ahead thread, before any batch needs it
    assert reads[:2] == [("window-0000", "part-0.parquet", 0, "ettflow-prefetch"),
                         ("window-0000", "part-0.parquet", 1, "ettflow-readahead")]
    assert rows(it) == list(range(4, 64))  # every later row once, in order
    assert len(reads) == ROW_GROUPS and len(set(r[:3] for r in reads)) == ROW_GROUPS  # each row group once
    assert all(r[3] == "ettflow-readahead" for r in reads[1:])  # each one after the first, ahead
    # across the empty file: part-0's last row group (1 row) reads ahead part-2's first
    assert ("window-0000", "part-2.parquet", 0, "ettflow-readahead") in reads


def test_the_first_batch_decodes_only_the_row_groups_it_holds(root):
    p = pipeline(root, batch_size=4)
    reads = _recording_reads(p)
    it = p.batches()
    assert rows([next(it)]) == list(range(4))
    assert reads == [("window-0000", "part-0.parquet", 0, threading.current_thread().name)]
    assert rows([next(it)]) == list(range(4, 8)) and len(reads) == 2


def test_an_unprefetched_stream_reads_each_row_group_where_it_is_needed(root):
    p = pipeline(root, batch_size=4)
    reads = _recording_reads(p)
    assert rows(p.batches()) == list(range(64))
    assert {r[3] for r in reads} == {threading.current_thread().name}
    assert len(reads) == ROW_GROUPS == len(set(r[:3] for r in reads))
