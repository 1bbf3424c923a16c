"""Which table shards a delta can hold (`delta._rows_of`): table- and column-wise shards hold
every row of their table, so the tracker's row ids index them; a row-wise shard holds a slice,
and deltas say so (`DeltaUnsupported`: the trainer then takes full saves, said once)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard

from ettflow.trainer.checkpoint.delta import DeltaUnsupported, _rows_of

KEY = "sparse_arch.embedding_bag_collection.embedding_bags.t0.weight"
TOUCHED = {"sparse_arch.embedding_bag_collection.embedding_bags.t0": torch.tensor([3, 7, 99])}


def shard(offsets: list[int], sizes: list[int]) -> Shard:
    return Shard(tensor=torch.zeros(sizes), metadata=ShardMetadata(shard_offsets=offsets, shard_sizes=sizes,
                                                                   placement="rank:0/cpu"))


def test_table_and_column_wise_shards_take_the_touched_rows():
    assert _rows_of(KEY, shard([0, 0], [100, 8]), 100, TOUCHED).tolist() == [3, 7, 99]  # table-wise
    assert _rows_of(KEY, shard([0, 4], [100, 4]), 100, TOUCHED).tolist() == [3, 7, 99]  # column-wise
    assert _rows_of(KEY, shard([0, 0], [100, 8]), 100, {}).tolist() == []  # nothing looked up since


def test_a_row_wise_shard_is_refused_by_name():
    with pytest.raises(DeltaUnsupported, match=r"t0.weight is sharded by rows \(a shard of rows 50..100 of 100\)"):
        _rows_of(KEY, shard([50, 0], [50, 8]), 100, TOUCHED)
    with pytest.raises(DeltaUnsupported, match="sharded by rows"):
        _rows_of(KEY, shard([0, 0], [50, 8]), 100, TOUCHED)  # the first half of the rows
