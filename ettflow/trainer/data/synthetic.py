"""Criteo-like synthetic windows whose clicks come from a hidden model, so training learns.

Each row has 13 dense counts (`int_0..int_12`, log-normal, some missing), 26 categorical ids
(`cat_0..cat_25`, power-law popularity over per-feature vocabularies of 3 to 100k ids, some
missing) and a `label` drawn from a fixed logistic model: weights on the log dense counts plus
a random effect per id of a few categorical features. The model depends on the seed and
drifts slowly: window t hours after the root's first window uses weights and id effects moved
by `drift * t` along fixed directions (drift 0: every window shows the same relationship).
Rows of window w come from (seed, w), so any window can be regenerated alone, identically.

`append_window(root)` adds the next hourly window to a root, with the config `generate_windows`
recorded in `root/_synthetic.json`, so appended windows equal those a longer generation makes.

Windows are written as `out/window=YYYYMMDDHH/part-NNNNN.parquet` (one folder per hour),
each first into a hidden folder and renamed into place when complete, plus `out/_schema.json`.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ettflow.trainer.data.schema import CRITEO_DENSE, CRITEO_SPARSE, criteo_schema

CARDINALITIES = (1000, 500, 100_000, 50_000, 300, 20, 10_000, 600, 3, 30_000, 5000, 80_000,
                 3000, 25, 10_000, 60_000, 10, 5000, 2000, 4, 70_000, 15, 15, 40_000, 60, 20_000)
EFFECT_FEATURES = (0, 1, 4, 6, 13)  # categorical features with a per-id effect on the click
TIME_FORMAT = "%Y%m%d%H"
EPOCH = datetime(2000, 1, 1)  # window rows are seeded by (seed, hours since EPOCH)
SYNTHETIC_FILE = "_synthetic.json"  # the SyntheticConfig a root was generated with (for append_window)


@dataclass(frozen=True, kw_only=True)
class SyntheticConfig:
    windows: int = 4
    rows_per_window: int = 10_000
    files_per_window: int = 2
    # rows per Parquet row group (None: pyarrow's default, a file's rows in one): the pipeline
    # decodes one row group at a time, so a rank's first batch waits for one, not the whole file
    row_group_size: int | None = 65_536
    seed: int = 0
    start: str = "2024010100"  # first window's hour, YYYYMMDDHH
    overwrite: bool = False
    null_fraction: float = 0.03  # share of missing values in the columns that have them
    drift: float = 0.02  # per hourly window: how far the click model moves (0: not at all)

    def __post_init__(self) -> None:
        for name in ("windows", "rows_per_window", "files_per_window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SyntheticConfig.{name} must be an int >= 1, got {v!r}")
        if self.row_group_size is not None and self.row_group_size < 1:
            raise ValueError(f"SyntheticConfig.row_group_size must be >= 1 or None, "
                             f"got {self.row_group_size!r}")
        if not 0.0 <= self.null_fraction < 1.0:
            raise ValueError(f"SyntheticConfig.null_fraction must be in [0, 1), "
                             f"got {self.null_fraction!r}")
        if not 0.0 <= self.drift <= 1.0:
            raise ValueError(f"SyntheticConfig.drift must be in [0, 1] (per window), got {self.drift!r}")
        try:
            ok = datetime.strptime(self.start, TIME_FORMAT) >= EPOCH
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"SyntheticConfig.start must be an hour as YYYYMMDDHH, from 2000 "
                             f"on, got {self.start!r}")


def _power_law_cdf(k: int, a: float) -> np.ndarray:
    p = np.arange(1, k + 1, dtype=np.float64) ** -a
    return np.cumsum(p) / p.sum()


class HiddenModel:
    """The click model behind the labels; fixed by the seed."""

    def __init__(self, seed: int):
        rng = np.random.default_rng([seed, 0])
        self.dense_mu = rng.uniform(0.0, 3.0, 13)
        self.dense_sigma = rng.uniform(0.5, 1.5, 13)
        self.dense_w = rng.normal(0.0, 0.6, 13)
        # popularity rank -> stored id, and rank -> click effect for the effect features
        self.ids = [rng.permutation(k) for k in CARDINALITIES]
        self.cdf = [_power_law_cdf(k, 1.1) for k in CARDINALITIES]
        self.effects = {c: rng.normal(0.0, 0.8, CARDINALITIES[c]) for c in EFFECT_FEATURES}
        self.bias = -2.5  # about 26% clicks
        # drift directions (their own stream: the rows of a window do not depend on them)
        drift_rng = np.random.default_rng([seed, 2])
        self.dense_w_dir = drift_rng.normal(0.0, 0.6, 13)
        self.effects_dir = {c: drift_rng.normal(0.0, 0.8, CARDINALITIES[c]) for c in EFFECT_FEATURES}

    def at(self, t: float) -> HiddenModel:
        """The model `t` drift units on (t = drift x hours since the first window)."""
        if t == 0:
            return self
        moved = object.__new__(HiddenModel)
        moved.__dict__.update(self.__dict__)
        moved.dense_w = self.dense_w + t * self.dense_w_dir
        moved.effects = {c: e + t * self.effects_dir[c] for c, e in self.effects.items()}
        return moved

    def rows(self, n: int, rng: np.random.Generator, null_fraction: float) -> pa.Table:
        cols: dict[str, pa.Array] = {}
        logit = np.full(n, self.bias)
        for i, name in enumerate(CRITEO_DENSE):
            counts = np.floor(np.expm1(rng.normal(self.dense_mu[i], self.dense_sigma[i], n)
                                       .clip(0.0, None))).astype(np.int64)
            missing = rng.random(n) < (null_fraction if i % 3 == 0 else 0.0)
            z = (np.log1p(counts) - self.dense_mu[i]) / self.dense_sigma[i]
            logit += np.where(missing, 0.0, self.dense_w[i] * z)
            cols[name] = pa.array(counts, mask=missing)
        for c, name in enumerate(CRITEO_SPARSE):
            ranks = np.searchsorted(self.cdf[c], rng.random(n))
            ranks = np.minimum(ranks, CARDINALITIES[c] - 1)
            missing = rng.random(n) < (null_fraction if c % 5 == 2 else 0.0)
            if c in self.effects:
                logit += self.effects[c][ranks]
            cols[name] = pa.array(self.ids[c][ranks].astype(np.int64), mask=missing)
        clicks = rng.random(n) < 1.0 / (1.0 + np.exp(-logit))
        cols["label"] = pa.array(clicks.astype(np.int8))
        return pa.table(cols)


def window_names(config: SyntheticConfig) -> list[str]:
    t0 = datetime.strptime(config.start, TIME_FORMAT)
    return [f"window={(t0 + timedelta(hours=w)).strftime(TIME_FORMAT)}"
            for w in range(config.windows)]


def write_window(table: pa.Table, folder: Path, *, files: int, row_group_size: int | None,
                 overwrite: bool) -> Path:
    """Write one window's rows as `files` part files, atomically (hidden folder, then rename)."""
    if folder.exists():
        if not overwrite:
            raise FileExistsError(f"{folder} exists; pass overwrite=True (--overwrite) to "
                                  "replace it, or start after it (--start)")
        shutil.rmtree(folder)
    tmp = folder.parent / f".{folder.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    bounds = np.linspace(0, table.num_rows, files + 1).astype(int)
    for f in range(files):
        pq.write_table(table.slice(bounds[f], bounds[f + 1] - bounds[f]),
                       tmp / f"part-{f:05d}.parquet", row_group_size=row_group_size)
    tmp.rename(folder)
    return folder


def generate_windows(out: str | Path, config: SyntheticConfig | None = None, *,
                     progress: bool = False) -> list[Path]:
    """Write `config.windows` hourly windows under `out`; return their folders.
    `progress`: show a progress bar (one step per window) on stderr while a person waits."""
    from tqdm import tqdm

    config = config or SyntheticConfig()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = HiddenModel(config.seed)
    folders = [_write(out, name, config, model)
               for name in tqdm(window_names(config), desc="windows", unit="window", disable=not progress)]
    (out / "_schema.json").write_text(json.dumps(criteo_schema().to_dict(), indent=2))
    (out / SYNTHETIC_FILE).write_text(json.dumps(asdict(replace(config, overwrite=False)), indent=2))
    return folders


def _hours(name: str) -> int:
    return int((datetime.strptime(name.split("=")[1], TIME_FORMAT) - EPOCH).total_seconds()) // 3600


def _write(out: Path, name: str, config: SyntheticConfig, model: HiddenModel) -> Path:
    """Window `name`: rows seeded by (seed, hour), clicks from the model drifted to its hour."""
    hour = _hours(name)
    rng = np.random.default_rng([config.seed, 1, hour])
    drifted = model.at(config.drift * (hour - _hours(f"window={config.start}")))
    table = drifted.rows(config.rows_per_window, rng, config.null_fraction)
    return write_window(table, out / name, files=config.files_per_window, row_group_size=config.row_group_size,
                        overwrite=config.overwrite)


def append_window(root: str | Path, **overrides) -> Path:
    """Add the next hourly window to a synthetic root (the hour after its last window), with
    the config recorded in `root/_synthetic.json` (`overrides`: SyntheticConfig fields, e.g.
    rows_per_window); returns the new window's folder. A root without `_synthetic.json`
    (generated before it existed) takes SyntheticConfig's defaults from its first window."""
    from ettflow.trainer.data.windows import list_windows

    root = Path(root)
    names = [n for n in list_windows(root) if n.startswith("window=")]
    if not names:
        raise ValueError(f"{root} has no hourly synthetic windows (window=YYYYMMDDHH) to append to: create "
                         "them with `ettflow data generate --out DIR`")
    recorded = root / SYNTHETIC_FILE
    base = json.loads(recorded.read_text()) if recorded.is_file() else {"start": names[0].split("=")[1]}
    config = SyntheticConfig(**{**base, **overrides, "windows": 1, "overwrite": False})
    nxt = datetime.strptime(names[-1].split("=")[1], TIME_FORMAT) + timedelta(hours=1)
    return _write(root, f"window={nxt.strftime(TIME_FORMAT)}", config, HiddenModel(config.seed))
