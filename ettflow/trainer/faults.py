"""Scripted faults inside a rank: a real SIGKILL, an exception, or a hang, at a given step.

The rank records the `failure` marker (durably, through the spool) at the instant the fault
fires, so lost in-flight work is measured from a known time. Faults scripted by time
(`FailAt.after_s`) are sent by the driver, which kills the rank's process from outside.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence

from ettflow.ett.spool import SpoolWriter

from .config import FailAt


class InjectedFailure(RuntimeError):
    """Raised by a scripted `raise` fault: stands for a bug in model or data code."""


def due(failures: Sequence[FailAt], *, attempt: int, rank: int, step: int) -> FailAt | None:
    for f in failures:
        if f.step == step and f.rank == rank and f.attempt == attempt:
            return f
    return None


def fire(fault: FailAt, recorder: SpoolWriter, *, step: int) -> None:
    """Carry out a fault at `step`. `kill` and `hang` never return."""
    klass = "user" if fault.kind == "raise" else "infrastructure"
    recorder.mark("failure", failure_class=klass, reason=f"injected {fault.kind} at step {step}",
                  failed_rank=recorder.rank, injected=True)
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # the signal is delivered asynchronously
    if fault.kind == "raise":
        raise InjectedFailure(f"injected failure at step {step} on rank {recorder.rank}")
    while True:  # hang: stop making progress until the watchdog kills this process
        time.sleep(1)
