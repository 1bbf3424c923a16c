"""A training batch, made from Arrow rows or made up (the fast batch).

Every batch has the same layout, whatever made it:
- dense: float32 [batch, len(schema.dense)]
- sparse: KeyedJaggedTensor, keys = schema.sparse_names, values int64 (ids already reduced
  into each table), lengths int32 [len(keys) * batch] (key-major, as TorchRec lays them out)
- labels: float32 [batch]
Single-valued features have length 1 (0 where the id is null); multi-valued ones any length.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ettflow.trainer.data.schema import DataError, FeatureSchema, SparseFeature
from ettflow.trainer.data.windows import Cursor

VALUES_DTYPE = torch.int64
LENGTHS_DTYPE = torch.int32
DENSE_DTYPE = torch.float32
LABEL_DTYPE = torch.float32


@dataclass(frozen=True, kw_only=True)
class Batch:
    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor
    # The stream cursor before and after this step's global batch (same on every rank);
    # None for a synthetic batch. Save `cursor_end` of the last trained batch.
    cursor_start: Cursor | None = None
    cursor_end: Cursor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return replace(self, dense=self.dense.to(device, non_blocking=non_blocking),
                       sparse=self.sparse.to(device, non_blocking=non_blocking),
                       labels=self.labels.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        return replace(self, dense=self.dense.pin_memory(), sparse=self.sparse.pin_memory(),
                       labels=self.labels.pin_memory())


def _stable_hash(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")


def reduce_ids(values: pa.Array, num_embeddings: int) -> np.ndarray:
    """Ids into [0, num_embeddings): integers modulo, strings by a stable hash modulo."""
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    if pa.types.is_integer(values.type):
        ids = values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        return np.mod(ids, num_embeddings)
    encoded = pc.dictionary_encode(values)
    table = np.fromiter((_stable_hash(s) % num_embeddings for s in encoded.dictionary.to_pylist()),
                        dtype=np.int64, count=len(encoded.dictionary))
    return table[encoded.indices.to_numpy(zero_copy_only=False)]


def _jagged(col: pa.Array, feat: SparseFeature) -> tuple[np.ndarray, np.ndarray]:
    """(ids, lengths) of one sparse column; null ids and null lists contribute nothing."""
    n = len(col)
    if feat.multi_valued:
        flat = pc.list_flatten(col)
        parents = pc.list_parent_indices(col).to_numpy(zero_copy_only=False)
        keep = flat.is_valid().to_numpy(zero_copy_only=False)
        flat = flat.filter(pa.array(keep))
        lengths = np.bincount(parents[keep], minlength=n)
    else:
        keep = col.is_valid().to_numpy(zero_copy_only=False)
        flat = col.filter(pa.array(keep)) if col.null_count else col
        lengths = keep.astype(np.int32)
    return reduce_ids(flat, feat.num_embeddings), lengths.astype(np.int32, copy=False)


def _numeric(col: pa.Array, *, fill: float | None, file: str, name: str) -> np.ndarray:
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    if pa.types.is_boolean(col.type):
        col = col.cast(pa.int8())
    if col.null_count:
        if fill is None:
            raise DataError(file, name, f"has {col.null_count} null values; labels must be set")
        col = pc.fill_null(col, fill)
    return col.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)


@dataclass(frozen=True, eq=False)
class Columns:
    """Rows decoded once into the batch layout, so that a batch is a slice, not a decode.

    `dense` float32 [n, len(schema.dense)] (log1p applied when the schema says so), `labels`
    float32 [n]; per sparse feature (schema order) `ids` int64 (reduced into its table),
    `lengths` int32 [n], and `offsets` int64 [n + 1]: row i's ids are
    ids[offsets[i]:offsets[i + 1]]. A pipeline decodes each file it reads once (vectorised,
    mostly outside the interpreter lock), then cuts every batch from it: the prefetch thread's
    per-batch work is a few array slices, so it seldom holds the lock that the training thread
    needs (on a 2-core host each held lock was a millisecond-scale data stall)."""

    dense: np.ndarray
    labels: np.ndarray
    ids: tuple[np.ndarray, ...]
    lengths: tuple[np.ndarray, ...]
    offsets: tuple[np.ndarray, ...]

    @property
    def num_rows(self) -> int:
        return int(self.labels.shape[0])

    def rows(self, lo: int, hi: int) -> Rows:
        if not 0 <= lo <= hi <= self.num_rows:
            raise ValueError(f"Columns.rows: [{lo}, {hi}) outside [0, {self.num_rows}]")
        return Rows(self, lo, hi)


@dataclass(frozen=True)
class Rows:
    """Rows [lo, hi) of decoded `columns` (nothing copied until a batch is made)."""

    columns: Columns
    lo: int
    hi: int

    @property
    def num_rows(self) -> int:
        return self.hi - self.lo

    def ids(self, k: int) -> np.ndarray:
        off = self.columns.offsets[k]
        return self.columns.ids[k][off[self.lo]:off[self.hi]]

    def lengths(self, k: int) -> np.ndarray:
        return self.columns.lengths[k][self.lo:self.hi]


def decode_table(table: pa.Table, schema: FeatureSchema, *, source: str = "<table>") -> Columns:
    """Rows of a window (already checked against `schema`), decoded into `Columns`."""
    cols = {name: table.column(name).combine_chunks() for name in schema.columns}
    n = table.num_rows
    if schema.dense:
        dense = np.stack([_numeric(cols[d], fill=0.0, file=source, name=d)
                          for d in schema.dense], axis=1)
        if schema.dense_log1p:
            dense = np.sign(dense) * np.log1p(np.abs(dense))
    else:
        dense = np.zeros((n, 0), dtype=np.float32)
    labels = _numeric(cols[schema.label], fill=None, file=source, name=schema.label)
    ids, lengths, offsets = [], [], []
    for f in schema.sparse:
        values, length = _jagged(cols[f.name], f)
        off = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(length, out=off[1:])
        ids.append(values.astype(np.int64, copy=False))
        lengths.append(length.astype(np.int32, copy=False))
        offsets.append(off)
    return Columns(dense=np.ascontiguousarray(dense, dtype=np.float32), labels=labels, ids=tuple(ids),
                   lengths=tuple(lengths), offsets=tuple(offsets))


def columns_to_batch(pieces: list[Rows], schema: FeatureSchema, *, cursor_start: Cursor | None = None,
                     cursor_end: Cursor | None = None) -> Batch:
    """One Batch of the rows of `pieces`, in order (a batch that spans files has a piece per
    file). Every tensor is a fresh copy: no batch shares memory with a decoded file."""
    if not pieces:
        raise ValueError("columns_to_batch needs at least one piece of rows")
    n = sum(p.num_rows for p in pieces)
    dense = np.concatenate([p.columns.dense[p.lo:p.hi] for p in pieces])
    labels = np.concatenate([p.columns.labels[p.lo:p.hi] for p in pieces])
    features = range(len(schema.sparse))
    kjt = KeyedJaggedTensor(
        keys=list(schema.sparse_names),
        values=torch.from_numpy(np.concatenate([p.ids(k) for k in features for p in pieces])),
        lengths=torch.from_numpy(np.concatenate([p.lengths(k) for k in features for p in pieces])),
        stride=n,
    )
    return Batch(dense=torch.from_numpy(dense), sparse=kjt, labels=torch.from_numpy(labels),
                 cursor_start=cursor_start, cursor_end=cursor_end)


def table_to_batch(table: pa.Table, schema: FeatureSchema, *, source: str = "<table>",
                   cursor_start: Cursor | None = None,
                   cursor_end: Cursor | None = None) -> Batch:
    """Rows of a window (already checked against `schema`) as one Batch."""
    columns = decode_table(table, schema, source=source)
    return columns_to_batch([columns.rows(0, columns.num_rows)], schema,
                            cursor_start=cursor_start, cursor_end=cursor_end)


def synthetic_batch(schema: FeatureSchema, batch_size: int, *, seed: int = 0,
                    max_multi: int = 3) -> Batch:
    """The fast batch: a made-up batch with exactly a real batch's keys, dtypes and shapes,
    so compilation (and model warm-up) can start before the first real batch is read.
    Multi-valued features get lengths 0..max_multi, so the jagged sizes vary as in real data."""
    if batch_size < 1:
        raise ValueError(f"synthetic_batch: batch_size must be >= 1, got {batch_size}")
    g = torch.Generator().manual_seed(seed)
    lengths, values = [], []
    for f in schema.sparse:
        if f.multi_valued:
            ln = torch.randint(0, max_multi + 1, (batch_size,), generator=g, dtype=LENGTHS_DTYPE)
        else:
            ln = torch.ones(batch_size, dtype=LENGTHS_DTYPE)
        lengths.append(ln)
        values.append(torch.randint(0, f.num_embeddings, (int(ln.sum()),), generator=g,
                                    dtype=VALUES_DTYPE))
    kjt = KeyedJaggedTensor(keys=list(schema.sparse_names), values=torch.cat(values),
                            lengths=torch.cat(lengths), stride=batch_size)
    return Batch(dense=torch.rand(batch_size, len(schema.dense), generator=g, dtype=DENSE_DTYPE),
                 sparse=kjt,
                 labels=torch.randint(0, 2, (batch_size,), generator=g).to(LABEL_DTYPE))
