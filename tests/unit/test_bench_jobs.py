"""`ettflow bench`, its pure part with exact numbers: the rows' flow parameters, accepted by the
flow's own plan; TTR per failure and the live-recovery ratio; the interval a run trained with
(the command end to end at tiny sizes: e2e/test_bench.py; the compile ablation, three cold
compiles in fresh processes, is left to the real runs)."""

from pathlib import Path

import pytest

from ettflow.bench.jobs import (
    BASELINE,
    LIVE_RECOVERY_OFF,
    OPTIMIZED,
    JobResult,
    JobSpec,
    Row,
    fixed_interval_row,
    flow_params,
)
from ettflow.bench.suite import BenchPlan, ttr_tables
from ettflow.ett.interval_plan import IntervalSource, PlannedInterval
from ettflow.ett.run_metrics import compute_run_metrics
from ettflow.tasks.plan import parse_failures, plan_refresh

from helpers.timelines import Timeline


def spec(data: Path, tmp_path: Path, **over) -> JobSpec:
    return JobSpec(data_root=data, train_windows=("window=2024010100",), held_out=("window=2024010101",),
                   work_root=tmp_path / "work", num_embeddings=100, batch_size=32, kill_steps=(89, 179), **over)


def test_kills_are_the_flow_s_fail_at_items(tmp_path):
    s = spec(tmp_path, tmp_path)
    assert s.fail_at() == ["kill:rank=1:step=89:attempt=0", "kill:rank=0:step=179:attempt=1"]
    faults, publish = parse_failures(s.fail_at())
    assert [(f.kind, f.rank, f.step, f.attempt) for f in faults] == [("kill", 1, 89, 0), ("kill", 0, 179, 1)]
    assert publish.times == 0 and publish.slow_s == 0.0
    assert BenchPlan.full().kill_steps() == (89, 179)  # 35% and 70% of 2 x 65,536 / (2 x 256) steps
    assert BenchPlan.quick().kill_steps() == (22, 44)


def test_rows_are_refresh_parameters_the_flow_s_plan_accepts(flow_data, tmp_path):
    s = JobSpec(data_root=flow_data, train_windows=("window=2024010100", "window=2024010101"),
                held_out=("window=2024010102",), work_root=tmp_path / "work", num_embeddings=100, batch_size=32,
                kill_steps=(20, 40))
    roots = {"model": "bench-dlrm", "data_root": str(flow_data), "spool_root": str(tmp_path / "spool"),
             "snapshot_root": str(tmp_path / "snap")}
    plans = {row.label: plan_refresh({**roots, **flow_params(s, row)}, run_id="r1")
             for row in (BASELINE, OPTIMIZED, fixed_interval_row(50), LIVE_RECOVERY_OFF)}
    base, opt = plans["baseline"], plans["optimized"]
    assert base.publish_in_trainer and not opt.publish_in_trainer  # the lease holds the devices while publishing
    assert not base.trainer.switches.async_checkpoint and opt.trainer.switches.async_checkpoint
    assert opt.trainer.checkpoint_every_steps is None  # the optimizer's interval
    assert plans["optimized, fixed 50-step interval"].trainer.checkpoint_every_steps == 50
    off = plans["optimized, live recovery off"].trainer.switches
    assert (off.live_recovery, off.memory_checkpoint, off.warm_pool) == (False, False, False)
    assert off.async_checkpoint
    assert opt.trainer.switches.live_recovery and opt.trainer.switches.memory_checkpoint
    for plan in plans.values():
        t = plan.trainer
        assert t.windows == s.train_windows and t.eval_windows == s.held_out and t.warm_start_from is None
        assert [(f.rank, f.step, f.attempt) for f in t.failures] == [(1, 20, 0), (0, 40, 1)]
        assert t.model.dense_arch == (64, 16) and t.model.over_arch == (64, 32, 1)  # the bench's model
        assert {f.num_embeddings for f in t.schema.sparse} == {100}
        assert plan.params.gate.gate_max_auc_drop is None
    with pytest.raises(ValueError, match="unknown switches"):
        Row(label="x", mode="optimized", switches={"warp_drive": True})
    assert LIVE_RECOVERY_OFF.slug == "optimized-live-recovery-off"


def killed_run(run_id: str, ttrs: list[float]) -> Timeline:
    """10 steps, then per TTR: rank (k+1)%2 killed 0.5 s after the last step, detected 0.5 s
    later, and the next attempt's first new step starts `ttr` s after the detection."""
    t = Timeline(run_id).mark("submitted", 0).ev("scheduling", 0, 1, rank=-1).steps(1, 0, 10)
    now, cursor = 11.0, 10
    for k, ttr in enumerate(ttrs):
        rank = (k + 1) % 2
        t.fail(now + 0.5, now + 1, failed_rank=rank, reason=f"rank {rank} killed")
        t.next_attempt()
        t.steps(now + 1 + ttr, cursor, 10)
        now, cursor = now + 1 + ttr + 10, cursor + 10
    return t


def job(row: Row, ttrs: list[float]) -> JobResult:
    events = killed_run(row.slug, ttrs).events
    return JobResult(run_id=row.slug, row=row.label, mode=row.mode, metrics=compute_run_metrics(events),
                     events=events, publish_s=0.0)


def test_ttr_per_failure_and_the_live_recovery_ratio():
    jobs = [job(BASELINE, [30.0, 32.0]), job(OPTIMIZED, [2.0, 3.0]), job(LIVE_RECOVERY_OFF, [10.0, 10.0])]
    per, ratio = ttr_tables(jobs)
    assert list(per["row"]) == ["baseline"] * 2 + ["optimized"] * 2 + ["optimized, live recovery off"] * 2
    assert list(per["TTR_s"]) == [30.0, 32.0, 2.0, 3.0, 10.0, 10.0]
    assert list(per["rank"]) == [1, 0] * 3 and per["recovered"].all() and not per["cascaded"].any()
    assert list(ratio["failure"]) == ["1", "2", "mean"]
    assert list(ratio["TTR_on_s"]) == [2.0, 3.0, 2.5] and list(ratio["TTR_off_s"]) == [10.0, 10.0, 10.0]
    assert list(ratio["on/off"]) == [0.2, 0.3, 0.25]
    _, none = ttr_tables(jobs[:2])  # live recovery off did not run: no ratio
    assert none is None


def test_the_interval_a_run_trained_with_is_read_from_its_saves():
    t = Timeline("r").mark("submitted", 0)
    for step in (2, 5, 10, 15):  # attempt 0, rank 0: the probe at 2, then every 5 steps (rank 1: the same saves)
        t.ev("checkpoint_save_blocking", step, step + 0.1, step=step).ev(
            "checkpoint_save_blocking", step, step + 0.1, rank=1, step=step)
    t.steps(20, 0, 2).next_attempt()
    for step in (3, 10, 17):  # attempt 1 probed again at 3 and chose 7
        t.ev("checkpoint_save_blocking", 30 + step, 30.1 + step, step=step)
    t.steps(50, 2, 2)
    j = JobResult(run_id="r", row="optimized", mode="optimized", metrics=compute_run_metrics(t.events),
                  events=t.events, publish_s=0.0)
    assert j.interval_steps == 5  # median of the gaps 5, 5, 7 (the probes left out)
    assert j.interval_source == "-"  # no plan recorded in this hand-built run
    fixed = PlannedInterval(source=IntervalSource.FIXED, interval_steps=16)
    t.mark("checkpoint_interval", 0, **fixed.to_attrs())
    j = JobResult(run_id="r", row="fixed", mode="optimized", metrics=compute_run_metrics(t.events),
                  events=t.events, publish_s=0.0)
    assert (j.interval_source, j.interval_steps) == ("fixed", 16)  # the plan's, however few saves


def test_durable_mb_sums_what_rank_0_sealed_in_the_background():
    from ettflow.bench.jobs import DELTA_OFF
    from ettflow.bench.suite import durable_mb

    from helpers.timelines import Timeline

    t = Timeline("r")
    t.ev("checkpoint_save_background", 1, 2, rank=0, step=5, bytes=3_000_000)
    t.ev("checkpoint_save_background", 1, 2, rank=1, step=5, bytes=3_000_000)  # the same folder, seen by rank 1
    t.ev("checkpoint_save_background", 3, 4, rank=0, step=10, kind="delta", bytes=500_000)
    assert durable_mb(t.events) == 3.5
    import math

    assert math.isnan(durable_mb(Timeline("sync").ev("checkpoint_save_blocking", 1, 2, step=5).events))  # no size
    assert DELTA_OFF.switches == {"delta_checkpoint": False} and DELTA_OFF.mode == "optimized"
