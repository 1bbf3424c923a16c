"""The training loop of one rank: steps, scripted faults, periodic and anchor checkpoints.

Every step is recorded with the data cursor it started and ended at, its loss and examples,
so the metric can tell new data from replay and the driver can watch progress. The checkpoint
interval is `checkpoint_every_steps` when set (by the refresh's plan, from the model's history:
`ett.interval_plan`); otherwise the first save is a probe at a tenth of the job, and the interval
after it comes from the metric core's optimizer, fed with the measured save-blocking time and
step time (the same on every rank: both are all-reduced) and the failure rate of the config
(`failure_rate_per_s`, else `expected_failures` per job).

A step whose loss is not finite ends the attempt before its backward pass, with a `numerics`
failure (see `numerics.py`); it is not recorded as a step. The scripted `nan` fault fills a
dense parameter with NaN just before its step, so that check fires at that step.

Every step boundary (before a step is trained) is also where the ranks agree on preemption
(`preemption.py`): one all-reduce of a "stop" flag, so all ranks stop at the same boundary
and can take the emergency checkpoint together. The loop tells the rank's heartbeat where it
is (training start, each step's start and end, saves), so the driver's watchdog can bound a
hang inside or between steps, and in a save (`rank_heartbeat.py`).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

from ettflow.ett.checkpoint_interval import WasteModel, optimal_interval
from ettflow.ett.checkpoint_tier import CheckpointTier
from ettflow.ett.events import DATA_STALL, FAULT_INJECTED
from ettflow.ett.failures import Failure, FailureClass, FailureError
from ettflow.ett.spool import SpoolWriter
from ettflow.trainer.compile.process_cache import apply_compile_settings
from ettflow.trainer.config import FailAt, TrainerConfig
from ettflow.trainer.data.prefetch import found_ready
from ettflow.trainer.faults import due
from ettflow.trainer.model import dense_parameters
from ettflow.trainer.protocol import CheckpointReport, Evaluation, IntervalChoice, MemoryIntervalChoice, RankResult
from ettflow.trainer.rank.fault_fire import fire
from ettflow.trainer.rank.numerics import loss_failure, poison, stop
from ettflow.trainer.rank.preemption import PREEMPTION, StopDecision
from ettflow.trainer.rank.rank_state import RankState
from ettflow.trainer.rank.step_clock import Fetch, resume_after
from ettflow.trainer.rank_heartbeat import SAVE, RankHeartbeat

log = logging.getLogger("ettflow.trainer")
MEMORY_PROBE_STEPS = 5  # steps measured before the in-memory tier's interval is chosen
MEMORY_BACKGROUND_SHARE = 0.1  # the most of the time between two in-memory copies their background work may take


@dataclass
class TierSchedule:
    """One checkpoint tier's schedule in the loop: its interval in steps (None: not chosen yet),
    the choice that set it (the optimizer's, after its probe), and each save's blocking seconds."""

    tier: CheckpointTier
    interval: int | None = None
    choice: IntervalChoice | MemoryIntervalChoice | None = None
    blocking: list[float] = field(default_factory=list)

    def due(self, step: int) -> bool:
        """Whether a save of this tier is due after `step` steps."""
        return bool(self.interval) and step % self.interval == 0


class TrainLoop:
    def __init__(self, config: TrainerConfig, rank: int, attempt: int, state: RankState,
                 rec: SpoolWriter, evaluate: Callable[[], Evaluation | None], *,
                 beat: RankHeartbeat | None = None) -> None:
        self.evaluate = evaluate
        self.beat = beat
        self.saved_step: int | None = None  # the last step this attempt saved a checkpoint at
        self.config, self.rank, self.attempt, self.state, self.rec = config, rank, attempt, state, rec
        self.checkpointing = state.checkpointing
        self.dmp = state.dmp
        self.groups = state.groups
        self.device = state.device
        self.opt = state.dense_opt
        self.params = dense_parameters(self.dmp)
        compiled = state.compiled_step
        self.step_fn = compiled if compiled is not None else state.dense_step
        if compiled is not None:  # a recompile in this thread compiles as the step's compile did
            apply_compile_settings(config)
        # each tier's schedule: durable saves (configured, else chosen after the probe save) and
        # in-memory copies (configured, else chosen after a few steps)
        self.durable = TierSchedule(tier=CheckpointTier.DURABLE, interval=config.checkpoint_every_steps)
        self.memory = TierSchedule(tier=CheckpointTier.MEMORY, interval=config.memory_every_steps)

    def train_step(self, batch, step: int, *, fault: FailAt | None = None) -> float:
        """One step; returns its loss. A non-finite loss raises a `numerics` FailureError
        before anything is updated (`fault`: the scripted `nan` item that caused it)."""
        batch = batch.to(self.device, non_blocking=True)
        opt = self.opt
        opt.zero_grad(set_to_none=True)
        embedded = self.dmp.module.sparse_arch(batch.sparse)  # sharded lookup; fused update in backward
        loss, _ = self.step_fn(batch.dense, embedded, batch.labels)
        loss_value = float(loss.detach())  # the step's one host sync, taken before the update
        failure = loss_failure(loss_value, rank=self.rank, step=step, injected=fault is not None)
        if failure is not None:  # nothing of this step is applied, and it is not recorded
            stop(self.rec, failure, **({"fault_index": fault.index} if fault is not None else {}))
        self.checkpointing.wait_staged()  # the sparse tables change in backward: a save's staging ends first
        loss.backward()
        self.groups.training.average_grads(self.params)
        opt.step()
        return loss_value

    def _steps_total(self, start_step: int) -> int:
        available = self.state.data.num_batches(self.checkpointing.resume_cursor)
        end = start_step + available
        return min(end, self.config.max_steps) if self.config.max_steps else end

    def _optimize(self, end_step: int, step_times: list[float], blocking: list[float], *,
                  background_s: float | None = 0.0):
        """The optimizer's interval for a save whose measured blocking is `blocking` (the same on
        every rank: the blocking, the mean step time and `background_s` are all-reduced), never
        shorter than a step nor than its background work allows (MEMORY_BACKGROUND_SHARE).
        Returns (choice, waste model, blocking s, step s, background s, shortest interval s), or
        None when `background_s` is None on any rank (its background work is still running)."""
        measured = self.groups.control.max_of([max(blocking), sum(step_times) / max(len(step_times), 1),
                                               background_s or 0.0, 1.0 if background_s is None else 0.0])
        if measured[3] > 0:
            return None
        csbt, step_s, background = measured[0], max(measured[1], 1e-6), measured[2]
        rate = self.config.failure_rate_per_s  # the model's history; else a guess per job
        model = WasteModel(job_s=max(end_step, 1) * step_s, save_blocking_s=csbt,
                           **({"failure_rate_per_s": rate} if rate is not None
                              else {"failures": self.config.expected_failures}))
        # background work (a copy's checksum and hand-off) shares the host with the steps: at most
        # MEMORY_BACKGROUND_SHARE of the time between two saves, so it never crowds them out
        floor_s = max(step_s, background / MEMORY_BACKGROUND_SHARE)
        return optimal_interval(model, min_interval_s=floor_s), model, csbt, step_s, background, floor_s

    def _choose_interval(self, end_step: int, step_times: list[float]) -> None:
        """After the probe save: the interval that minimizes expected wasted training."""
        choice, model, csbt, step_s, _, _ = self._optimize(end_step, step_times, self.durable.blocking)
        self.durable.interval = max(1, round(choice.interval_s / step_s))
        self.durable.choice = IntervalChoice(interval_steps=self.durable.interval, interval_s=choice.interval_s,
                                             young_s=choice.young_s, daly_s=choice.daly_s,
                                             expected_wasted_s=choice.expected_wasted_s, save_blocking_s=csbt,
                                             step_s=step_s, expected_failures=model.expected_failures)

    def _choose_memory_interval(self, end_step: int, step_times: list[float]) -> bool:
        """The in-memory tier's interval: the optimizer's, fed with the measured blocking of a
        memory copy instead of a durable save's, and no shorter than its background work allows.
        False: a rank's copy is still in flight, so its background time is not known yet (the
        ranks agree to try again after the next step; nothing waits for it)."""
        chosen = self._optimize(end_step, step_times, self.memory.blocking,
                                background_s=self.checkpointing.background_s(CheckpointTier.MEMORY))
        if chosen is None:
            return False
        choice, _, csbt, step_s, background, floor_s = chosen
        self.memory.interval = max(1, round(max(choice.interval_s, floor_s) / step_s))
        self.memory.choice = MemoryIntervalChoice(interval_steps=self.memory.interval, save_blocking_s=csbt,
                                                  background_s=background, expected_wasted_s=choice.expected_wasted_s)
        return True

    def _save_memory(self, step: int, cursor) -> None:
        self.memory.blocking.append(self.checkpointing.save(CheckpointTier.MEMORY, step, cursor,
                                                            since=self.rec.recorded_until))

    def _phase(self, name: str):
        return self.beat.phase(name) if self.beat is not None else nullcontext()

    def _save(self, step: int, cursor, loss: float | None) -> float:
        """A periodic save the loop waits for; the heartbeat leaves training for its duration."""
        if self.beat is not None:
            self.beat.leave("train_step")
        try:
            with self._phase(SAVE):
                blocking = self.checkpointing.save(CheckpointTier.DURABLE, step, cursor, loss=loss,
                                                   since=self.rec.recorded_until)
        finally:
            if self.beat is not None:
                self.beat.step_ended(step - 1)  # the training clock restarts after the save
        self.saved_step = step
        return blocking

    def _stop_preempted(self, step: int, cursor, loss: float | None, decision: StopDecision) -> None:
        """Every rank stops at this boundary: the emergency checkpoint when the grace allows it
        (all ranks save together), then the signalled rank's marker, and the attempt ends."""
        saved = None
        if self.beat is not None:
            self.beat.leave("train_step")  # the save has its own bound
        if decision.save and cursor is not None and step != self.saved_step:
            with self._phase(SAVE):
                self.durable.blocking.append(self.checkpointing.save(CheckpointTier.DURABLE, step, cursor, loss=loss))
                self.checkpointing.durable.wait()  # durable and committed on every rank
            saved = step
        elif decision.save and step == self.saved_step:
            # the periodic save of this very step serves (CI saw the stop land right after one, and no
            # emergency save was needed); it may still be committing in the background: durable first
            with self._phase(SAVE):
                self.checkpointing.durable.wait()
            saved = step
        self.groups.control.barrier()  # nobody reports before every rank's part of the save is done
        if PREEMPTION.signalled:
            log.warning("preempted at step %d: emergency checkpoint %s (grace left %.1f s)", step,
                        "taken" if saved is not None else "skipped", decision.grace_left_s)
            failure = PREEMPTION.mark(self.rank, self.attempt, step, emergency_checkpoint=saved,
                                      grace_left_s=round(min(decision.grace_left_s, 1e9), 3))
        else:
            failure = Failure(failure_class=FailureClass.PREEMPTION, rank=self.rank, attempt=self.attempt,
                              step=step, secondary=True,
                              reason=f"rank {self.rank} stopped at step {step}: a peer was preempted")
        raise FailureError(failure)

    def run(self) -> RankResult:
        PREEMPTION.in_loop = True
        try:
            return self._run()
        finally:
            PREEMPTION.in_loop = False

    def _run(self) -> RankResult:
        step = self.checkpointing.resume_step
        end = self._steps_total(step)
        first = self.state.first_batch
        batches = self.state.batches
        probe_at = None if self.durable.interval else step + max(1, (end - step) // 10)
        step_times: list[float] = []
        examples = 0
        t_train = time.time()
        last_cursor = None
        loss_value: float | None = None  # None: no step trained in this attempt
        memory = self.checkpointing.tier(CheckpointTier.MEMORY) is not None  # this rank has the in-memory tier
        if memory:  # a restore point from the start: a live recovery never lacks one
            self._save_memory(step, self.checkpointing.resume_cursor)
        memory_probe_at = step + MEMORY_PROBE_STEPS if memory and self.memory.interval is None else None
        if self.beat is not None:
            self.beat.training(step)
        # where the next step's interval starts (`step_clock`: no gap between steps); after the
        # memory copy of the start it starts where that ended
        since = self.rec.recorded_until if memory and self.rec.recorded_until else time.time()
        record_s = 0.0
        while step < end:
            fetch_start = time.time()
            batch = first if first is not None else next(batches)
            fetch = Fetch(since=min(since, fetch_start), fetch_start=fetch_start, ready=max(time.time(), fetch_start),
                          batch_was_ready=first is not None or found_ready(batches))
            first = None
            fault = due(self.config.failures, attempt=self.attempt, rank=self.rank, step=step)
            nan_fault = fault if fault is not None and fault.kind == "nan" else None
            if nan_fault is not None:
                poison(self.params)
            elif fault is not None and fault.kind == "corrupt":
                self.checkpointing.corrupt_memory()
                self.rec.mark(FAULT_INJECTED, kind="corrupt", step=step, fault_index=fault.index)
            elif fault is not None:
                fire(fault, self.rec, step=step)
            if self.beat is not None:  # from here the rank waits for its peers: it is inside the step
                self.beat.step_started(step)
            decision = PREEMPTION.agree(self.groups.control)
            if decision.stop:
                self._stop_preempted(step, last_cursor, loss_value, decision)
            t0 = fetch.step_start  # the step owns its fetch (unless stalled), heartbeat and agreement
            loss_value = self.train_step(batch, step, fault=nan_fault)
            t1 = since = time.time()
            if self.beat is not None:
                self.beat.step_ended(step)
            if self.config.record_steps:
                r0 = time.perf_counter()
                if fetch.stalled:
                    self.rec.record(DATA_STALL, fetch.since, fetch.ready, sync=False, step=step,
                                    wait_s=fetch.wait_s)
                self.rec.record("train_step", t0, t1, sync=False, step=step, loss=loss_value, examples=batch.batch_size,
                                cursor_start=list(batch.cursor_start.as_tuple()),
                                cursor_end=list(batch.cursor_end.as_tuple()))
                record_s += time.perf_counter() - r0  # what recording costs the training thread
            step_times.append(t1 - t0)
            examples += batch.batch_size
            step += 1
            last_cursor = batch.cursor_end
            if self.rank == 0 and step % self.config.log_every == 0:
                rate = len(step_times) / max(time.time() - t_train, 1e-9)
                log.info("step %d/%d loss %.4f %.1f steps/s %.0f examples/s", step, end, loss_value,
                         rate, rate * batch.batch_size * self.config.world_size)
            due_save = step == probe_at or self.durable.due(step)
            if memory and step < end:
                if due_save or self.memory.due(step):
                    self._save_memory(step, last_cursor)
                if step == memory_probe_at and not self._choose_memory_interval(end, step_times):
                    memory_probe_at += 1  # (after the save: its all-reduce is the next step's)
            if due_save and step < end:
                self.durable.blocking.append(self._save(step, last_cursor, loss_value))
                if step == probe_at:
                    self._choose_interval(end, step_times)
            since = resume_after(t1, self.rec.recorded_until)  # after a save: at its end, never inside it
        elapsed = max(time.time() - t_train, 1e-9)
        PREEMPTION.in_loop = False  # from here a SIGTERM ends the process (no step boundary is left)
        if self.beat is not None:
            self.beat.leave("train_step")
        with self.rec.span("anchor_checkpoint", step=step) as attrs, self._phase(SAVE):
            anchor = self.checkpointing.save_anchor(step, last_cursor, self.rec.run_id, loss=loss_value)
            handoff = self.checkpointing.handoff
            attrs.update(path=str(anchor) if anchor else None,
                         **({"handed_off": True, "bytes": handoff.nbytes} if handoff is not None else {}))
        evaluation = None
        if self.state.eval_data is not None and self.config.eval_batches > 0:
            with self.rec.span("evaluation") as attrs, self._phase("evaluation"):
                evaluation = self.evaluate()
                attrs.update(evaluation.spool_attrs() if evaluation is not None else {})
        return RankResult(
            rank=self.rank, attempt=self.attempt, final_step=step, steps_this_attempt=len(step_times),
            loss=loss_value if loss_value is not None else float("nan"),
            steps_per_s=len(step_times) / elapsed, examples_per_s=examples * self.config.world_size / elapsed,
            step_s_median=statistics.median(step_times) if step_times else None,  # fetch to end of a step
            record_s=record_s,  # time in the step events' record calls
            checkpoint=CheckpointReport(blocking_s=tuple(self.durable.blocking),
                                        memory_blocking_s=tuple(self.memory.blocking), interval=self.durable.choice,
                                        memory_interval=self.memory.choice),
            compile=self.state.compiler.report(), anchor=str(anchor) if anchor else None,
            anchor_handoff=self.checkpointing.handoff, eval=evaluation, eval_start=self.state.eval_start,
            trained_from=t_train)

