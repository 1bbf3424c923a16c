"""A stop of the driver's process (SIGTERM), taken at the driver's next safe point.

While the driver watches its ranks, the main thread sits in Ray's `wait` (Cython). A Python
signal handler that raises there (Prefect's, which raises `TerminationSignal`) comes out of
Ray as `SystemError: <cyfunction CoreWorker.wait> returned a result with an exception set`:
the stop was taken for a bug in the training code (class `user`) and the run restarted. So,
for the time the driver runs, SIGTERM only notes the signal (`DeferredStop`), and the driver
raises `StopRequested` from its loop (`check`, after each poll), where its handling
(`driver._preempt`) and the caller's (the train task re-raises it as Prefect's own
termination) run as for any stop. Outside the driver, the process's handler stands.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType

log = logging.getLogger("ettflow.trainer")
_NOTED = False  # a stop of this process was noted (it stays noted: the process is going)


def note_stop() -> None:
    """This process was told to stop: a `DeferredStop` noted the signal, the driver preempts its
    ranks, or a task saw the stop."""
    global _NOTED
    _NOTED = True


def stop_noted() -> bool:
    """Whether this process was told to stop (even by a stop not raised yet): what the process
    asks of a cluster it is taking down with it can wait, and should not."""
    return _NOTED


def ask_stop_cause(stop_cause: Callable[[], str | None]) -> str | None:
    """Who stopped this process, when an operator did (a cancel: a sentence); None for a
    preemption, and when the question cannot be answered (no API): the stop is then a
    preemption, as before."""
    try:
        return stop_cause()
    except Exception:  # noqa: BLE001 - whoever cannot say is a preemption
        log.warning("could not tell who stopped this process", exc_info=True)
        return None


class StopRequested(BaseException):
    """The process was told to stop by `signal` (a number, as Prefect's `TerminationSignal`
    carries it: `classify.stop_signal` names it); never an error of the training code."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stop requested by {signal.Signals(signum).name}")
        self.signal = signum


class RunWithdrawn(Exception):
    """The run's work is no longer its own: a stop check (`TrainingDriver`'s `stop_check`)
    raises it when the run's claims on its windows went to another refresh while its process
    stood still (`tasks.claims_fence`). The driver stops the ranks at once. It is neither a
    failure of the training (no failure recorded, nothing spent of the budget: the stand-still
    that cost the claims is the run's failure, recorded by whoever took them) nor a preemption
    (no emergency checkpoint: what it would save is another refresh's to train). `cause`: why,
    as its owner said it (re-raised by the train task)."""

    def __init__(self, reason: str, cause: BaseException | None = None) -> None:
        super().__init__(reason)
        self.cause = cause

    def __reduce__(self):  # survives pickling with its cause
        return (type(self), (str(self), self.cause))


class DeferredStop:
    """Within the block, SIGTERM is noted instead of handled; `check()` raises it as
    `StopRequested`. The previous handler is put back on exit (and a stop noted but never
    checked is raised then). Outside the main thread nothing is installed: `check` is a no-op."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        self.signum = signum
        self.noted: int | None = None
        self._previous: signal.Handlers | object | None = None
        self._installed = False

    def _note(self, signum: int, _frame: FrameType | None) -> None:
        note_stop()
        self.noted = signum

    def check(self) -> None:
        if self.noted is not None:
            noted, self.noted = self.noted, None
            raise StopRequested(noted)

    def __enter__(self) -> DeferredStop:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(self.signum, self._note)
            self._installed = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._installed:
            signal.signal(self.signum, self._previous)  # type: ignore[arg-type]
            self._installed = False
        if exc_type is None:
            self.check()  # a stop that came as the block ended still stops the process
