"""The driver's heartbeat in the spool: how a run whose process died is told from a live one.

`RunHeartbeat` wraps the driver side of a run (the flow's body). On entry it writes the run
record ``<spool>/<run_id>/heartbeat.json`` (the period, the process, the run's labels); then a
daemon thread touches the file every `every_s` seconds (its mtime is the last beat: no byte is
written, so a full disk does not stop it). On exit it rewrites the record with the outcome:
``completed``, ``failed`` (the body raised an Exception) or ``crashed`` (a BaseException such
as KeyboardInterrupt or SystemExit), and the time it ended.

A run is orphaned when its record has no end and its last beat is older than
`HeartbeatRecord.bound_s` (3 periods + `SLACK_S`). Its **detection** time is defined as the
last beat + that bound: a fixed function of the spool, so archiving the run later, or twice,
gives the same row. `read_heartbeat` returns None for a run that never had one (a bench job,
a sample run, a spool from an older ettflow).

A process that stood still (SIGSTOP, a paused VM, heavy swapping) cannot tell that it did from
its own code, except by its clock: the beat thread measures the time between two beats it
wrote, and a gap past the bound is a `Lapse` (`RunHeartbeat.lapse`): for that span anyone
could have taken the run for dead and released its claims. The run's owner asks whether they
were (`tasks.claims_fence.ClaimsFence`) and `clear`s the lapse when they were not.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .json_file import replace_json
from .settled import unsettle

HEARTBEAT_FILE = "heartbeat.json"
DEFAULT_EVERY_S = 2.0
PERIODS = 3  # beats that may be missed before the run counts as orphaned
SLACK_S = 2.0  # on top of the missed periods: a loaded machine, a slow file system
OUTCOMES = ("completed", "failed", "crashed")

log = logging.getLogger("ettflow.ett")


def heartbeat_file(spool_root: Path | str, run_id: str) -> Path:
    return Path(spool_root) / run_id / HEARTBEAT_FILE


def stale_bound_s(every_s: float) -> float:
    """How long after its last beat a run without an end counts as orphaned."""
    return PERIODS * every_s + SLACK_S


@dataclass(frozen=True, kw_only=True)
class HeartbeatRecord:
    """What the heartbeat file says about a run.

    last_beat: the file's mtime (epoch seconds): the last time the driver was known alive.
    ended_at / outcome: set when the driver left its `RunHeartbeat` block (None: it never did).
    labels: what the flow said about the run (model, mode, world_size, switches, tags).
    """

    run_id: str
    every_s: float
    started_at: float
    last_beat: float
    pid: int | None = None
    host: str | None = None
    ended_at: float | None = None
    outcome: str | None = None
    labels: Mapping[str, Any] = field(default_factory=dict)

    @property
    def bound_s(self) -> float:
        return stale_bound_s(self.every_s)

    @property
    def detection_at(self) -> float:
        """When an orphaned run counts as detected: its last beat + the bound."""
        return self.last_beat + self.bound_s

    @property
    def ended(self) -> bool:
        return self.ended_at is not None

    def is_orphaned(self, now: float | None = None) -> bool:
        """No end recorded and no beat within the bound."""
        now = time.time() if now is None else now
        return not self.ended and now > self.detection_at

    def is_live(self, now: float | None = None) -> bool:
        return not self.ended and not self.is_orphaned(now)


def read_heartbeat(spool_root: Path | str, run_id: str) -> HeartbeatRecord | None:
    """The run's heartbeat record, or None when it has none (or it is unreadable: logged)."""
    path = heartbeat_file(spool_root, run_id)
    try:
        last_beat = path.stat().st_mtime
        data = json.loads(path.read_text())
        return HeartbeatRecord(
            run_id=str(data.get("run_id", run_id)), every_s=float(data["every_s"]),
            started_at=float(data["started_at"]), last_beat=last_beat, pid=data.get("pid"),
            host=data.get("host"), ended_at=data.get("ended_at"), outcome=data.get("outcome"),
            labels=dict(data.get("labels") or {}),
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("heartbeat file %s is unreadable (%s): the run is treated as having none", path, exc)
        return None


@dataclass(frozen=True)
class Lapse:
    """A span in which the run's heartbeat went unwritten past its bound: from its last beat
    written before (`since`) to the first one after (`until`), epoch seconds."""

    since: float
    until: float

    @property
    def seconds(self) -> float:
        return self.until - self.since


def lapse_after(lapse: Lapse | None, written: float, now: float, bound_s: float) -> Lapse | None:
    """The lapse not cleared yet once a beat is written at `now`, the one before at `written`:
    a gap past `bound_s` is a lapse, and extends one not cleared yet (its owner asks again)."""
    if now - written <= bound_s:
        return lapse
    return Lapse(lapse.since if lapse is not None else written, now)


class RunHeartbeat:
    """Context manager: the driver of `run_id` is alive while the block runs (see the module)."""

    def __init__(self, spool_root: Path | str, run_id: str, every_s: float = DEFAULT_EVERY_S, *,
                 labels: Mapping[str, Any] | None = None) -> None:
        if not every_s > 0:
            raise ValueError(f"RunHeartbeat.every_s must be > 0 seconds, got {every_s!r}")
        self.path = heartbeat_file(spool_root, run_id)
        self.run_id, self.every_s = run_id, float(every_s)
        self.labels = dict(labels or {})
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._record: dict[str, Any] = {}
        self._forget = False
        self._outcome: str | None = None
        self._lapse: Lapse | None = None  # the first lapse not cleared yet (set by the beat thread only)
        self._written = 0.0  # when the beat thread last wrote a beat (or the block began)
        self._written_mtime: float | None = None  # the file's mtime then (None: not read since this block wrote it)
        self._lapse_lock = threading.Lock()

    def __enter__(self) -> RunHeartbeat:
        self._record = {"run_id": self.run_id, "every_s": self.every_s, "started_at": time.time(),
                        "pid": os.getpid(), "host": socket.gethostname(), "labels": self.labels}
        wrote = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            replace_json(self.path, self._record)
            wrote = True
            unsettle(self.path.parent.parent, self.run_id)  # a flow retry reopens the run
        except OSError as exc:  # the run goes on; it cannot be told orphaned if it dies
            log.warning("cannot write the heartbeat %s (%s): if this run dies, archive it with "
                        "`ettflow archive --run %s`", self.path, exc, self.run_id)
        self._stop.clear()
        self._written, self._lapse = self._record["started_at"], None
        self._written_mtime = self._written_mtime_now() if wrote else None
        self._thread = threading.Thread(target=self._beat, name="ettflow-heartbeat", daemon=True)
        self._thread.start()
        return self

    def relabel(self, labels: Mapping[str, Any]) -> None:
        """Keep `labels` in the record from now on (what the run learned since it started)."""
        self.labels = dict(labels)
        self._record = {**self._record, "labels": self.labels}
        try:
            replace_json(self.path, self._record)
        except OSError as exc:
            log.warning("cannot update the heartbeat %s (%s)", self.path, exc)

    def end_as(self, outcome: str) -> None:
        """Record `outcome` at the block's end whatever way it ends (a failure the block handled)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"RunHeartbeat.end_as: outcome must be one of {OUTCOMES}, got {outcome!r}")
        self._outcome = outcome

    def forget(self) -> None:
        """Leave no record at the block's end (a run that archives no row, such as one refused or
        one that published another run's anchor: nothing of it is to reconcile), nor its spool
        folder when the record was all it held."""
        self._forget = True

    @property
    def bound_s(self) -> float:
        return stale_bound_s(self.every_s)

    def _written_mtime_now(self) -> float | None:
        try:
            return self.path.stat().st_mtime
        except OSError:
            return None

    @property
    def lapse(self) -> Lapse | None:
        """The first span since the block began (or since the last `clear`) in which no beat was
        written for longer than the bound: anyone may have taken the run for dead then."""
        return self._lapse

    def clear(self, lapse: Lapse) -> None:
        """The run's owner found that `lapse` cost it nothing (its claims are still its own); a
        lapse extended since it asked stays."""
        with self._lapse_lock:
            if self._lapse == lapse:
                self._lapse = None

    def _beat(self) -> None:
        warned = False
        while not self._stop.wait(self.every_s):
            try:
                os.utime(self.path)  # the mtime is the beat: no byte written
                now, mtime = time.time(), self.path.stat().st_mtime
                # the gap on this process's clock, or on the file's (a shared file system's server
                # stamps the mtime that other hosts compare with their clocks): the longer counts
                gap = max(now - self._written,
                          mtime - self._written_mtime if self._written_mtime is not None else 0.0)
                with self._lapse_lock:
                    self._lapse = lapse_after(self._lapse, now - gap, now, self.bound_s)
                if gap > self.bound_s:  # it may have been taken for dead: its row may change
                    unsettle(self.path.parent.parent, self.run_id)
                self._written, self._written_mtime = now, mtime
                warned = False
            except OSError as exc:
                if not warned:
                    log.warning("heartbeat %s not updated: %s", self.path, exc)
                    warned = True

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.every_s + 1.0)
        if self._forget and exc_type is None:
            with contextlib.suppress(OSError):  # a record left behind is reconciled as a finished run
                self.path.unlink(missing_ok=True)
                self.path.parent.rmdir()  # the run's folder too, when nothing else is in it
            return
        if self._outcome is not None and exc_type is None:
            outcome = self._outcome
        elif exc_type is None:
            outcome = "completed"
        elif issubclass(exc_type, Exception):
            outcome = "failed"
        else:
            outcome = "crashed"
        try:
            replace_json(self.path, {**self._record, "ended_at": time.time(), "outcome": outcome})
            unsettle(self.path.parent.parent, self.run_id)
        except OSError as exc_:
            log.warning("cannot record the end of run %s in %s (%s): it may later be archived as "
                        "crashed", self.run_id, self.path, exc_)
