"""The data preprocessing pipeline (DPP): windows in, fixed-size batches out, with a cursor.

Sharding rule. The files of the chosen windows form one stream of rows. From a start cursor,
step g takes the global batch of `batch_size * world_size` rows at stream position
`start + g * batch_size * world_size`; rank r takes its r-th `batch_size` rows. So ranks read
disjoint rows, the cursor after a step is the same on every rank (`Batch.cursor_end`), and a
restore from that cursor (even with another world size) trains every later row exactly once.
The last, ragged global batch is dropped (its rows stay after the final cursor, so the next
refresh that starts from that cursor trains them); every rank runs `num_batches()` steps.

Building a pipeline reads only file footers and fails fast on a file that does not match the
schema; rows are read when batches are made, one Parquet row group at a time: a row group is
decoded once into the batch layout (`batch.Columns`) and every batch is cut from it. So the
first batch waits for its file's first row group, not the whole file (a file written as one
row group is read whole, as before). A prefetched stream (`batches(prefetch=N)`) also reads
ahead: once its batches are half way through a row group, the next one (in this file or the
next) is read and decoded in a background thread, so crossing into it does not stall the step
that needs it (a window's second file stalled every rank about 1 s); not sooner, so that at the
run's start it does not compete with the compile for the rank's cores. Its error, if any, is raised
where the stream reaches that row group, as a synchronous read would.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
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
    cached_files: int = 2  # decoded row groups kept in memory per rank (the batch being cut holds its own)

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
        self._decoded: OrderedDict[Chunk, Columns] = OrderedDict()
        self._ahead: dict[Chunk, Future[Columns]] = {}  # row groups being read ahead (prefetched streams)
        self._groups: dict[Path, list[int]] = {}  # a file's row-group boundaries (its footer, read once)
        filled = [p for p in self.index.files if p.num_rows > 0]  # an empty file is never read
        self._after = dict(zip((p.path for p in filled), filled[1:]))

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
        it = self._batches(self.index.position(Cursor.of(start)), readahead=prefetch > 0)
        return Prefetcher(it, depth=prefetch) if prefetch > 0 else it

    def __iter__(self) -> Iterator[Batch]:
        return self.batches()

    def _batches(self, pos: int, *, readahead: bool = False) -> Iterator[Batch]:
        b, gb = self.config.batch_size, self.global_batch
        for _ in range(full_batches(self.index.total_rows - pos, b, self.config.world_size)):
            mine = pos + self.config.rank * b
            yield columns_to_batch(self._rows(mine, mine + b, readahead=readahead), self.schema,
                                   cursor_start=self.index.cursor(pos), cursor_end=self.index.cursor(pos + gb))
            pos += gb

    def _rows(self, start: int, stop: int, *, readahead: bool = False) -> list[Rows]:
        out = []
        for part, lo, hi in self.index.locate(start, stop):
            bounds = self._bounds(part)
            g = max(bisect.bisect_right(bounds, lo) - 1, 0)
            while lo < hi:
                g_lo, g_hi = bounds[g], bounds[g + 1]
                end = min(hi, g_hi)
                out.append(self._columns(part, g).rows(lo - g_lo, end - g_lo))
                if readahead and 2 * (end - g_lo) >= g_hi - g_lo:  # half way through it: the next one
                    self._read_ahead_after(part, g)
                lo, g = end, g + 1
        return out

    def _bounds(self, part: PartFile) -> list[int]:
        """The file's row-group boundaries ([0, ..., num_rows]), from its footer."""
        bounds = self._groups.get(part.path)
        if bounds is None:
            try:
                meta = pq.ParquetFile(part.path).metadata
            except (pa.ArrowException, OSError) as e:
                raise DataError(part.path, None, f"could not be read ({e})") from e
            if meta.num_rows != part.num_rows:
                raise DataError(part.path, None, f"has {meta.num_rows} rows, its footer said "
                                f"{part.num_rows} when the run started; it changed underneath")
            bounds = [0, *itertools.accumulate(meta.row_group(g).num_rows for g in range(meta.num_row_groups))]
            self._groups[part.path] = bounds
        return bounds

    def _read_ahead_after(self, part: PartFile, group: int) -> None:
        if group + 2 < len(self._bounds(part)):  # the file's next row group
            nxt = Chunk(part, group + 1)
        else:
            after = self._after.get(part.path)
            if after is None:
                return
            nxt = Chunk(after, 0)
        if nxt not in self._decoded and nxt not in self._ahead:
            self._ahead[nxt] = _read_ahead(lambda: self._read(nxt))

    def _columns(self, part: PartFile, group: int) -> Columns:
        chunk = Chunk(part, group)
        columns = self._decoded.get(chunk)
        if columns is None:
            ahead = self._ahead.pop(chunk, None)
            columns = ahead.result() if ahead is not None else self._read(chunk)
            self._decoded[chunk] = columns
            while len(self._decoded) > self.config.cached_files:
                self._decoded.popitem(last=False)
        return columns

    def _read(self, chunk: Chunk) -> Columns:
        part, g = chunk.part, chunk.group
        bounds = self._bounds(part)
        expected = bounds[g + 1] - bounds[g]
        try:
            table = pq.ParquetFile(part.path).read_row_group(g, columns=list(self.schema.columns))
        except (pa.ArrowException, OSError) as e:
            raise DataError(part.path, None, f"could not be read ({e})") from e
        if table.num_rows != expected:
            raise DataError(part.path, None, f"has {table.num_rows} rows in row group {g}, its footer said "
                            f"{expected} when the run started; it changed underneath")
        return decode_table(table, self.schema, source=str(part.path))


@dataclass(frozen=True)
class Chunk:
    """One row group of one part file: the unit the pipeline reads, decodes and keeps."""

    part: PartFile
    group: int


def _read_ahead(read: Callable[[], Columns]) -> Future[Columns]:
    """`read` run in a daemon thread (one row group, read and decoded); the consumer's `result()`
    returns its columns or raises its error where a synchronous read would."""
    future: Future[Columns] = Future()

    def run() -> None:
        try:
            future.set_result(read())
        except BaseException as e:  # noqa: BLE001 - raised in the consumer by result()
            future.set_exception(e)

    threading.Thread(target=run, name="ettflow-readahead", daemon=True).start()
    return future
