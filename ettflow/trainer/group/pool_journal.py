"""The cluster pool's journal: what it holds, written as it changes, so that its death loses
none of it (issue 42 #1).

The pool's service actor keeps its holdings (prewarmed workers, keepers) and its unacknowledged
ledger lines in memory; killed, it takes its actors with it (it owns them) and, without a
journal, their held time never reaches the ledger. So the service rewrites one small JSON file
on every change and on each reaper tick (`beat`): the holdings open now, the ledger lines not
yet acknowledged, and whether it stopped cleanly. The next service of the same home reads it
when it starts (`recover`):

- each holding the dead service still held becomes a ledger line, `reason` "pool_lost",
  released at the journal's last beat (the last moment the service is known to have lived;
  its actors died with it, at most one reaper tick later);
- its unacknowledged lines are adopted as they were (nothing acknowledged is read twice: `ack`
  rewrites the journal);
- `lost_at`: when the service was lost (None after a clean `stop`), which the next run that
  finds the pool empty is told (its ranks start cold because of it, not silently).

Pure apart from the file it reads and writes (atomic replace: a death mid-write leaves the
previous journal).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ettflow.ett.capacity import Holding
from ettflow.ett.json_file import replace_json

log = logging.getLogger("ettflow.trainer")
POOL_LOST = "pool_lost"  # the reason of a line recovered from a dead service's holding
VERSION = 1


@dataclass(frozen=True)
class Recovered:
    """What a journal left by an earlier service gives the next one."""

    lines: tuple[Holding, ...]  # its unacknowledged lines and, when it was lost, its open holdings closed
    lost_at: float | None  # its last beat when it did not stop cleanly, else None
    open_holdings: int = 0  # how many holdings it lost


class PoolJournal:
    """One service's journal file (`path`)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    def write(self, *, beat: float, open_holdings: Iterable[Holding], ledger: Iterable[Holding],
              stopped: bool = False) -> None:
        """Replace the journal with the service's state at `beat` (`open_holdings`: each held
        thing as the line it would become if released at `beat`)."""
        body = {"version": VERSION, "beat": beat, "stopped": stopped,
                "open": [asdict(h) for h in open_holdings], "ledger": [asdict(h) for h in ledger]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        replace_json(self.path, body)

    def recover(self) -> Recovered | None:
        """What the previous service left (None: no journal, or one that does not parse: said
        in a warning, and left in place for a person to read)."""
        try:
            body = json.loads(self.path.read_text())
            beat = float(body["beat"])
            ledger = [Holding(**d) for d in body.get("ledger", [])]
            held = [Holding(**d) for d in body.get("open", [])]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("cluster pool: its journal %s could not be read (%s: %s); what an earlier pool held is not "
                        "in the ledger", self.path, type(exc).__name__, exc)
            return None
        if body.get("stopped"):
            return Recovered(lines=tuple(ledger), lost_at=None)
        lost = [_closed(h, beat) for h in held]
        return Recovered(lines=tuple(ledger + lost), lost_at=beat, open_holdings=len(lost))


def _closed(h: Holding, at: float) -> Holding:
    """An open holding of a dead service, released when it was last seen alive."""
    return replace(h, released_at=max(at, h.requested_at), reason=POOL_LOST)
