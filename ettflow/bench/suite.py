"""The benchmark suite: each measurement of the paired evaluation as a table (pandas frame).

Every job is a run of the product's `refresh_model` flow (`jobs.run_flow_job`): baseline and
optimized go through the same tasks, the trainer lease included, with the same scripted kills
(`fail_at`), and the checkpoint interval the flow's plan picks (the project's optimizer). At
the default (shortest) length two ablation rows run beside the pair: the optimized mode with
the fixed interval (`BenchPlan.fixed_interval_steps`), and with live recovery and the memory
checkpoint switched off, whose TTR per failure the optimized mode's is compared with
(`ttr_tables`), and with the warm pool off. The bench drives its jobs as a long-lived driver
drives refresh after refresh (`BenchPlan.warm_pool`): a run that trains to the end leaves its
ranks' processes prewarming for the next run of the same shape (trainer/group/warm_pool.py, the
optimized mode's switch), and the bench waits until they are ready before the next job, as
refreshes hours apart find them; the warm-up run (the previous refresh) leaves the first ones.
Every number comes from real runs on this machine, side by side in one
invocation; targets are ratios, reported with the margin by which they are met or missed.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm import tqdm

from ettflow.ett.cascade import attribute
from ettflow.ett.checkpoint_interval import WasteModel, optimal_interval
from ettflow.ett.events import L2_ORDER, PhaseEvent
from ettflow.trainer.data.synthetic import SyntheticConfig, generate_windows
from ettflow.trainer.data.windows import list_windows

from .compile_ablation import run_ablation
from .jobs import (
    BASELINE,
    BASELINE_FRESH_HOST,
    DELTA_OFF,
    LIVE_RECOVERY_OFF,
    MODEL,
    OPTIMIZED,
    WARM_POOL_OFF,
    JobResult,
    JobSpec,
    Row,
    fixed_interval_row,
    run_flow_job,
    trainer_rank0,
    warm_compile_cache,
)

POOL_READY_TIMEOUT_S = 180.0


@dataclass(frozen=True, kw_only=True)
class BenchPlan:
    lengths: tuple[int, ...]  # training windows per job, shortest first; the first is the default pair
    rows_per_window: int
    batch_size: int = 256
    num_embeddings: int = 20_000
    fixed_interval_steps: int = 50  # the ablation row "optimized, fixed N-step interval"
    kill_fractions: tuple[float, float] = (0.35, 0.7)  # of the default pair's steps
    ablation_batches: int = 8
    overhead_steps: int = 200
    overhead_repeats: int = 8  # pairs of runs with and without recording, interleaved (ABBA)
    # the process keeps a warm pool, as a long-lived driver does (False: every job starts cold)
    warm_pool: bool = True
    # switches set on every job, both modes and every row (`--switch`; e.g. compile off for a smoke run)
    switches: dict[str, bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.lengths):
            raise ValueError(f"BenchPlan.lengths must be ints >= 1, got {self.lengths!r}")
        for name in ("rows_per_window", "batch_size", "num_embeddings", "fixed_interval_steps", "ablation_batches",
                     "overhead_steps", "overhead_repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BenchPlan.{name} must be an int >= 1, got {value!r}")
        Row(label="every job", mode="optimized", switches=self.switches)  # names an unknown switch
        if not all(0 < f < 1 for f in self.kill_fractions):
            raise ValueError(f"BenchPlan.kill_fractions must lie in (0, 1), got {self.kill_fractions!r}")

    @classmethod
    def quick(cls) -> BenchPlan:
        return cls(lengths=(1,), rows_per_window=16_384, batch_size=128, num_embeddings=5_000,
                   fixed_interval_steps=16, ablation_batches=4, overhead_steps=60, overhead_repeats=2)

    @classmethod
    def full(cls) -> BenchPlan:
        return cls(lengths=(2, 8, 32), rows_per_window=65_536)

    def steps(self, windows: int, world_size: int = 2) -> int:
        return windows * self.rows_per_window // (self.batch_size * world_size)

    def kill_steps(self) -> tuple[int, ...]:
        """The steps of the scripted kills (one per attempt), from the default pair's length."""
        base = self.steps(self.lengths[0])
        return tuple(int(f * base) for f in self.kill_fractions)

    def ablation_rows(self) -> tuple[Row, ...]:
        rows = (BASELINE_FRESH_HOST, fixed_interval_row(self.fixed_interval_steps), LIVE_RECOVERY_OFF, DELTA_OFF)
        return (*rows, WARM_POOL_OFF) if self.warm_pool else rows


class Bench:
    def __init__(self, plan: BenchPlan, out: Path, progress: Callable[[str], None] = print, *,
                 rows: bool = True, runner: Any = None) -> None:
        from .deployed import InProcessRunner

        self.plan, self.out, self.say = plan, out, progress
        self.runner = runner if runner is not None else InProcessRunner()  # the path every job takes
        self.with_rows = rows
        self.data = out / "data"
        self.stamp = time.strftime("%Y%m%d-%H%M%S")
        self.state = out / f"state-{self.stamp}"  # each job's warehouse, spool and snapshots
        self.work = out / "work"  # checkpoints, and the model's compile cache, shared by the jobs
        self.jobs: list[JobResult] = []  # every row's jobs (not the warm-up)

    @property
    def cache(self) -> Path:
        """The model's compile cache (the flow's plan puts it under the work root)."""
        return self.work / MODEL / "compile-cache"

    def prepare_data(self) -> tuple[str, ...]:
        need = max(self.plan.lengths) + 1
        have = list_windows(self.data) if self.data.is_dir() else []
        if len(have) < need:
            self.say(f"generating {need} windows x {self.plan.rows_per_window} rows")
            generate_windows(self.data, SyntheticConfig(windows=need, rows_per_window=self.plan.rows_per_window,
                                                        files_per_window=2, seed=11, overwrite=True),
                             progress=True)
        return tuple(list_windows(self.data))

    def spec(self, windows: tuple[str, ...], length: int, kill_steps: tuple[int, ...]) -> JobSpec:
        return JobSpec(data_root=self.data, train_windows=windows[:length], held_out=windows[-1:],
                       work_root=self.work, num_embeddings=self.plan.num_embeddings,
                       batch_size=self.plan.batch_size, kill_steps=kill_steps, switches=dict(self.plan.switches))

    def job(self, spec: JobSpec, row: Row, label: str) -> JobResult:
        name = f"L{label}-{row.slug}"
        self.runner.wait_pool(POOL_READY_TIMEOUT_S)  # what the previous run left prewarming is ready first
        self.say(f"  {name} ...")
        result = run_flow_job(spec, row, self.state / name, runner=self.runner)
        m = result.metrics
        ttrs = ", ".join(f"{f.ttr_s:.2f}" for f in m.failures) or "-"
        self.say(f"  {name} (run {result.run_id}): wall {m.wall_s:.1f} s, ETT {m.ett_pct:.1f}%, NoF {m.nof}, "
                 f"TTR {ttrs} s, {m.checkpoint_saves} saves ({result.interval_source} interval)")
        self.jobs.append(result)
        return result

    # ---- 1 + 2: ETT pairs at several job lengths, the ablation rows at the default one ---
    def pairs(self, windows: tuple[str, ...]) -> tuple[dict[int, tuple[JobResult, JobResult]], list[JobResult]]:
        """The pair (baseline, optimized) per length, and the ablation rows' jobs (default length)."""
        kills = self.plan.kill_steps()
        self.runner.keep_warm(self.plan.warm_pool)
        try:
            self.say("warm-up: the previous refresh of the model (leaves its compile cache"
                     f"{' and the warm pool' if self.plan.warm_pool else ''})")
            warm_compile_cache(self.spec(windows, 1, ()), self.state / "warm-up", self.runner)
            return self._pairs(windows, kills)
        finally:
            self.runner.close()

    def _pairs(self, windows: tuple[str, ...], kills: tuple[int, ...]) -> tuple[dict, list[JobResult]]:
        rows = self.plan.ablation_rows() if self.with_rows else ()
        out, extra = {}, []
        with tqdm(total=2 * len(self.plan.lengths) + len(rows), desc="ETT jobs", unit="job") as bar:
            for length in self.plan.lengths:
                self.say(f"pair at {length} window(s), killed at steps {kills}")
                spec = self.spec(windows, length, kills)
                jobs = []
                for row in (BASELINE, OPTIMIZED):
                    jobs.append(self.job(spec, row, str(length)))
                    bar.update()
                out[length] = (jobs[0], jobs[1])
                if length == self.plan.lengths[0]:
                    for row in rows:
                        extra.append(self.job(spec, row, str(length)))
                        bar.update()
        return out, extra

    # ---- 3: compile ablation ---------------------------------------------------------------
    def ablation(self) -> pd.DataFrame:
        self.say("compile ablation (three fresh processes)")
        rows = run_ablation(self.data, batches=self.plan.ablation_batches, batch_size=self.plan.batch_size)
        frame = pd.DataFrame(rows)
        cold = frame.loc[frame["mode"] == "dense-step", "first_step_s"].iloc[0]
        frame["compile_vs_cold_%"] = (100 * (frame["first_step_s"] + frame["restore_s"]) / cold).round(1)
        return frame

    # ---- 6: orchestration overhead ---------------------------------------------------------
    def overhead(self, windows: tuple[str, ...]) -> pd.DataFrame:
        """Recording on vs off: the trainer alone (driver + Ray group; the flow has no switch
        to turn step recording off), with the model's warm compile cache; then Prefect's start."""
        self.say("overhead: recording on vs off, Prefect start")
        length = min(max(1, -(-self.plan.overhead_steps // max(self.plan.steps(1), 1))), len(windows) - 1)
        spec = replace(self.spec(windows, length, ()), max_steps=self.plan.overhead_steps, eval_batches=0)
        rates: dict[bool, list[float]] = {True: [], False: []}  # examples/s over the loop, saves included
        step_s: dict[bool, list[float]] = {True: [], False: []}  # the median step interval (fetch to end)
        inline: list[float] = []
        for pair in tqdm(range(self.plan.overhead_repeats), desc="overhead pairs", unit="pair"):
            for record in ((True, False) if pair % 2 == 0 else (False, True)):  # ABBA: a drift cancels
                r0 = trainer_rank0(replace(spec, record_steps=record),
                                   f"bench-{self.stamp}-overhead-{'on' if record else 'off'}-{pair}",
                                   self.state / "overhead-spool", cache_root=self.cache)
                rates[record].append(r0.examples_per_s)
                step_s[record].append(r0.step_s_median)
                if record:  # the record calls' own time, as a share of the loop's (same run: no noise between runs)
                    inline.append(100 * r0.record_s * r0.steps_per_s / r0.steps_this_attempt)
        # per step, the median is robust to the bursts of a shared machine; as rates (1 / step_s)
        stats = overhead_stats([1 / s for s in step_s[True]], [1 / s for s in step_s[False]])
        loop = overhead_stats(rates[True], rates[False])
        t0 = time.time()
        subprocess.run([sys.executable, "-c", "from prefect import flow\n@flow\ndef f():\n    return 1\nf()"],
                       check=True, capture_output=True)
        prefect_s = time.time() - t0
        return pd.DataFrame([
            {"what": "examples/s with ETT recording", "value": round(statistics.mean(rates[True]), 1)},
            {"what": "examples/s without recording", "value": round(statistics.mean(rates[False]), 1)},
            {"what": "median step s with ETT recording", "value": round(statistics.median(step_s[True]), 5)},
            {"what": "median step s without recording", "value": round(statistics.median(step_s[False]), 5)},
            {"what": "recording overhead %", "value": round(stats.mean_pct, 2)},
            {"what": "recording overhead %, 95% upper bound", "value": round(stats.upper_pct, 2)},
            {"what": "recording overhead %, 95% half-width (noise)", "value": round(stats.half_width_pct, 2)},
            {"what": "recording overhead, interleaved pairs", "value": stats.pairs},
            {"what": "record calls, % of the training loop's time (mean of runs)",
             "value": round(statistics.mean(inline), 3)},
            {"what": "record calls, % of the training loop's time (max of runs)", "value": round(max(inline), 3)},
            {"what": "recording overhead % of examples/s over the loop (saves in)", "value": round(loop.mean_pct, 2)},
            {"what": "... its 95% half-width", "value": round(loop.half_width_pct, 2)},
            {"what": "Prefect: first flow run incl. ephemeral server, s", "value": round(prefect_s, 2)},
        ])


# Student's t, two-sided 95% (the 0.975 quantile) by degrees of freedom; a df between two
# entries takes the smaller df's (larger, so conservative) value.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980}


def t975(df: int) -> float:
    if df < 1:
        raise ValueError(f"t975 needs df >= 1, got {df}")
    return _T975[max(k for k in _T975 if k <= df)]


@dataclass(frozen=True, kw_only=True)
class OverheadStats:
    """The recording overhead over interleaved pairs: per pair 100 x (off - on) / off (on, off:
    the throughputs of the pair's runs with and without recording), their mean and the 95%
    confidence half-width of the mean (Student's t; 0 with one pair, where it is unknown:
    `upper_pct` is then the mean). The target is met when `upper_pct` is below it; the
    difference from zero is resolved when the half-width is below the mean."""

    pairs: int
    per_pair_pct: tuple[float, ...]
    mean_pct: float
    half_width_pct: float

    @property
    def upper_pct(self) -> float:
        return self.mean_pct + self.half_width_pct


def overhead_stats(on: list[float], off: list[float]) -> OverheadStats:
    if len(on) != len(off) or not on:
        raise ValueError(f"overhead_stats needs as many runs with recording as without (>= 1), got "
                         f"{len(on)} and {len(off)}")
    per_pair = tuple(100 * (b - a) / b for a, b in zip(on, off))
    n = len(per_pair)
    half = t975(n - 1) * statistics.stdev(per_pair) / n ** 0.5 if n > 1 else 0.0
    return OverheadStats(pairs=n, per_pair_pct=per_pair, mean_pct=statistics.mean(per_pair), half_width_pct=half)


def _row_values(job: JobResult) -> dict:
    m = job.metrics
    return {"wall_s": m.wall_s, "TTS_s": m.tts_s, "NoF": m.nof,
            **{f"TTR{i + 1}_s": f.ttr_s for i, f in enumerate(m.failures)}, "ETT%": m.ett_pct,
            "capETT%": m.capacity_ett_pct, "held_s": m.held.held_s,
            "saves": m.checkpoint_saves, "interval_steps": job.interval_steps, "durable_MB": durable_mb(job.events),
            **{f"{c}_s": m.components[c] for c in L2_ORDER}}


def durable_mb(events: Sequence[PhaseEvent]) -> float:
    """The MB the job's durable checkpoints wrote in the background (every commit's folder, as
    rank 0 sealed it: bases and deltas); NaN when it wrote none that way (synchronous saves
    record no size)."""
    sizes = [e.info.bytes for e in events if e.phase == "checkpoint_save_background" and e.rank == 0
             and e.info.bytes is not None]
    return sum(sizes) / 1e6 if sizes else float("nan")


def pair_table(pair: tuple[JobResult, JobResult]) -> pd.DataFrame:
    frame = pd.DataFrame([{"mode": job.mode, **_row_values(job)} for job in pair]).set_index("mode")
    frame = frame.astype(float)
    frame.loc["difference"] = frame.loc["optimized"] - frame.loc["baseline"]
    return frame.round(2).reset_index()


def pooled_ranks(job: JobResult) -> int:
    """How many of the job's first ranks started in processes the warm pool had prewarmed."""
    return job.pooled_ranks


def rows_table(jobs: Sequence[JobResult]) -> pd.DataFrame:
    """Every row at the default length side by side: the pair and the ablation rows, with the
    path each ran on (a deployment run, or in one process) and its deployment, where its
    checkpoint interval came from (the plan's record: probe, fixed), how many of its ranks
    started from the warm pool, the spares held for it, and what they held (`held_s`)."""
    return pd.DataFrame([{"row": j.row, "path": j.path, "deployment": j.deployment, "interval": j.interval_source,
                          "pooled_ranks": j.pooled_ranks, "pool_used": j.pooled_ranks > 0, "spares": j.spares,
                          **_row_values(j)} for j in jobs]).round(2)


def ttr_tables(jobs: Sequence[JobResult], *, on: str = OPTIMIZED.label,
               off: str = LIVE_RECOVERY_OFF.label) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """TTR of every failure of every row (`ett.run_metrics`: detection to the next step that
    trains new data); and, when both rows ran, the k-th failure's TTR with live recovery `on`
    against `off`, side by side, their ratio, and the ratio of the means. Every scripted kill
    is a single-rank kill, and both rows kill the same ranks at the same steps."""
    per = pd.DataFrame([{"row": j.row, "failure": i + 1, "attempt": f.attempt, "rank": f.rank,
                         "class": f.failure_class, "TTR_s": round(f.ttr_s, 2), "recovered": f.recovered,
                         "cascaded": f.cascaded} for j in jobs for i, f in enumerate(j.metrics.failures)])
    by_row = {j.row: j for j in jobs}
    if on not in by_row or off not in by_row:
        return per, None
    a, b = by_row[on].metrics.failures, by_row[off].metrics.failures
    rows = [{"failure": str(i + 1), "rank": fa.rank, "TTR_on_s": fa.ttr_s, "TTR_off_s": fb.ttr_s,
             "on/off": fa.ttr_s / fb.ttr_s if fb.ttr_s > 0 else float("nan")} for i, (fa, fb) in enumerate(zip(a, b))]
    if rows:
        mean_on = statistics.mean(r["TTR_on_s"] for r in rows)
        mean_off = statistics.mean(r["TTR_off_s"] for r in rows)
        rows.append({"failure": "mean", "rank": -1, "TTR_on_s": mean_on, "TTR_off_s": mean_off,
                     "on/off": mean_on / mean_off if mean_off > 0 else float("nan")})
    frame = pd.DataFrame(rows, columns=["failure", "rank", "TTR_on_s", "TTR_off_s", "on/off"])
    return per, frame.round({"TTR_on_s": 2, "TTR_off_s": 2, "on/off": 3})


def attribution_table(pair: tuple[JobResult, JobResult]) -> pd.DataFrame:
    a = attribute(pair[0].metrics, pair[1].metrics)
    rows = [("saved lost time, s", a.saved_lost_s), ("direct: startup (dTTS), s", a.saved_startup_s),
            ("direct: recovery (d sum TTR), s", a.saved_recovery_s),
            ("direct: checkpointing (d save blocking), s", a.saved_checkpointing_s),
            ("direct: shutdown, s", a.saved_shutdown_s),
            ("cascade bound (1 + NoF) x dTTS, s", a.startup_cascade_bound_s),
            ("fast batch bound min(DPP warm-up, compile) per startup, s", a.fast_batch_saving_per_startup_s),
            ("TTR reduction / TTS reduction", a.ttr_to_tts_ratio if a.ttr_to_tts_ratio is not None else float("nan")),
            ("ETT gain, points", a.ett_gain_pts)]
    return pd.DataFrame(rows, columns=["what", "value"]).round(2)


def checkpoint_table(jobs: Sequence[JobResult]) -> pd.DataFrame:
    """Save blocking of the pairs' jobs: sync (baseline) vs async (optimized); ablation rows left out."""
    rows = []
    for mode in ("baseline", "optimized"):
        blocking = [e.duration for j in jobs if j.row == mode for e in j.events
                    if e.phase == "checkpoint_save_blocking" and e.rank == 0]
        if blocking:
            q = statistics.quantiles(blocking, n=10) if len(blocking) > 2 else [min(blocking), max(blocking)]
            rows.append({"mode": "sync" if mode == "baseline" else "async", "saves": len(blocking),
                         "median_s": statistics.median(blocking), "p10_s": q[0], "p90_s": q[-1],
                         "max_s": max(blocking)})
    return pd.DataFrame(rows).round(4)


def wasted_curve(job_s: float, blocking_s: float, failures: float = 3) -> tuple[pd.DataFrame, dict]:
    model = WasteModel(job_s=job_s, save_blocking_s=blocking_s, failures=failures)
    choice = optimal_interval(model)
    grid = sorted({job_s * f for f in (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 1.0)} | {choice.interval_s})
    frame = pd.DataFrame({"interval_s": grid, "wasted_s": [model.wasted_s(t) for t in grid]})
    return frame, {"interval_s": choice.interval_s, "wasted_s": choice.expected_wasted_s, "young_s": choice.young_s,
                   "daly_s": choice.daly_s}


def shutdown_table(pair: tuple[JobResult, JobResult]) -> pd.DataFrame:
    """Device-held time after the last step (to the lease's release) and publishing, per mode:
    the baseline publishes while the lease holds the devices, the optimized mode after release."""
    return pd.DataFrame([{"mode": j.mode, "publishing": "in trainer" if j.mode == "baseline" else "standalone (CPU)",
                          "device_held_after_last_step_s": round(j.after_last_step_s, 2),
                          "publish_s": round(j.publish_s, 2)} for j in pair])
