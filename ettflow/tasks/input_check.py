"""The `check-inputs` task: the refresh's data, checked before a trainer is reserved.

Once the windows are claimed (`tasks.claims`), every file of the training windows and of the
held-out windows is checked against the declared schema from its Parquet footer alone (the
columns, their types: `trainer.data.parquet_check.validate_parquet`, as the ranks check them), and
the training windows must hold at least one full batch for every rank. A file that fails
refuses the refresh here, with the file and column named and what to do, in one line (no
traceback), with nothing reserved or trained: like a refused parameter, no ETT row and no
failure in the run's failure history (a `data` failure is one the ranks meet while training);
its claims are released like any failed refresh's. The flow process reads footers only: no
torch (`tasks.progress` reads the same index for its step count)."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Failed, State

from ettflow.trainer.data.schema import DataError
from ettflow.trainer.data.windows import StreamIndex, full_batches, split_windows

from .plan import RefreshPlan


def check_windows(plan: RefreshPlan) -> tuple[int, int, int]:
    """(training rows, their full steps, held-out rows); raises `DataError` on the first bad
    file or when the training windows hold no full step."""
    config = plan.trainer
    train, held_out = split_windows(config)
    index = StreamIndex(config.data_root, config.schema, train)
    steps = full_batches(index.total_rows, config.batch_size, config.world_size)
    if steps < 1:
        raise DataError(config.data_root, None,
                        f"windows {', '.join(train)} hold {index.total_rows} rows, fewer than one step of "
                        f"{config.world_size} ranks x batch_size {config.batch_size}: lower batch_size or "
                        "train more windows")
    held = StreamIndex(config.data_root, config.schema, held_out).total_rows if held_out else 0
    return index.total_rows, steps, held


@task(name="check-inputs", cache_policy=NO_CACHE)
def check_inputs(plan: RefreshPlan) -> int | State:
    """The training steps the windows hold, or a Failed state carrying the `DataError`."""
    try:
        rows, steps, held = check_windows(plan)
    except DataError as exc:
        return Failed(message=f"the input data cannot be trained on: {exc}; fix or remove it, or choose other "
                              "windows (`windows`, `eval_windows`)", data=exc)
    get_run_logger().info("inputs checked: %d training rows (%d steps of %d ranks), %d held-out rows", rows, steps,
                          plan.trainer.world_size, held)
    return steps
