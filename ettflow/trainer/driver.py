"""The training driver: runs the rank group, watches it, recovers it, within a failure budget.

Per attempt: reserve the group (the wait is the `scheduling` phase), launch training on every
rank, then watch. A rank whose process dies, whose code raises, or that stops making steps
for `watchdog_s` (read from the spool) is a failure: the driver records its detection, tears
the whole group down (`shutdown`), and starts the next attempt, which restores the latest
checkpoint and the compile cache and replays from the checkpoint's cursor. Scripted SIGKILLs
by time are sent from here.

The group is a collaborator (`group_factory(attempt) -> WorkerGroup`), so tests can step this
loop with a dummy group and no cluster; `RayWorkerGroup` is the real one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ettflow.ett.spool import SpoolWriter

from .config import TrainerConfig
from .progress import SpoolTail


@dataclass(frozen=True)
class RankFailure:
    rank: int
    died: bool  # the process is gone (killed, crashed, node lost)
    error: str
    user_error: bool = False  # an exception raised by model or data code
    fatal: bool = False  # retrying cannot help (bad data): the run stops at once


class WorkerGroup(Protocol):
    def reserve(self) -> None: ...  # placement + processes up

    def launch(self) -> None: ...  # start training on every rank

    def poll(self, timeout_s: float) -> tuple[dict[int, dict], list[RankFailure]]: ...

    def kill(self, rank: int) -> None: ...  # SIGKILL the rank's process

    def teardown(self) -> None: ...  # stop every rank and release the devices


class TrainingFailed(RuntimeError):
    """The failure budget is spent; the message lists every failure."""


@dataclass
class TrainingResult:
    run_id: str
    attempts: int
    failures: list[dict] = field(default_factory=list)
    ranks: dict[int, dict] = field(default_factory=dict)  # what each rank returned

    @property
    def rank0(self) -> dict:
        return self.ranks.get(0, {})


def classify(failures: list[RankFailure]) -> tuple[str, str, int]:
    """(failure_class, reason, rank): a dead process is infrastructure; else a user error."""
    dead = [f for f in failures if f.died]
    if dead:
        return "infrastructure", f"rank {dead[0].rank} process died: {dead[0].error}", dead[0].rank
    user = [f for f in failures if f.user_error or f.fatal]
    first = (user or failures)[0]
    return ("user" if user else "infrastructure"), f"rank {first.rank}: {first.error}", first.rank


class TrainingDriver:
    def __init__(
        self,
        config: TrainerConfig,
        run_id: str,
        spool_root: Path | str,
        group_factory: Callable[[int], WorkerGroup],
        *,
        poll_s: float = 0.25,
        grace_s: float = 2.0,
        clock: Callable[[], float] = time.time,
        before_release: Callable[[dict[int, dict]], Any] | None = None,
    ) -> None:
        """`before_release(rank_results)` runs after training while the group still holds
        its devices (the baseline's in-trainer publishing); it is recorded as `publish`."""
        self.config, self.run_id, self.spool_root = config, run_id, Path(spool_root)
        self.group_factory = group_factory
        self.before_release = before_release
        self.released_with: Any = None  # what before_release returned
        self.poll_s, self.grace_s, self.clock = poll_s, grace_s, clock

    def run(self, *, first_attempt: int = 0, submitted_at: float | None = None) -> TrainingResult:
        result = TrainingResult(self.run_id, attempts=0)
        attempt = first_attempt
        if submitted_at is not None or first_attempt == 0:
            with SpoolWriter(self.spool_root, self.run_id, attempt, -1) as rec:
                rec.mark("submitted", submitted_at if submitted_at is not None else self.clock())
        while True:
            result.attempts += 1
            outcome = self._attempt(attempt)
            if outcome.get("ranks") is not None:
                result.ranks = outcome["ranks"]
                return result
            result.failures.append(outcome["failure"])
            if outcome["failure"]["fatal"]:
                raise TrainingFailed(f"run {self.run_id} stopped: {outcome['failure']['reason']}")
            if len(result.failures) > self.config.max_failures:
                lines = "; ".join(f"attempt {f['attempt']}: {f['reason']}" for f in result.failures)
                raise TrainingFailed(
                    f"run {self.run_id}: {len(result.failures)} failures exceed the budget of "
                    f"{self.config.max_failures} ({lines})"
                )
            attempt += 1

    def _attempt(self, attempt: int) -> dict[str, Any]:
        rec = SpoolWriter(self.spool_root, self.run_id, attempt, -1)
        try:
            group = self.group_factory(attempt)
            t0 = self.clock()
            try:
                group.reserve()
            finally:
                rec.record("scheduling", t0, self.clock(), world_size=self.config.world_size)
            group.launch()
            return self._watch(attempt, group, rec)
        finally:
            rec.close()

    def _watch(self, attempt: int, group: WorkerGroup, rec: SpoolWriter) -> dict[str, Any]:
        tail = SpoolTail(self.spool_root, self.run_id, attempt, self.config.world_size)
        timed_kills = [f for f in self.config.failures if f.after_s is not None and f.attempt == attempt]
        finished: dict[int, dict] = {}
        while True:
            done, failed = group.poll(self.poll_s)
            finished.update(done)
            tail.poll()
            now = self.clock()
            started = tail.training_started
            for fault in list(timed_kills):
                if started is not None and now >= started + fault.after_s:
                    timed_kills.remove(fault)
                    rec.mark("failure", failure_class="infrastructure", failed_rank=fault.rank,
                             reason=f"injected SIGKILL of rank {fault.rank} after {fault.after_s} s", injected=True)
                    group.kill(fault.rank)
            if not failed and len(finished) < self.config.world_size:
                stalled = tail.stalled_rank(self.config.watchdog_s, now)
                if stalled is not None:
                    failed = [RankFailure(stalled, died=False, error=f"no step for {self.config.watchdog_s} s (hang)")]
            if failed:
                return self._recover(attempt, group, rec, failed)
            if len(finished) == self.config.world_size:
                # shutdown runs from the ranks' end of work until the devices are released
                ended = min(min(r.get("finished_at", now) for r in finished.values()), now)
                if self.before_release is not None:
                    t0 = self.clock()
                    try:
                        self.released_with = self.before_release(finished)
                    finally:
                        rec.record("publish", t0, self.clock(), in_trainer=True)
                group.teardown()
                rec.record("shutdown", ended, self.clock(), failed=False)
                return {"ranks": finished}

    def _recover(self, attempt: int, group: WorkerGroup, rec: SpoolWriter, failed: list[RankFailure]) -> dict:
        detected = self.clock()
        deadline = detected + self.grace_s  # let the other ranks' outcomes arrive to classify
        while not any(f.died for f in failed) and self.clock() < deadline:
            _, more = group.poll(self.poll_s)
            failed = failed + more
        klass, reason, rank = classify(failed)
        rec.mark("failure_detected", detected, failure_class=klass, reason=reason[:500], failed_rank=rank)
        try:
            group.teardown()
        finally:
            rec.record("shutdown", detected, self.clock(), failed=True)
        fatal = any(f.fatal for f in failed)
        return {"failure": {"attempt": attempt, "failure_class": klass, "reason": reason, "rank": rank,
                            "fatal": fatal}}
