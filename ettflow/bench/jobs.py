"""One benchmark job: one run of the product's `refresh_model` flow, measured from its spool.

A job is a row of the paired evaluation (`Row`): a mode (baseline or optimized), optionally
with switches overridden (an ablation row) and a fixed checkpoint interval (an ablation row;
otherwise the flow's plan leaves the interval to the project's optimizer). Its scripted kills
are the flow's `fail_at` items (`trainer.config.FAIL_AT_GRAMMAR`): the k-th kill SIGKILLs rank
(k+1) % world at its step, in attempt k. So baseline and optimized go through the same tasks
the flow uses: claim, reserve (the lease), train (the driver, its restarts), anchor, publish
while the lease still holds the devices (baseline: `publish_in_trainer`) or on the CPU after
the release (optimized), record the lineage, archive.

Each job is the first refresh of the model `MODEL` in a warehouse, spool and snapshot root of
its own (`<state>/<run label>/`), so no job's history, lineage or gate depends on the jobs run
before it; with no history the plan's interval is the trainer's probe save and the optimizer
(`ett.interval_plan`, `trainer/rank/loop.py`). Every job shares the data root and the work root,
hence the model's compile cache: `warm_compile_cache` is the previous refresh of the same
model, which leaves the archive the optimized mode finds (a continuous refresh's steady state).

`trainer_config` and `trainer_rank0` run the trainer alone, without the flow: the
recording-overhead measurement (the flow has no switch to turn step recording off) and the
interval bench (`bench/intervals.py`) use them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ettflow.ett.events import PhaseEvent
from ettflow.ett.run_metrics import RunMetrics, compute_run_metrics
from ettflow.tasks.parameters import ArchitectureParams, RefreshParameters, SwitchParams
from ettflow.tasks.plan import trainer_config as plan_trainer_config
from ettflow.trainer.config import FailAt, TrainerConfig
from ettflow.trainer.data.schema import criteo_schema
from ettflow.trainer.model_config import ModelConfig
from ettflow.trainer.protocol import RankResult

MODEL = "bench-dlrm"  # the model every job refreshes (its compile cache is shared)
MODES = ("baseline", "optimized")


@dataclass(frozen=True, kw_only=True)
class Row:
    """A row of the evaluation: `mode`, with `switches` overridden (the flow's `switches`
    parameter) and a fixed `interval_steps` (None: the plan's optimizer picks the interval)."""

    label: str
    mode: str
    switches: dict[str, bool] = field(default_factory=dict)
    interval_steps: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"Row.mode must be one of {MODES}, got {self.mode!r}")
        if self.interval_steps is not None and (isinstance(self.interval_steps, bool) or self.interval_steps < 1):
            raise ValueError(f"Row.interval_steps must be an int >= 1 or None, got {self.interval_steps!r}")
        known = set(SwitchParams.model_fields)
        unknown = sorted(set(self.switches) - known)
        if unknown:
            raise ValueError(f"Row.switches has unknown switches {unknown}; known: {sorted(known)}")

    @property
    def slug(self) -> str:
        return "-".join("".join(c if c.isalnum() else " " for c in self.label.lower()).split())


BASELINE = Row(label="baseline", mode="baseline")
OPTIMIZED = Row(label="optimized", mode="optimized")


def fixed_interval_row(steps: int) -> Row:
    return Row(label=f"optimized, fixed {steps}-step interval", mode="optimized", interval_steps=steps)


# the study's fleet: a restart lands on a fresh host, with no local compile cache (every
# process compiles cold); the untuned baseline above keeps PyTorch's local cache on its host
BASELINE_FRESH_HOST = Row(label="baseline, fresh host (no local compile cache)", mode="baseline",
                          switches={"local_inductor_cache": False})
# issue 12's recovery off: no live recovery, no in-memory tier, no warm pool (a restart would
# take its ranks' processes from the pool): every rank restarts from disk, the slower way
LIVE_RECOVERY_OFF = Row(label="optimized, live recovery off", mode="optimized",
                        switches={"live_recovery": False, "memory_checkpoint": False, "warm_pool": False})
# the optimized mode with its ranks started the usual way, not from the processes the previous
# run left prewarmed (trainer/group/warm_pool.py): what the pool takes off TTS, side by side
WARM_POOL_OFF = Row(label="optimized, warm pool off", mode="optimized", switches={"warm_pool": False})
# issue 44: the optimized mode without its delta checkpoints (every periodic save a full one),
# beside the optimized row, for what the deltas change in ETT, TTR and the durable bytes written
DELTA_OFF = Row(label="optimized, delta checkpoints off", mode="optimized", switches={"delta_checkpoint": False})


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    data_root: Path
    train_windows: tuple[str, ...]
    held_out: tuple[str, ...]
    work_root: Path
    num_embeddings: int = 20_000
    batch_size: int = 256
    world_size: int = 2
    checkpoint_every_steps: int | None = None  # None: the optimizer's (probe save, then the optimal interval)
    kill_steps: tuple[int, ...] = ()  # the k-th kill happens in attempt k, alternating ranks
    model: ModelConfig = field(default_factory=ModelConfig)
    record_steps: bool = True
    max_steps: int | None = None
    eval_batches: int | None = None  # None: the mode's preset (tasks.parameters.EVAL_BATCHES_PRESET)
    switches: dict[str, bool] = field(default_factory=dict)  # set on every job, over the row's (`--switch`)

    def failures(self) -> tuple[FailAt, ...]:
        return tuple(FailAt(kind="kill", rank=(i + 1) % self.world_size, step=s, attempt=i)
                     for i, s in enumerate(self.kill_steps))

    def fail_at(self) -> list[str]:
        """The kills as the flow's `fail_at` items (FAIL_AT_GRAMMAR)."""
        return [f"kill:rank={f.rank}:step={f.step}:attempt={f.attempt}" for f in self.failures()]

    def architecture(self) -> dict[str, Any]:
        """The model as the flow's `architecture` parameter (`ArchitectureParams`)."""
        arch = asdict(self.model)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in arch.items()
                if k in ArchitectureParams.model_fields}


@dataclass
class JobResult:
    run_id: str
    row: str  # the row's label
    mode: str
    metrics: RunMetrics
    events: list[PhaseEvent]
    publish_s: float
    snapshot: Any = None
    path: str = "in-process"  # how it ran (bench/deployed.py): "deployed" or "in-process"
    deployment: str = "-"  # the deployment it was a run of (deployed)

    @property
    def pooled_ranks(self) -> int:
        """How many of its first ranks started in processes the warm pool had prewarmed."""
        return sum(1 for e in self.events if e.phase == "spare_start" and e.info.pooled
                   and e.info.for_rank is not None)

    @property
    def spares(self) -> int:
        """Hot spares held for it (used or not)."""
        return sum(1 for e in self.events if e.phase == "spare_start" and e.info.for_rank is None)

    @property
    def after_last_step_s(self) -> float:
        """Device-held time after the last training step (the study's shutdown): from the end
        of the last step to the release of the devices (the end of the last `shutdown`)."""
        last = max(e.end for e in self.events if e.phase == "train_step")
        released = max(e.end for e in self.events if e.phase == "shutdown")
        return released - last

    @property
    def interval_source(self) -> str:
        """Where the run's checkpoint interval came from (the plan's record): probe, fixed, history."""
        from ettflow.tasks.run_spool import planned_interval

        planned = planned_interval(self.events)
        return str(planned.source) if planned is not None else "-"

    @property
    def interval_steps(self) -> float | None:
        """The interval the run trained with: the plan's, when it set one (fixed, history);
        else the optimizer's after each attempt's probe save: the median step distance between
        consecutive saves of rank 0 within an attempt, its first save (the probe) left out
        (None: no attempt saved twice after its probe)."""
        from ettflow.tasks.run_spool import planned_interval

        planned = planned_interval(self.events)
        if planned is not None and planned.interval_steps:
            return float(planned.interval_steps)
        gaps: list[int] = []
        for attempt in {e.attempt for e in self.events}:
            steps = sorted(e.info.step for e in self.events if e.phase == "checkpoint_save_blocking"
                           and e.rank == 0 and e.attempt == attempt and e.info.step is not None)[1:]
            gaps += [b - a for a, b in zip(steps, steps[1:])]
        return float(statistics.median(gaps)) if gaps else None


def flow_params(spec: JobSpec, row: Row, **over: Any) -> dict[str, Any]:
    """The `refresh_model` parameters of the job (besides the roots `Refresher.params` sets)."""
    switches = {**row.switches, **spec.switches} or None
    return {"mode": row.mode, "switches": switches, "architecture": spec.architecture(),
            "windows": list(spec.train_windows), "eval_windows": list(spec.held_out), "world_size": spec.world_size,
            "batch_size": spec.batch_size, "max_embeddings": spec.num_embeddings, "max_steps": spec.max_steps,
            "checkpoint_every_steps": row.interval_steps or spec.checkpoint_every_steps,
            "eval_batches": spec.eval_batches, "fail_at": spec.fail_at(), "work_root": str(spec.work_root),
            "warm_start": False, "gate_max_auc_drop": None, "bootstrap_windows": None, **over}


def run_flow_job(spec: JobSpec, row: Row, state: Path, *, runner: Any = None,
                 tags: dict[str, Any] | None = None) -> JobResult:
    """Run the job as one `refresh_model` flow run with its own warehouse, spool and snapshots
    under `state`, on `runner`'s path (bench/deployed.py; None: in this process); its metrics
    from its spool."""
    from .refreshes import Refresher, SequencePlan

    state.mkdir(parents=True, exist_ok=True)
    refresher = Refresher(state, SequencePlan(world_size=spec.world_size, batch_size=spec.batch_size,
                                              max_embeddings=spec.num_embeddings), runner)
    params = refresher.params(MODEL, spec.data_root, **flow_params(spec, row, tags={
        "benchmark": True, "bench": "pair", "row": row.label, **(tags or {})}))
    result, events = refresher.run(params)
    metrics = compute_run_metrics(events)
    publish_s = sum(e.duration for e in events if e.phase in ("publish", "publish_standalone")
                    and e.info.outcome in ("published", "gated"))
    return JobResult(run_id=metrics.run_id, row=row.label, mode=row.mode, metrics=metrics, events=events,
                     publish_s=publish_s, snapshot=result.get("snapshot"), path=refresher.runner.path,
                     deployment=refresher.runner.deployment)


def warm_compile_cache(spec: JobSpec, state: Path, runner: Any = None) -> JobResult:
    """The previous refresh of the same model (2 steps, no kills, optimized): leaves the
    compile-cache archive that the optimized jobs find, and the warm pool's prewarmed
    processes the next optimized job starts from (the cluster's, or this process's)."""
    return run_flow_job(replace(spec, kill_steps=(), max_steps=2), OPTIMIZED, state, runner=runner,
                        tags={"bench": "warm-up"})


def trainer_config(spec: JobSpec, mode: str, run_id: str, *, cache_root: Path | None) -> TrainerConfig:
    """The job's trainer config for a run of the trainer alone: the flow's parameters of the
    job (`flow_params`), made into a config by the flow's own function."""
    params = RefreshParameters.parse(flow_params(spec, Row(label=mode, mode=mode)))
    return plan_trainer_config(params, data_root=spec.data_root, work_dir=spec.work_root / run_id,
                               compile_cache_root=cache_root, schema=criteo_schema(spec.num_embeddings),
                               max_failures=len(spec.kill_steps) + 1, record_steps=spec.record_steps,
                               log_every=10_000)


def trainer_rank0(spec: JobSpec, run_id: str, spool: Path, *, cache_root: Path | None) -> RankResult:
    """Rank 0's result of one optimized run of the trainer alone (the driver and its Ray group,
    no flow, no publishing): examples/s, the median step, the time in its record calls. The
    recording overhead compares runs with `record_steps` on and off."""
    from ettflow.trainer.group.driver import TrainingDriver
    from ettflow.trainer.group.ray_group import RayWorkerGroup, end_run
    from ettflow.trainer.rank.actor import TrainerActor

    cfg = trainer_config(spec, "optimized", run_id, cache_root=cache_root)
    driver = TrainingDriver(cfg, run_id, spool, lambda a: RayWorkerGroup(cfg, run_id, a, spool, actor_cls=TrainerActor))
    try:
        return driver.run(submitted_at=time.time()).rank0
    finally:
        end_run(run_id)
