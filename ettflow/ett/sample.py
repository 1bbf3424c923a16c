"""A sample refresh timeline, written through the real spool, for `ettflow sample`.

It lets a new user see `ettflow report` before any trainer ran: a job that queues, initializes
sequentially, compiles, trains with periodic checkpoints, is killed once, recovers (replaying
from its last checkpoint) and shuts down. Durations are drawn around the given means with a
seeded jitter, so every sample run is different but reproducible. The run is tagged sample.
"""

from __future__ import annotations

import random
from pathlib import Path

from .events import INIT_STAGES, SUBMITTED
from .spool import SpoolWriter

MEAN_S = {
    "scheduling": 40.0, "device_init": 6.0, "process_group_init": 9.0, "preproc_creation": 4.0,
    "train_module_creation": 25.0, "init_plugins": 3.0, "pre_train": 5.0,
    "get_first_batch_data": 30.0, "pt2_compile": 120.0, "checkpoint_restore": 15.0,
    "checkpoint_save_blocking": 12.0, "step": 2.0, "shutdown": 60.0, "detect": 20.0,
}


def write_sample_run(spool_root: Path | str, run_id: str, *, seed: int = 0, steps: int = 600,
                     checkpoint_every: int = 100, fail_at_step: int | None = 430,
                     start: float = 1_700_000_000.0) -> None:
    rng = random.Random(seed)

    def d(name: str) -> float:
        return MEAN_S[name] * rng.uniform(0.8, 1.2)

    t = start
    attempt, step = 0, 0
    saved_step = 0
    driver = SpoolWriter(spool_root, run_id, attempt, -1)
    driver.mark(SUBMITTED, t)
    while True:
        rank0 = SpoolWriter(spool_root, run_id, attempt, 0)
        t0, t = t, t + d("scheduling")
        driver.record("scheduling", t0, t)
        for stage in INIT_STAGES:
            t0, t = t, t + d(stage)
            rank0.record(stage, t0, t)
        if attempt > 0:
            t0, t = t, t + d("checkpoint_restore")
            rank0.record("checkpoint_restore", t0, t, step=saved_step)
        t0, t = t, t + d("pt2_compile")
        rank0.record("pt2_compile", t0, t)
        step = saved_step
        failed = False
        while step < steps:
            t0, t = t, t + d("step")
            rank0.record("train_step", t0, t, step=step, cursor_start=step, cursor_end=step + 1)
            step += 1
            if attempt == 0 and fail_at_step is not None and step == fail_at_step:
                t += d("step") / 2  # killed mid-step
                driver.mark("failure", t, failure_class="infrastructure", reason="sample kill of rank 0")
                t += d("detect")
                driver.mark("failure_detected", t, failure_class="infrastructure")
                failed = True
                break
            if step % checkpoint_every == 0 and step < steps:
                t0, t = t, t + d("checkpoint_save_blocking")
                rank0.record("checkpoint_save_blocking", t0, t, step=step)
                saved_step = step
        t0, t = t, t + d("shutdown")
        driver.record("shutdown", t0, t, failed=failed)
        rank0.close()
        if not failed:
            break
        attempt += 1
        driver.close()
        driver = SpoolWriter(spool_root, run_id, attempt, -1)
    driver.close()
