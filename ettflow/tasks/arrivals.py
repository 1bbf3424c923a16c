"""Data that arrives, for the embedded demo: before a refresh on the default synthetic data,
`ensure_new_window` appends the next hourly window when the model has nothing new to train.

A continuous refresh trains the windows newer than the model's watermark (`window_choice`);
on real data they arrive by themselves. The embedded defaults (`ettflow refresh` without a
data root) have a fixed set of synthetic windows, so a second refresh, or the README command
run again, would find nothing new and be skipped: this appends the next window (synthetic,
with the slow drift of `trainer.data.synthetic.append_window`) exactly when that would happen.
A data root or windows given by the user are never touched.

The flow calls it (`arrive_windows`, once the warehouse is checked), so a deployment's scheduled
refresh of the demo trains a new window each time, as `ettflow refresh` does; appends are
serialized by a lock beside the data, so two refreshes starting together add one window.
"""

from __future__ import annotations

import fcntl
from collections.abc import Mapping
from typing import Any

from prefect import get_run_logger

from ettflow.ett.warehouse import Warehouse

from .parameters import RefreshParameters
from .plan import RefreshPlan, default_data_root
from .warehouse_url import resolve_warehouse_url
from .window_choice import select_windows


def ensure_new_window(params: RefreshParameters | Mapping[str, Any]) -> str | None:
    """Append a window to the default data when the model would have nothing new; returns its
    name (None: the user's data, explicit windows, or something new already there)."""
    from ettflow.trainer.data.synthetic import append_window
    from ettflow.trainer.data.windows import list_windows

    p = params if isinstance(params, RefreshParameters) else RefreshParameters.parse(params)
    if p.data.data_root or p.data.windows:
        return None
    root = default_data_root()
    with Warehouse.open(resolve_warehouse_url(p.warehouse)) as wh:
        mark = wh.watermark(p.model)
    with open(root / ".append.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        choice = select_windows(list_windows(root), mark, max_windows=p.data.max_windows,
                                bootstrap=p.data.bootstrap_windows)
        if not choice.nothing_new:
            return None
        return append_window(root).name


def arrive_windows(plan: RefreshPlan) -> str | None:
    """`ensure_new_window` in the flow, once its warehouse is checked: the demo's next window,
    when it needs one (None: the user's data or windows, or something new already there)."""
    arrived = ensure_new_window(plan.params)
    if arrived:
        get_run_logger().info("new data arrived on the default synthetic source: %s (the next hourly window, "
                              "drifting as `ettflow data append` makes it)", arrived)
    return arrived
