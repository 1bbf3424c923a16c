"""How a skipped refresh reads in its spool: the one `scheduling` event the claim task writes
when it skips (`tasks.claims.record_skip`), with `stage="claim_windows"`, `outcome="skipped"`
and the reason. Read by the archiving hooks (a `skipped` row, not a 0% ETT run)."""

from __future__ import annotations

from collections.abc import Sequence

from ettflow.ett.events import PhaseEvent
from ettflow.ett.lineage import Outcome

SKIP_STAGE = "claim_windows"


def skip_reason(evs: Sequence[PhaseEvent]) -> str | None:
    """Why the run was skipped, from its spool (None: it was not)."""
    for e in evs:
        if e.phase == "scheduling" and e.info.stage == SKIP_STAGE and e.info.outcome == Outcome.SKIPPED.value:
            return e.info.reason or "skipped"
    return None
