"""Each rank's heartbeat: the phases it is in and since when, so the driver's watchdog covers
every phase (startup, compile, restore, steps, saves), each with its own bound.

A rank's `RankHeartbeat` keeps its state in memory: the phases it is in, each with the time it
entered it, and in training the step it is at and whether it is inside it. A daemon thread
writes that state to ``<spool>/<run_id>/attempt-NNN.rank-R.beat.json`` (write + rename, so a
reader never sees half a file) when it changes and every `every_s` seconds; the training
thread never does I/O for it. The file is not a spool event (not ``*.jsonl``): the metric never
reads it, and a step costs one dictionary update.

The thread keeps beating while the training thread hangs, so a fresh beat only says the
process lives (a dead process is reported by Ray). The driver decides on the phase's start
(`find_hang`, pure): a rank is hung when it has stayed in one phase longer than that phase's
bound (`PhaseBounds`, from `TrainerConfig`). The rules:

- A rank with no beat yet is in `startup` since the attempt launched it.
- In training, the rank's clock runs from its last progress (its training start, the start or
  the end of a step), and only once every rank trains: a rank waiting in a collective for a
  peer that still compiles is not hung; the peer is judged by its own phase's bound.
- Among the hung ranks the culprit is the one that progressed least (in init before training;
  at step s: before it, then in the save made before it, then inside it; a lower step first),
  then the one hung longest: its peers wait for it in a collective.
- So a training rank ahead of a peer is not judged on its step clock at all: it waits for that
  peer in a collective, however long, and the peer is judged by its own clock. Judging it
  blamed the waiting rank whenever its clock ran out first (a loaded host: the hung peer's
  clock had a pause left out, the waiting rank's had none). A save keeps its own bound, ahead
  or not: a rank past its loop (the anchor's save, the evaluation) reads as no further than
  one in it, so excusing a save could excuse a real hang there.
- Time the rank's process did not run is not the rank's: the pauses its beat reports, and the
  silence since a beat overdue by more than `PAUSE_MIN_S` (a pause not yet seen by the thread,
  which is not running either), are left out of its phase's time, at most one bound's worth (a
  process stopped for good, or one whose hang holds the interpreter lock and so silences its
  beat, is still hung, at twice the bound). A host that starves both ranks
  of CPU for seconds must not cost the run a full restart (a loaded CI host declared a 3-s step
  bound hung after 2.3 s of starvation).

The thread also notices when its own process was not running (`Pause`, pure): it woke more
than `PAUSE_MIN_S` later than it meant to while the process used less than
`PAUSE_CPU_SHARE` of that gap in CPU time (SIGSTOP, a frozen VM, a host starving it; a
training thread holding the lock would have used the CPU). It hands the span to `on_pause`
(the rank records a `process_paused` event: the evidence that owns a stalled step to the host),
and its beat carries the newest ones to the watchdog.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ettflow.ett.failures import Failure, FailureClass

log = logging.getLogger("ettflow.trainer")

TRAINING = "train_step"  # the loop's phase: from the training start, between and inside steps
STARTUP = "startup"  # a rank that has not beaten yet
SAVE = "checkpoint_save"  # a save the loop waits for (periodic, emergency, anchor)
STARTUP_STAGES = ("device_init", "process_group_init", "preproc_creation", "train_module_creation",
                  "init_plugins", "compile_cache_restore", "pre_train", "get_first_batch_data", "evaluation")


PAUSE_MIN_S = 1.0  # a wake-up later than planned by more than this may be a pause
PAUSE_CPU_SHARE = 0.1  # ... when the process used less CPU than this share of the gap
BEAT_EVERY_S = 0.5  # the thread's beat period
PAUSES_KEPT = 8  # the newest pauses a beat carries (older ones predate any phase still open)


@dataclass(frozen=True)
class Pause:
    """The process was not running between `start` and `end` (wall clock, epoch seconds)."""

    start: float
    end: float

    @staticmethod
    def between(last_wall: float, wall: float, *, slept_s: float, planned_s: float, cpu_s: float) -> Pause | None:
        """A pause, given the thread's last wake-up and this one (`wall`), the time it slept
        (monotonic), the most it meant to sleep and the process's CPU time in between."""
        late = slept_s - planned_s
        if late <= PAUSE_MIN_S or cpu_s >= PAUSE_CPU_SHARE * slept_s:
            return None
        return Pause(start=last_wall, end=wall)


@dataclass
class PauseNotices:
    """Which of a process's pauses the console hears of: the first, then only one at least twice
    as long as the longest it heard of (a starved host pauses a rank again and again; one line
    says so). Every pause is recorded in the run's timeline whatever this says."""

    longest_told_s: float = 0.0

    def tell(self, pause: Pause) -> bool:
        took = pause.end - pause.start
        if took < 2 * self.longest_told_s:
            return False
        self.longest_told_s = took
        return True


def beat_file(root: Path | str, run_id: str, attempt: int, rank: int) -> Path:
    return Path(root) / run_id / f"attempt-{attempt:03d}.rank-{rank}.beat.json"


@dataclass(frozen=True, kw_only=True)
class PhaseBounds:
    """How long a rank may stay in one phase before it counts as hung (seconds)."""

    startup_s: float
    compile_s: float
    restore_s: float
    step_s: float
    save_s: float

    @classmethod
    def of(cls, config: Any) -> PhaseBounds:
        """The bounds of a `TrainerConfig`."""
        return cls(startup_s=config.startup_timeout_s, compile_s=config.compile_timeout_s,
                   restore_s=config.restore_timeout_s, step_s=config.step_timeout_s, save_s=config.save_timeout_s)

    def bound(self, phase: str) -> float:
        """The bound of `phase`: every init stage (and the final evaluation) has startup's."""
        if phase == "pt2_compile":
            return self.compile_s
        if phase == "checkpoint_restore":
            return self.restore_s
        if phase == TRAINING:
            return self.step_s
        if phase == SAVE:
            return self.save_s
        return self.startup_s


@dataclass(frozen=True, kw_only=True)
class RankBeat:
    """What one beat file says.

    beat: when it was written. phases: phase -> when the rank entered it (init stages may run
    concurrently). training_since: when the rank entered the training loop (None: not yet).
    step: in training, the step the rank is at (the next one to train); in_step: inside it.
    """

    rank: int
    pid: int
    beat: float
    phases: Mapping[str, float] = field(default_factory=dict)
    training_since: float | None = None
    step: int | None = None
    in_step: bool = False
    pauses: tuple[Pause, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": self.pid, "beat": self.beat, "phases": dict(self.phases),
                "training_since": self.training_since, "step": self.step, "in_step": self.in_step,
                "pauses": [[p.start, p.end] for p in self.pauses]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RankBeat:
        return cls(rank=int(d["rank"]), pid=int(d["pid"]), beat=float(d["beat"]),
                   phases={str(k): float(v) for k, v in d.get("phases", {}).items()},
                   training_since=d.get("training_since"), step=d.get("step"), in_step=bool(d.get("in_step")),
                   pauses=tuple(Pause(float(a), float(b)) for a, b in d.get("pauses", ())))

    def not_running(self, since: float, now: float) -> float:
        """How much of [since, now] the rank's process did not run: its reported pauses, and
        the silence past an overdue beat (a pause its thread has not woken to report)."""
        reported = sum(max(0.0, min(p.end, now) - max(p.start, since)) for p in self.pauses)
        overdue = now - max(self.beat, since) - BEAT_EVERY_S
        return reported + (overdue if overdue > PAUSE_MIN_S else 0.0)


def write_beat(path: Path, beat: RankBeat) -> None:
    """Atomically replace the beat file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(beat.to_dict()))
    os.replace(tmp, path)


def read_beat(path: Path) -> RankBeat | None:
    """The beat in `path`; None when there is none (yet) or it does not parse."""
    try:
        return RankBeat.from_dict(json.loads(path.read_text()))
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True, kw_only=True)
class Hang:
    """A rank that stayed in `phase` since `since` for `for_s`, past its `bound_s`."""

    rank: int
    phase: str
    since: float
    for_s: float
    bound_s: float
    step: int | None = None
    not_running_s: float = 0.0  # of `for_s`, the time its process did not run (not counted)

    def failure(self, attempt: int) -> Failure:
        paused = f", {self.not_running_s:.1f} s of it not running" if self.not_running_s else ""
        return Failure(failure_class=FailureClass.INFRASTRUCTURE, rank=self.rank, attempt=attempt, step=self.step,
                       hang=True, reason=f"rank {self.rank} hung in {self.phase} for {self.for_s:.1f} s{paused} "
                              f"(bound {self.bound_s:g} s)")


def find_hang(beats: Mapping[int, RankBeat | None], bounds: PhaseBounds, now: float, *,
              launched_at: float, done: frozenset[int] | set[int] = frozenset()) -> Hang | None:
    """The culprit hang among the ranks not `done`, by the rules of the module docstring."""
    live = {r: b for r, b in beats.items() if r not in done}
    all_training = bool(live) and all(b is not None and b.training_since is not None for b in live.values())
    train_clock = max((b.training_since for b in live.values() if b is not None and b.training_since is not None),
                      default=None)
    least = min((_progress(b) for b in live.values() if b is not None), default=(-1, 0))
    found: list[tuple[tuple, Hang]] = []
    for rank, b in live.items():
        if b is None:
            hang = _overdue(rank, STARTUP, launched_at, bounds, now)
            if hang is not None:
                found.append(((0, -1, 0, hang.since), hang))
            continue
        training = b.training_since is not None
        progress = _progress(b)
        rank_key = (1, *progress) if training else (0, -1, 0)  # the culprit's order: least progressed first
        for phase, since in b.phases.items():
            if phase == TRAINING:
                if not all_training:
                    continue  # waits for a peer still in init: the peer's bound judges it
                if progress > least:
                    continue  # ahead of a peer: waits for it in a collective; the peer is judged
                since = max(since, train_clock)
            hang = _overdue(rank, phase, since, bounds, now, step=b.step if training else None, beat=b)
            if hang is not None:
                found.append(((*rank_key, since), hang))
    return min(found, key=lambda pair: pair[0])[1] if found else None


def _progress(b: RankBeat) -> tuple[int, int]:
    """A training rank's progress: its step s, then 0 before it, 1 in the save the loop makes
    before step s (periodic saves come between steps), 2 inside step s."""
    return (b.step if b.step is not None else -1, 2 if b.in_step else int(SAVE in b.phases))


def _overdue(rank: int, phase: str, since: float, bounds: PhaseBounds, now: float,
             step: int | None = None, beat: RankBeat | None = None) -> Hang | None:
    bound = bounds.bound(phase)
    not_running = min(bound, beat.not_running(since, now)) if beat is not None else 0.0
    if now - since - not_running <= bound:
        return None
    return Hang(rank=rank, phase=phase, since=since, for_s=now - since, bound_s=bound, step=step,
                not_running_s=not_running)


class RankHeartbeat:
    """The rank side: phases entered and left by the training code, written by a daemon thread."""

    def __init__(self, path: Path | str, rank: int, *, every_s: float = BEAT_EVERY_S,
                 clock: Callable[[], float] = time.time, on_pause: Callable[[Pause], None] | None = None) -> None:
        self.path, self.rank, self.every_s, self.clock = Path(path), rank, every_s, clock
        self.on_pause = on_pause
        self._lock = threading.Lock()
        self._phases: dict[str, float] = {}
        self._training_since: float | None = None
        self._step: int | None = None
        self._in_step = False
        self._pauses: tuple[Pause, ...] = ()
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> RankHeartbeat:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()
        self._thread = threading.Thread(target=self._loop, name=f"ettflow-heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._changed.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def snapshot(self) -> RankBeat:
        with self._lock:
            return RankBeat(rank=self.rank, pid=os.getpid(), beat=self.clock(), phases=dict(self._phases),
                            training_since=self._training_since, step=self._step, in_step=self._in_step,
                            pauses=self._pauses)

    # ---- what the training code calls ---------------------------------------------------
    def enter(self, phase: str) -> None:
        with self._lock:
            self._phases[phase] = self.clock()
        self._changed.set()

    def leave(self, phase: str) -> None:
        with self._lock:
            self._phases.pop(phase, None)
        self._changed.set()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.enter(name)
        try:
            yield
        finally:
            self.leave(name)

    def training(self, step: int) -> None:
        """The loop starts at `step` (its clock starts now)."""
        now = self.clock()
        with self._lock:
            self._training_since, self._step, self._in_step = now, step, False
            self._phases[TRAINING] = now
        self._changed.set()

    def step_started(self, step: int) -> None:
        with self._lock:  # no wake-up: the next periodic beat carries it
            self._step, self._in_step = step, True
            self._phases[TRAINING] = self.clock()

    def step_ended(self, step: int) -> None:
        with self._lock:
            self._step, self._in_step = step + 1, False
            self._phases[TRAINING] = self.clock()

    # ---- the thread ---------------------------------------------------------------------
    def _write(self) -> None:
        try:
            write_beat(self.path, self.snapshot())
        except OSError as exc:  # the spool's own writes report a full disk; the driver sees a stale beat
            log.warning("heartbeat of rank %d not written: %s", self.rank, exc)

    def _loop(self) -> None:
        last_wall, last_mono, last_cpu = self.clock(), time.monotonic(), time.process_time()
        while not self._stop.is_set():
            self._changed.wait(self.every_s)
            self._changed.clear()
            wall, mono, cpu = self.clock(), time.monotonic(), time.process_time()
            pause = Pause.between(last_wall, wall, slept_s=mono - last_mono, planned_s=self.every_s,
                                  cpu_s=cpu - last_cpu)
            last_wall, last_mono, last_cpu = wall, mono, cpu
            if pause is not None:  # in this very beat: the watchdog leaves it out of the phase's time
                with self._lock:
                    self._pauses = (*self._pauses, pause)[-PAUSES_KEPT:]
            self._write()
            if pause is not None and self.on_pause is not None:
                try:
                    self.on_pause(pause)
                except Exception:  # noqa: BLE001 - evidence only: the beat must go on
                    log.exception("rank %d: recording a pause of its process failed", self.rank)
