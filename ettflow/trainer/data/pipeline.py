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
the batch layout (`batch.Columns`) and every batch is cut from it. A prefetched stream
(`batches(prefetch=N)`) also reads ahead: once its batches are half way through a file, the next
file is read and decoded in a background thread, so crossing into it does not stall the step
that needs it (a window's second file stalled every rank about 1 s); not sooner, so that at the
run's start it does not compete with the compile for the rank's cores. Its error, if any, is raised
where the stream reaches that file, as a synchronous read would.
"""

from __future__ import annotations

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
        self._ahead: dict[Path, Future[Columns]] = {}  # files being read ahead (prefetched streams)
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
        pieces = self.index.locate(start, stop)
        for part, _, hi in pieces if readahead else ():
            if 2 * hi >= part.num_rows:  # half way through a file (not at the run's start)
                self._read_ahead_after(part)
        return [self._columns(part).rows(lo, hi) for part, lo, hi in pieces]

    def _read_ahead_after(self, part: PartFile) -> None:
        nxt = self._after.get(part.path)
        if nxt is not None and nxt.path not in self._decoded and nxt.path not in self._ahead:
            self._ahead[nxt.path] = _read_ahead(lambda: self._read(nxt))

    def _columns(self, part: PartFile) -> Columns:
        columns = self._decoded.get(part.path)
        if columns is None:
            ahead = self._ahead.pop(part.path, None)
            columns = ahead.result() if ahead is not None else self._read(part)
            self._decoded[part.path] = columns
            while len(self._decoded) > self.config.cached_files:
                self._decoded.popitem(last=False)
        return columns

    def _read(self, part: PartFile) -> Columns:
        try:
            table = pq.read_table(part.path, columns=list(self.schema.columns))
        except (pa.ArrowException, OSError) as e:
            raise DataError(part.path, None, f"could not be read ({e})") from e
        if table.num_rows != part.num_rows:
            raise DataError(part.path, None, f"has {table.num_rows} rows, its footer said "
                            f"{part.num_rows} when the run started; it changed underneath")
        return decode_table(table, self.schema, source=str(part.path))


def _read_ahead(read: Callable[[], Columns]) -> Future[Columns]:
    """`read` run in a daemon thread (one file, read and decoded); the consumer's `result()`
    returns its columns or raises its error where a synchronous read would."""
    future: Future[Columns] = Future()

    def run() -> None:
        try:
            future.set_result(read())
        except BaseException as e:  # noqa: BLE001 - raised in the consumer by result()
            future.set_exception(e)

    threading.Thread(target=run, name="ettflow-readahead", daemon=True).start()
    return future
