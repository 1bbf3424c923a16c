"""Carrying out a scripted fault in this rank's process (`trainer/faults.py` says which are due
and what each does): a real SIGKILL, an exception, a hang, or a preemption through the rank's
own SIGTERM handling (`preemption.py`)."""

from __future__ import annotations

import os
import signal
import time

from ettflow.ett.spool import SpoolWriter
from ettflow.trainer.config import FailAt
from ettflow.trainer.faults import InjectedFailure, record_fired

from .preemption import PREEMPTION


def fire(fault: FailAt, recorder: SpoolWriter, *, step: int | None) -> None:
    """Carry out a fault at `step` (None: in its init stage). `kill` and `hang` never return;
    `raise` raises; `preempt` sends SIGTERM to this process and returns once it was handled."""
    if fault.kind in ("nan", "corrupt"):
        raise ValueError(f"the {fault.kind} fault is carried out by the training loop, not by fire()")
    if fault.kind == "preempt":
        PREEMPTION.fault_index = fault.index
        os.kill(os.getpid(), signal.SIGTERM)
        PREEMPTION.wait(5.0)  # delivered to the main thread asynchronously
        return
    failure = record_fired(fault, recorder, rank=recorder.rank, step=step)
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # the signal is delivered asynchronously
    if fault.kind == "raise":
        raise InjectedFailure(failure)
    while True:  # hang: stop making progress until the watchdog kills this process
        time.sleep(1)
