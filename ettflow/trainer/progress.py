"""Follow a running attempt through its spool: steps, loss, throughput, last progress per rank.

The driver's step watchdog and the progress reports read the same durable events the metric
uses, so nothing extra has to travel from the ranks.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from ettflow.ett.spool import spool_file


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
        self.offsets = dict.fromkeys(self.files, 0)
        self.ranks = {r: RankProgress() for r in self.files}
        self.failure_markers: list[dict] = []

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
                    self._take(rank, json.loads(line))
                except ValueError:
                    continue  # the metric reader reports corrupt lines; the tail skips them
        return self.ranks

    def _take(self, rank: int, rec: dict) -> None:
        p = self.ranks[rank]
        phase = rec.get("phase")
        if phase == "train_step":
            p.steps += 1
            p.last_step_end = rec["end"]
            if p.first_step_start is None:
                p.first_step_start = rec["start"]
            attrs = rec.get("attrs", {})
            p.loss = attrs.get("loss", p.loss)
            p.examples += int(attrs.get("examples", 0))
        elif phase == "failure":
            self.failure_markers.append(rec)

    @property
    def training_started(self) -> float | None:
        starts = [p.first_step_start for p in self.ranks.values() if p.first_step_start is not None]
        return min(starts) if starts else None

    def stalled_rank(self, watchdog_s: float, now: float | None = None) -> int | None:
        """A rank that trained before but has made no step for `watchdog_s`."""
        now = time.time() if now is None else now
        for rank, p in self.ranks.items():
            last = p.last_step_end
            if last is None and self.training_started is not None:
                last = self.training_started  # it never stepped while another rank did
            if last is not None and now - last > watchdog_s:
                return rank
        return None

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
