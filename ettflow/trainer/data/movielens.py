"""MovieLens-100K as time-ordered windows: real interactions that nobody here made.

The data ships inside the `recbole==1.2.1` wheel (`recbole/dataset_example/ml-100k/`).
`fetch_movielens` downloads that wheel alone (`pip download --no-deps`, so nothing is
installed), extracts the three files it needs and caches them. `movielens_windows` joins
ratings with users and items, orders them by time and writes equal-sized consecutive windows
`window-0000, window-0001, ...`; the label is rating >= 4. Categorical strings (gender,
occupation, zip, genres) are encoded by a sorted vocabulary, so ids never collide.
"""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from ettflow.trainer.data.schema import movielens_schema
from ettflow.trainer.data.synthetic import write_window

WHEEL = "recbole==1.2.1"
MEMBER_DIR = "recbole/dataset_example/ml-100k/"
FILES = ("ml-100k.inter", "ml-100k.item", "ml-100k.user")


def fetch_movielens(cache_dir: str | Path) -> Path:
    """The folder holding ml-100k.{inter,item,user}; downloads them once into `cache_dir`."""
    cache = Path(cache_dir)
    if all((cache / f).is_file() for f in FILES):
        return cache
    with tempfile.TemporaryDirectory(prefix="ettflow-ml100k-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", WHEEL, "--no-deps", "--quiet",
               "--disable-pip-version-check", "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("recbole-*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download {WHEEL} (`{' '.join(cmd)}` exited {done.returncode}: "
                f"{done.stderr.strip()[-500:]}); it needs PyPI, or copy {', '.join(FILES)} "
                f"from the wheel's {MEMBER_DIR} into {cache}")
        cache.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as whl:
            for name in FILES:
                part = cache / f".{name}.tmp"
                with whl.open(MEMBER_DIR + name) as src, open(part, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                part.replace(cache / name)
    return cache


def _read(path: Path) -> pd.DataFrame:
    df = pd.read_csv(path, sep="\t", dtype=str, quoting=csv.QUOTE_NONE, keep_default_na=False)
    return df.rename(columns=lambda c: c.split(":")[0])


def _vocab(values) -> dict[str, int]:
    return {v: i for i, v in enumerate(sorted(set(values)))}


def read_movielens(src: str | Path) -> tuple[pd.DataFrame, dict[str, dict[str, int]]]:
    """All ratings joined with their user and item, in time order, and the vocabularies."""
    src = Path(src)
    inter, items, users = (_read(src / f) for f in FILES)
    genres = items["class"].str.split()
    vocab = {"gender": _vocab(users["gender"]), "occupation": _vocab(users["occupation"]),
             "zip": _vocab(users["zip_code"]), "genres": _vocab(g for gs in genres for g in gs)}
    users = pd.DataFrame({
        "user_id": users["user_id"].astype(np.int64),
        "age": users["age"].astype(np.int64),
        "gender": users["gender"].map(vocab["gender"]).astype(np.int64),
        "occupation": users["occupation"].map(vocab["occupation"]).astype(np.int64),
        "zip": users["zip_code"].map(vocab["zip"]).astype(np.int64),
    })
    items = pd.DataFrame({"item_id": items["item_id"].astype(np.int64),
                          "genres": [[vocab["genres"][g] for g in gs] for gs in genres]})
    df = pd.DataFrame({
        "timestamp": inter["timestamp"].astype(float).astype(np.int64),
        "user_id": inter["user_id"].astype(np.int64),
        "item_id": inter["item_id"].astype(np.int64),
        "rating": inter["rating"].astype(float).astype(np.float32),
    })
    df = df.merge(users, on="user_id", how="left", validate="many_to_one")
    df = df.merge(items, on="item_id", how="left", validate="many_to_one")
    df["label"] = (df["rating"] >= 4).astype(np.int8)
    df = df.sort_values(["timestamp", "user_id", "item_id"], kind="stable", ignore_index=True)
    return df, vocab


def movielens_windows(out: str | Path, *, windows: int = 10, files_per_window: int = 1,
                      cache_dir: str | Path | None = None, overwrite: bool = False) -> list[Path]:
    """Write MovieLens-100K under `out` as `windows` consecutive time-ordered windows."""
    if windows < 1 or files_per_window < 1:
        raise ValueError(f"windows and files_per_window must be >= 1, got {windows}, "
                         f"{files_per_window}")
    out = Path(out)
    src = fetch_movielens(cache_dir if cache_dir is not None else out / "_source")
    df, vocab = read_movielens(src)
    arrow_types = {"genres": pa.list_(pa.int64())}
    folders = []
    for w, chunk in enumerate(np.array_split(np.arange(len(df)), windows)):
        part = df.iloc[chunk]
        table = pa.table({c: pa.array(part[c].tolist() if c == "genres" else part[c].to_numpy(),
                                      type=arrow_types.get(c)) for c in df.columns})
        folders.append(write_window(table, out / f"window-{w:04d}", files=files_per_window,
                                    row_group_size=None, overwrite=overwrite))
    (out / "_schema.json").write_text(json.dumps(movielens_schema().to_dict(), indent=2))
    (out / "_vocab.json").write_text(json.dumps(vocab, indent=1))
    return folders
