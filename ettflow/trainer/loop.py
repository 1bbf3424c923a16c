"""The training loop of one rank: steps, scripted faults, periodic and anchor checkpoints.

Every step is recorded with the data cursor it started and ended at, its loss and examples,
so the metric can tell new data from replay and the driver can watch progress. The checkpoint
interval is `checkpoint_every_steps` when set; otherwise the first save is a probe at a tenth
of the job, and the interval after it comes from the metric core's optimizer, fed with the
measured save-blocking time and step time (the same on every rank: both are all-reduced).

A step whose loss is not finite ends the attempt before its backward pass, with a `numerics`
failure (see `numerics.py`); it is not recorded as a step. The scripted `nan` fault fills a
dense parameter with NaN just before its step, so that check fires at that step.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from ettflow.ett.checkpoint_interval import WasteModel, optimal_interval
from ettflow.ett.spool import SpoolWriter

from .config import FailAt, TrainerConfig
from .faults import due, fire
from .model import dense_parameters, sync_dense_grads
from .numerics import loss_failure, poison, stop
from .rank_state import RankState

log = logging.getLogger("ettflow.trainer")


class TrainLoop:
    def __init__(self, config: TrainerConfig, rank: int, attempt: int, state: RankState,
                 rec: SpoolWriter, evaluate) -> None:
        self.evaluate = evaluate
        self.config, self.rank, self.attempt, self.state, self.rec = config, rank, attempt, state, rec
        self.plugins = state.plugins
        self.dmp = state.dmp
        self.pg = state.pg
        self.device = state.device
        self.opt = state.dense_opt
        self.params = dense_parameters(self.dmp)
        compiled = state.compiled_step
        self.step_fn = compiled if compiled is not None else state.dense_step
        self.interval = config.checkpoint_every_steps
        self.interval_choice: dict[str, Any] = {}
        self.blocking: list[float] = []

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
        loss.backward()
        sync_dense_grads(self.params, self.pg)
        opt.step()
        return loss_value

    def _steps_total(self, start_step: int) -> int:
        available = self.state.data.num_batches(self.plugins.resume_cursor)
        end = start_step + available
        return min(end, self.config.max_steps) if self.config.max_steps else end

    def _choose_interval(self, end_step: int, step_times: list[float]) -> None:
        """After the probe save: the interval that minimizes expected wasted training."""
        measured = torch.tensor([max(self.blocking), sum(step_times) / max(len(step_times), 1)],
                                dtype=torch.float64)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=self.pg)
        csbt, step_s = float(measured[0]), max(float(measured[1]), 1e-6)
        model = WasteModel(job_s=max(end_step, 1) * step_s, save_blocking_s=csbt,
                           failures=self.config.expected_failures)
        choice = optimal_interval(model, min_interval_s=step_s)
        self.interval = max(1, round(choice.interval_s / step_s))
        self.interval_choice = {"interval_steps": self.interval, "interval_s": choice.interval_s,
                                "young_s": choice.young_s, "daly_s": choice.daly_s,
                                "expected_wasted_s": choice.expected_wasted_s,
                                "save_blocking_s": csbt, "step_s": step_s}

    def run(self) -> dict[str, Any]:
        step = self.plugins.resume_step
        end = self._steps_total(step)
        first = self.state.first_batch
        batches = self.state.batches
        probe_at = None if self.interval else step + max(1, (end - step) // 10)
        step_times: list[float] = []
        examples = 0
        t_train = time.time()
        last_cursor = None
        loss_value: float | None = None  # None: no step trained in this attempt
        while step < end:
            batch = first if first is not None else next(batches)
            first = None
            fault = due(self.config.failures, attempt=self.attempt, rank=self.rank, step=step)
            nan_fault = fault if fault is not None and fault.kind == "nan" else None
            if nan_fault is not None:
                poison(self.params)
            elif fault is not None:
                fire(fault, self.rec, step=step)
            t0 = time.time()
            loss_value = self.train_step(batch, step, fault=nan_fault)
            t1 = time.time()
            if self.config.record_steps:
                self.rec.record("train_step", t0, t1, sync=False, step=step, loss=loss_value, examples=batch.batch_size,
                                cursor_start=list(batch.cursor_start.as_tuple()),
                                cursor_end=list(batch.cursor_end.as_tuple()))
            step_times.append(t1 - t0)
            examples += batch.batch_size
            step += 1
            last_cursor = batch.cursor_end
            if self.rank == 0 and step % self.config.log_every == 0:
                rate = len(step_times) / max(time.time() - t_train, 1e-9)
                log.info("step %d/%d loss %.4f %.1f steps/s %.0f examples/s", step, end, loss_value,
                         rate, rate * batch.batch_size * self.config.world_size)
            due_save = (step == probe_at) or (self.interval and step % self.interval == 0)
            if due_save and step < end:
                self.blocking.append(self.plugins.save(step, last_cursor, loss=loss_value))
                if step == probe_at:
                    self._choose_interval(end, step_times)
        elapsed = max(time.time() - t_train, 1e-9)
        result: dict[str, Any] = {
            "rank": self.rank, "attempt": self.attempt, "final_step": step,
            "steps_this_attempt": len(step_times),
            "loss": loss_value if loss_value is not None else float("nan"),
            "steps_per_s": len(step_times) / elapsed, "examples_per_s": examples * self.config.world_size / elapsed,
            "cursor": last_cursor.to_dict() if last_cursor is not None else None,
            "checkpoint": {"saves": len(self.blocking), "blocking_s": self.blocking, **self.interval_choice},
        }
        with self.rec.span("anchor_checkpoint", step=step) as attrs:
            anchor = self.plugins.save_anchor(step, last_cursor, self.rec.run_id, loss=loss_value)
            attrs["path"] = result["anchor"] = str(anchor) if anchor else None
        if self.state.eval_data is not None and self.config.eval_batches > 0:
            with self.rec.span("evaluation") as attrs:
                result["eval"] = self.evaluate()
                attrs.update(result["eval"] or {})
        result["eval_start"] = self.state.eval_start
        result["compile"] = self.plugins.compile_report()
        return result

