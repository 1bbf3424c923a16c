"""The fleet simulator: one refresh at any scale, as the phase events the trainer writes.

A pure discrete-event model of one refresh (issue 41). It emits the trainer's own event
vocabulary, so `run_metrics.compute_run_metrics` computes its ETT, capETT and six components:
one definition of the metric for measured and simulated runs.

One refresh (`simulate_refresh`), times from its submission (0):

- the pool's prewarm (`Policy.prewarm`): every rank's worker held `JobCosts.prewarm_s` before
  the submission (a pooled-rank holding, just in time; the start costs are then the warm ones).
  Under the keep-alive (`Policy.keep_alive_gap_s`: the run comes that long after the release
  that started the prewarm) the workers are requested at the release and held until the run
  takes them, if it comes while they are ready and kept (`Policy.keep_alive_s` after ready);
  otherwise they are released unused `keep_alive_s` after they were ready and the run starts
  cold (`hold_rule.decide_hold`'s keep-alive prices the same);
- an attempt: scheduling, trainer init, PT2 compile (the cold or warm start, `StartCosts`);
  training in blocks of equal length, a durable save's blocking after every checkpoint interval;
  after the last block the devices stay held for `shutdown_s` (anchor, evaluation, release);
- failures: a Poisson process at the job's rate (`FailureModel.rate_per_s(gpus)`), running while
  an attempt's ranks run (its start, training and saves; not during a recovery's hand-off or the
  final shutdown). A failure is detected `detect_s` later. Then:
  - live recovery with a ready spare node: the next attempt hands the lost node's place to the
    spare (`live_recovery_s`: hand-off, process-group rebuild, restore) and replays from the last
    checkpoint; a new spare node is started and is ready `spare_start_s` later;
  - live recovery with no ready spare: the same, a spare started at the loss (`spare_start_s`
    more on the critical path);
  - without live recovery: every rank restarts (`restart_s`: teardown, scheduling, init, compile,
    restore), then replays from the last checkpoint.
  The work since the last checkpoint is lost (in flight, or replayed: wasted training). A live
  recovery restores from the same interval's checkpoint (the host-memory copy, where the
  trainer keeps one more often, would replay less: this errs on the side of the baseline).
- spares (`Policy.spares`): spare nodes held from the submission to the end, each
  `gpus_per_node` slots; one used is replaced by a new one (held from its start).

The checkpoint interval is `Policy.interval_s`, or Young's for the job's rate and the save's
blocking (`checkpoint_interval.young_interval`), at least one block. A block is at most an
interval / `BLOCKS_PER_INTERVAL` and the run emits at most `MAX_BLOCKS` of them, and the
intervals no failure interrupts are one step record and their saves (`ahead` in
`simulate_refresh`: the same numbers), so a 16k-GPU run of hours simulates in milliseconds.
The rank dimension is one rank whose `scheduling` record carries `world_size = gpus` (the
capacity counts every GPU as one slot).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from .checkpoint_interval import young_interval
from .events import FAILURE, FAILURE_DETECTED, SUBMITTED, PhaseEvent
from .spare_sizing import AT_LOSS, RULE, SpareInputs

BLOCKS_PER_INTERVAL = 4
MAX_BLOCKS = 800
DRIVER = -1


@dataclass(frozen=True, kw_only=True)
class StartCosts:
    """An attempt's start, seconds: the ranks placed, the trainer built, the model compiled."""

    scheduling_s: float
    init_s: float
    compile_s: float

    @property
    def total_s(self) -> float:
        return self.scheduling_s + self.init_s + self.compile_s


@dataclass(frozen=True, kw_only=True)
class JobCosts:
    """A model's costs, seconds, as one refresh pays them (see the module docstring). `measured`
    names the fields read from runs; the others are assumed (`ASSUMED_COSTS`)."""

    cold: StartCosts  # a start on fresh workers
    warm: StartCosts  # a start on prewarmed (pooled) workers
    prewarm_s: float  # a pooled worker's prewarm, held before the run
    train_s: float  # new data per refresh, in training seconds (the window)
    save_blocking_s: float  # one durable checkpoint's blocking (CSBT)
    detect_s: float  # a failure to its detection
    restart_s: float  # detection to the first step of a restarted attempt (every rank restarts)
    live_recovery_s: float  # detection to the first step when a ready spare takes the lost node
    spare_start_s: float  # a spare node started, to ready (at the loss: on the critical path)
    shutdown_s: float  # after the last step, devices held
    measured: frozenset[str] = frozenset()


# Stated defaults where a model's runs cannot say (seconds). Start and restart costs are the
# study's fleet job shape (cold compile 2,050 s, 254 s from a reusable cache; scheduling and
# init of a large job); the rest is this machine's order of magnitude (BENCHMARKS.md).
ASSUMED_COSTS = JobCosts(
    cold=StartCosts(scheduling_s=300.0, init_s=400.0, compile_s=2050.0),
    warm=StartCosts(scheduling_s=30.0, init_s=120.0, compile_s=254.0),
    prewarm_s=600.0, train_s=4 * 3600.0, save_blocking_s=30.0, detect_s=60.0, restart_s=900.0,
    live_recovery_s=60.0, spare_start_s=600.0, shutdown_s=120.0)


@dataclass(frozen=True)
class FailureModel:
    """A job's failure rate against its GPU count, from published fleet data: `points` are
    (GPUs, job MTTF in hours); between and beyond two points MTTF is a power law in GPUs, with
    one point it is inversely proportional to them (a constant rate per GPU)."""

    name: str
    points: tuple[tuple[int, float], ...]
    source: str

    def mttf_h(self, gpus: int) -> float:
        if gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {gpus}")
        pts = sorted(self.points)
        if len(pts) == 1:
            (n0, m0), = pts
            return m0 * n0 / gpus
        (n0, m0), (n1, m1) = (pts[0], pts[1]) if gpus <= pts[1][0] else (pts[-2], pts[-1])
        alpha = math.log(m0 / m1) / math.log(n1 / n0)
        return m0 * (n0 / gpus) ** alpha

    def rate_per_s(self, gpus: int) -> float:
        return 1.0 / (self.mttf_h(gpus) * 3600.0)


# Job MTTF 7.9 h at 1,024 GPUs and 1.8 h at 16,384 A100s (Kokolis et al., "Revisiting
# Reliability in Large-Scale Machine Learning Research Clusters", HPCA 2025).
HPCA25 = FailureModel("hpca25", ((1024, 7.9), (16384, 1.8)),
                      "HPCA'25 (Meta RSC): job MTTF 7.9 h at 1,024 GPUs, 1.8 h at 16,384 A100s")
# 419 unexpected interruptions in 54 days of pre-training on 16,384 H100s (Llama 3 report, 2024).
LLAMA3 = FailureModel("llama3", ((16384, 54 * 24 / 419),),
                      "Llama 3 (2024): 419 unexpected interruptions in 54 days on 16,384 H100s")
FAILURE_MODELS = {m.name: m for m in (HPCA25, LLAMA3)}


def constant_mttf(mttf_h: float, gpus: int) -> FailureModel:
    """A user's own rate: job MTTF `mttf_h` at `gpus`, constant per GPU."""
    return FailureModel(f"mttf {mttf_h:g} h at {gpus}", ((gpus, mttf_h),), "given on the command line")


@dataclass(frozen=True, kw_only=True)
class Policy:
    """What a run does: live recovery (else every rank restarts), spare nodes held, the
    checkpoint interval (None: Young's for the job), prewarmed workers (warm start)."""

    name: str
    live_recovery: bool
    spares: int = 0
    interval_s: float | None = None
    prewarm: bool = False
    gpus_per_node: int = 8
    keep_alive_gap_s: float | None = None  # a keep-alive prewarm: the release -> this run (None: just in time)
    keep_alive_s: float = 0.0  # how long a ready worker is kept for it

    def __post_init__(self) -> None:
        if self.spares < 0 or self.gpus_per_node < 1 or (self.interval_s is not None and self.interval_s <= 0) \
                or self.keep_alive_s < 0 or (self.keep_alive_gap_s is not None and self.keep_alive_gap_s < 0):
            raise ValueError(f"policy out of range: {self}")


# the untuned user's run: cold start, every rank restarts, a checkpoint every 30 minutes
BASELINE = Policy(name="baseline", live_recovery=False, interval_s=1800.0)
OPTIMIZED = Policy(name="optimized", live_recovery=True, spares=1, prewarm=True)


@dataclass
class _Run:
    """The event log under construction (internal to `simulate_refresh`)."""

    run_id: str
    events: list[PhaseEvent] = field(default_factory=list)
    attempt: int = 0

    def ev(self, phase: str, start: float, end: float, rank: int = 0, **attrs) -> None:
        self.events.append(PhaseEvent(run_id=self.run_id, attempt=self.attempt, rank=rank, phase=phase,
                                      start=start, end=end, attrs=attrs))

    def mark(self, phase: str, at: float, **attrs) -> None:
        self.ev(phase, at, at, DRIVER, **attrs)


def recovery_s(costs: JobCosts, *, live: bool, spare_ready: bool) -> float:
    """A failure's detection to the next attempt's first step, before its replay: the one
    recovery model, which `simulate_refresh` plays and the spare decision prices
    (`spare_inputs`). Live: the lost node's place handed to a spare, started at the loss unless
    one was `spare_ready`; else every rank restarts."""
    if not live:
        return costs.restart_s
    return costs.live_recovery_s + (0.0 if spare_ready else costs.spare_start_s)


def restart_share(costs: JobCosts, start: StartCosts) -> float:
    """The share of `start` a restart plays again: the measured restart split in the start's
    proportions (`simulate_refresh`), its init and compile on the ranks' running clock
    (`simulate_inputs.measure_run` places a replay's failures on that clock with it)."""
    return min(1.0, costs.restart_s / start.total_s) if start.total_s > 0 else 0.0


def spare_inputs(costs: JobCosts, *, world_size: int, wall_s: float, rate_per_s: float, scripted_failures: int = 0,
                 live_at_loss: bool = True, slots_per_spare: float = 1.0, sources: str = "") -> SpareInputs:
    """What the spare decision (`spare_sizing.size_spares`) reads, from this model's costs: the
    TTR with a ready spare and without one (a spare started at the loss where the placement
    recovers live without a held one, `live_at_loss`; else every rank restarts), and a used
    spare's replacement (its start). Its closed form is this simulator's expectation: a unit
    test checks that it holds the number of spares the replications find best."""
    return SpareInputs(
        world_size=world_size, wall_s=wall_s, rate_per_s=rate_per_s, scripted_failures=scripted_failures,
        ttr_with_s=costs.detect_s + recovery_s(costs, live=True, spare_ready=True),
        ttr_without_s=costs.detect_s + recovery_s(costs, live=live_at_loss, spare_ready=False),
        replace_s=costs.spare_start_s, slots_per_spare=slots_per_spare, sources=sources)


def interval_of(costs: JobCosts, policy: Policy, rate_per_s: float) -> float:
    """The checkpoint interval the run trains with (seconds of training)."""
    if policy.interval_s is not None:
        return policy.interval_s
    if rate_per_s <= 0:
        return costs.train_s
    return young_interval(costs.save_blocking_s, 1.0 / rate_per_s)


def simulate_refresh(costs: JobCosts, policy: Policy, failures: FailureModel | None, gpus: int, rng: random.Random,
                     *, run_id: str = "sim", failure_times: Sequence[float] | None = None) -> list[PhaseEvent]:
    """One refresh's events (see the module docstring). `failure_times`: failures at these
    seconds of the ranks' running time instead of drawn ones (a measured run replayed,
    `simulate_inputs.measure_run` says how its failures' running times are read)."""
    rate = failures.rate_per_s(gpus) if failures is not None else 0.0
    interval = min(max(interval_of(costs, policy, rate), 1e-6), costs.train_s)
    block = max(interval / BLOCKS_PER_INTERVAL, costs.train_s / MAX_BLOCKS)
    per_interval = max(1, round(interval / block))
    blocks = max(1, math.ceil(costs.train_s / block - 1e-9))
    block = costs.train_s / blocks
    node = policy.gpus_per_node
    scripted = sorted(failure_times) if failure_times is not None else None

    run = _Run(run_id)
    run.mark(SUBMITTED, 0.0)
    warm = policy.prewarm
    if policy.prewarm and policy.keep_alive_gap_s is None:
        run.ev("spare_start", -costs.prewarm_s, 0.0, DRIVER, for_rank=0, pooled=True, taken_at=0.0, slots=gpus,
               rule="just-in-time")
    elif policy.prewarm:  # requested at the release; taken if the run comes while it is ready and kept
        requested = -policy.keep_alive_gap_s
        ready = requested + costs.prewarm_s
        warm = ready <= 0.0 <= ready + policy.keep_alive_s
        if warm:
            run.ev("spare_start", requested, ready, DRIVER, for_rank=0, pooled=True, taken_at=0.0, slots=gpus,
                   rule="keep-alive")
        else:
            run.ev("spare_start", requested, ready, DRIVER, pooled=True, used=False,
                   released_at=ready + policy.keep_alive_s, slots=gpus, rule="keep-alive")
    # when each held spare node is (or becomes) ready; each was requested `spare_start_s` before
    spares: list[float] = [costs.spare_start_s] * policy.spares
    spare_events: list[tuple[float, bool, float]] = []  # (requested, used, ended) per spare node

    # the failure process's clock: the ranks' running time (their start, training and saves; not
    # scheduling, a hand-off or a detection), for drawn and replayed failures alike: a replayed one
    # then falls at the same point of the training however far the replay's recoveries, each its
    # mean, drift from the measured ones (on a wall clock, a replay that ran 0.4 s ahead finished
    # before a measured run's last failure and lost it); one due while no rank runs fires as the
    # ranks start again
    busy = 0.0

    def next_failure() -> float:
        if scripted is not None:
            return scripted.pop(0) if scripted else math.inf
        return busy + rng.expovariate(rate) if rate > 0 else math.inf

    fail_at = next_failure()

    def run_for(t: float, seconds: float) -> tuple[float, float | None]:
        """Advance the ranks `seconds` from `t`: (end, None) or (t_failed, the failure's time)."""
        nonlocal busy
        now = busy
        if now + seconds <= fail_at:
            busy += seconds
            return t + seconds, None
        into = max(0.0, fail_at - now)
        busy += into
        return t + into, t + into

    def ahead(t: float, position: int, saved: int) -> tuple[float, int, int, float | None]:
        """The whole intervals (each its blocks, then its save) that end before the next failure
        and before the training's last save, from `position` (an interval's start): one
        `train_step` for their blocks, then their saves, not a step record per block between them
        (the blocks after the last save are recorded one by one, as before a failure). A failure
        restarts from the last save either way, and the metric code reads the steps by their
        cursors, so ETT and its components are the same (and `measure_run` reads the saves'
        count and steps); an attempt's first step record is the long one, so no later block
        reads as a stall. Returns (t, position, saved, failed_at)."""
        now = busy
        room = fail_at - now - 1e-9  # the blocks and saves that fit before the failure
        saves_left = (blocks - position - 1) // per_interval  # the saves between here and the end
        whole = per_interval * block + costs.save_blocking_s  # an interval and its save
        intervals = saves_left if room >= saves_left * whole else max(int(room // whole), 0)
        trained, saves = intervals * per_interval, intervals
        if trained <= 1:
            return t, position, saved, None
        end, failed_at = run_for(t, trained * block)
        if failed_at is not None:  # not expected (room was checked): the blocks are lost as a failure would lose them
            return end, position, saved, failed_at
        run.ev("train_step", t, end, cursor_start=position, cursor_end=position + trained)
        start, t, position = position, end, position + trained
        for k in range(1, saves + 1):  # one record per save, back to back: their count and steps as trained
            end, failed_at = run_for(t, costs.save_blocking_s)
            if failed_at is not None:
                return end, position, saved, failed_at
            run.ev("checkpoint_save_blocking", t, end, step=start + k * per_interval)
            t, saved = end, start + k * per_interval
        return t, position, saved, None

    t, done, saved = 0.0, 0, 0  # done: blocks trained (new data); saved: blocks in the last checkpoint
    start = costs.warm if warm else costs.cold
    restart_kind: str | None = None  # how the current attempt began after a failure
    while True:
        failed_at = None
        if restart_kind in (None, "restart"):  # a start: every rank placed, built, compiled
            scale, teardown = 1.0, 0.0
            if restart_kind == "restart":  # the measured restart, its start's parts in proportion
                scale = restart_share(costs, start)
                teardown = max(0.0, costs.restart_s - start.total_s)
                run.ev("shutdown", t, t + teardown, DRIVER)  # the failed attempt's teardown, restore
                t += teardown
            run.ev("scheduling", t, t + start.scheduling_s * scale, DRIVER, world_size=gpus)
            t += start.scheduling_s * scale
            for phase, secs in (("device_init", start.init_s * scale), ("pt2_compile", start.compile_s * scale)):
                end, failed_at = run_for(t, secs)
                if failed_at is not None:
                    break
                run.ev(phase, t, end)
                t = end
        else:
            recovery = recovery_s(costs, live=True, spare_ready=restart_kind != "at_loss")
            run.ev("spare_handoff", t, t + recovery, DRIVER, world_size=gpus)  # no failure drawn in it
            t += recovery
        position = saved
        if failed_at is None:
            t, position, saved, failed_at = ahead(t, position, saved)
            done = max(done, position)
        while failed_at is None and position < blocks:
            end, failed_at = run_for(t, block)
            if failed_at is not None:
                break
            run.ev("train_step", t, end, cursor_start=position, cursor_end=position + 1)
            t, position = end, position + 1
            done = max(done, position)
            if position % per_interval == 0 and position < blocks:
                end, failed_at = run_for(t, costs.save_blocking_s)
                if failed_at is not None:
                    break
                run.ev("checkpoint_save_blocking", t, end, step=position)
                t, saved = end, position
        if failed_at is None:
            run.ev("shutdown", t, t + costs.shutdown_s, DRIVER)
            t += costs.shutdown_s
            break
        run.mark(FAILURE, failed_at, failure_class="infrastructure", reason="simulated node failure")
        t = failed_at + costs.detect_s
        run.mark(FAILURE_DETECTED, t, failure_class="infrastructure")
        fail_at = next_failure()
        if not policy.live_recovery:
            restart_kind = "restart"
        elif any(ready <= t for ready in spares):
            i = next(i for i, ready in enumerate(spares) if ready <= t)
            spare_events.append((spares[i] - costs.spare_start_s, True, t))
            spares[i] = t + costs.spare_start_s  # its replacement, held from now
            restart_kind = "live"
        else:
            restart_kind = "at_loss"
            run.ev("spare_start", t, t + costs.spare_start_s, DRIVER, used=True, taken_at=t + costs.spare_start_s,
                   slots=node, rule=AT_LOSS)
        run.attempt += 1
    for ready in spares:  # the spares still held at the end: released unused
        spare_events.append((ready - costs.spare_start_s, False, t))
    for requested, used, ended in spare_events:
        attrs = {"used": True, "taken_at": ended} if used else {"used": False, "released_at": ended}
        run.ev("spare_start", requested, requested, DRIVER, slots=node, rule=RULE, **attrs)
    return run.events




@dataclass(frozen=True)
class Estimate:
    """A mean over replications and its 95% confidence half-width (normal approximation)."""

    mean: float
    half_width: float

    @staticmethod
    def of(values: Sequence[float]) -> Estimate:
        n = len(values)
        mean = sum(values) / n
        sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
        return Estimate(mean, 1.96 * sd / math.sqrt(n))


@dataclass(frozen=True)
class SimSummary:
    """A policy at one GPU count over `replications` simulated refreshes."""

    policy: Policy
    gpus: int
    replications: int
    mttf_h: float
    interval_s: float
    ett: Estimate
    cap_ett: Estimate
    nof: float
    components: dict[str, float]  # mean exposed seconds per component


def replicate(costs: JobCosts, policy: Policy, failures: FailureModel, gpus: int, *, replications: int = 200,
              seed: int = 0) -> SimSummary:
    """`replications` refreshes, replication i drawn from `Random(seed + i)` whatever the policy
    (common random numbers: policies are compared on the same failure draws where they line up)."""
    from .run_metrics import compute_run_metrics

    if replications < 1:
        raise ValueError(f"replications must be >= 1, got {replications}")
    runs = [compute_run_metrics(simulate_refresh(costs, policy, failures, gpus, random.Random(seed + i),
                                                 run_id=f"sim-{i}")) for i in range(replications)]
    names = runs[0].components
    return SimSummary(
        policy=policy, gpus=gpus, replications=replications, mttf_h=failures.mttf_h(gpus),
        interval_s=min(interval_of(costs, policy, failures.rate_per_s(gpus)), costs.train_s),
        ett=Estimate.of([m.ett_pct for m in runs]), cap_ett=Estimate.of([m.capacity_ett_pct for m in runs]),
        nof=sum(m.nof for m in runs) / replications,
        components={k: sum(m.components[k] for m in runs) / replications for k in names})
