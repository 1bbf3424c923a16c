"""The data preprocessing pipeline (DPP): windows in, fixed-size batches out, with a cursor.

Sharding rule. The files of the chosen windows form one stream of rows. From a start cursor,
step g takes the global batch of `batch_size * world_size` rows at stream position
`start + g * batch_size * world_size`; rank r takes its r-th `batch_size` rows. So ranks read
disjoint rows, the cursor after a step is the same on every rank (`Batch.cursor_end`), and a
restore from that cursor (even with another world size) trains every later row exactly once.
The last, ragged global batch is dropped (its rows stay after the final cursor, so the next
refresh that starts from that cursor trains them); every rank runs `num_batches()` steps.

Building a pipeline reads only file footers and fails fast on a file that does not match the
schema; rows are read when batches are made, one file at a time: a file is decoded once into
the batch layout (`batch.Columns`) and every batch is cut from it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ettflow.trainer.data.batch import Batch, Columns, Rows, columns_to_batch, decode_table
from ettflow.trainer.data.prefetch import Prefetcher
from ettflow.trainer.data.schema import DataError, FeatureSchema
from ettflow.trainer.data.windows import Cursor, PartFile, StreamIndex, full_batches

CursorLike = Cursor | Mapping[str, Any] | Sequence[int] | None


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """root: folder of window folders; windows: names to read (None: all, in name order)."""

    root: str | Path
    schema: FeatureSchema
    batch_size: int
    rank: int = 0
    world_size: int = 1
    windows: tuple[str, ...] | None = None
    cached_files: int = 2  # decoded files kept in memory per rank (a batch spans at most two)

    def __post_init__(self) -> None:
        if isinstance(self.schema, Mapping):
            object.__setattr__(self, "schema", FeatureSchema.from_dict(self.schema))
        if not isinstance(self.schema, FeatureSchema):
            raise ValueError(f"DataConfig.schema must be a FeatureSchema (or its dict), "
                             f"got {type(self.schema).__name__}")
        for name in ("batch_size", "world_size", "cached_files"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"DataConfig.{name} must be an int >= 1, got {v!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"DataConfig.rank must be in [0, world_size={self.world_size}), "
                             f"got {self.rank!r}")
        if self.windows is not None:
            if isinstance(self.windows, str):
                raise ValueError("DataConfig.windows must be a list of window names, not a str")
            object.__setattr__(self, "windows", tuple(self.windows))


class DataPipeline:
    def __init__(self, config: DataConfig):
        self.config = config
        self.schema = config.schema
        self.index = StreamIndex(config.root, config.schema, config.windows)
        self._decoded: OrderedDict[Path, Columns] = OrderedDict()

    @property
    def global_batch(self) -> int:
        return self.config.batch_size * self.config.world_size

    def num_batches(self, start: CursorLike = None) -> int:
        """Steps every rank runs from `start` to the end of the chosen windows."""
        pos = self.index.position(Cursor.of(start))
        return full_batches(self.index.total_rows - pos, self.config.batch_size,
                            self.config.world_size)

    def end_cursor(self, start: CursorLike = None) -> Cursor:
        """The cursor after the last full batch from `start`: where the next refresh starts."""
        pos = self.index.position(Cursor.of(start))
        return self.index.cursor(pos + self.num_batches(start) * self.global_batch)

    def batches(self, start: CursorLike = None, *, prefetch: int = 0) -> Iterator[Batch]:
        """This rank's batches from `start`; with prefetch > 0 a background thread keeps that
        many ready (call `.close()` on the returned iterator to stop it early)."""
        it = self._batches(self.index.position(Cursor.of(start)))
        return Prefetcher(it, depth=prefetch) if prefetch > 0 else it

    def __iter__(self) -> Iterator[Batch]:
        return self.batches()

    def _batches(self, pos: int) -> Iterator[Batch]:
        b, gb = self.config.batch_size, self.global_batch
        for _ in range(full_batches(self.index.total_rows - pos, b, self.config.world_size)):
            mine = pos + self.config.rank * b
            yield columns_to_batch(self._rows(mine, mine + b), self.schema,
                                   cursor_start=self.index.cursor(pos), cursor_end=self.index.cursor(pos + gb))
            pos += gb

    def _rows(self, start: int, stop: int) -> list[Rows]:
        return [self._columns(part).rows(lo, hi) for part, lo, hi in self.index.locate(start, stop)]

    def _columns(self, part: PartFile) -> Columns:
        columns = self._decoded.get(part.path)
        if columns is None:
            try:
                table = pq.read_table(part.path, columns=list(self.schema.columns))
            except (pa.ArrowException, OSError) as e:
                raise DataError(part.path, None, f"could not be read ({e})") from e
            if table.num_rows != part.num_rows:
                raise DataError(part.path, None, f"has {table.num_rows} rows, its footer said "
                                f"{part.num_rows} when the run started; it changed underneath")
            columns = decode_table(table, self.schema, source=str(part.path))
            self._decoded[part.path] = columns
            while len(self._decoded) > self.config.cached_files:
                self._decoded.popitem(last=False)
        return columns
