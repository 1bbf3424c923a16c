"""The failure-history estimate and the interval planned from it, on hand-built histories
(exact numbers), and the history read out of a real warehouse (SQLite and PostgreSQL)."""

from __future__ import annotations

import pytest

from ettflow.ett.checkpoint_interval import WasteModel, optimal_interval
from ettflow.ett.checkpoint_tier import CheckpointTier
from ettflow.ett.failure_history import (
    HOUR_S,
    EstimateConfig,
    RunHistory,
    estimate,
)
from ettflow.ett.failures import FailureClass
from ettflow.ett.interval_plan import IntervalSource, PlannedInterval, plan_interval
from ettflow.tasks.run_spool import RunRecorder

INFRA, PREEMPT, PUBLISH = FailureClass.INFRASTRUCTURE, FailureClass.PREEMPTION, FailureClass.PUBLISH
DAY = 24 * HOUR_S
WINDOWS = ["window=2024010100", "window=2024010101", "window=2024010102"]  # conftest's flow_data


def run(run_id: str, model: str, at: float, hours: float, failures=(), **kw) -> RunHistory:
    return RunHistory(run_id=run_id, model=model, wall_start=at, training_s=hours * HOUR_S,
                      failures=tuple(failures), **kw)


def fleet_and_model() -> list[RunHistory]:
    return [
        run("o1", "other", 100.0, 0.5, [INFRA, INFRA, PUBLISH]),
        run("o2", "other", 200.0, 0.5, [INFRA, PREEMPT]),
        run("m1", "m", 300.0, 1.0, [INFRA, PUBLISH], effective_training_s=3000.0, effective_steps=600, windows=3,
            detection_s=(0.5,), restore_s=(4.0,), saves={CheckpointTier.DURABLE: (1.0, 2.0, 3.0)}),
    ]


def test_estimate_value():
    est = estimate(fleet_and_model(), model="m", now=1000.0, config=EstimateConfig(prior_hours=1.0))
    # fleet (other): 1 h, 3 infrastructure + 1 preemption (publish never counts) -> 3/h and 1/h
    # own: 1 h, 1 infrastructure; posterior means (r S + k) / (S + T), S = T = 1 h
    assert est.rate_of(INFRA) == pytest.approx((3 * 1 + 1) / 2) == 2.0
    assert est.rate_of(PREEMPT) == pytest.approx(0.5)
    assert est.rate_of(PUBLISH) == 0.0
    assert est.rate_per_h == pytest.approx(2.5) and est.rate_per_s == pytest.approx(2.5 / 3600)
    assert est.own_weight == 0.5 and est.own_failures == 1 and est.fleet_hours == 1.0 and est.runs == 1
    assert est.save_blocking_s == {CheckpointTier.DURABLE: 2.0} and est.saves == {CheckpointTier.DURABLE: 3}
    assert (est.detection_s, est.restore_s, est.step_s, est.steps_per_window) == (0.5, 4.0, 5.0, 200.0)
    assert est.has_history
    infra = next(c for c in est.classes if c.failure_class is INFRA)
    assert (infra.alpha, infra.beta_h, infra.sd_per_h) == (4.0, 2.0, pytest.approx(1.0))


def test_new_model_starts_at_the_fleet_rate_and_moves_to_its_own():
    fleet = [run("o", "other", 0.0, 10.0, [INFRA] * 10)]  # 1/h
    cfg = EstimateConfig(prior_hours=1.0)
    rates, weights = [], []
    for n in (0, 1, 3, 9):  # n runs of 1 h with 4 failures each: own rate 4/h
        own = [run(f"m{i}", "m", 10.0 + i, 1.0, [INFRA] * 4) for i in range(n)]
        est = estimate(fleet + own, model="m", now=100.0, config=cfg)
        rates.append(est.rate_per_h)
        weights.append(est.own_weight)
    assert rates == pytest.approx([1.0, 5 / 2, 13 / 4, 37 / 10])  # (1 + 4n) / (1 + n)
    assert weights == pytest.approx([0.0, 1 / 2, 3 / 4, 9 / 10])
    # no history of its own: the fleet's rate, and no save cost: the trainer probes
    est = estimate(fleet, model="m", now=100.0, config=cfg)
    assert not est.has_history and est.runs == 0
    assert plan_interval(est, windows=2, max_steps=None).source is IntervalSource.PROBE


def test_a_rate_change_is_noticed_within_the_window():
    # one 1 h run a day; 1 failure each until day 19, 5 failures each from day 20 (worse hardware)
    history = [run(f"d{d}", "m", d * DAY, 1.0, [INFRA] * (1 if d < 20 else 5)) for d in range(31)]
    cfg = EstimateConfig(window_s=10 * DAY, prior_hours=1.0, default_rate_per_h={INFRA: 1.0})
    rate = [estimate(history, model="m", now=(t + 0.5) * DAY, config=cfg).rate_per_h for t in (19, 20, 25, 30)]
    # windows: days 10..19 (10 runs, 10 failures); 11..20 (9 + 5); 16..25 (4 + 6 x 5); 21..30 (10 x 5)
    assert rate == pytest.approx([11 / 11, 15 / 11, 35 / 11, 51 / 11])
    everything = EstimateConfig(window_s=100 * DAY, prior_hours=1.0, default_rate_per_h={INFRA: 1.0})
    # over all 31 days the change is diluted: (1 + 20 + 55) / (1 + 31)
    assert estimate(history, model="m", now=30.5 * DAY, config=everything).rate_per_h == pytest.approx(76 / 32)


def test_the_interval_is_the_optimizer_s_for_the_estimated_inputs():
    est = estimate(fleet_and_model(), model="m", now=1000.0, config=EstimateConfig(prior_hours=1.0))
    planned = plan_interval(est, windows=3, max_steps=None)
    # 200 new steps per window x 3 windows x 5 s a step; CSBT 2 s; 2.5 failures per hour
    model = WasteModel(job_s=3000.0, save_blocking_s=2.0, failure_rate_per_s=2.5 / 3600)
    choice = optimal_interval(model, min_interval_s=5.0)
    assert planned.source is IntervalSource.HISTORY
    assert planned.job_s == 3000.0 and planned.save_blocking_s == 2.0 and planned.rate_per_h == 2.5
    assert planned.interval_s == choice.interval_s
    assert planned.interval_steps == round(choice.interval_s / 5.0) == 15
    assert planned.expected_wasted_s == pytest.approx(model.wasted_s(15 * 5.0))
    # max_steps caps the expected training time
    capped = plan_interval(est, windows=3, max_steps=100)
    assert capped.job_s == 500.0
    assert capped.interval_s == optimal_interval(WasteModel(job_s=500.0, save_blocking_s=2.0,
                                                            failure_rate_per_s=2.5 / 3600),
                                                 min_interval_s=5.0).interval_s
    # a fixed interval is kept, with its expected waste beside it
    fixed = plan_interval(est, windows=3, max_steps=None, fixed_steps=50)
    assert (fixed.source, fixed.interval_steps, fixed.expected_wasted_s) == (
        IntervalSource.FIXED, 50, pytest.approx(model.wasted_s(250.0)))
    # what the run stores comes back the same
    assert PlannedInterval.from_attrs(planned.to_attrs()) == planned
    assert planned.to_attrs()["source"] == "history"


def test_recoveries_are_told_apart_by_how_they_recovered():
    """A ready spare (a hand-off in the next attempt, its spare prewarmed before the failure), a
    spare started at the loss (neither), a restart of every rank (no hand-off); the estimate's
    means over the model's own runs."""
    from ettflow.ett.failure_history_db import _ttrs

    recovered = [(0, 100.0, 2.0), (1, 200.0, 9.0), (2, 300.0, 12.0)]
    handoffs = {("r", 1), ("r", 2)}  # attempts 1 and 2 began with a spare's hand-off
    ready = {("r", 1): [50.0], ("r", 2): [305.0]}  # attempt 1's spare was ready at 50; attempt 2's at 305
    assert _ttrs("r", recovered, handoffs, ready) == {"ttr_ready_spare_s": (2.0,), "ttr_restart_s": (12.0,)}
    runs = [run("m1", "m", 300.0, 1.0, ttr_ready_spare_s=(2.0, 4.0), ttr_restart_s=(12.0,), spare_start_s=(6.0,)),
            run("m2", "m", 400.0, 1.0, ttr_restart_s=(8.0,), spare_start_s=(7.0, 8.0))]
    est = estimate(runs, model="m", now=1000.0, config=EstimateConfig(prior_hours=1.0))
    assert (est.ttr_ready_spare_s, est.ttr_restart_s, est.recoveries) == (3.0, 10.0, 4)
    assert (est.spare_start_s, est.spare_starts) == (7.0, 3)  # spares started at a loss, request to ready


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="prior_hours"):
        EstimateConfig(prior_hours=0)
    with pytest.raises(ValueError, match="replaying classes"):
        EstimateConfig(default_rate_per_h={PUBLISH: 1.0})


def test_history_read_from_the_warehouse(warehouse_url):
    """A run with a save on two ranks, an infrastructure failure and a recovery that restores
    and replays (test_warehouse.run_events), read back from SQLite and PostgreSQL."""
    from test_warehouse import archive

    from ettflow.ett.failure_history_db import estimate_from_warehouse, read_history
    from ettflow.ett.lineage import LineageRecord, Outcome
    from ettflow.ett.warehouse import Warehouse

    with Warehouse.open(warehouse_url) as wh:
        archive(wh, "run-a", t0=1_000.0)
        archive(wh, "run-b", t0=5_000.0, model="other")
        archive(wh, "run-old", t0=10.0)  # before the window
        wh.record_lineage(LineageRecord(model="dlrm", run_id="run-a", windows=("w1", "w2"),
                                        outcome=Outcome.PUBLISHED))
        history = read_history(wh, since=500.0)
        est = estimate_from_warehouse(wh, model="dlrm", now=6_000.0,
                                      config=EstimateConfig(window_s=5_500.0, prior_hours=1.0))
    assert [h.run_id for h in history] == ["run-a", "run-b"]
    a = history[0]
    # steps 0-4 (5 s), save (1 s on both ranks), steps 5-7 (3 s) lost to the failure, restore
    # (2 s), then steps 5-12: 5-7 replayed (3 s), 8-12 new; effective 13 s, wasted 6 s (the
    # save, the replay and 2 s lost in flight from the failure to its detection); 13 steps a rank
    assert (a.model, a.wall_start, a.training_s, a.effective_training_s, a.effective_steps) == (
        "dlrm", 1_000.0, 19.0, 13.0, 13)
    assert (a.failures, a.detection_s, a.restore_s, a.windows) == ((INFRA,), (2.0,), (2.0,), 2)
    # its recovery restarted every rank (no spare hand-off): a restart's TTR, none by a spare
    assert a.ttr_ready_spare_s == () and len(a.ttr_restart_s) == 1 and a.ttr_restart_s[0] > 0
    assert est.ttr_restart_s == a.ttr_restart_s[0] and est.ttr_ready_spare_s is None and est.recoveries == 1
    assert a.saves == {CheckpointTier.DURABLE: (1.0,)}
    # 1 failure in 19 s of training; the fleet ("other"): 1 in 19 s; S = 1 h
    fleet_rate = 3600 / 19
    assert est.runs == 1 and est.rate_per_h == pytest.approx((fleet_rate + 1) / (1 + 19 / 3600))
    assert est.save_blocking_s == {CheckpointTier.DURABLE: 1.0} and est.step_s == 1.0 and est.steps_per_window == 6.5
    assert a.spare_start_s == () and est.spare_start_s is None  # no spare started at its loss


def test_spares_started_at_a_loss_are_read_back_with_their_start(warehouse_url):
    """The driver's `spare_start` of a spare started when a rank was lost (rule spare-at-loss):
    its request to ready is what a held spare saves on a CPU placement (the spare decision)."""
    from test_warehouse import info_for, run_events

    from ettflow.ett.events import PhaseEvent
    from ettflow.ett.failure_history_db import read_history
    from ettflow.ett.run_metrics import compute_run_metrics
    from ettflow.ett.warehouse import Warehouse

    events = run_events("run-s", t0=1_000.0) + [
        PhaseEvent(run_id="run-s", attempt=1, rank=-1, phase="spare_start", start=1_030.0, end=1_036.5,
                   attrs={"used": True, "taken_at": 1_036.5, "rule": "spare-at-loss"}, seq=900),
        PhaseEvent(run_id="run-s", attempt=0, rank=-1, phase="spare_start", start=1_000.0, end=1_000.0,
                   attrs={"used": False, "released_at": 1_050.0, "rule": "spare-by-saving"}, seq=901)]
    with Warehouse.open(warehouse_url) as wh:
        wh.archive_run(info_for("run-s"), events, compute_run_metrics(events))
        history = read_history(wh, since=500.0)
    assert [h.spare_start_s for h in history] == [(6.5,)]  # the held one, unused, is not a start at a loss


def test_the_plan_takes_the_interval_from_history(flow_data, tmp_path):
    """`with_interval`: history -> the trainer's interval in steps (no probe); none -> the probe
    with the fleet's rate; the refresh's own checkpoint_every_steps wins."""
    from ettflow.tasks.plan import plan_refresh, with_interval

    from helpers.plans import params

    est = estimate(fleet_and_model(), model="m", now=1000.0, config=EstimateConfig(prior_hours=1.0))
    plan = plan_refresh(params(flow_data, tmp_path, windows=WINDOWS), run_id="r1")
    planned = with_interval(plan, est)
    assert planned.interval == plan_interval(est, windows=3, max_steps=None)
    assert planned.trainer.checkpoint_every_steps == 15
    assert planned.trainer.failure_rate_per_s == pytest.approx(2.5 / 3600)
    new_model = estimate(fleet_and_model()[:2], model="m", now=1000.0, config=EstimateConfig(prior_hours=1.0))
    probing = with_interval(plan, new_model)
    assert probing.interval.source is IntervalSource.PROBE and probing.trainer.checkpoint_every_steps is None
    assert probing.trainer.failure_rate_per_s == pytest.approx(4.0 / 3600)  # the fleet's 3 + 1 per hour
    fixed = with_interval(plan_refresh(params(flow_data, tmp_path, windows=WINDOWS,
                                              checkpoint_every_steps=7), run_id="r2"), est)
    assert fixed.interval.source is IntervalSource.FIXED and fixed.trainer.checkpoint_every_steps == 7
    empty = with_interval(plan, estimate([], model="m", now=1000.0))  # no hours anywhere
    assert empty.interval.rate_per_h is None and empty.trainer.failure_rate_per_s is None
    assert empty.interval.source is IntervalSource.PROBE and empty.interval.runs == 0
    nothing = with_interval(plan, None)
    assert nothing.interval.source is IntervalSource.PROBE and nothing.trainer.failure_rate_per_s is None


def test_the_plan_sizes_spares_by_their_expected_saving(flow_data, tmp_path):
    """`with_spares`: the model's rate over its expected training, plus the run's scripted kills,
    against one spare's slot-seconds; the trainer gets the count, the marker the numbers."""
    from ettflow.ett.spare_sizing import DEFAULT_REPLACE_S, DEFAULT_WALL_S
    from ettflow.tasks.plan import plan_refresh, with_spares
    from ettflow.tasks.run_spool import RunRecorder, spare_plan

    from helpers.plans import params

    est = estimate(fleet_and_model(), model="m", now=1000.0, config=EstimateConfig(prior_hours=1.0))
    plan = plan_refresh(params(flow_data, tmp_path, windows=WINDOWS, device="cpu"), run_id="r1")
    sized = with_spares(plan, est)  # 2.5 failures/h over 3000 s of expected training (600 steps of 5 s)
    assert sized.spares.cost_slot_s == pytest.approx(3000.0)
    assert sized.spares.expected_failures == pytest.approx(2.5 / 3600 * 3000.0)
    # a CPU placement: without a held spare a lost rank is replaced by one started at the loss, so
    # a held spare saves that start (the simulator's recovery model), not a restart of every rank
    gain = DEFAULT_REPLACE_S
    assert sized.spares.saving_slot_s[0] == pytest.approx(2.5 / 3600 * 3000.0 * gain * 2)  # 42 slot-s
    assert "without a spare: a spare started at the loss" in sized.spares.reason
    assert sized.spares.spares == 0 and sized.trainer.spares == 0 and "does not pay" in sized.spares.reason
    from dataclasses import replace as swap

    measured = with_spares(plan, swap(est, ttr_ready_spare_s=1.0, ttr_restart_s=301.0, recoveries=5))
    # 2.08 expected failures x 10 s saved x 2 slots = 42 slot-s < 3,000: still none; the measured restart
    # (301 s) is not what a held spare saves here, the at-loss spare's start is
    assert measured.spares.saving_slot_s[0] == pytest.approx(2.5 / 3600 * 3000.0 * DEFAULT_REPLACE_S * 2)
    assert "measured over 5 recoveries" in measured.spares.reason and "(10 s assumed)" in measured.spares.reason
    started = with_spares(plan, swap(est, spare_start_s=6.0, spare_starts=3))  # the model's at-loss spares measured
    assert started.spares.saving_slot_s[0] == pytest.approx(2.5 / 3600 * 3000.0 * 6.0 * 2)
    assert "a spare started at the loss (6.0 s, measured over 3)" in started.spares.reason
    cold = with_spares(plan, None)  # no history: the stated defaults
    assert cold.spares.cost_slot_s == DEFAULT_WALL_S and "no history" in cold.spares.reason
    kills = [f"kill:rank={i % 2}:step={i + 1}" for i in range(4)]
    killed = with_spares(plan_refresh(params(flow_data, tmp_path, windows=WINDOWS, fail_at=kills, device="cpu"),
                                      run_id="r2"), None)
    # 4 scripted kills + 60 s at 1/h: 4.017 x 10 s x 2 slots = 80.3 slot-s > 60 held: one spare pays
    assert killed.spares.saving_slot_s[0] == pytest.approx((4 + DEFAULT_WALL_S / 3600) * gain * 2)
    assert killed.spares.spares == 1 and killed.trainer.spares == 1 and "4 scripted kill(s)" in killed.spares.reason
    off = plan_refresh(params(flow_data, tmp_path, windows=WINDOWS, switches={"live_recovery": False}), run_id="r3")
    assert with_spares(off, est).spares is None  # nothing to size: no live recovery
    gpu = with_spares(plan_refresh(params(flow_data, tmp_path, windows=WINDOWS, device="cuda"), run_id="r4"),
                      swap(est, ttr_ready_spare_s=1.0, ttr_restart_s=301.0, recoveries=5))
    # a GPU placement holds no spare device: without a held spare every rank restarts, so the spare saves
    # the measured restart (2.08 x 300 s x 2 = 1,250 slot-s < 3,000 held: none still)
    assert gpu.spares.saving_slot_s[0] == pytest.approx(2.5 / 3600 * 3000.0 * 300.0 * 2)
    assert "without a spare: every rank restarts" in gpu.spares.reason
    recorder = RunRecorder(tmp_path / "spool", "r1")
    recorder.record_spare_plan(0, sized.spares, 5.0)
    marked = spare_plan(recorder.events())
    assert (marked.rule, marked.spares, marked.reason) == ("spare-by-saving", 0, sized.spares.reason)


def test_the_interval_is_stored_with_the_run_and_reported(warehouse_url, tmp_path, capsys):
    """The spool marker -> the run's `checkpoint_interval` tag -> `report --intervals`, and the
    ETT artifact's rows; realized waste from L2 (SQLite and PostgreSQL)."""
    import json

    from test_warehouse import run_events

    from ettflow.cli import main
    from ettflow.ett.events import CHECKPOINT_INTERVAL
    from ettflow.ett.run_metrics import compute_run_metrics
    from ettflow.ett.spool import read_spool
    from ettflow.ett.warehouse import RunInfo, Warehouse
    from ettflow.tasks import run_spool
    from ettflow.tasks.artifacts import interval_rows

    planned = PlannedInterval(source=IntervalSource.HISTORY, rate_per_h=2.5, save_blocking_s=1.0, step_s=1.0,
                              job_s=13.0, interval_s=5.2, interval_steps=5, expected_wasted_s=4.0, own_weight=0.5)
    RunRecorder(tmp_path, "run-a").record_interval(0, planned, 1_030.0)
    marks = [e for e in read_spool(tmp_path, "run-a").events if e.phase == CHECKPOINT_INTERVAL]
    assert run_spool.planned_interval(marks) == planned
    events = run_events("run-a", t0=1_000.0)
    events.append(marks[0].__class__(**{**marks[0].to_dict(), "seq": 99}))
    metrics = compute_run_metrics(events)
    assert metrics.components["wasted_training"] == 6.0  # the marker changes nothing in the metric
    assert metrics.components == compute_run_metrics(events[:-1]).components
    with Warehouse.open(warehouse_url) as wh:
        wh.archive_run(RunInfo(run_id="run-a", model="dlrm", mode="optimized",
                               tags=run_spool.interval_tags(marks)), events, metrics)
        wh.archive_run(RunInfo(run_id="run-b", model="dlrm", mode="optimized"), run_events("run-b", t0=2_000.0),
                       compute_run_metrics(run_events("run-b", t0=2_000.0)))
    assert main(["report", "--url", warehouse_url, "--model", "dlrm", "--intervals", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["run"] for r in rows] == ["run-a", "run-b"]
    a, b = rows
    assert (a["source"], a["interval_steps"], a["rate_per_h"], a["csbt_s"], a["expected_wasted_s"]) == (
        "history", 5, 2.5, 1.0, 4.0)
    # realized: 6 s wasted = 3 s replay + 2 s lost in flight, 1 s save blocking; wall 54 s
    assert (a["wasted_s"], a["replay_s"], a["save_blocking_s"], a["realized/expected"]) == (6.0, 5.0, 1.0, 1.5)
    assert a["wasted%"] == round(100 * 6.0 / metrics.wall_s, 1)
    assert (b["source"], b["expected_wasted_s"], b["wasted_s"]) == ("-", None, 6.0)
    assert main(["report", "--url", warehouse_url, "--intervals"]) == 2
    assert "--intervals needs --model" in capsys.readouterr().err
    shown = {r["metric"]: (r["exposed"], r["raw"]) for r in interval_rows(planned, metrics)}
    assert shown["checkpoint interval s (history; raw: steps)"] == (5.2, 5)
    assert shown["expected wasted s (raw: realized)"] == (4.0, 6.0)


def saving_run(run_id: str, model: str, t0: float, blocking: list[tuple[str, float]]):
    """Two ranks; 10 steps of 1 s before each save of `blocking` ((kind, seconds): rank 1 blocks
    that long, rank 0 half of it), then a failure and a recovery, as a trainer with
    `delta_checkpoint` records them (`checkpoint_save_blocking` attrs `kind`, `mode`)."""
    from test_warehouse import with_seqs

    from helpers.timelines import Timeline

    t = Timeline(run_id)
    t.mark("submitted", t0).ev("scheduling", t0, t0 + 1, rank=-1)
    s, step = t0 + 1, 0
    for kind, seconds in blocking:
        for rank in (0, 1):
            t.steps(s, step, 10, rank=rank)
        s, step = s + 10, step + 10
        for rank, took in ((0, seconds / 2), (1, seconds)):
            t.ev("checkpoint_save_blocking", s, s + took, rank=rank, step=step, kind=kind,
                 mode="delta" if kind == "delta" else "sync", bytes=1 << (16 if kind == "delta" else 22))
        s += seconds
    t.fail(s, s + 1, failure_class="infrastructure", reason="node lost", failed_rank=1)
    t.next_attempt()
    t.ev("scheduling", s + 1, s + 2, rank=-1).ev("checkpoint_restore", s + 2, s + 3).ev(
        "checkpoint_restore", s + 2, s + 3, rank=1)
    t.ev("shutdown", s + 3, s + 4)
    return with_seqs(t.events)


def test_cheaper_delta_saves_shorten_the_interval_planned_from_history(warehouse_url):
    """Issue 28: a delta save is a durable save of its own blocking, so the history's CSBT is
    the mean over bases and deltas together and the next refresh's interval is shorter where
    saves got cheaper (same failures, same step time; archived and read back through the
    warehouse, SQLite and PostgreSQL)."""
    from ettflow.ett.failure_history_db import estimate_from_warehouse
    from ettflow.ett.run_metrics import compute_run_metrics
    from ettflow.ett.warehouse import RunInfo, Warehouse

    full = [("base", 2.0)] * 4
    delta = [("base", 2.0), ("delta", 0.2), ("delta", 0.2), ("delta", 0.2)]
    config = EstimateConfig(window_s=10_000.0, prior_hours=1.0)
    with Warehouse.open(warehouse_url) as wh:
        for run_id, model, saves in (("full-1", "full", full), ("delta-1", "delta", delta)):
            events = saving_run(run_id, model, 1_000.0, saves)
            wh.archive_run(RunInfo(run_id=run_id, model=model, mode="optimized", flow_run_id=f"flow-{run_id}",
                                   tags={}), events, compute_run_metrics(events))
        est = {m: estimate_from_warehouse(wh, model=m, now=5_000.0, config=config) for m in ("full", "delta")}
    # a save's blocking is its slowest rank's: the full run's 2.0 s each, the delta run's mean (2 + 3 x 0.2) / 4
    assert est["full"].save_blocking_s == {CheckpointTier.DURABLE: 2.0}
    assert est["delta"].save_blocking_s == {CheckpointTier.DURABLE: pytest.approx(0.65)}
    assert est["full"].saves == est["delta"].saves == {CheckpointTier.DURABLE: 4}
    assert est["full"].step_s == est["delta"].step_s == 1.0
    planned = {m: plan_interval(e, windows=3, max_steps=None) for m, e in est.items()}
    for m in ("full", "delta"):
        model = WasteModel(job_s=planned[m].job_s, save_blocking_s=est[m].save_blocking_s[CheckpointTier.DURABLE],
                           failure_rate_per_s=est[m].rate_per_s)
        assert planned[m].source is IntervalSource.HISTORY
        assert planned[m].interval_s == optimal_interval(model, min_interval_s=1.0).interval_s
    # the rates differ a little (the saves' seconds are training hours, and each model is the
    # other's fleet), but the delta model's is not the higher: the shorter interval is the saves'
    assert est["delta"].rate_per_h <= est["full"].rate_per_h
    assert planned["delta"].interval_steps < planned["full"].interval_steps
    assert planned["delta"].expected_wasted_s < planned["full"].expected_wasted_s
