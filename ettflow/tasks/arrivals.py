"""Data that arrives, for the embedded demo: before a refresh on the default synthetic data,
`ensure_new_window` appends the next hourly window when the model has nothing new to train.

A continuous refresh trains the windows newer than the model's watermark (`window_choice`);
on real data they arrive by themselves. The embedded defaults (`ettflow refresh` without a
data root) have a fixed set of synthetic windows, so a second refresh, or the README command
run again, would find nothing new and be skipped: this appends the next window (synthetic,
with the slow drift of `trainer.data.synthetic.append_window`) exactly when that would happen.
A data root or windows given by the user are never touched.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ettflow.ett.warehouse import Warehouse

from .plan import default_data_root
from .warehouse_url import resolve_warehouse_url
from .window_choice import select_windows


def ensure_new_window(params: Mapping[str, Any]) -> str | None:
    """Append a window to the default data when the model would have nothing new; returns its
    name (None: the user's data, explicit windows, or something new already there)."""
    from ettflow.trainer.data.synthetic import append_window
    from ettflow.trainer.data.windows import list_windows

    if params.get("data_root") or params.get("windows"):
        return None
    root = default_data_root()
    with Warehouse.open(resolve_warehouse_url(params)) as wh:
        mark = wh.watermark(params.get("model") or "dlrm")
    choice = select_windows(list_windows(root), mark, max_windows=int(params.get("max_windows") or 4),
                            bootstrap=params.get("bootstrap_windows"))
    if not choice.nothing_new:
        return None
    return append_window(root).name
