"""Preemption: SIGTERM to a rank ends its attempt as a `preemption` failure, with an emergency
checkpoint when the grace period allows.

The handler is installed by the actor's constructor, which Ray runs in the worker process's
main thread (the only thread that may install one), replacing Ray's own (which exits the
worker at once). The handler only notes the time and sets an event; the work is done by the
training thread and by a watcher thread:

- In the training loop, every step ends with a one-element all-reduce of "stop" (`agree`):
  all ranks stop at the same step boundary, so a checkpoint save, a collective, can be taken
  even when one rank only got SIGTERM. The save is taken when at least half the grace period
  is left on every signalled rank (its durable time is not known ahead: half the grace is the
  stated margin) and the step was not saved yet. Then the signalled rank records its
  `failure` marker (class preemption, placed at the signal, with `emergency_checkpoint`) and
  every rank ends the attempt: the signalled one with its preemption failure, the others
  with a secondary one (they stopped because of it).
- Outside the loop (init, the anchor save, evaluation), or when the loop does not reach a step
  boundary within the grace period (a peer is hung), the watcher thread records the marker
  and exits the process: no checkpoint, Ray reports the process's loss, the marker its class.
- After the rank's session ended (`detach`), SIGTERM only exits the process: it is the end of
  the group, not a preemption. The driver's teardown SIGKILLs local ranks before `ray.kill`
  (`ray_group.py`), so its own stop is never taken for a preemption.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

from ettflow.ett.events import FAILURE
from ettflow.ett.failures import Failure, FailureClass
from ettflow.ett.spool import SpoolWriter
from ettflow.trainer.collectives import Group

log = logging.getLogger("ettflow.trainer")
EXIT_CODE = 128 + signal.SIGTERM
SAVE_GRACE_SHARE = 0.5  # the emergency save is taken with at least this share of the grace left
_NOT_SIGNALLED = 1e18  # a rank without SIGTERM: "infinite" grace left in the all-reduce


@dataclass(frozen=True)
class StopDecision:
    """What the ranks agreed at a step boundary: stop (someone was preempted), and whether
    an emergency checkpoint fits (`grace_left_s`: the least grace left on a signalled rank)."""

    stop: bool
    grace_left_s: float = float("inf")
    save: bool = False


class PreemptionSignal:
    """The process's SIGTERM state: one per process (the handler is process-wide)."""

    def __init__(self) -> None:
        self.signalled_at: float | None = None
        self.fault_index: int | None = None  # the scripted `preempt` item that sent it
        self.grace_s = 30.0
        self.in_loop = False
        self._event = threading.Event()
        self._rec: SpoolWriter | None = None
        self._marked = False
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    def install(self, grace_s: float) -> bool:
        """Install the handler (main thread only; False elsewhere) and start the watcher."""
        self.grace_s = grace_s
        if threading.current_thread() is not threading.main_thread():
            log.warning("SIGTERM handler not installed: not in the main thread; preemption ends the process")
            return False
        signal.signal(signal.SIGTERM, self._handler)
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="ettflow-preemption", daemon=True)
            self._watcher.start()
        return True

    def attach(self, rec: SpoolWriter) -> None:
        """The rank's spool writer: where the `failure` marker goes."""
        self._rec = rec

    def detach(self, rec: SpoolWriter) -> None:
        """The rank's session ended: a SIGTERM from now on only ends the process (no marker)."""
        with self._lock:
            if self._rec is rec:
                self._rec = None

    @property
    def signalled(self) -> bool:
        return self.signalled_at is not None

    def grace_left(self, now: float | None = None) -> float:
        if self.signalled_at is None:
            return float("inf")
        return self.grace_s - ((time.time() if now is None else now) - self.signalled_at)

    def wait(self, timeout_s: float) -> bool:
        return self._event.wait(timeout_s)

    def _handler(self, signum, frame) -> None:  # noqa: ARG002 - the signal API
        if self.signalled_at is None:
            self.signalled_at = time.time()
        self._event.set()

    # ---- decisions and records --------------------------------------------------------
    def agree(self, control: Group) -> StopDecision:
        """Every rank's "stop?" at a step boundary, on the control group (a collective: every
        rank calls it; CPU values, no device sync)."""
        flag, neg_left = control.max_of([1.0 if self.signalled else 0.0,
                                         -self.grace_left() if self.signalled else -_NOT_SIGNALLED])
        stop, left = flag > 0, -neg_left
        return StopDecision(stop=stop, grace_left_s=left, save=stop and left >= SAVE_GRACE_SHARE * self.grace_s)

    def failure(self, rank: int, attempt: int, step: int | None) -> Failure:
        at = f"at step {step}" if step is not None else "outside training steps"
        return Failure(failure_class=FailureClass.PREEMPTION, rank=rank, attempt=attempt, step=step,
                       reason=f"rank {rank} preempted (SIGTERM) {at}", injected=self.fault_index is not None)

    def mark(self, rank: int, attempt: int, step: int | None, **extra) -> Failure:
        """Record the `failure` marker (once), placed at the signal."""
        failure = self.failure(rank, attempt, step)
        with self._lock:
            if self._marked or self._rec is None:
                return failure
            self._marked = True
            if self.fault_index is not None:
                extra["fault_index"] = self.fault_index
            self._rec.mark(FAILURE, self.signalled_at, **failure.to_attrs(), **extra)
        return failure

    def _watch(self) -> None:
        self._event.wait()
        deadline = (self.signalled_at or time.time()) + self.grace_s
        while self.in_loop and time.time() < deadline:
            time.sleep(0.05)  # the loop stops at its next step boundary and ends the attempt itself
        if self.in_loop or not self._marked:
            rec = self._rec
            if rec is not None:
                log.warning("rank %d preempted outside a step boundary: exiting without a checkpoint", rec.rank)
                try:
                    self.mark(rec.rank, rec.attempt, None, emergency_checkpoint=None)
                    rec.close()
                except Exception:  # noqa: BLE001 - exit all the same: the scheduler takes the devices
                    log.exception("the preemption marker of rank %d was not recorded", rec.rank)
            os._exit(EXIT_CODE)
        # the loop handled it: the attempt ends and the driver releases the process


PREEMPTION = PreemptionSignal()
