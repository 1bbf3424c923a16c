"""Follow a running attempt through its spool: steps, loss, throughput, last progress per rank.

The progress reports read the same durable events the metric uses. The driver's watchdog reads
the ranks' heartbeat files beside them (`beats`, see `rank_heartbeat.py`), and takes each
rank's own `failure` marker as soon as it is written (`new_failure_markers`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ettflow.ett.events import FAILURE, TRAIN_STEP, PhaseEvent
from ettflow.ett.spool import spool_file
from ettflow.trainer.rank_heartbeat import RankBeat, beat_file, read_beat


@dataclass
class RankProgress:
    steps: int = 0
    last_step_end: float | None = None
    first_step_start: float | None = None
    loss: float | None = None
    examples: int = 0


class SpoolTail:
    """Reads only what was appended since the last poll; ignores a torn tail until whole."""

    def __init__(self, root: Path | str, run_id: str, attempt: int, world_size: int) -> None:
        self.files = {r: spool_file(root, run_id, attempt, r) for r in range(world_size)}
        self.beat_files = {r: beat_file(root, run_id, attempt, r) for r in range(world_size)}
        self._unread_failures: list[tuple[int, PhaseEvent]] = []
        self.offsets = dict.fromkeys(self.files, 0)
        self.ranks = {r: RankProgress() for r in self.files}
        self.failure_markers: list[PhaseEvent] = []

    def poll(self) -> dict[int, RankProgress]:
        for rank, path in self.files.items():
            try:
                with open(path, "rb") as fh:
                    fh.seek(self.offsets[rank])
                    chunk = fh.read()
            except FileNotFoundError:
                continue
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self.offsets[rank] += len(complete)
            for line in complete.splitlines():
                try:
                    self._take(rank, PhaseEvent.from_dict(json.loads(line)))
                except ValueError:  # EventError too
                    continue  # the metric reader reports corrupt lines; the tail skips them
        return self.ranks

    def _take(self, rank: int, ev: PhaseEvent) -> None:
        p = self.ranks[rank]
        if ev.phase == TRAIN_STEP:
            p.steps += 1
            p.last_step_end = ev.end
            if p.first_step_start is None:
                p.first_step_start = ev.start
            p.loss = ev.info.loss if ev.info.loss is not None else p.loss
            p.examples += ev.info.examples or 0
        elif ev.phase == FAILURE:
            self.failure_markers.append(ev)
            self._unread_failures.append((rank, ev))

    def new_failure_markers(self) -> list[tuple[int, PhaseEvent]]:
        """(rank, marker) of the `failure` markers read since the last call."""
        out, self._unread_failures = self._unread_failures, []
        return out

    def beats(self) -> dict[int, RankBeat | None]:
        """Each rank's latest heartbeat (None: none yet)."""
        return {rank: read_beat(path) for rank, path in self.beat_files.items()}

    @property
    def training_started(self) -> float | None:
        starts = [p.first_step_start for p in self.ranks.values() if p.first_step_start is not None]
        return min(starts) if starts else None

    def summary(self) -> dict:
        steps = min((p.steps for p in self.ranks.values()), default=0)
        start = self.training_started
        ends = [p.last_step_end for p in self.ranks.values() if p.last_step_end is not None]
        elapsed = (max(ends) - start) if (start is not None and ends) else 0.0
        examples = sum(p.examples for p in self.ranks.values())
        losses = [p.loss for p in self.ranks.values() if p.loss is not None]
        return {
            "steps": steps,
            "steps_per_s": steps / elapsed if elapsed > 0 else 0.0,
            "examples_per_s": examples / elapsed if elapsed > 0 else 0.0,
            "loss": sum(losses) / len(losses) if losses else None,
        }
