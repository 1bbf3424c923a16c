"""The `prune-checkpoints` and `prune-snapshots` tasks: what a model's run checkpoint folders
and published snapshots keep (snapshots: `ettflow.publish.retention`'s policy).

Policy (`doomed_runs`, pure): of the folders under `<work_root>/<model>/runs/`, keep

- the folders of the model's last `keep_refreshes` refreshes that wrote an anchor (lineage,
  newest first);
- the current anchor's run (the last PUBLISHED refresh: its snapshot is the current one) and
  this refresh's parent, whatever their age;
- this run, and any folder without an anchor (a refresh that may still be training), unless
  its run is over: its heartbeat in the spool ended or went silent (or it has none) and nothing
  in the folder changed for `ABANDONED_AFTER_S` (a day: by then a flow retry of it would have
  run, and its claims have lapsed). A failed or killed refresh's checkpoints have no reader
  after that (a retry restarts from them; anchor reuse reads anchors only), and each is a
  model's size or more: they went nowhere before (`abandoned_runs`);

where a refresh's folder is the one its anchor lives in: a refresh that published the anchor a
stopped run of the same windows sealed (`tasks/anchor_reuse.py`) keeps that run's folder. It
removes every other folder that holds an anchor. It runs after the lineage is recorded, as
its own task with its own log line (never inside publishing).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from ettflow.ett.heartbeat import read_heartbeat
from ettflow.ett.lineage import STALE_AFTER_S, LineageRecord, Outcome

from .plan import RefreshPlan
from .warehouse_url import error_text, resolve_warehouse_url


def doomed_runs(folders: Mapping[str, bool], refreshes: Sequence[LineageRecord], *, keep: int,
                protected: Collection[str], runs_root: Path | None = None) -> list[str]:
    """Run ids whose folders go: `folders` maps run id -> holds an anchor; `refreshes` is the
    model's lineage (any order); `protected` are run ids never removed (this run, the parent's
    folder). A kept refresh keeps its own folder and the one under `runs_root` its anchor is in."""
    newest = sorted((r for r in refreshes if r.anchor), key=lambda r: (r.created_at, r.run_id), reverse=True)
    chosen = newest[:keep]
    published = [r for r in newest if r.outcome is Outcome.PUBLISHED]
    if published:
        chosen.append(max(published, key=lambda r: (r.finished_at or r.created_at, r.created_at)))
    kept = set(protected) | {r.run_id for r in chosen} | {anchor_home(r.anchor, runs_root) for r in chosen}
    return sorted(run for run, anchored in folders.items() if anchored and run not in kept)


def anchor_home(anchor: str | None, runs_root: Path | None) -> str | None:
    """The run folder under `runs_root` that holds `anchor` (`<runs_root>/<run>/checkpoints/...`),
    None when it lies elsewhere. Read from the path's own segments (`.../<model>/runs/<run>/
    checkpoints/...`): a host that mounts the shared work root elsewhere wrote the same tail."""
    if anchor is None or runs_root is None:
        return None
    parts, tail = Path(anchor).parts, Path(runs_root).parts[-2:]  # (<model>, "runs")
    for i in range(len(parts) - 4, -1, -1):
        if parts[i:i + 2] == tail and parts[i + 3] == "checkpoints":
            return parts[i + 2]
    return None


ABANDONED_AFTER_S = STALE_AFTER_S
Pruned = TypeVar("Pruned")  # what a retention policy returns


def abandoned_runs(unanchored: Mapping[str, float], live: Collection[str], *, now: float,
                   after_s: float = ABANDONED_AFTER_S) -> list[str]:
    """Run ids of folders without an anchor that go: `unanchored` maps run id -> the newest
    modification time in its folder; `live` are runs whose heartbeat is live (kept whatever
    their age)."""
    return sorted(run for run, changed in unanchored.items() if run not in live and now - changed > after_s)


def newest_change(folder: Path, now: float) -> float:
    """The newest modification time of `folder` and everything under it. What vanishes during
    the scan (a save renaming its files) is passed over; anything else that cannot be read, or
    a folder gone, reads as changed `now`: kept (never taken for a day old)."""
    try:
        newest = folder.stat().st_mtime
        for path in folder.rglob("*"):
            try:
                newest = max(newest, path.lstat().st_mtime)
            except FileNotFoundError:
                continue
    except OSError:
        return now
    return newest


def run_folders(runs_root: Path) -> dict[str, bool]:
    if not runs_root.is_dir():
        return {}
    return {p.name: any(p.glob("checkpoints/*/anchor.json")) for p in runs_root.iterdir() if p.is_dir()}


def model_lineage(plan: RefreshPlan) -> list[LineageRecord]:
    """The model's lineage, which both policies read (raises `OUTAGES` when it is unavailable)."""
    from ettflow.ett.warehouse import Warehouse

    with Warehouse.open(resolve_warehouse_url(plan.warehouse)) as wh:
        return wh.lineage(plan.model)


def apply_retention(plan: RefreshPlan, refreshes: Sequence[LineageRecord] | None = None) -> tuple[list[str], int]:
    """Remove the run folders the policy dooms (`refreshes`: the model's lineage, read when not
    given); returns (removed run ids, folders kept)."""
    refreshes = model_lineage(plan) if refreshes is None else refreshes
    parent = plan.parent
    protected = {plan.run_id} | ({parent.run_id, anchor_home(parent.anchor, plan.runs_root)} - {None}
                                 if parent is not None else set())
    folders = run_folders(plan.runs_root)
    doomed = doomed_runs(folders, refreshes, keep=plan.params.checkpoint.keep_refreshes, protected=protected,
                         runs_root=plan.runs_root)
    now = time.time()
    unanchored = {run: newest_change(plan.runs_root / run, now) for run, anchored in folders.items()
                  if not anchored and run not in protected}
    live = {run for run in unanchored if (beat := read_heartbeat(plan.spool_root, run)) is not None
            and beat.is_live()}
    doomed += abandoned_runs(unanchored, live, now=now)
    for run in doomed:
        shutil.rmtree(plan.runs_root / run, ignore_errors=True)
    return doomed, len(folders) - len(doomed)


@task(name="prune-checkpoints", cache_policy=NO_CACHE)
def prune_checkpoints(plan: RefreshPlan) -> list[str]:
    """Apply the retention policy to the model's run folders; returns the run ids removed. It
    needs the lineage: with the warehouse unavailable nothing is removed (the next refresh prunes)."""
    done = _after_lineage(plan, "prune-checkpoints", lambda refreshes: apply_retention(plan, refreshes))
    if done is None:
        return []
    doomed, kept = done
    get_run_logger().info("prune-checkpoints: model %s keeps %d run folder(s) (the last %d refreshes, the current "
                          "and the parent anchor, runs that may still train), removed %d%s", plan.model, kept,
                          plan.params.checkpoint.keep_refreshes, len(doomed),
                          f": {', '.join(doomed)}" if doomed else "")
    return doomed


def _after_lineage(plan: RefreshPlan, task_name: str,
                   apply: Callable[[Sequence[LineageRecord]], Pruned | None]) -> Pruned | None:
    """`apply` (a retention policy) on the model's lineage, as the housekeeping it is once the
    refresh recorded its own: None, said in a warning, when the lineage is unavailable or when
    anything stops it (the refresh stays as it ended; the next one prunes again)."""
    from ettflow.ett.archive import OUTAGES, outage_reason

    try:
        refreshes = model_lineage(plan)
    except OUTAGES as exc:
        get_run_logger().warning("%s: model %s: nothing removed, the lineage is unavailable (%s)", task_name,
                                 plan.model, outage_reason(exc))
        return None
    try:
        return apply(refreshes)
    except Exception as exc:  # noqa: BLE001 - housekeeping after the lineage: the refresh stays as it ended
        get_run_logger().warning("%s: model %s: stopped by %s; the next refresh prunes again", task_name, plan.model,
                                 error_text(exc, plan.warehouse, trace=not isinstance(exc, OSError)))
        return None


@dataclass(frozen=True)
class PrunedSnapshots:
    """What `apply_snapshot_retention` did: the snapshot folders removed, how many stay, the
    staging folders removed, and the snapshot folders whose manifest could not be read (one
    that stays blocks every removal: its chain is unknown)."""

    removed: list[str]
    kept: int
    staging: int
    unreadable: list[str]


def apply_snapshot_retention(plan: RefreshPlan, refreshes: Sequence[LineageRecord] | None = None) -> PrunedSnapshots:
    """Remove the snapshots the policy dooms (`publish.retention.doomed_snapshots`; `refreshes`:
    the model's lineage, read when not given) and the publishes' staging folders untouched for a
    day. Raises PublishError when `current` is unreadable (nothing removed)."""
    from ettflow.publish import read_current
    from ettflow.publish.retention import doomed_snapshots, read_snapshots, remove_snapshot, staging_folders

    refreshes = model_lineage(plan) if refreshes is None else refreshes
    root = plan.snapshot_root
    current = read_current(root)
    snapshots = read_snapshots(root)
    newest = sorted(refreshes, key=lambda r: (r.created_at, r.run_id), reverse=True)
    names = [(name, r.outcome is Outcome.PUBLISHED) for r in newest
             for name in (r.run_id, Path(r.snapshot).name if r.snapshot else None) if name]
    protected = {plan.run_id} | ({current.snapshot} if current is not None else set())
    doomed = doomed_snapshots(snapshots, names, keep=plan.params.storage.keep_snapshots, protected=protected)
    for name in doomed:
        remove_snapshot(root, name)
    now = time.time()
    stale = [p for p in staging_folders(root) if now - newest_change(p, now) > ABANDONED_AFTER_S]
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)
    unreadable = sorted(name for name, entry in snapshots.items() if not entry.readable and name not in doomed)
    return PrunedSnapshots(removed=doomed, kept=len(snapshots) - len(doomed), staging=len(stale), unreadable=unreadable)


@task(name="prune-snapshots", cache_policy=NO_CACHE)
def prune_snapshots(plan: RefreshPlan) -> list[str]:
    """Apply the snapshot retention policy to the model's snapshot root; returns the snapshot
    folders removed. Without the lineage (warehouse unavailable) or with an unreadable `current`
    nothing is removed: the next refresh prunes."""
    from ettflow.publish import PublishError

    def apply(refreshes: Sequence[LineageRecord]) -> PrunedSnapshots | None:
        try:
            return apply_snapshot_retention(plan, refreshes)
        except PublishError as exc:
            get_run_logger().warning("prune-snapshots: model %s: nothing removed, the current snapshot is unknown "
                                     "(%s)", plan.model, exc)
            return None

    done = _after_lineage(plan, "prune-snapshots", apply)
    if done is None:
        return []
    get_run_logger().info("prune-snapshots: model %s keeps %d snapshot(s) (the last %d published, the current "
                          "one, this run's and the bases their deltas need), removed %d%s%s", plan.model, done.kept,
                          plan.params.storage.keep_snapshots, len(done.removed),
                          f": {', '.join(done.removed)}" if done.removed else "",
                          f"; and {done.staging} staging folder(s) of publishes interrupted over a day ago"
                          if done.staging else "")
    if done.unreadable:
        get_run_logger().warning("prune-snapshots: model %s: the manifest of %s cannot be read: while such a "
                                 "snapshot stays, its chain is unknown and nothing is removed (remove or repair it)",
                                 plan.model, ", ".join(done.unreadable))
    return done.removed
