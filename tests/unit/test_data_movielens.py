"""MovieLens-100K windows: time-ordered, label = rating >= 4, trainable by the pipeline."""

import itertools
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from ettflow.trainer.data.movielens import FILES, movielens_windows
from ettflow.trainer.data.pipeline import DataConfig, DataPipeline
from ettflow.trainer.data.schema import movielens_schema

from helpers.movielens import fake_source as _fake_source


def check_windows(folders, batch_size=8):
    schema = movielens_schema()
    tables = [pq.read_table(f) for f in folders]
    for a, b in itertools.pairwise(tables):
        assert a.column("timestamp").to_numpy().max() <= b.column("timestamp").to_numpy().min()
    for t in tables:
        ts = t.column("timestamp").to_numpy()
        assert (np.diff(ts) >= 0).all()
        rating = t.column("rating").to_numpy()
        assert (t.column("label").to_numpy() == (rating >= 4)).all()
    root = folders[0].parent
    p = DataPipeline(DataConfig(root=root, schema=schema, batch_size=batch_size))
    batches = list(p)
    rows = sum(t.num_rows for t in tables)
    assert len(batches) == p.num_batches() == rows // batch_size
    genres = torch.cat([b.sparse["genres"].lengths() for b in batches])
    assert len(set(genres.tolist())) > 1  # multi-valued: jagged lengths vary
    for b in batches:
        for f in schema.sparse:
            assert b.sparse[f.name].values().max() < f.num_embeddings
    return tables


def test_windows_from_source_files(tmp_path):
    src = _fake_source(tmp_path / "src")
    folders = movielens_windows(tmp_path / "out", windows=4, cache_dir=src)
    assert [f.name for f in folders] == [f"window-{i:04d}" for i in range(4)]
    tables = check_windows(folders)
    assert sum(t.num_rows for t in tables) == 60
    row = tables[0].slice(0, 1).to_pylist()[0]
    assert set(row) >= {"user_id", "item_id", "genres", "age", "gender", "occupation", "zip"}


@pytest.mark.skipif(os.environ.get("ETTFLOW_OFFLINE") == "1", reason="needs PyPI")
def test_movielens_100k_downloaded_from_the_recbole_wheel(tmp_path):
    folders = movielens_windows(tmp_path / "ml", windows=5)
    assert all((tmp_path / "ml" / "_source" / f).is_file() for f in FILES)
    tables = check_windows(folders, batch_size=4096)
    assert sum(t.num_rows for t in tables) == 100_000
    labels = np.concatenate([t.column("label").to_numpy() for t in tables])
    assert 0.5 < labels.mean() < 0.6  # 55% of MovieLens-100K ratings are 4 or 5
