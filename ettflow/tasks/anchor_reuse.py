"""A refresh stopped after its anchor was sealed keeps it; the next refresh of the same windows
publishes it instead of training them again (issue 42 #2: two runs stopped by `ettflow down`
while they published had finished training, and their training was redone).

- a failed or stopped run's lineage record names the anchor it sealed, if any
  (`claims.record_failure`, through the train task's `finished_anchor`); its windows are
  released as any failed run's. A run killed outright (CRASHED, settled from outside it when
  its row is archived: `ett.archive.sealed_anchor`) names the anchor its spool says it wrote.
- `reusable_anchor(plan, records)`: the newest failed or crashed record of the model whose
  anchor the plan may publish as its own training: the same windows, from the same parent, an
  anchor of the plan's model and schema, trained with the plan's batch size and step cap
  (`trained_with`), that verifies (every file's checksum). The parent must
  be the same because the anchor holds that parent's state plus these windows; a changed model
  or schema would publish something the user no longer asked for. A record settled from outside
  its run (`lineage.settle_ended_run`: crashed, or failed or cancelled before it recorded its
  end) names no parent run: the anchor's own `parent` (the checkpoint it started from) must be
  the plan's, as for every record.

The flow asks after its inputs are checked and before anything is reserved; a reuse publishes
on the CPU and records the lineage as published with that anchor, with no ETT row (nothing was
reserved or trained: that training is in the stopped run's row). Reading markers and
checksums only: no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from ettflow.ett.lineage import LineageRecord, Outcome
from ettflow.ett.warehouse import Warehouse
from ettflow.trainer.checkpoint.anchor import AnchorFormatError, AnchorInfo, TrainedWith, load_anchor
from ettflow.trainer.checkpoint.config import CheckpointError
from ettflow.trainer.checkpoint.verify import verify

from .plan import RefreshPlan
from .warehouse_url import resolve_warehouse_url

log = logging.getLogger("ettflow")


def reusable_anchor(plan: RefreshPlan, records: Sequence[LineageRecord],
                    publishable: Callable[[str, RefreshPlan], bool] | None = None) -> LineageRecord | None:
    """The newest failed or crashed record (of `records`, the model's lineage, oldest first)
    whose anchor the plan may publish instead of training (see the module docstring); None
    otherwise. `publishable`: whether an anchor folder is the plan's model, schema, parent and
    windows and verifies (default: read from the folder)."""
    publishable = publishable or _publishable
    windows = tuple(plan.trainer.windows or ())
    parent = plan.parent.run_id if plan.parent is not None else None
    for record in reversed(records):
        if record.outcome not in (Outcome.FAILED, Outcome.CRASHED) or not record.anchor or not windows:
            continue
        if record.run_id == plan.run_id:  # its own earlier try (a flow retry): its train task resumes the anchor
            continue
        if tuple(record.windows) != windows:
            continue
        if record.parent_run_id is not None and record.parent_run_id != parent:
            continue  # (a record settled from outside the run does not know its parent: the anchor's own decides)
        if publishable(record.anchor, plan):
            return record
    return None


def _publishable(anchor: str, plan: RefreshPlan) -> bool:
    info = _anchor_info(Path(anchor))
    t = plan.trainer
    if info is None or not _same_windows(info, plan) or info.parent != t.warm_start_from:
        return False
    if info.model != t.model or info.schema != t.schema:
        log.info("anchor %s of a stopped refresh is not reused: its model or schema is not this refresh's", anchor)
        return False
    differs = trained_otherwise(info, plan)
    if differs is not None:
        log.info("anchor %s of a stopped refresh is not reused: %s", anchor, differs)
        return False
    try:
        verify(anchor)
    except (CheckpointError, OSError) as exc:
        log.warning("anchor %s of a stopped refresh is not reused: it failed its check (%s)", anchor, exc)
        return False
    return True


def _anchor_info(folder: Path) -> AnchorInfo | None:
    try:
        return load_anchor(folder)
    except (AnchorFormatError, OSError):
        return None


def trained_otherwise(info: AnchorInfo, plan: RefreshPlan) -> str | None:
    """Why the anchor's training is not what the plan asks of these windows (its batch size a
    rank or its step cap differ, or it does not say: a marker older than `trained_with`), in
    words; None when it is the same."""
    asked = TrainedWith.of(plan.trainer)
    if info.trained_with is None:
        return "its marker does not say how it trained (an older ettflow)"
    if info.trained_with != asked:
        return (f"it trained with batch {info.trained_with.batch_size}, max_steps {info.trained_with.max_steps}; "
                f"this refresh asks batch {asked.batch_size}, max_steps {asked.max_steps}")
    return None


def _same_windows(info: AnchorInfo, plan: RefreshPlan) -> bool:
    return info.windows is not None and tuple(info.windows) == tuple(plan.trainer.windows or ())


@task(name="find-sealed-anchor", cache_policy=NO_CACHE)
def find_reusable_anchor(plan: RefreshPlan) -> LineageRecord | None:
    """The stopped refresh whose sealed anchor this one publishes instead of training (logged)."""
    with Warehouse.open(resolve_warehouse_url(plan.warehouse)) as wh:
        found = reusable_anchor(plan, wh.lineage(plan.model))
    if found is not None:
        get_run_logger().info("model %s: run %s sealed the anchor of these windows (%s) before it stopped (%s): "
                              "publishing it, not training again", plan.model, found.run_id, found.anchor,
                              found.reason or "failed")
    return found
