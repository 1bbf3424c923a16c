"""Training progress while the train task runs: a Prefect progress artifact and log lines.

A background thread follows the latest attempt's spool (`SpoolTail`, the same events the
metric and the driver's watchdog read) and, every few seconds, updates the progress artifact
(steps done of the steps planned, loss, throughput) and logs one line. It runs in a copy of
the task's context, so it talks to the same Prefect API as the task.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from typing import Any

from ettflow.trainer.progress import SpoolTail

from . import run_spool


class StepTail(SpoolTail):
    """`SpoolTail` that also keeps the furthest global step (the loop's `step` attribute)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step = 0
        self.last_phase: str | None = None  # the last phase a rank finished (init, compile, ...)

    def _take(self, rank: int, rec: dict) -> None:
        super()._take(rank, rec)
        if rec.get("phase") == "train_step":
            self.step = max(self.step, int(rec.get("attrs", {}).get("step", -1)) + 1)
        elif rec.get("phase"):
            self.last_phase = rec["phase"]


def planned_steps(config) -> int | None:
    """Steps each rank runs from the start of the data (None if the data cannot be read)."""
    try:
        from ettflow.trainer.data.pipeline import DataConfig, DataPipeline
        from ettflow.trainer.session import split_windows

        train, _ = split_windows(config)
        data = DataPipeline(DataConfig(root=config.data_root, schema=config.schema, batch_size=config.batch_size,
                                       world_size=config.world_size, windows=train))
        steps = data.num_batches()
        return min(steps, config.max_steps) if config.max_steps else steps
    except Exception:  # noqa: BLE001 - progress is best effort; the trainer reports bad data
        return None


class ProgressReporter:
    def __init__(self, plan, logger: logging.Logger | logging.LoggerAdapter, *, every_s: float = 3.0,
                 artifact: bool = True) -> None:
        self.plan, self.logger, self.every_s = plan, logger, every_s
        self.total = planned_steps(plan.trainer)
        self.artifact_id = None
        self.use_artifact = artifact
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tail: StepTail | None = None
        self._tail_attempt: int | None = None
        self._started = self._quiet_since = time.time()

    def __enter__(self) -> ProgressReporter:
        if self.use_artifact:
            try:
                from prefect.artifacts import create_progress_artifact

                self.artifact_id = create_progress_artifact(
                    0.0, key=f"training-progress-{self.plan.artifact_slug}",
                    description=f"Training run {self.plan.run_id}: waiting for the first step")
            except Exception:  # noqa: BLE001 - no artifact without an API; logs still show progress
                self.logger.warning("could not create the progress artifact", exc_info=True)
        ctx = contextvars.copy_context()
        self._thread = threading.Thread(target=ctx.run, args=(self._loop,), name="ettflow-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            self.report(final=True, succeeded=exc_type is None)
        except Exception:  # noqa: BLE001
            self.logger.debug("progress report failed", exc_info=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.report()
            except Exception:  # noqa: BLE001 - never let progress reporting break training
                self.logger.debug("progress report failed", exc_info=True)

    def poll(self) -> dict[str, Any]:
        attempt = run_spool.last_attempt(self.plan.spool_root, self.plan.run_id)
        if self._tail is None or self._tail_attempt != attempt:
            if self._tail_attempt is not None:
                self._announce_restart(self._tail_attempt, attempt)
            self._tail = StepTail(self.plan.spool_root, self.plan.run_id, attempt, self.plan.trainer.world_size)
            self._tail_attempt = attempt
            self._started = time.time()
        self._tail.poll()
        return {"attempt": attempt, "step": self._tail.step, "last_phase": self._tail.last_phase,
                **self._tail.summary()}

    def _announce_restart(self, old: int, new: int) -> None:
        failed = [e for e in run_spool.events(self.plan.spool_root, self.plan.run_id)
                  if e.attempt == old and e.phase == "failure_detected"]
        why = f"{failed[0].attrs.get('failure_class')} failure: {failed[0].attrs.get('reason')}" if failed else "?"
        self.logger.warning("attempt %d failed (%s); attempt %d restores the last checkpoint", old, why, new)

    def report(self, final: bool = False, succeeded: bool = False) -> None:
        s = self.poll()
        if s["step"] == 0 and not final:
            now = time.time()
            if now - self._quiet_since >= 30.0:  # still starting: say so every 30 s (a short console)
                self._quiet_since = now
                self.logger.info("attempt %d starting up for %.0f s (last finished phase: %s)", s["attempt"],
                                 now - self._started, s["last_phase"] or "-")
            return
        pct = 100.0 * min(s["step"] / self.total, 1.0) if self.total else 0.0
        loss = "-" if s["loss"] is None else f"{s['loss']:.4f}"
        text = (f"step {s['step']}/{self.total or '?'} ({pct:.0f}%), attempt {s['attempt']}, loss {loss}, "
                f"{s['examples_per_s']:.0f} examples/s")
        self.logger.info("training: %s", text)
        if self.artifact_id is not None:
            from prefect.artifacts import update_progress_artifact

            update_progress_artifact(self.artifact_id, 100.0 if succeeded else pct,
                                     description=f"Training run {self.plan.run_id}: {text}")
