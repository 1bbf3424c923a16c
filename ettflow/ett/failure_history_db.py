"""Read the failure history (`failure_history.RunHistory`) out of the warehouse.

    with Warehouse.open(url) as wh:
        est = estimate_from_warehouse(wh, model="dlrm", now=time.time())

Per run started at or after `since` (skipped runs left out), from the tables the archive
writes (`warehouse_models`):

- `runs`: model, wall start, new steps (counted on every rank: divided by the ranks that
  recorded `train_step` events in `events`);
- `run_components`: exposed `effective_training` and `wasted_training` seconds;
- `failures`: one class per failed attempt, and detected_at - failed_at; a recovered one's TTR
  by how it recovered (`events`: a `spare_handoff` in the next attempt and that attempt's used
  `spare_start` ready before the failure: a ready spare; no hand-off: every rank restarted);
- `checkpoints`: blocking saves; a save's blocking is the longest of its ranks' (per attempt
  and step); its tier from its kind (`TIER_OF_KIND`: the durable tier's saves are 'blocking';
  a memory tier archives its saves under a kind of its own, mapped here);
- `attempts`: `checkpoint_restore` seconds of each attempt that follows a failed one;
- `refresh_lineage`: how many windows the run trained.

Only reads; the schema is unchanged.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from sqlalchemy import Table, func, select

from .checkpoint_tier import CheckpointTier
from .event_attrs import attrs_of
from .failure_history import EstimateConfig, HistoryEstimate, RunHistory, estimate
from .failures import FailureClass
from .spare_sizing import AT_LOSS
from .warehouse_models import Attempt, Checkpoint, Event, Failure, RefreshLineage, Run, RunComponent

TIER_OF_KIND: dict[str, CheckpointTier] = {"blocking": CheckpointTier.DURABLE}
SKIPPED = "skipped"
_CHUNK = 500
_TRAINING = ("effective_training", "wasted_training")


def _chunks(items: Sequence[str]) -> Iterable[Sequence[str]]:
    for i in range(0, len(items), _CHUNK):
        yield items[i:i + _CHUNK]


def read_history(wh, *, since: float, until: float | None = None) -> list[RunHistory]:
    """Every model's runs started in [since, until] (None: no end), oldest first."""
    runs: Table = Run.__table__
    comps: Table = RunComponent.__table__
    fails: Table = Failure.__table__
    ckpts: Table = Checkpoint.__table__
    atts: Table = Attempt.__table__
    lin: Table = RefreshLineage.__table__
    evs: Table = Event.__table__
    stmt = select(runs.c.run_id, runs.c.model, runs.c.wall_start, runs.c.effective_steps).where(
        runs.c.wall_start >= since, runs.c.status != SKIPPED)
    if until is not None:
        stmt = stmt.where(runs.c.wall_start <= until)
    training: dict[str, dict[str, float]] = defaultdict(dict)
    failures: dict[str, list[tuple[int, FailureClass, float]]] = defaultdict(list)
    recovered: dict[str, list[tuple[int, float, float]]] = defaultdict(list)  # (attempt, failed_at, ttr_s)
    handoffs: set[tuple[str, int]] = set()  # (run, attempt) where a spare took a lost rank's place
    spares_ready: dict[tuple[str, int], list[float]] = defaultdict(list)  # used spares' ready times
    at_loss: dict[str, list[float]] = defaultdict(list)  # starts of spares started at a loss
    saves: dict[tuple[str, CheckpointTier, int, int | None], float] = {}
    attempts: dict[str, list[tuple[int, dict]]] = defaultdict(list)
    windows: dict[str, int] = {}
    ranks: dict[str, int] = {}
    with wh.engine.connect() as conn:
        rows = list(conn.execute(stmt.order_by(runs.c.wall_start, runs.c.run_id)))
        ids = [r.run_id for r in rows]
        for chunk in _chunks(ids):
            for r in conn.execute(select(comps.c.run_id, comps.c.name, comps.c.exposed_s).where(
                    comps.c.kind == "component", comps.c.name.in_(_TRAINING), comps.c.run_id.in_(chunk))):
                training[r.run_id][r.name] = r.exposed_s
            for r in conn.execute(select(fails.c.run_id, fails.c.attempt, fails.c.seq, fails.c.failure_class,
                                         fails.c.failed_at, fails.c.detected_at, fails.c.ttr_s, fails.c.recovered)
                                  .where(fails.c.run_id.in_(chunk))):
                failures[r.run_id].append((r.attempt, FailureClass.parse(r.failure_class),
                                           max(r.detected_at - r.failed_at, 0.0)))
                if r.recovered and r.seq == 0 and r.ttr_s is not None:
                    recovered[r.run_id].append((r.attempt, r.failed_at, r.ttr_s))
            for r in conn.execute(select(evs.c.run_id, evs.c.attempt, evs.c.phase, evs.c.start, evs.c.end,
                                         evs.c.attrs).where(
                    evs.c.run_id.in_(chunk), evs.c.phase.in_(("spare_handoff", "spare_start")))):
                if r.phase == "spare_handoff":
                    handoffs.add((r.run_id, r.attempt))
                elif (spare := attrs_of("spare_start", r.attrs or {})).used:
                    spares_ready[(r.run_id, r.attempt)].append(r.end)
                    if spare.rule == AT_LOSS and r.end > r.start:
                        at_loss[r.run_id].append(r.end - r.start)
            for r in conn.execute(select(ckpts.c.run_id, ckpts.c.kind, ckpts.c.attempt, ckpts.c.step,
                                         ckpts.c.duration_s).where(ckpts.c.run_id.in_(chunk),
                                                                   ckpts.c.kind.in_(list(TIER_OF_KIND)))):
                key = (r.run_id, TIER_OF_KIND[r.kind], r.attempt, r.step)
                saves[key] = max(saves.get(key, 0.0), r.duration_s)
            for r in conn.execute(select(atts.c.run_id, atts.c.attempt, atts.c.failed, atts.c.phase_raw_s).where(
                    atts.c.run_id.in_(chunk))):
                attempts[r.run_id].append((r.attempt, {"failed": r.failed, **dict(r.phase_raw_s or {})}))
            for r in conn.execute(select(lin.c.run_id, lin.c.windows).where(lin.c.run_id.in_(chunk))):
                windows[r.run_id] = len(r.windows or ())
            for r in conn.execute(select(evs.c.run_id, func.count(func.distinct(evs.c.rank)).label("n")).where(
                    evs.c.run_id.in_(chunk), evs.c.phase == "train_step").group_by(evs.c.run_id)):
                ranks[r.run_id] = int(r.n)
    per_run_saves: dict[str, dict[CheckpointTier, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (run_id, tier, _attempt, _step), blocking in sorted(saves.items(), key=lambda kv: str(kv[0])):
        per_run_saves[run_id][tier].append(blocking)
    out = []
    for r in rows:
        t = training.get(r.run_id, {})
        fs = sorted(failures.get(r.run_id, []), key=lambda f: f[0])
        ordered = sorted(attempts.get(r.run_id, []), key=lambda a: a[0])
        restores = tuple(float(cur.get("checkpoint_restore", 0.0))
                         for (_, prev), (_, cur) in zip(ordered, ordered[1:]) if prev["failed"])
        out.append(RunHistory(
            run_id=r.run_id, model=r.model, wall_start=r.wall_start,
            training_s=sum(t.get(name, 0.0) for name in _TRAINING),
            effective_training_s=t.get("effective_training", 0.0),
            effective_steps=int(r.effective_steps or 0) // max(ranks.get(r.run_id, 1), 1),
            windows=windows.get(r.run_id) or None, failures=tuple(f[1] for f in fs),
            detection_s=tuple(f[2] for f in fs), restore_s=restores,
            saves={tier: tuple(v) for tier, v in per_run_saves.get(r.run_id, {}).items()},
            spare_start_s=tuple(at_loss.get(r.run_id, ())),
            **_ttrs(r.run_id, recovered.get(r.run_id, []), handoffs, spares_ready)))
    return out


def _ttrs(run_id: str, recovered: list[tuple[int, float, float]], handoffs: set[tuple[str, int]],
          spares_ready: dict[tuple[str, int], list[float]]) -> dict[str, tuple[float, ...]]:
    """A run's recovered failures' TTRs: by a spare that was ready when the rank was lost (a
    hand-off in the next attempt, its used spare prewarmed before the failure), or by a restart
    of every rank (no hand-off); a spare started only at the loss is in neither."""
    ready, restart = [], []
    for attempt, failed_at, ttr in sorted(recovered):
        nxt = (run_id, attempt + 1)
        if nxt not in handoffs:
            restart.append(ttr)
        elif any(end <= failed_at for end in spares_ready.get(nxt, ())):
            ready.append(ttr)
    return {"ttr_ready_spare_s": tuple(ready), "ttr_restart_s": tuple(restart)}


def estimate_from_warehouse(wh, *, model: str, now: float, config: EstimateConfig | None = None,
                            exclude_run: str | None = None) -> HistoryEstimate:
    """`failure_history.estimate` over the warehouse's runs in the window before `now`
    (`exclude_run`: a run to leave out, e.g. the refresh being planned, after a flow retry)."""
    config = config or EstimateConfig()
    history = [h for h in read_history(wh, since=now - config.window_s, until=now) if h.run_id != exclude_run]
    return estimate(history, model=model, now=now, config=config)


def phase_seconds(wh, run_ids: Sequence[str], names: Sequence[str]) -> dict[tuple[str, str], float]:
    """(run, phase) -> exposed seconds of those L2 phases (`run_components`, kind 'phase')."""
    comps: Table = RunComponent.__table__
    out: dict[tuple[str, str], float] = {}
    with wh.engine.connect() as conn:
        for chunk in _chunks(list(run_ids)):
            for r in conn.execute(select(comps.c.run_id, comps.c.name, comps.c.exposed_s).where(
                    comps.c.kind == "phase", comps.c.name.in_(list(names)), comps.c.run_id.in_(chunk))):
                out[(r.run_id, r.name)] = r.exposed_s
    return out
