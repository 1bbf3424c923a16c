"""The training run's claims fence: a run taken for dead while it stood still stops training.

A run's flow process that stands still past its heartbeat's bound (a SIGSTOP, a paused VM,
heavy swapping) may be taken for dead by a refresh waiting on its windows: that one archives it
as crashed and claims the windows (`tasks.claims`). When the process resumes, its ranks (other
processes) may still be training. Its publish would be refused (`ett.lineage`'s fence), but
until then it would hold its devices for windows that are another refresh's to train.

`ClaimsFence.check` is the driver's stop check beside the SIGTERM one (`train`). It costs
nothing while the run's heartbeat has no lapse (`ett.heartbeat.RunHeartbeat.lapse`). After one,
it asks the warehouse whether the run still holds its claims (`lineage.claims_lost`), in a
thread of its own, so the driver's polls (failure and hang detection) never wait on the
warehouse; `check` acts on the answer at the poll after it came:

- lost: it raises `RunWithdrawn` carrying the `ClaimsLost`; the driver tears the ranks down at
  once, with nothing saved and no failure recorded (`TrainingDriver._withdraw`), and the train
  task raises the `ClaimsLost`: the run ends failed as when its publish is refused;
- held: asked again every `RETRY_S` until `SETTLE_S` after the lapse was seen, and only a
  "held" asked that late clears it: the refresh that found the run dead may still be archiving
  it (its whole spool read) before it releases the claims and takes them;
- no answer (the warehouse unreachable, or any other error): training goes on, it asks again
  `RETRY_S` later, and the publish's fence decides in the end.

Ranks that finished while the process stood still leave no poll to act at: `after_training`
asks once more, and waits, before the anchor goes on to be published.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from ettflow.ett.heartbeat import Lapse
from ettflow.ett.lineage import ClaimsLost
from ettflow.ett.redact import scrub_urls
from ettflow.trainer.group.stop_request import RunWithdrawn

RETRY_S = 5.0  # between two questions after a lapse
SETTLE_S = 30.0  # a "held" asked this long after the lapse was seen clears it

log = logging.getLogger("ettflow.tasks")

# (asked at, on the fence's clock; what came back: a ClaimsLost, None for held, or why there is no
# answer, in words with no secret, made in the question's thread)
Answer = tuple[float, ClaimsLost | str | None]


class Lapsing(Protocol):
    """What the fence reads of the run's heartbeat (`RunHeartbeat`)."""

    @property
    def lapse(self) -> Lapse | None: ...

    def clear(self, lapse: Lapse) -> None: ...


def in_thread(question: Callable[[], None]) -> None:
    threading.Thread(target=question, name="ettflow-claims-fence", daemon=True).start()


def _described(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {scrub_urls(str(exc))}"


class ClaimsFence:
    """`check()` raises `RunWithdrawn` once the run's claims are found lost after a lapse of
    its heartbeat (see the module). `holds()`: why the run holds no claim now, or None when it
    holds one. `ask(question)`: runs the question (default: in a thread of its own; a test's runs
    it at once). `describe`: an error's words for the log, no secret in them. `log`: the run's."""

    def __init__(self, beat: Lapsing, holds: Callable[[], ClaimsLost | None], *, log: Any = log,
                 clock: Callable[[], float] = time.monotonic, retry_s: float = RETRY_S, settle_s: float = SETTLE_S,
                 ask: Callable[[Callable[[], None]], None] = in_thread,
                 describe: Callable[[BaseException], str] = _described) -> None:
        self.beat, self.holds, self.log, self.clock = beat, holds, log, clock
        self.retry_s, self.settle_s, self.ask, self.describe = retry_s, settle_s, ask, describe
        self._lock = threading.Lock()
        self._answer: Answer | None = None
        self._asking = False
        self._next_ask = float("-inf")
        self._since: float | None = None  # when this lapse was first seen (the fence's clock)
        self._until: float | None = None  # and its end then
        self._warned = False

    def check(self) -> None:
        lapse = self.beat.lapse
        if lapse is None:
            return
        now = self.clock()
        if self._since is None or lapse.until != self._until:  # a new lapse, or this one extended: settle anew
            self._since, self._until = now, lapse.until
        with self._lock:
            due = not self._asking and now >= self._next_ask
            if due:
                self._asking, self._next_ask = True, now + self.retry_s
        if due:
            try:
                self.ask(lambda: self._question(now))
            except Exception as exc:  # noqa: BLE001 - no thread to ask in (the process is out of them): no answer
                with self._lock:
                    self._asking, self._answer = False, (now, f"the question could not start: {self.describe(exc)}")
        with self._lock:
            answer, self._answer = self._answer, None
        if answer is not None:
            self._act(lapse, *answer)

    def after_training(self) -> None:
        """Once the driver is done (the ranks may have finished while the process stood still, so
        no poll came after the lapse): with a lapse not cleared, ask now and wait for the answer;
        lost: raise the `ClaimsLost` before the anchor is published. "Held" or no answer: the
        publish's fence decides."""
        lapse = self.beat.lapse
        if lapse is None:
            return
        try:
            result = self.holds()
        except Exception as exc:  # noqa: BLE001 - no answer: the publish's fence decides
            self.log.warning("this run's heartbeat lapsed for %.1f s (its process stood still): whether it still "
                             "holds its claims cannot be asked now (%s); the publish decides", lapse.seconds,
                             self.describe(exc))
            return
        if result is not None:
            self.log.warning("this run's heartbeat lapsed for %.1f s (its process stood still) and it was taken for "
                             "dead: %s. Its anchor is not published", lapse.seconds, result)
            raise result

    def _question(self, asked_at: float) -> None:
        result: ClaimsLost | str | None = "no answer"
        try:
            result = self.holds()
        except Exception as exc:  # noqa: BLE001 - no answer: training goes on, the publish's fence decides
            result = self.describe(exc)  # here, off the driver's thread: the words may need the Prefect API
        finally:  # whatever ended the question (even a BaseException), the next one may be asked
            with self._lock:
                self._answer, self._asking = (asked_at, result), False

    def _act(self, lapse: Lapse, asked_at: float, result: ClaimsLost | str | None) -> None:
        if isinstance(result, ClaimsLost):
            self.log.warning("this run's heartbeat lapsed for %.1f s (its process stood still) and it was taken for "
                             "dead: %s. Its ranks are stopped now", lapse.seconds, result)
            raise RunWithdrawn(f"stood still {lapse.seconds:.1f} s and lost its claims: {result}", cause=result)
        if isinstance(result, str):
            if not self._warned:
                self.log.warning("this run's heartbeat lapsed for %.1f s (its process stood still): whether it still "
                                 "holds its claims cannot be asked now (%s); training goes on, asked again every "
                                 "%.0f s, and the publish decides", lapse.seconds, result, self.retry_s)
                self._warned = True
            return
        if self._since is not None and asked_at - self._since >= self.settle_s:
            self.beat.clear(lapse)
            self._since, self._warned = None, False
            self.log.info("this run's heartbeat lapsed for %.1f s (its process stood still); it still holds its "
                          "claims: training goes on", lapse.seconds)


def fence_for(plan: Any, beat: Lapsing, log: Any, **timing: float) -> ClaimsFence:
    """The fence of the refresh `plan` (a `RefreshPlan`), asking its warehouse; `timing`:
    `retry_s`, `settle_s` (a test's shorter ones)."""
    from ettflow.ett import lineage
    from ettflow.ett.warehouse import Warehouse
    from ettflow.ett.warehouse_db import default_url, make_engine

    from .warehouse_url import error_text, resolve_warehouse_url

    url: list[str] = []  # resolved at the first question (a Secret block's is an API call)

    def holds() -> ClaimsLost | None:
        if not url:
            url.append(resolve_warehouse_url(plan.warehouse) or default_url())
        # a read, with no schema upgrade (its migration lock): the run's claim upgraded the schema
        with Warehouse(make_engine(url[0])) as wh:
            return lineage.claims_lost(wh, plan.model, plan.run_id)

    return ClaimsFence(beat, holds, log=log, describe=lambda exc: error_text(exc, plan.warehouse), **timing)
