"""`ettflow bench intervals`: the checkpoint interval from the model's history, measured.

A sequence of refreshes of one model (the same training windows each time, the real trainer:
Ray actors, DMP, gloo, async DCP checkpoints) whose failures come from a Poisson process at a
set rate per second of training: for refresh i, the count is Poisson(rate x its training time)
and each failure is a real SIGKILL of a rank (`kill:rank=R:step=S`, FAIL_AT_GRAMMAR) at a step
drawn uniformly from the job's steps, seeded. Every refresh runs the SAME kills under each
policy, side by side:

- fixed: `checkpoint_every_steps` = 50, the paired bench's fixed-interval ablation row;
- probe: today's refresh default: a probe save at a tenth of each job, then the optimizer's
  interval for `expected_failures` = 1 per job;
- history: the plan's interval from this policy's own earlier refreshes (`ett.interval_plan`
  over `failure_history_db.estimate_from_warehouse` of its warehouse; the first refresh has
  no history and probes, with the prior's rate). The model has no fleet here: its prior is
  today's guess (one failure per job, sized by the calibration job), weighing `prior_s`
  seconds of training.

Saves are synchronous (`async_checkpoint` off) so a save costs several steps of these tiny
jobs, as a durable save costs many steps of a real one; every policy runs the same switches.

Realized wasted training (the L2 `wasted_training`: replayed steps, work lost in flight,
save blocking) is summed over the sequence and reported as a share of the summed wall time.

The hindsight-best fixed interval is computed, not run: the same kill steps are replayed at
every fixed interval k in the measured model (a kill at step s loses s mod k steps; a job of
N steps takes ceil(N / k) - 1 saves; the fixed arm's measured step time and save blocking),
plus the fixed arm's measured failure-to-detection loss (`lost_in_flight`, the same for every
interval). The model's value at the fixed arm's own interval is printed beside that arm's
measured waste, so the model's error is visible.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ettflow.ett.failure_history import EstimateConfig
from ettflow.ett.failures import FailureClass
from ettflow.ett.interval_plan import TAG, IntervalSource, PlannedInterval, plan_interval
from ettflow.ett.run_metrics import RunMetrics, compute_run_metrics

if TYPE_CHECKING:  # imported where they are used: every `ettflow` command imports this module
    import numpy as np
    import pandas as pd

POLICIES = ("fixed", "probe", "history")
MODEL = "bench-intervals"


@dataclass(frozen=True, kw_only=True)
class IntervalBenchPlan:
    refreshes: int = 8
    rate_per_s: float = 0.07  # failures per second of training (the Poisson process)
    seed: int = 0
    windows: int = 2  # training windows per refresh (one more is held out)
    rows_per_window: int = 24_576
    batch_size: int = 64  # per rank
    world_size: int = 2
    num_embeddings: int = 20_000
    fixed_steps: int = 50  # the `fixed` policy (the paired bench's fixed-interval ablation row)
    max_kills: int = 3  # per refresh (the driver's failure budget is this + 1)
    prior_s: float = 10.0  # the fleet prior's weight for `history`, in seconds of training
    async_checkpoint: bool = False  # synchronous durable saves: a save costs several steps, as in real jobs

    def __post_init__(self) -> None:
        if self.refreshes < 1 or not self.rate_per_s >= 0 or self.max_kills < 0:
            raise ValueError("refreshes >= 1, rate_per_s >= 0 and max_kills >= 0 required")

    @property
    def steps(self) -> int:
        return self.windows * self.rows_per_window // (self.batch_size * self.world_size)

    def estimate_config(self, prior_rate_per_s: float) -> EstimateConfig:
        """The bench's model has no fleet: its prior is today's guess, one failure per job."""
        return EstimateConfig(window_s=7 * 24 * 3600.0, prior_hours=self.prior_s / 3600.0,
                              default_rate_per_h={FailureClass.INFRASTRUCTURE: 3600.0 * prior_rate_per_s})


def kill_steps(rng: np.random.Generator, *, rate_per_s: float, train_s: float, steps: int,
               max_kills: int) -> tuple[int, ...]:
    """A Poisson number of failures over `train_s` seconds of training (at most `max_kills`),
    each at a uniformly drawn step in [1, steps), sorted: the k-th kill ends attempt k."""
    n = min(int(rng.poisson(rate_per_s * train_s)), max_kills)
    return tuple(sorted(int(s) for s in rng.integers(1, max(steps, 2), size=n)))


def replay_waste(kills: list[tuple[int, ...]], *, steps: int, interval: int, step_s: float, csbt_s: float) -> float:
    """Replayed + save-blocking seconds of the kill sequence at a fixed interval (see the module
    docstring)."""
    lost = sum(s % interval for ks in kills for s in ks)
    saves = (math.ceil(steps / interval) - 1) * len(kills)
    return lost * step_s + saves * csbt_s


@dataclass
class Job:
    policy: str
    refresh: int
    run_id: str
    kills: tuple[int, ...]
    planned: PlannedInterval
    metrics: RunMetrics
    interval_steps: int | None  # what the trainer used (after its probe, for a probing job)

    @property
    def wasted_s(self) -> float:
        return self.metrics.components["wasted_training"]

    def phase(self, name: str) -> float:
        t = self.metrics.phases.get(name)
        return t.exposed_s if t is not None else 0.0


class IntervalBench:
    def __init__(self, plan: IntervalBenchPlan, out: Path, say=print) -> None:
        self.plan, self.out, self.say = plan, out, say
        self.data, self.spool, self.cache = out / "data", out / "spool", out / "compile-cache"
        self.stamp = time.strftime("%Y%m%d-%H%M%S")
        self.jobs: list[Job] = []

    def prepare(self) -> tuple[str, ...]:
        from ettflow.trainer.data.synthetic import SyntheticConfig, generate_windows
        from ettflow.trainer.data.windows import list_windows

        need = self.plan.windows + 1
        have = list_windows(self.data) if self.data.is_dir() else []
        if len(have) < need or self._rows() != self.plan.rows_per_window:
            generate_windows(self.data, SyntheticConfig(windows=need, rows_per_window=self.plan.rows_per_window,
                                                        files_per_window=1, seed=11, overwrite=True))
            (self.data / ".rows").write_text(str(self.plan.rows_per_window))
        return tuple(list_windows(self.data))[:need]

    def _rows(self) -> int | None:
        f = self.data / ".rows"
        return int(f.read_text()) if f.is_file() else None

    def run(self, windows: tuple[str, ...], run_id: str, *, kills: tuple[int, ...], interval_steps: int | None,
            rate_per_s: float | None) -> tuple[RunMetrics, list, dict]:
        from ettflow.ett.spool import read_spool
        from ettflow.trainer.group.driver import TrainingDriver
        from ettflow.trainer.group.ray_group import RayWorkerGroup, end_run
        from ettflow.trainer.model import ModelConfig
        from ettflow.trainer.rank.actor import TrainerActor

        from .jobs import JobSpec, trainer_config

        p = self.plan
        spec = JobSpec(data_root=self.data, train_windows=windows[:p.windows], held_out=windows[p.windows:],
                       work_root=self.out / "work", num_embeddings=p.num_embeddings, batch_size=p.batch_size,
                       world_size=p.world_size, kill_steps=kills, checkpoint_every_steps=1,
                       model=ModelConfig(embedding_dim=16, dense_arch=(32, 16), over_arch=(32, 1)))
        cfg = replace(trainer_config(spec, "optimized", run_id, cache_root=self.cache),
                      checkpoint_every_steps=interval_steps, failure_rate_per_s=rate_per_s, eval_batches=0)
        cfg = cfg.with_switches(async_checkpoint=p.async_checkpoint)
        driver = TrainingDriver(cfg, run_id, self.spool,
                                lambda a: RayWorkerGroup(cfg, run_id, a, self.spool, actor_cls=TrainerActor))
        try:
            result = driver.run(submitted_at=time.time())
        finally:
            end_run(run_id)
        events = read_spool(self.spool, run_id).events
        return compute_run_metrics(events), events, result.rank0

    def calibrate(self, windows: tuple[str, ...]) -> tuple[float, float]:
        """One job without failures (also warms the compile cache): step time, save blocking."""
        m, _, _ = self.run(windows, f"ibench-{self.stamp}-calibrate", kills=(),
                           interval_steps=self.plan.fixed_steps, rate_per_s=None)
        per_rank_steps = m.effective_steps / self.plan.world_size
        return m.components["effective_training"] / per_rank_steps, m.checkpoint_blocking_s

    def sequence(self) -> tuple[list[tuple[int, ...]], float, float]:
        from ettflow.ett.failure_history_db import estimate_from_warehouse
        from ettflow.ett.warehouse import RunInfo, Warehouse

        windows = self.prepare()
        step_s, csbt = self.calibrate(windows)
        p = self.plan
        self.say(f"calibration: {step_s * 1000:.1f} ms a step, {csbt * 1000:.1f} ms save blocking; "
                 f"{p.steps} steps a refresh ({p.steps * step_s:.1f} s of training), "
                 f"{p.rate_per_s * p.steps * step_s:.2f} failures expected a refresh")
        import numpy as np

        rng = np.random.default_rng(p.seed)
        kills = [kill_steps(rng, rate_per_s=p.rate_per_s, train_s=p.steps * step_s, steps=p.steps,
                            max_kills=p.max_kills) for _ in range(p.refreshes)]
        houses = {policy: Warehouse.open(f"sqlite:///{self.out / f'warehouse-{self.stamp}-{policy}.db'}")
                  for policy in POLICIES}
        try:
            for i, ks in enumerate(kills):
                for policy in POLICIES:
                    if policy == "fixed":
                        planned = PlannedInterval(source=IntervalSource.FIXED, interval_steps=p.fixed_steps)
                        rate = None
                    elif policy == "probe":
                        planned, rate = PlannedInterval(source=IntervalSource.PROBE), None
                    else:
                        est = estimate_from_warehouse(houses[policy], model=MODEL, now=time.time(),
                                                      config=p.estimate_config(1.0 / (p.steps * step_s)))
                        planned = plan_interval(est, windows=p.windows, max_steps=None)
                        rate = planned.rate_per_h / 3600.0 if planned.rate_per_h is not None else None
                    steps = planned.interval_steps if planned.source is not IntervalSource.PROBE else None
                    run_id = f"ibench-{self.stamp}-{i}-{policy}"
                    m, events, rank0 = self.run(windows, run_id, kills=ks, interval_steps=steps, rate_per_s=rate)
                    chosen = rank0.checkpoint.interval
                    used = steps or (chosen.interval_steps if chosen is not None else None)
                    houses[policy].archive_run(RunInfo(run_id=run_id, model=MODEL, mode=policy,
                                                       tags={TAG: planned.to_attrs(), "benchmark": True}),
                                               events, m)
                    job = Job(policy, i, run_id, ks, planned, m, used)
                    self.jobs.append(job)
                    self.say(f"refresh {i} {policy:8s} kills {list(ks)} interval {used} steps "
                             f"({planned.source.value}): wall {m.wall_s:.1f} s, wasted {job.wasted_s:.2f} s, "
                             f"NoF {m.nof}")
        finally:
            for wh in houses.values():
                wh.close()
        return kills, step_s, csbt

    def tables(self, kills: list[tuple[int, ...]]) -> dict[str, pd.DataFrame]:
        import pandas as pd

        p = self.plan
        per_job = pd.DataFrame([{
            "refresh": j.refresh, "policy": j.policy, "kills": " ".join(map(str, j.kills)) or "-",
            "source": j.planned.source.value, "interval_steps": j.interval_steps,
            "rate_per_h": None if j.planned.rate_per_h is None else round(j.planned.rate_per_h, 1),
            "expected_wasted_s": None if j.planned.expected_wasted_s is None else round(j.planned.expected_wasted_s, 2),
            "wasted_s": round(j.wasted_s, 3), "replay_s": round(j.phase("train_step_replay"), 3),
            "lost_in_flight_s": round(j.phase("lost_in_flight"), 3),
            "save_blocking_s": round(j.phase("checkpoint_save_blocking"), 3),
            "saves": j.metrics.checkpoint_saves, "wall_s": round(j.metrics.wall_s, 2), "NoF": j.metrics.nof}
            for j in self.jobs])
        fixed = [j for j in self.jobs if j.policy == "fixed"]
        step_s = sum(j.metrics.components["effective_training"] for j in fixed) / sum(
            j.metrics.effective_steps / p.world_size for j in fixed)
        saves = [j for j in fixed if j.metrics.checkpoint_saves]
        csbt = sum(j.metrics.checkpoint_blocking_s * j.metrics.checkpoint_saves for j in saves) / max(
            sum(j.metrics.checkpoint_saves for j in saves), 1)
        in_flight = sum(j.phase("lost_in_flight") for j in fixed)
        curve = {k: replay_waste(kills, steps=p.steps, interval=k, step_s=step_s, csbt_s=csbt) + in_flight
                 for k in range(1, p.steps + 1)}
        best = min(curve, key=curve.__getitem__)
        rows = []
        for policy in POLICIES:
            jobs = [j for j in self.jobs if j.policy == policy]
            wasted, wall = sum(j.wasted_s for j in jobs), sum(j.metrics.wall_s for j in jobs)
            rows.append({"policy": policy, "wasted_s": round(wasted, 2), "wall_s": round(wall, 1),
                         "wasted_%_of_wall": round(100 * wasted / wall, 3), "NoF": sum(j.metrics.nof for j in jobs),
                         "saves": sum(j.metrics.checkpoint_saves for j in jobs)})
        summary = pd.DataFrame(rows)
        by = summary.set_index("policy")["wasted_s"]
        summary.loc[len(summary)] = {"policy": f"hindsight-best fixed ({best} steps, model)",
                                     "wasted_s": round(curve[best], 2), "wall_s": None, "wasted_%_of_wall": None,
                                     "NoF": None, "saves": None}
        summary.loc[len(summary)] = {"policy": f"model at fixed ({p.fixed_steps} steps)",
                                     "wasted_s": round(curve[p.fixed_steps], 2), "wall_s": None,
                                     "wasted_%_of_wall": None, "NoF": None, "saves": None}
        targets = pd.DataFrame([
            {"target": "history-fed waste / fixed waste", "measured": round(by["history"] / by["fixed"], 3),
             "goal": "<= 0.8"},
            {"target": "history-fed waste / hindsight-best fixed (model)", "measured": round(
                by["history"] / curve[best], 3), "goal": "<= 1.15"},
            {"target": "probe waste / fixed waste", "measured": round(by["probe"] / by["fixed"], 3), "goal": "-"},
        ])
        targets["met"] = [g == "-" or float(m) <= float(g.split()[1]) for m, g in zip(targets["measured"],
                                                                                     targets["goal"])]
        model = pd.DataFrame([{"step_ms": round(1000 * step_s, 2), "csbt_ms": round(1000 * csbt, 2),
                               "lost_in_flight_s": round(in_flight, 2), "steps_per_refresh": p.steps,
                               "hindsight_best_steps": best, "rate_per_s": p.rate_per_s, "seed": p.seed}])
        return {"per_refresh": per_job, "waste": summary, "model": model, "targets": targets}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="results/intervals", help="results folder (default: ./results/intervals)")
    p.add_argument("--refreshes", type=int, default=IntervalBenchPlan.refreshes)
    p.add_argument("--rate", type=float, default=IntervalBenchPlan.rate_per_s, help="failures per training second")
    p.add_argument("--seed", type=int, default=IntervalBenchPlan.seed)
    p.add_argument("--verbose", action="store_true", help="show every library's warnings and logs too")


def main(args: argparse.Namespace) -> int:
    from ettflow.console import quiet_third_party
    from ettflow.trainer.group.ray_group import ensure_ray

    from .output import Clock, command_line, write_tables

    quiet_third_party(verbose=getattr(args, "verbose", False))
    plan = IntervalBenchPlan(refreshes=args.refreshes, rate_per_s=args.rate, seed=args.seed)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    clock = Clock()
    ensure_ray(num_cpus=4)
    bench = IntervalBench(plan, out, clock.say)
    kills, _, _ = bench.sequence()
    tables = bench.tables(kills)
    header = (f"# ettflow bench intervals\n\nCommand: `{command_line(args)}`; "
              f"machine: {platform.machine()} {os.cpu_count()} cores; took {clock.elapsed():.0f} s.")
    write_tables(out, tables, header=header)
    met = tables["targets"]["met"]
    clock.say(f"targets met: {int(met.sum())}/{len(met)}; tables in {out}")
    return 0
