"""Data windows on disk, and the data cursor that points into them.

Layout: `root/<window>/<part>.parquet`. Windows are the sub-folders of `root` in name order
(`window=2024010100`, `window-0000`, ...), parts the `.parquet` files of a window in name
order; names starting with `.` or `_` are ignored (work in progress, markers). A window index
is the position of its folder in the listing of `root`, so indices stay stable while new
windows are appended (deleting old windows shifts them: keep a retention prefix or restart
from a fresh cursor).

All files of the windows read form one stream of rows. A `Cursor` (window, file, row) names
the next row not yet trained; `StreamIndex` converts between cursors and stream positions.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ettflow.trainer.data.parquet_check import validate_parquet
from ettflow.trainer.data.schema import DataError, FeatureSchema

if TYPE_CHECKING:
    from ettflow.trainer.config import TrainerConfig


@dataclass(frozen=True, kw_only=True, order=True)
class Cursor:
    """The next row to train: row `row` of part file `file` of window `window`.

    Plain and serialisable; `as_tuple()` is what phase events and the metric compare.
    """

    window: int = 0
    file: int = 0
    row: int = 0

    def __post_init__(self) -> None:
        for name in ("window", "file", "row"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Cursor.{name} must be an int >= 0, got {v!r}")

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.window, self.file, self.row)

    def to_dict(self) -> dict[str, int]:
        return {"window": self.window, "file": self.file, "row": self.row}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Cursor:
        unknown = set(d) - {"window", "file", "row"}
        if unknown:
            raise ValueError(f"Cursor: unknown fields {sorted(unknown)}")
        return cls(window=d.get("window", 0), file=d.get("file", 0), row=d.get("row", 0))

    @classmethod
    def of(cls, value: Cursor | Mapping[str, Any] | Sequence[int] | None) -> Cursor:
        """A cursor from itself, its dict, its tuple, or None (the start)."""
        if value is None:
            return cls()
        if isinstance(value, Cursor):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        w, f, r = value
        return cls(window=w, file=f, row=r)


def _visible(p: Path) -> bool:
    return not p.name.startswith((".", "_"))


def list_windows(root: str | Path) -> list[str]:
    """Window folder names under `root`, in order."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(root, None, "is not a folder of data windows (it does not exist "
                        "or is a file); run `ettflow data generate --out ...` or fix the path")
    return sorted(p.name for p in root.iterdir() if p.is_dir() and _visible(p))


def list_parts(window_dir: str | Path) -> list[Path]:
    return sorted(p for p in Path(window_dir).iterdir()
                  if p.is_file() and p.suffix == ".parquet" and _visible(p))


@dataclass(frozen=True, kw_only=True)
class PartFile:
    window: int  # index of the window folder under root
    file: int  # index of the part in its window
    path: Path
    num_rows: int
    offset: int  # stream position of its first row


def full_batches(rows: int, batch_size: int, world_size: int = 1) -> int:
    """Steps every rank runs over `rows` stream rows (the ragged last global batch dropped)."""
    if batch_size < 1 or world_size < 1:
        raise ValueError(f"batch_size and world_size must be >= 1, got {batch_size}, {world_size}")
    return max(rows, 0) // (batch_size * world_size)


class StreamIndex:
    """The files of the chosen windows, checked against the schema, as one row stream.

    Building it reads every file's footer (not its data), so a bad file stops the run
    before training, with the file and column named.
    """

    def __init__(self, root: str | Path, schema: FeatureSchema,
                 windows: Sequence[str] | None = None):
        names = list_windows(root)
        chosen = names if windows is None else list(windows)
        missing = [w for w in chosen if w not in names]
        if missing:
            raise DataError(root, None, f"has no window folders {missing} (it has {names[:5]}"
                            f"{'...' if len(names) > 5 else ''})")
        self.root = Path(root)
        self.files: list[PartFile] = []
        offset = 0
        for w in sorted(names.index(name) for name in chosen):
            for f, path in enumerate(list_parts(self.root / names[w])):
                n = validate_parquet(path, schema)
                self.files.append(PartFile(window=w, file=f, path=path, num_rows=n, offset=offset))
                offset += n
        self.total_rows = offset
        self.windows = frozenset(names.index(name) for name in chosen)
        self._keys = [(p.window, p.file) for p in self.files]
        self._offsets = [p.offset for p in self.files]

    def position(self, cursor: Cursor) -> int:
        """Rows of the stream before `cursor` (files before it, plus its row)."""
        k = bisect.bisect_left(self._keys, (cursor.window, cursor.file))
        if k < len(self.files) and self._keys[k] == (cursor.window, cursor.file):
            part = self.files[k]
            if cursor.row > part.num_rows:
                raise DataError(part.path, None, f"has {part.num_rows} rows but the cursor "
                                f"{cursor.as_tuple()} points at row {cursor.row}; the file "
                                "changed since the checkpoint was written")
            return part.offset + cursor.row
        if cursor.row and cursor.window in self.windows:
            raise DataError(self.root, None, f"has no part file for cursor {cursor.as_tuple()}; "
                            "a window or file was removed since the checkpoint was written")
        return self._offsets[k] if k < len(self.files) else self.total_rows

    def cursor(self, position: int) -> Cursor:
        """The cursor of stream position `position` (at a file boundary: the next file)."""
        if not 0 <= position <= self.total_rows:
            raise ValueError(f"position {position} outside the stream [0, {self.total_rows}]")
        if not self.files:
            return Cursor()
        k = bisect.bisect_right(self._offsets, position) - 1
        while k + 1 < len(self.files) and self.files[k].offset + self.files[k].num_rows <= position:
            k += 1  # skip empty files and land on the file that holds `position`
        part = self.files[k]
        return Cursor(window=part.window, file=part.file, row=position - part.offset)

    def locate(self, start: int, stop: int) -> list[tuple[PartFile, int, int]]:
        """The (file, first row, end row) pieces that hold stream rows [start, stop)."""
        out = []
        k = max(bisect.bisect_right(self._offsets, start) - 1, 0)
        while start < stop and k < len(self.files):
            part = self.files[k]
            lo, hi = start - part.offset, min(stop - part.offset, part.num_rows)
            if hi > lo:
                out.append((part, lo, hi))
                start = part.offset + hi
            k += 1
        return out


def split_windows(config: TrainerConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Training windows and held-out windows: with no windows given, every window but the
    last trains and the last is held out."""
    if config.windows is not None:
        return config.windows, tuple(config.eval_windows or ())
    names = list_windows(config.data_root)
    if len(names) < 2:
        raise ValueError(
            f"{config.data_root} has {len(names)} window(s): give `windows` explicitly, or at "
            "least two windows so the last can be held out for evaluation"
        )
    return tuple(names[:-1]), tuple(config.eval_windows or names[-1:])
