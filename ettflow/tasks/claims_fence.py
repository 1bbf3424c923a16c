"""The training run's claims fence: a run taken for dead while it stood still stops training.

A run's flow process that stands still past its heartbeat's bound (a SIGSTOP, a paused VM,
heavy swapping) may be taken for dead by a refresh waiting on its windows: that one archives it
as crashed and claims the windows (`tasks.claims`). When the process resumes, its ranks (other
processes) may still be training. Its publish would be refused (`ett.lineage`'s fence), but
until then it would hold its devices for windows that are another refresh's to train.

`ClaimsFence.check` is the driver's stop check beside the SIGTERM one (`train`). It costs
nothing while the run's heartbeat has no lapse (`ett.heartbeat.RunHeartbeat.lapse`). After one,
it asks the warehouse whether the run still holds its claims (`lineage.claims_lost`):

- held: nobody took the run for dead; the lapse is cleared and training goes on;
- lost: it raises `RunWithdrawn` carrying the `ClaimsLost`; the driver tears the ranks down at
  once, with nothing saved and no failure recorded (`TrainingDriver._withdraw`), and the train
  task raises the `ClaimsLost`: the run ends failed as when its publish is refused;
- the warehouse unreachable: training goes on and it asks again `RETRY_S` later (the publish's
  fence decides in the end).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from ettflow.ett.heartbeat import Lapse
from ettflow.ett.lineage import ClaimsLost
from ettflow.trainer.group.stop_request import RunWithdrawn

RETRY_S = 5.0  # between two questions to an unreachable warehouse

log = logging.getLogger("ettflow.tasks")


class Lapsing(Protocol):
    """What the fence reads of the run's heartbeat (`RunHeartbeat`)."""

    @property
    def lapse(self) -> Lapse | None: ...

    def clear(self, lapse: Lapse) -> None: ...


class ClaimsFence:
    """`check()` raises `RunWithdrawn` once the run's claims are found lost after a lapse of
    its heartbeat (see the module). `holds()`: why the run holds no claim now, or None when it
    holds one; it may raise an outage (`outages`). `log`: the run's logger."""

    def __init__(self, beat: Lapsing, holds: Callable[[], ClaimsLost | None], *,
                 outages: tuple[type[BaseException], ...], log: Any = log, clock: Callable[[], float] = time.monotonic,
                 retry_s: float = RETRY_S) -> None:
        self.beat, self.holds, self.outages = beat, holds, outages
        self.log, self.clock, self.retry_s = log, clock, retry_s
        self._next_ask = float("-inf")
        self._warned = False

    def check(self) -> None:
        lapse = self.beat.lapse
        if lapse is None or self.clock() < self._next_ask:
            return
        try:
            lost = self.holds()
        except self.outages as exc:
            self._next_ask = self.clock() + self.retry_s
            if not self._warned:
                self.log.warning("this run's heartbeat lapsed for %.1f s (its process stood still): whether it still "
                                 "holds its claims cannot be asked now (%s: %s); training goes on, asked again every "
                                 "%.0f s, and the publish decides", lapse.seconds, type(exc).__name__, exc,
                                 self.retry_s)
                self._warned = True
            return
        if lost is None:
            self.beat.clear(lapse)
            self.log.info("this run's heartbeat lapsed for %.1f s (its process stood still); it still holds its "
                          "claims: training goes on", lapse.seconds)
            return
        self.log.warning("this run's heartbeat lapsed for %.1f s (its process stood still) and it was taken for dead: "
                         "%s. Its ranks are stopped now", lapse.seconds, lost)
        raise RunWithdrawn(f"stood still {lapse.seconds:.1f} s and lost its claims: {lost}", cause=lost)


def fence_for(plan: Any, beat: Lapsing, log: Any) -> ClaimsFence:
    """The fence of the refresh `plan` (a `RefreshPlan`), asking its warehouse."""
    from ettflow.ett import lineage
    from ettflow.ett.archive import OUTAGES
    from ettflow.ett.warehouse import Warehouse

    from .warehouse_url import resolve_warehouse_url

    def holds() -> ClaimsLost | None:
        with Warehouse.open(resolve_warehouse_url(plan.warehouse)) as wh:
            return lineage.claims_lost(wh, plan.model, plan.run_id)

    return ClaimsFence(beat, holds, outages=OUTAGES, log=log)
