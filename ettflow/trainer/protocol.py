"""The values that cross a process boundary in the trainer (driver <-> rank actors, spares and
pooled workers): frozen dataclasses, pickled by Ray as they are, so that no side reads a dict
by string key or parses a message.

- `RankResult`: what a rank's `train` (or `rejoin`, `join`) returns to the driver when it
  finished, with its `CheckpointReport`, `CompileReport` and `Evaluation`s;
- `WorkerInfo`: where a trainer actor's process runs (its `ready`/`adopt` answer);
- `PrewarmTimings`: what a spare's or pooled worker's `prewarm` took (with `Repair`: what became
  of a damaged compile-cache archive it met);
- `RestorePoint`: where a live recovery resumes (the driver picks it, every rank restores it);
  its tier is a `CheckpointTier` (`ett.checkpoint_tier`, shared with the metric core);
- `PollStatus`: what one look at an attempt's ranks found (a worker group's `poll`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from ettflow.ett.checkpoint_tier import CheckpointTier
from ettflow.ett.failures import Failure

from .checkpoint.anchor import AnchorInfo
from .compile.stats import CompileStats

MEMORY, DURABLE = CheckpointTier.MEMORY, CheckpointTier.DURABLE


@dataclass(frozen=True, kw_only=True)
class RestorePoint:
    """Where a live recovery resumes: `step`, from the in-memory tier (`source` MEMORY) or
    from the durable checkpoint at `path` (`source` DURABLE)."""

    step: int
    source: CheckpointTier
    path: str | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "source", CheckpointTier(self.source))
        except ValueError:
            raise ValueError(f"RestorePoint.source must be {MEMORY.value!r} or {DURABLE.value!r}, "
                             f"got {self.source!r}") from None
        if self.step < 0:
            raise ValueError(f"RestorePoint.step must be >= 0, got {self.step}")
        if self.source is DURABLE and not self.path:
            raise ValueError("a durable RestorePoint names its checkpoint folder (path)")

    def spool_attrs(self) -> dict[str, Any]:
        """The point as the restore's spool attributes."""
        return {"restore_step": self.step, "restore_tier": self.source.value,
                **({"path": self.path} if self.path else {})}


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    """Mean BCE loss and AUC over `examples` held-out rows (every rank's)."""

    loss: float
    auc: float
    examples: int

    @classmethod
    def of(cls, measured: Mapping[str, Any] | None) -> Evaluation | None:
        """From `evaluate.evaluate`'s numbers (None or empty: nothing was evaluated)."""
        if not measured:
            return None
        return cls(loss=float(measured["loss"]), auc=float(measured["auc"]), examples=int(measured["examples"]))

    def spool_attrs(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class IntervalChoice:
    """The durable checkpoint interval a rank chose after its probe save (`ett.checkpoint_interval`):
    `interval_steps` (= `interval_s` / `step_s`), Young's and Daly's intervals, the expected
    wasted training at that interval, from the measured save blocking and step time."""

    interval_steps: int
    interval_s: float
    young_s: float
    daly_s: float
    expected_wasted_s: float
    save_blocking_s: float
    step_s: float
    expected_failures: float


@dataclass(frozen=True, kw_only=True)
class MemoryIntervalChoice:
    """The in-memory tier's interval, chosen as `IntervalChoice` is from a memory copy's
    blocking (`save_blocking_s`) and no shorter than its background work (`background_s`)."""

    interval_steps: int
    save_blocking_s: float
    background_s: float
    expected_wasted_s: float


@dataclass(frozen=True, kw_only=True)
class CheckpointReport:
    """A rank's checkpoint saves in its attempt: the seconds each durable save and each
    in-memory copy blocked the loop, and the intervals it chose (None: not chosen, e.g. a
    fixed interval or no probe)."""

    blocking_s: tuple[float, ...] = ()
    memory_blocking_s: tuple[float, ...] = ()
    interval: IntervalChoice | None = None
    memory_interval: MemoryIntervalChoice | None = None

    @property
    def saves(self) -> int:
        return len(self.blocking_s)

    @property
    def memory_saves(self) -> int:
        return len(self.memory_blocking_s)


@dataclass(frozen=True, kw_only=True)
class CompileReport:
    """What the compiler did in the rank's process, and whether the compile-cache archive hit."""

    stats: CompileStats = field(default_factory=CompileStats)
    cache_hit: bool = False


@dataclass(frozen=True, kw_only=True)
class AnchorHandOff:
    """One rank's part of the anchor checkpoint, handed off in host memory so the rank can
    release its device before the anchor is on disk (`Switches.release_before_seal`): the
    files DCP wrote for it (`checkpoint/host_writer.py`; rank 0's include `.metadata`), its
    data cursor (JSON, as a periodic save's manifest keeps it), the folder's root and step, and
    on rank 0 the anchor marker to write once the folder is sealed. The driver writes, seals
    and marks it after the release (`trainer/group/anchor_seal.py`)."""

    rank: int
    step: int
    world_size: int
    root: str  # the run's checkpoint folder
    files: tuple[tuple[str, bytes], ...]  # (name, bytes), written as they are
    cursor: str  # JSON
    anchor: AnchorInfo | None = None  # rank 0's

    @property
    def nbytes(self) -> int:
        return sum(len(data) for _, data in self.files)


@dataclass(frozen=True, kw_only=True)
class RankResult:
    """A rank that finished its attempt: the last step it trained (`final_step`) and that
    step's loss, the steps of this attempt and their rates (examples over every rank), the
    median step time (fetch to end of a step) and the time in the step events' record calls,
    its anchor checkpoint (rank 0 names the folder; None: no anchor written), the held-out
    evaluation at the end and, on a cold start, before training, when its training loop began
    and when it finished."""

    rank: int
    attempt: int
    final_step: int
    steps_this_attempt: int
    loss: float
    steps_per_s: float
    examples_per_s: float
    step_s_median: float | None
    record_s: float
    checkpoint: CheckpointReport
    compile: CompileReport
    anchor: str | None = None
    anchor_handoff: AnchorHandOff | None = None  # the anchor in host memory, sealed by the driver after the release
    eval: Evaluation | None = None
    eval_start: Evaluation | None = None
    finished_at: float | None = None
    trained_from: float | None = None  # when its training loop began (init, restore, compile done)


@dataclass(frozen=True, kw_only=True)
class WorkerInfo:
    """Where a trainer actor's process runs: its pid on node `node_id` (address `node_ip`),
    when the process started (`created_at`; for a rank, never before the driver asked for it)
    and when it answered (`ready_at`)."""

    pid: int
    node_ip: str
    node_id: str
    created_at: float
    ready_at: float
    rss_bytes: int | None = None  # the process's resident memory when it answered


@dataclass(frozen=True, kw_only=True)
class StageRequest:
    """A prewarmed worker's staging of the anchor its next run will likely warm start from
    (`checkpoint/staged_anchor.py`): the folder, the most bytes it may hold, and how long it
    waits for the folder's seal."""

    path: str
    max_bytes: int
    wait_s: float = 60.0


class StagingState(str, Enum):
    """Where a pooled worker's staging of an anchor stands."""

    WAITING = "waiting for its seal"
    READING = "reading"
    STAGED = "staged"
    FAILED = "not staged"
    TAKEN = "handed to a restore"
    DISCARDED = "dropped"


@dataclass(frozen=True, kw_only=True)
class StagingStatus:
    """A pooled worker's staging of its next run's likely parent, as the worker sees it now
    (`checkpoint/staged_anchor.py`): `ettflow pool status` says what it holds, not what it was
    asked to. `nbytes` and `read_s` once staged; `error` why it was not."""

    path: str
    state: StagingState
    nbytes: int = 0
    read_s: float | None = None
    error: str | None = None

    def describe(self) -> str:
        if self.state is StagingState.STAGED:
            took = f", read and checked in {self.read_s:.2f} s" if self.read_s is not None else ""
            return f"stages {self.path} ({self.nbytes / 2**20:.1f} MiB in memory{took})"
        if self.state is StagingState.FAILED:
            return f"staging {self.path} failed: {self.error}"
        return f"stages {self.path}: {self.state.value}"


class Repair(Enum):
    """What became of a damaged archive that a pool's prewarmed worker refused (`rank/spare.py`).
    The processes that miss a key take turns at its cold compile (`cold_claim.py`: the pool's
    workers, a run's ranks, spares), so one of them saves a new archive, and another may restore
    that and compile warm."""

    REPLACED = "replaced"  # this worker compiled cold and replaced it
    REPLACED_BY_ANOTHER = "replaced_by_another"  # this worker compiled cold; another's new archive came first
    # another process saved the archive since (a new one, or the one refused mid-save, whole now):
    # this worker restored it and compiled warm
    RESTORED_REPLACEMENT = "restored_replacement"
    NOT_REPLACED = "not_replaced"  # this worker compiled cold; its save was skipped (the log says why)


@dataclass(frozen=True, kw_only=True)
class PrewarmTimings:
    """A prepared worker's `prewarm` (spare.py): building the dense part, compiling it (with
    the compile cache's hit; None: not compiled, or no cache), reading the data footers, and
    the whole of it from `started_at` (the process start) to `ready_at`."""

    build_s: float
    compile_s: float
    cache_hit: bool | None
    footers_s: float
    started_at: float | None = None
    ready_at: float | None = None
    prewarm_s: float | None = None
    cache_miss: str | None = None  # the compile cache's archive was refused as damaged (`RestoreMiss`'s value)
    cache_reason: str = ""  # ... and why
    cache_repair: str | None = None  # ... and what became of it (`Repair`'s value)
    # the archive holds what this prewarm compiled cold: its own save (its turn at the cold
    # compile, or a repair) or another process's valid archive of the key, found after it; the run
    # does not save it again (a second save rewrites the archive while other ranks restore it)
    cache_stored: bool = False

    def spool_attrs(self) -> dict[str, Any]:
        """As a `spare_start` event's attributes."""
        return {"build_s": self.build_s, "compile_s": self.compile_s, "cache_hit": self.cache_hit,
                "footers_s": self.footers_s, **({"prewarm_s": self.prewarm_s} if self.prewarm_s is not None else {}),
                **({"cache_miss": self.cache_miss, "cache_reason": self.cache_reason,
                    "cache_repair": self.cache_repair} if self.cache_miss else {}),
                **({"cache_stored": True} if self.cache_stored else {})}


@dataclass(frozen=True, kw_only=True)
class PollStatus:
    """One look at an attempt's ranks (`WorkerGroup.poll`): the ranks that finished since the
    last look, with their results, and the failures seen (a rank's process lost, or raised)."""

    finished: Mapping[int, RankResult] = field(default_factory=dict)
    failed: tuple[Failure, ...] = ()


@dataclass(frozen=True)
class StartSample:
    """One run's start, as its group measured it at its release: seconds from asking for its
    ranks to the last of them beginning its training loop; `pooled`: every rank came from the
    pool (False: every rank started its own process)."""

    seconds: float
    pooled: bool


@dataclass(frozen=True)
class PooledInfo:
    """One thing the cluster's warm pool holds (`group/pool_service.py`), as `ettflow pool status`
    lists it (it crosses from the pool's actor to the asking process)."""

    # "worker", "keeper", "run's worker" / "run's keeper" (taken, watched), "planned", "decided"
    # (the model's last release decided to hold nothing: `rule` none, `why` its numbers), "lost"
    # (the previous service died holding things: `requested_at` its last beat, `pool_journal.py`)
    kind: str
    model: str  # the model's name in the config (its shape is the key's digest)
    key: str  # a short digest of the warm key
    state: str  # "prewarming" or "ready" (a failed worker is dropped)
    requested_at: float
    ready_at: float | None
    node: str | None
    rule: str = ""  # the hold rule it is held under (`group/hold_rule.py`)
    why: str = ""  # the rule's numbers (the model's measured prewarm, the schedule)
    actor: str = ""  # a keeper's Ray name (`state_keeper.pooled_keeper_name`), as the run's warnings give it
    staging: str = ""  # a worker's staging of its next run's parent, as the worker answered (`StagingStatus`)

    @property
    def holds_actor(self) -> bool:
        """A process the pool holds now (a worker or keeper, pooled or taken by a run); the
        other lines are what it plans, decided or lost."""
        return self.kind in ("worker", "keeper") or self.kind.startswith("run's")
