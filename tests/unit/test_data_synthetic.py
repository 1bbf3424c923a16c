"""Synthetic windows: deterministic, Criteo-shaped, and their clicks can be learned."""

import argparse

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from ettflow.trainer.data.cli import main, register
from ettflow.trainer.data.parquet_check import validate_parquet
from ettflow.trainer.data.pipeline import DataConfig, DataPipeline
from ettflow.trainer.data.schema import criteo_schema
from ettflow.trainer.data.synthetic import (
    EFFECT_FEATURES,
    SyntheticConfig,
    generate_windows,
)


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve: P(score of a click > score of a non-click), ties half."""
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    s = scores[order]
    i = 0
    while i < len(s):  # average ranks over ties
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    pos = labels == 1
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def test_auc_helper():
    assert auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == 0.75
    assert auc(np.array([0.5, 0.5]), np.array([0, 1])) == 0.5


def test_windows_are_hourly_complete_and_match_the_schema(tmp_path):
    cfg = SyntheticConfig(windows=3, rows_per_window=50, files_per_window=2, start="2024123123")
    folders = generate_windows(tmp_path, cfg)
    assert [f.name for f in folders] == ["window=2024123123", "window=2025010100",
                                         "window=2025010101"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftovers
    for f in folders:
        parts = sorted(f.glob("*.parquet"))
        assert len(parts) == 2
        assert sum(validate_parquet(p, criteo_schema()) for p in parts) == 50
    with pytest.raises(FileExistsError, match="overwrite"):
        generate_windows(tmp_path, cfg)


def test_same_seed_same_rows_and_windows_differ(tmp_path):
    cfg = SyntheticConfig(windows=2, rows_per_window=200, files_per_window=1, seed=7)
    a = generate_windows(tmp_path / "a", cfg)
    b = generate_windows(tmp_path / "b", cfg)
    read = [pq.read_table(f / "part-00000.parquet") for f in (*a, *b)]
    assert read[0].equals(read[2]) and read[1].equals(read[3])
    assert not read[0].equals(read[1])
    ids = read[0].column("cat_2").to_numpy()
    _, counts = np.unique(ids, return_counts=True)
    assert counts.max() >= 10  # heavy-tailed: a few ids are popular
    assert read[0].column("int_0").null_count > 0


def test_config_is_validated():
    with pytest.raises(ValueError, match="rows_per_window must be an int >= 1"):
        SyntheticConfig(rows_per_window=0)
    with pytest.raises(ValueError, match="YYYYMMDDHH"):
        SyntheticConfig(start="2024-01-01")


def test_labels_are_learnable_held_out(tmp_path):
    generate_windows(tmp_path, SyntheticConfig(windows=2, rows_per_window=20_000, seed=3))
    schema = criteo_schema()
    train, test = ([b for b in DataPipeline(DataConfig(
        root=tmp_path, schema=schema, batch_size=1000, windows=(w,)))]
        for w in ("window=2024010100", "window=2024010101"))
    keys = [f"cat_{c}" for c in EFFECT_FEATURES]
    torch.manual_seed(0)
    dense = torch.nn.Linear(13, 1)
    tables = torch.nn.ModuleDict({k: torch.nn.EmbeddingBag(100_000, 1, mode="sum") for k in keys})

    def score(b):
        out = dense(b.dense).squeeze(1)
        for k in keys:
            jt = b.sparse[k]
            out = out + tables[k](jt.values(), jt.offsets()[:-1].long()).squeeze(1)
        return out

    opt = torch.optim.Adam([*dense.parameters(), *tables.parameters()], lr=0.05)
    for _ in range(3):
        for b in train:
            opt.zero_grad()
            torch.nn.functional.binary_cross_entropy_with_logits(score(b), b.labels).backward()
            opt.step()
    with torch.no_grad():
        scores = torch.cat([score(b) for b in test]).numpy()
    labels = torch.cat([b.labels for b in test]).numpy()
    assert 0.15 < labels.mean() < 0.4
    assert auc(scores, labels) > 0.75  # the hidden model allows about 0.88


def test_cli_generate(tmp_path, capsys):
    assert main(["generate", "--out", str(tmp_path), "--windows", "2",
                 "--rows-per-window", "30", "--seed", "1"]) == 0
    assert "wrote 2 windows" in capsys.readouterr().out
    assert (tmp_path / "_schema.json").is_file()
    assert main(["generate", "--out", str(tmp_path), "--windows", "2",
                 "--rows-per-window", "30"]) == 2
    assert "overwrite" in capsys.readouterr().err

    parser = argparse.ArgumentParser(prog="ettflow")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["data", "movielens", "--out", "x", "--windows", "3"])
    assert args.windows == 3 and callable(args.func)


def test_append_adds_the_next_hour_identical_to_a_longer_generation_and_drifts(tmp_path):
    from ettflow.trainer.data.synthetic import append_window

    cfg = SyntheticConfig(windows=2, rows_per_window=300, files_per_window=1, seed=4, drift=0.5)
    generate_windows(tmp_path / "grown", cfg)
    assert main(["append", "--root", str(tmp_path / "grown")]) == 0
    folder = append_window(tmp_path / "grown")
    assert folder.name == "window=2024010103"
    longer = generate_windows(tmp_path / "long", SyntheticConfig(**{**cfg.__dict__, "windows": 4}))
    for w in longer:
        assert pq.read_table(w / "part-00000.parquet").equals(pq.read_table(tmp_path / "grown" / w.name /
                                                                             "part-00000.parquet"))
    # same rows and features, but the click model moved: labels differ from a drift-free root
    still = generate_windows(tmp_path / "still", SyntheticConfig(**{**cfg.__dict__, "windows": 4, "drift": 0.0}))
    first, last = (pq.read_table(w / "part-00000.parquet") for w in (still[0], still[3]))
    assert first.equals(pq.read_table(longer[0] / "part-00000.parquet"))  # window 0 has not drifted
    assert last.drop(["label"]).equals(pq.read_table(longer[3] / "part-00000.parquet").drop(["label"]))
    assert not last.column("label").equals(pq.read_table(longer[3] / "part-00000.parquet").column("label"))
    with pytest.raises(ValueError, match="no hourly synthetic windows"):
        append_window(tmp_path / "empty" if (tmp_path / "empty").mkdir() is None else None)
