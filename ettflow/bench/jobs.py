"""One benchmark job: the real trainer (Ray actors, DMP, gloo) in baseline or optimized mode,
with scripted kills, then publishing: inside the trainer for the baseline (the devices are
held), standalone on CPU after release for the optimized mode. Its ETT comes from its spool."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ettflow.ett.events import PhaseEvent
from ettflow.ett.run_metrics import RunMetrics, compute_run_metrics
from ettflow.ett.spool import SpoolWriter, read_spool
from ettflow.publish import PublishConfig, publish_snapshot
from ettflow.trainer.config import FailAt, Switches, TrainerConfig
from ettflow.trainer.data.schema import criteo_schema
from ettflow.trainer.driver import TrainingDriver, TrainingResult
from ettflow.trainer.model import ModelConfig
from ettflow.trainer.ray_group import RayWorkerGroup


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    data_root: Path
    train_windows: tuple[str, ...]
    held_out: tuple[str, ...]
    work_root: Path
    num_embeddings: int = 20_000
    batch_size: int = 256
    world_size: int = 2
    checkpoint_every_steps: int = 50
    kill_steps: tuple[int, ...] = ()  # the k-th kill happens in attempt k, alternating ranks
    model: ModelConfig = field(default_factory=ModelConfig)
    record_steps: bool = True
    max_steps: int | None = None

    def failures(self) -> tuple[FailAt, ...]:
        return tuple(FailAt(kind="kill", rank=(i + 1) % self.world_size, step=s, attempt=i)
                     for i, s in enumerate(self.kill_steps))


@dataclass
class JobResult:
    run_id: str
    mode: str
    metrics: RunMetrics
    events: list[PhaseEvent]
    training: TrainingResult
    publish_s: float
    snapshot: Any = None

    @property
    def after_last_step_s(self) -> float:
        """Device-held time after the last training step (the study's shutdown)."""
        last = max(e.end for e in self.events if e.phase == "train_step")
        return self.metrics.wall_end - last


def trainer_config(spec: JobSpec, mode: str, run_id: str, *, cache_root: Path | None) -> TrainerConfig:
    return TrainerConfig(
        data_root=str(spec.data_root), schema=criteo_schema(spec.num_embeddings), windows=spec.train_windows,
        eval_windows=spec.held_out, work_dir=str(spec.work_root / run_id),
        compile_cache_root=str(cache_root) if cache_root else None, model=spec.model,
        switches=Switches.preset(mode), world_size=spec.world_size, batch_size=spec.batch_size,
        checkpoint_every_steps=spec.checkpoint_every_steps, failures=spec.failures(),
        max_failures=len(spec.kill_steps) + 1, record_steps=spec.record_steps, max_steps=spec.max_steps,
        eval_batches=4, log_every=10_000,
    )


def _publish_config(spec: JobSpec, anchor: str, run_id: str) -> PublishConfig:
    return PublishConfig(anchor=anchor, output_root=spec.work_root / "snapshots", data_root=spec.data_root,
                         windows=list(spec.held_out), run_id=run_id, validation_batches=2)


def run_job(spec: JobSpec, mode: str, run_id: str, spool: Path, *, cache_root: Path | None = None,
            publish: bool = True) -> JobResult:
    cfg = trainer_config(spec, mode, run_id, cache_root=cache_root)
    in_trainer = publish and mode == "baseline"

    def publish_in_trainer(ranks: dict[int, dict]):
        return publish_snapshot(_publish_config(spec, ranks[0]["anchor"], run_id))

    driver = TrainingDriver(cfg, run_id, spool, lambda a: RayWorkerGroup(cfg, run_id, a, spool),
                            before_release=publish_in_trainer if in_trainer else None)
    training = driver.run(submitted_at=time.time())
    snapshot, publish_s = driver.released_with, 0.0
    if publish and not in_trainer:
        with SpoolWriter(spool, run_id, training.attempts - 1, -1) as rec:  # the last attempt
            t0 = time.time()
            snapshot = publish_snapshot(_publish_config(spec, training.rank0["anchor"], run_id))
            publish_s = time.time() - t0
            rec.record("publish_standalone", t0, t0 + publish_s, standalone=True)
    events = read_spool(spool, run_id).events
    metrics = compute_run_metrics(events)
    if in_trainer:
        publish_s = metrics.raw("publish")
    return JobResult(run_id, mode, metrics, events, training, publish_s, snapshot)


def warm_compile_cache(spec: JobSpec, spool: Path, cache_root: Path, run_id: str) -> JobResult:
    """The previous refresh of the same model: leaves the compile-cache archive that the
    optimized mode finds (a continuous refresh's steady state)."""
    short = replace(spec, kill_steps=(), max_steps=2)
    return run_job(short, "optimized", run_id, spool, cache_root=cache_root, publish=False)
