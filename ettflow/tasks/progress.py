"""The run's progress: one Prefect progress artifact per flow run, and log lines.

`RunProgress` is the run's one progress artifact (key ``training-progress-<slug>``, on the
flow run). It is found by its key on the flow run, and created only when there is none yet, so
a retried train task, a restart, a flow retry and the final hooks all update the same one. The
flow shows its steps in it (claiming the windows, reserving the trainer, publishing) and ends
it at the run's final state (`finish`: 100% when completed, else where training stopped).

While the train task runs, `ProgressReporter` follows the latest attempt: a background thread
reads its spool (`SpoolTail`, the same events the metric and the driver's watchdog read) and
its ranks' heartbeats, and every few seconds updates the artifact and logs one line. Before
the first step it says which startup phase the ranks are in and for how long
(`startup_text`: ``attempt 0 starting: pt2_compile for 35 s``); after a failure, which
attempt failed and why, and, once the next one trains, what it restored (`restored_text`).
It runs in a copy of the task's context, so it talks to the same Prefect API as the task.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any
from uuid import UUID

from ettflow.ett.checkpoint_tier import RestoreSource
from ettflow.ett.events import CHECKPOINT_FALLBACK, TRAIN_STEP, PhaseEvent
from ettflow.ett.failures import Failure
from ettflow.ett.run_summary import failure_line
from ettflow.trainer.group.progress import SpoolTail
from ettflow.trainer.rank_heartbeat import RankBeat

log = logging.getLogger("ettflow.tasks")

KEY_PREFIX = "training-progress-"


def progress_key(slug: str) -> str:
    return f"{KEY_PREFIX}{slug}"


class RunProgress:
    """The flow run's one progress artifact (see the module docstring). Without a Prefect API
    or a flow run id ("local") it does nothing; an API error is logged, never raised."""

    def __init__(self, flow_run_id: str, slug: str) -> None:
        self.key = progress_key(slug)
        try:
            self.flow_run_id: UUID | None = UUID(str(flow_run_id))
        except ValueError:
            self.flow_run_id = None
        self.artifact_id: UUID | None = None
        self.pct = 0.0

    def _find(self, client) -> None:
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
        from prefect.client.schemas.sorting import ArtifactSort

        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[self.key]),
                                           flow_run_id=ArtifactFilterFlowRunId(any_=[self.flow_run_id])),
            sort=ArtifactSort.CREATED_DESC, limit=1)
        if found:
            self.artifact_id, self.pct = found[0].id, float(found[0].data or 0.0)

    def show(self, text: str, pct: float | None = None, *, create: bool = True) -> None:
        """Set the artifact's description to `text` (and its progress to `pct`; None: keep it),
        creating the artifact if the flow run has none yet (unless `create` is false)."""
        from prefect.settings import PREFECT_API_URL

        if self.flow_run_id is None or not PREFECT_API_URL.value():
            return
        try:
            from prefect.client.orchestration import get_client
            from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate

            with get_client(sync_client=True) as client:
                if self.artifact_id is None:
                    self._find(client)
                self.pct = self.pct if pct is None else max(0.0, min(100.0, pct))
                if self.artifact_id is None and not create:
                    return
                if self.artifact_id is None:
                    self.artifact_id = client.create_artifact(ArtifactCreate(
                        type="progress", key=self.key, flow_run_id=self.flow_run_id, data=self.pct,
                        description=text)).id
                else:
                    client.update_artifact(self.artifact_id, ArtifactUpdate(data=self.pct, description=text))
        except Exception:  # noqa: BLE001 - progress is for the UI; the run goes on
            log.warning("could not update the progress artifact %s of flow run %s", self.key, self.flow_run_id,
                        exc_info=True)

    def finish(self, state_title: str, message: str, history: list[str] | None = None) -> None:
        """The run's final state: `Completed · ETT ...` at 100%; other states keep the progress.
        `history` (`ett.run_summary.progress_history`): what the run went through, kept below
        it as a list. A run that never showed progress (refused before it started) gets none now."""
        text = f"{state_title} · {message}" + ("\n\n" + "\n".join(f"- {line}" for line in history) if history else "")
        self.show(text, 100.0 if state_title == "Completed" else None, create=False)


class StepTail(SpoolTail):
    """`SpoolTail` that also keeps the furthest global step (the loop's `step` attribute)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step = 0

    def _take(self, rank: int, ev: PhaseEvent) -> None:
        super()._take(rank, ev)
        if ev.phase == TRAIN_STEP:
            self.step = max(self.step, (ev.info.step if ev.info.step is not None else -1) + 1)


def planned_steps(config) -> int | None:
    """Steps each rank runs from the start of the data (None if the data cannot be read).
    Reads the files' footers only (the stream index): the flow process imports no torch for it."""
    try:
        from ettflow.trainer.data.windows import StreamIndex, full_batches, split_windows

        train, _ = split_windows(config)
        index = StreamIndex(config.data_root, config.schema, train)
        steps = full_batches(index.total_rows, config.batch_size, config.world_size)
        return min(steps, config.max_steps) if config.max_steps else steps
    except Exception:  # noqa: BLE001 - progress is best effort; the trainer reports bad data
        return None


def startup_text(attempt: int, beats: Mapping[int, RankBeat | None], now: float) -> str:
    """What an attempt does before its first step, from its ranks' heartbeats: the phase the
    ranks entered last, for how long (`attempt 1 starting: checkpoint_restore for 3 s`), or
    that the rank processes are starting (no beat yet)."""
    entered = [(since, phase) for b in beats.values() if b is not None for phase, since in b.phases.items()]
    if not entered:
        return f"attempt {attempt} starting: launching the rank processes"
    since, phase = max(entered)
    if phase == "train_step":
        return f"attempt {attempt} starting: waiting for the first step"
    return f"attempt {attempt} starting: {phase} for {max(now - since, 0.0):.0f} s"


def step_text(step: int, total: int | None, attempt: int, loss: float | None, examples_per_s: float) -> str:
    """`step 12/60 (20%), attempt 0, loss 0.6931, 512 examples/s`."""
    pct = 100.0 * min(step / total, 1.0) if total else 0.0
    shown = "-" if loss is None else f"{loss:.4f}"
    return f"step {step}/{total or '?'} ({pct:.0f}%), attempt {attempt}, loss {shown}, {examples_per_s:.0f} examples/s"


def restart_text(failure: Failure | None, new_attempt: int) -> str:
    """`attempt 0 failed (infrastructure: rank 1 killed at step 16); attempt 1 restarts from the newest
    good copy`: what it restores is said once it trains (`restored_text`), not promised."""
    old = failure.attempt if failure is not None and failure.attempt is not None else new_attempt - 1
    why = failure.summary if failure is not None else "cause not recorded"
    return f"attempt {old} failed ({why}); attempt {new_attempt} restarts from the newest good copy"


def restored_text(events: list[PhaseEvent], attempt: int) -> str:
    """What `attempt` started from, read from its spool once it trains (pure): the step it
    restored and from where (the in-memory tier, the run's durable checkpoint, the parent
    anchor), each damaged checkpoint it skipped, or that no copy could be used (step 0)."""
    own = [e for e in events if e.attempt == attempt]
    restores = sorted((e for e in own if e.phase == "checkpoint_restore" and not e.info.error),
                      key=lambda e: (e.rank, e.start))
    skipped = sorted({e.info.damaged_step for e in own
                      if e.phase == CHECKPOINT_FALLBACK and e.info.damaged_step is not None})
    damage = (f"; damaged checkpoint(s) of step {', '.join(map(str, skipped))} skipped" if skipped else "")
    if not restores:
        return f"attempt {attempt} started from step 0: no copy of this run could be restored{damage}"
    first = restores[0]
    if first.info.source is RestoreSource.PARENT:
        return (f"attempt {attempt} started from step 0 on the parent refresh's anchor: no copy of this run could "
                f"be restored{damage}")
    where = "the in-memory copies" if first.info.source is RestoreSource.MEMORY else "the durable checkpoint"
    return f"attempt {attempt} restored step {first.info.step} from {where}{damage}"


class ProgressReporter:
    def __init__(self, plan, logger: logging.Logger | logging.LoggerAdapter, *, every_s: float = 3.0,
                 artifact: bool = True) -> None:
        self.plan, self.logger, self.every_s = plan, logger, every_s
        self.total = planned_steps(plan.trainer)
        self.progress = RunProgress(plan.run_id, plan.artifact_slug) if artifact else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tail: StepTail | None = None
        self._tail_attempt: int | None = None
        self._restart: str | None = None  # the last restart, said until the next attempt trains
        self._told: set[int] = set()  # attempts whose ending failure the log has said
        self._quiet_since = time.time()
        self._said: str | None = None  # the last progress line logged (the final report repeats it)

    def __enter__(self) -> ProgressReporter:
        self._show(f"attempt {self.plan.recorder.last_attempt()} starting", None)
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

    def _show(self, text: str, pct: float | None) -> None:
        if self.progress is not None:
            self.progress.show(text, pct)

    def poll(self) -> dict[str, Any]:
        attempt = self.plan.recorder.last_attempt()
        if self._tail is None or self._tail_attempt != attempt:
            if attempt > 0:  # a restart (also one that happened before the first look)
                self._announce_restart(attempt)
            self._tail = StepTail(self.plan.spool_root, self.plan.run_id, attempt, self.plan.trainer.world_size)
            self._tail_attempt = attempt
        self._tail.poll()
        return {"attempt": attempt, "step": self._tail.step, **self._tail.summary()}

    def _announce_restart(self, new: int) -> None:
        failures = self.plan.recorder.failures()
        earlier = [f for f in failures if f.attempt is not None and f.attempt < new]
        for f in earlier:  # each attempt's ending failure once: ettflow's words first, Ray's detail after
            if f.attempt not in self._told:
                self._told.add(f.attempt)
                self.logger.warning("%s", failure_line(f))
        self._restart = restart_text(earlier[-1] if earlier else None, new)
        self.logger.warning("%s", self._restart)
        self._quiet_since = time.time()  # just said: the "still starting" line waits its 30 s

    def report(self, final: bool = False, succeeded: bool = False) -> None:
        s = self.poll()
        if s["step"] == 0 and not final:
            now = time.time()
            text = startup_text(s["attempt"], self._tail.beats() if self._tail is not None else {}, now)
            if self._restart is not None:
                text = f"{self._restart}; {text}"
            self._show(text, None)
            if now - self._quiet_since >= 30.0:  # still starting: say so every 30 s (a short console)
                self._quiet_since = now
                self.logger.info("%s", text)
            return
        if self._restart is not None and s["step"] > 0:  # the restart trains: say what it really restored
            self.logger.info("%s", restored_text(self.plan.recorder.events(),
                                                 s["attempt"]))
            self._restart = None
        text = step_text(s["step"], self.total, s["attempt"], s["loss"], s["examples_per_s"])
        if text != self._said:
            self.logger.info("training: %s", text)
            self._said = text
        pct = 100.0 * min(s["step"] / self.total, 1.0) if self.total else None
        if final and not succeeded:
            text = f"training stopped at {text}"
        self._show(text, pct)
