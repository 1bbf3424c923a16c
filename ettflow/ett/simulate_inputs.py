"""The simulator's inputs measured from runs: a run's costs, policy and failure times.

`measure_run(events)` reads one run's events (as the trainer wrote them) into what
`simulate.simulate_refresh` takes, so the run can be replayed (its own failure times) and its
measured ETT compared with the simulated one (the validation), and a model's runs summed into
its costs (`model_costs`: the median of each cost over the runs that measured it).

- the start: TTS split as the sweep splits what happened before the first step (scheduling,
  compile; init the rest); pooled ranks make it a warm start, their held time per slot the
  prewarm;
- training: the effective seconds (new data); the checkpoint interval from how many steps
  were saved (spread evenly); a save's blocking: the durable save's mean (CSBT) plus the in-memory copies'
  blocking spread over the durable saves;
- failures: their times on the ranks' running clock (the simulator's failure clock: from the
  end of the start's scheduling, less each recovery from its failure to the next attempt's
  first step, a restart's start kept as the simulator keeps it), so a replay fails at the same
  point of its training; detection (mean), each recovery from detection
  to the next attempt's first step less its replay: a restart (every rank), a live recovery
  with a ready spare, or one whose spare started at the loss (its start measured apart);
- the shutdown: from the last step to the end of the wall.

Pure: no I/O.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

from .events import TRAIN_STEP, PhaseEvent
from .run_metrics import RunMetrics, compute_run_metrics
from .simulate import ASSUMED_COSTS, JobCosts, Policy, StartCosts, restart_share
from .spare_sizing import AT_LOSS, SHARED


@dataclass(frozen=True)
class MeasuredRun:
    """A run as the simulator takes it, beside what it measured."""

    run_id: str
    costs: JobCosts
    policy: Policy
    gpus: int
    failure_times: tuple[float, ...]
    metrics: RunMetrics


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def measure_run(events: Sequence[PhaseEvent]) -> MeasuredRun:
    """One run's costs, policy and failure times (see the module docstring)."""
    m = compute_run_metrics(events)
    w0 = m.wall_start
    if not m.started_training:
        raise ValueError(f"run {m.run_id} trained nothing: it has no costs to measure")
    first = w0 + m.tts_s
    # the start's exposed parts: the same sweep over what happened before the first step
    before = compute_run_metrics([e for e in events if e.attempt == 0 and e.end <= first + 1e-9]).components
    sched = min(before["scheduling"], m.tts_s)
    compile_s = min(before["pt2_compile"], m.tts_s - sched)
    start = StartCosts(scheduling_s=sched, init_s=m.tts_s - sched - compile_s, compile_s=compile_s)

    steps = sorted((e for e in events if e.phase == TRAIN_STEP and e.rank == 0), key=lambda e: e.start)
    saved = {e.info.step for e in events if e.phase == "checkpoint_save_blocking" and e.info.step}
    train_s = m.effective_s
    interval_s = train_s / (len(saved) + 1)  # the saves' steps spread evenly (a probe save's included)
    durable = m.phases.get("checkpoint_save_blocking")
    memory = m.phases.get("memory_save_blocking")
    n_saves = max(m.checkpoint_saves, 1)
    blocking = (durable.exposed_s if durable else 0.0) + (memory.exposed_s if memory else 0.0)

    handoffs = {e.attempt: e for e in events if e.phase == "spare_handoff" and e.info.handed}
    at_loss = [e for e in events if e.phase == "spare_start" and e.info.for_rank is None and e.info.rule == AT_LOSS]
    # a run's own spares held ahead (not its parts of a cluster pool's shared spares: the replay
    # prices a run's own; a sharing run replays as holding none of its own)
    held_spares = [e for e in events if e.phase == "spare_start" and e.info.for_rank is None and e.attempt == 0
                   and e.info.rule not in (AT_LOSS, SHARED)]
    restarts, lives, starts = [], [], [e.duration for e in at_loss]
    for f in m.failures:
        nxt = f.attempt + 1
        resumed = next((e.start for e in steps if e.attempt == nxt), None)
        if resumed is None:
            continue
        recovery = resumed - f.detected_at
        if nxt not in handoffs:
            restarts.append(recovery)
        elif any(abs(e.start - f.detected_at) < recovery for e in at_loss):
            lives.append(recovery - (_mean(starts) or 0.0))
        else:
            lives.append(recovery)
    d = ASSUMED_COSTS
    measured = {"cold", "warm", "train_s", "save_blocking_s", "shutdown_s"}
    pooled = m.held.pooled_s > 0
    values = {
        "restart_s": _mean(restarts), "live_recovery_s": _mean(lives), "spare_start_s": _mean(starts),
        "detect_s": _mean([f.detected_at - f.failed_at for f in m.failures]),
        "prewarm_s": m.held.pooled_s / m.held.slots if pooled else None,
    }
    measured |= {k for k, v in values.items() if v is not None}
    costs = JobCosts(
        cold=start, warm=start, train_s=train_s, save_blocking_s=blocking / n_saves,
        shutdown_s=max(0.0, m.wall_end - (steps[-1].end if steps else first)),
        **{k: (getattr(d, k) if v is None else v) for k, v in values.items()}, measured=frozenset(measured))
    live = bool(handoffs) or bool(held_spares) or bool(at_loss)
    policy = Policy(name="measured", live_recovery=live, spares=len(held_spares), interval_s=max(interval_s, 1e-3),
                    prewarm=pooled, gpus_per_node=1)
    return MeasuredRun(run_id=m.run_id, costs=costs, policy=policy, gpus=m.held.slots,
                       failure_times=_running_times(m, steps, costs, handoffs), metrics=m)


def _running_times(m: RunMetrics, steps: Sequence[PhaseEvent], costs: JobCosts,
                   handoffs: dict[int, PhaseEvent]) -> tuple[float, ...]:
    """Each failure's time on the ranks' running clock, as `simulate.simulate_refresh` keeps
    it: the ranks run from the end of the start's scheduling to the first failure, and in each
    later attempt from its first step (a restart: less its start's init and compile, which the
    simulator runs on that clock, scaled as it scales them) to its failure. A failure of an
    attempt that never stepped (lost in its hand-off or start) is due as its ranks start."""
    first_step: dict[int, float] = {}
    for e in steps:
        first_step.setdefault(e.attempt, e.start)
    start = costs.cold  # measure_run's cold and warm starts are the same measured one
    scale = restart_share(costs, start)
    running, out = 0.0, []
    began: float | None = m.wall_start + start.scheduling_s
    for f in sorted(m.failures, key=lambda f: f.failed_at):
        if began is not None:
            running += max(0.0, f.failed_at - began)
        out.append(running)
        resumed = first_step.get(f.attempt + 1)
        restarted = f.attempt + 1 not in handoffs
        began = None if resumed is None else resumed - (scale * (start.init_s + start.compile_s) if restarted else 0.0)
    return tuple(out)


def model_costs(runs: Sequence[MeasuredRun], default: JobCosts = ASSUMED_COSTS) -> JobCosts:
    """A model's costs: each one the median over the runs that measured it, else `default`'s;
    the cold start from runs without pooled ranks, the warm one from runs with them."""
    out = {}
    for f in fields(JobCosts):
        if f.name in ("cold", "warm", "measured"):
            continue
        have = [getattr(r.costs, f.name) for r in runs if f.name in r.costs.measured]
        out[f.name] = statistics.median(have) if have else getattr(default, f.name)
    measured = {name for name in out if any(name in r.costs.measured for r in runs)}
    cold = [r.costs.cold for r in runs if not r.policy.prewarm]
    warm = [r.costs.warm for r in runs if r.policy.prewarm]
    for key, starts in (("cold", cold), ("warm", warm)):
        if starts:
            out[key] = StartCosts(**{f.name: statistics.median(getattr(s, f.name) for s in starts)
                                     for f in fields(StartCosts)})
            measured.add(key)
        else:
            out[key] = getattr(default, key)
    return replace(default, **out, measured=frozenset(measured))
