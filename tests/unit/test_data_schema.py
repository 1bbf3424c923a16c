"""Schema checks: a file that does not fit stops the run, naming the file and the column."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ettflow.trainer.data.parquet_check import validate_parquet
from ettflow.trainer.data.pipeline import DataConfig, DataPipeline
from ettflow.trainer.data.schema import (
    DataError,
    FeatureSchema,
    SparseFeature,
    criteo_schema,
    movielens_schema,
)
from ettflow.trainer.data.windows import Cursor

SCHEMA = FeatureSchema(
    dense=("d0",),
    sparse=(SparseFeature(name="s0", num_embeddings=10),
            SparseFeature(name="tags", num_embeddings=10, multi_valued=True)),
    label="y",
)


def _table(**override):
    cols = {"d0": pa.array([1.0, 2.0]), "s0": pa.array([1, 2]),
            "tags": pa.array([[1], [2, 3]]), "y": pa.array([0, 1])}
    cols.update(override)
    return pa.table({k: v for k, v in cols.items() if v is not None})


def _write(path, table):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def test_a_fitting_file_passes_and_reports_its_rows(tmp_path):
    assert validate_parquet(_write(tmp_path / "a.parquet", _table()), SCHEMA) == 2


def test_a_footer_is_read_once_per_process_until_the_file_changes(tmp_path, monkeypatch):
    import os

    path = _write(tmp_path / "once.parquet", _table())
    reads = []
    real = pq.ParquetFile
    monkeypatch.setattr(pq, "ParquetFile", lambda p: reads.append(p) or real(p))
    assert validate_parquet(path, SCHEMA) == validate_parquet(path, SCHEMA) == 2
    assert len(reads) == 1  # the second check is a stat
    _write(path, pa.concat_tables([_table(), _table()]))
    os.utime(path, ns=(1, 1))  # even a rewrite within the clock's resolution: size or time changes
    assert validate_parquet(path, SCHEMA) == 4 and len(reads) == 2
    _write(path, _table(y=pa.array(["a", "b"])))  # a rewrite that breaks the schema is caught
    with pytest.raises(DataError, match="y"):
        validate_parquet(path, SCHEMA)


def test_string_ids_and_extra_columns_are_accepted(tmp_path):
    t = _table(s0=pa.array(["a", "b"]), tags=pa.array([["x"], []]), extra=pa.array([1, 2]))
    assert validate_parquet(_write(tmp_path / "a.parquet", t), SCHEMA) == 2


@pytest.mark.parametrize(
    "override, column, words",
    [
        ({"d0": None}, "d0", "is missing"),
        ({"s0": None}, "s0", "is missing"),
        ({"d0": pa.array(["1", "2"])}, "d0", "has type string"),
        ({"y": pa.array(["no", "yes"])}, "y", "has type string"),
        ({"s0": pa.array([1.5, 2.5])}, "s0", "has type double"),
        ({"s0": pa.array([[1], [2]])}, "s0", "single-valued"),
        ({"tags": pa.array([1, 2])}, "tags", "list of integers or strings"),
    ],
)
def test_mismatch_names_file_and_column(tmp_path, override, column, words):
    path = _write(tmp_path / "bad.parquet", _table(**override))
    with pytest.raises(DataError) as err:
        validate_parquet(path, SCHEMA)
    assert err.value.file == str(path) and err.value.column == column
    assert str(path) in str(err.value) and repr(column) in str(err.value)
    assert words in str(err.value)


def test_not_parquet_at_all_names_the_file(tmp_path):
    path = tmp_path / "junk.parquet"
    path.write_text("user,item\n1,2\n")
    with pytest.raises(DataError, match="not a valid Parquet file") as err:
        validate_parquet(path, SCHEMA)
    assert err.value.file == str(path) and err.value.column is None


def test_pipeline_checks_every_file_before_training(tmp_path):
    for w in range(3):
        _write(tmp_path / f"window-{w}" / "part-0.parquet", _table())
    bad = _write(tmp_path / "window-2" / "part-1.parquet", _table(d0=pa.array(["x", "y"])))
    with pytest.raises(DataError) as err:
        DataPipeline(DataConfig(root=tmp_path, schema=SCHEMA, batch_size=1))
    assert err.value.file == str(bad) and err.value.column == "d0"


def test_missing_root_and_missing_window_are_named(tmp_path):
    with pytest.raises(DataError, match="not a folder of data windows"):
        DataPipeline(DataConfig(root=tmp_path / "nope", schema=SCHEMA, batch_size=1))
    _write(tmp_path / "window-0" / "p.parquet", _table())
    with pytest.raises(DataError, match="window-9"):
        DataPipeline(DataConfig(root=tmp_path, schema=SCHEMA, batch_size=1,
                                windows=("window-9",)))


def test_schema_config_is_validated_with_a_reason():
    with pytest.raises(ValueError, match="num_embeddings must be an int >= 1"):
        SparseFeature(name="a", num_embeddings=0)
    with pytest.raises(ValueError, match="more than once"):
        FeatureSchema(dense=("a",), sparse=(SparseFeature(name="a", num_embeddings=2),), label="y")
    with pytest.raises(ValueError, match="at least one sparse"):
        FeatureSchema(dense=("a",), sparse=(), label="y")
    with pytest.raises(ValueError, match="rank must be in"):
        DataConfig(root=".", schema=SCHEMA, batch_size=2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        DataConfig(root=".", schema=SCHEMA, batch_size=0)


@pytest.mark.parametrize("schema", [SCHEMA, criteo_schema(), movielens_schema()])
def test_schema_round_trips_through_json(schema):
    again = FeatureSchema.from_dict(json.loads(json.dumps(schema.to_dict())))
    assert again == schema
    assert DataConfig(root=".", schema=schema.to_dict(), batch_size=1).schema == schema


def test_cursor_is_a_plain_comparable_value():
    c = Cursor(window=2, file=1, row=7)
    assert c.as_tuple() == (2, 1, 7)
    assert Cursor.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert Cursor.of([2, 1, 7]) == c and Cursor.of(None) == Cursor()
    assert Cursor(window=1, file=9, row=9) < c < Cursor(window=2, file=2, row=0)
    with pytest.raises(ValueError, match="Cursor.row must be an int >= 0"):
        Cursor(row=-1)
