"""Data windows and the data preprocessing pipeline (DPP).

- schema: FeatureSchema / SparseFeature, criteo_schema(), movielens_schema(), DataError; parquet_check: validate_parquet
- windows: window folders on disk, Cursor (window, file, row), StreamIndex
- batch: Batch (dense, KeyedJaggedTensor, labels, cursors), synthetic_batch (the fast batch)
- pipeline: DataConfig, DataPipeline (sharded fixed-size batches, resume), full_batches
- prefetch: Prefetcher (background thread)
- synthetic / movielens: write windows; cli: `ettflow data generate|movielens`

Names are imported lazily, so `ettflow data generate` does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DataError": "schema", "FeatureSchema": "schema", "SparseFeature": "schema",
    "criteo_schema": "schema", "movielens_schema": "schema", "validate_parquet": "parquet_check",
    "Cursor": "windows", "StreamIndex": "windows", "list_windows": "windows",
    "Batch": "batch", "synthetic_batch": "batch", "table_to_batch": "batch",
    "DataConfig": "pipeline", "DataPipeline": "pipeline", "full_batches": "pipeline",
    "Prefetcher": "prefetch",
    "SyntheticConfig": "synthetic", "generate_windows": "synthetic",
    "fetch_movielens": "movielens", "movielens_windows": "movielens",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
