"""A data file checked against its window's `FeatureSchema` from its Parquet footer alone
(schema and row count), so every file of a run is checked before training starts; a mismatch
raises `DataError` naming the file and the column."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .schema import DataError, FeatureSchema


def _plain(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


def _is_numeric(t: pa.DataType) -> bool:
    t = _plain(t)
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def _is_id(t: pa.DataType) -> bool:
    t = _plain(t)
    return pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def column_problem(schema: FeatureSchema, name: str, t: pa.DataType) -> str | None:
    """What is wrong with column `name` of Arrow type `t` under `schema`; None if it fits."""
    if name in schema.dense:
        ok, want = _is_numeric(t), "an integer or floating type (a dense feature)"
    elif name == schema.label:
        ok = _is_numeric(t) or pa.types.is_boolean(t)
        want = "an integer, floating or bool type (the label)"
    else:
        feat = next(f for f in schema.sparse if f.name == name)
        if feat.multi_valued:
            ok = _is_list(t) and _is_id(t.value_type)
            want = "a list of integers or strings (a multi-valued sparse feature)"
        elif _is_list(t):
            return (f"has type {t}, but the schema declares it single-valued; declare it "
                    "multi_valued=True or write one id per row")
        else:
            ok, want = _is_id(t), "an integer or string type (a sparse feature id)"
    return None if ok else f"has type {t}, expected {want}"


def validate_arrow_schema(file: str | Path, arrow: pa.Schema, schema: FeatureSchema) -> None:
    for name in schema.columns:
        idx = arrow.get_field_index(name)
        if idx < 0:
            raise DataError(file, name, "is missing; the schema declares it "
                            "(fix the file or the FeatureSchema)")
        problem = column_problem(schema, name, arrow.field(idx).type)
        if problem:
            raise DataError(file, name, problem)


# files this process checked, by (path, size, modification time, schema): their row counts.
# A window root's footers are read once per process (a spare reads them while it prewarms, so
# a recovery's data index costs a stat per file); a rewritten file has a new key, and a file
# that changed underneath anyway is caught when its rows are read (pipeline.py).
_CHECKED: dict[tuple[str, int, int, FeatureSchema], int] = {}
_CHECKED_MAX = 200_000


def validate_parquet(path: str | Path, schema: FeatureSchema) -> int:
    """Check one file against `schema` from its footer alone; return its row count."""
    try:
        st = os.stat(path)
        key = (str(path), st.st_size, st.st_mtime_ns, schema)
    except OSError:
        key = None
    if key is not None and key in _CHECKED:
        return _CHECKED[key]
    try:
        meta = pq.ParquetFile(path).metadata
        arrow = meta.schema.to_arrow_schema()
    except (pa.ArrowException, OSError) as e:
        raise DataError(path, None, f"is not a valid Parquet file ({e})") from e
    validate_arrow_schema(path, arrow, schema)
    if key is not None:
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.clear()
        _CHECKED[key] = meta.num_rows
    return meta.num_rows
