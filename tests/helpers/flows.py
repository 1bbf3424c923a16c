"""Running `refresh_model` in a test: the tiny model every end-to-end test trains, the switches
of a run whose subject is not the compile or live recovery, and one way to run the flow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The model of every end-to-end test (flow and trainer level alike), so that they share one
# compile-cache archive: its key holds the model config and the batch's shapes (conftest's
# `compile_cache` builds it once per session).
TINY = {"embedding_dim": 8, "dense_arch": [16, 8], "over_arch": [16, 1], "dense_lr": 0.02, "sparse_lr": 0.1}
BATCH = 32
MODEL = "dlrm"
# A run that checks something other than the compile or live recovery: no compile, no spare,
# no in-memory keeper (each is two processes less to start on the test's two cores).
PLAIN = {"compile": False, "live_recovery": False, "memory_checkpoint": False}


def flow_env(root: Path, data_root: str | Path, work_root: str | Path, **over: Any) -> dict[str, Any]:
    """The parameters of a refresh of the tiny model: its own spool, snapshots and SQLite
    warehouse under `root`, the session's work root (checkpoints and the compile cache)."""
    env = {
        "data_root": str(data_root), "architecture": TINY, "max_embeddings": 100, "world_size": 2,
        "batch_size": BATCH, "eval_batches": 2, "work_root": str(work_root),
        "snapshot_root": str(root / "snapshots"), "spool_root": str(root / "spool"),
        "warehouse_url": f"sqlite:///{root / 'warehouse.db'}",
    }
    env.update(over)
    return env


def flow_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    """The flow's arguments (one object per section) for parameters in any spelling
    (`world_size`), not validated here: the flow validates them, as a deployment run's."""
    from ettflow.tasks.parameters import RefreshParameters

    return RefreshParameters.nest(params)


def run(env: dict[str, Any], flow=None, **over: Any):
    """Run the flow (`refresh_model` unless another is given) on `env` with `over` on top;
    (final state, flow run id)."""
    if flow is None:
        from ettflow.flows.refresh import refresh_model as flow
    state = flow(**flow_kwargs({**env, **over}), return_state=True)
    return state, str(state.state_details.flow_run_id)


def warehouse_row(url: str, run_id: str):
    """(the run's row or None, its archived events, its failures) as the warehouse holds them."""
    from ettflow.ett.warehouse import Warehouse

    with Warehouse.open(url) as wh:
        runs = wh.runs_frame(run_id=run_id)
        return (runs.iloc[0] if len(runs) else None), wh.table_frame("events", run_id), \
            wh.table_frame("failures", run_id)


def assert_components_sum_to_wall(row) -> None:
    from ettflow.ett.warehouse import COMPONENT_COLUMNS

    assert abs(sum(row[c] for c in COMPONENT_COLUMNS) - row["wall_s"]) < 1e-3, \
        {c: row[c] for c in (*COMPONENT_COLUMNS, "wall_s")}
