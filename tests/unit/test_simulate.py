"""The fleet simulator (`ett.simulate`): scripted failures with answers worked out by hand,
the published failure models, a measured run replayed, and the command."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from ettflow.ett.run_metrics import compute_run_metrics
from ettflow.ett.simulate import (
    ASSUMED_COSTS,
    HPCA25,
    LLAMA3,
    OPTIMIZED,
    JobCosts,
    Policy,
    StartCosts,
    constant_mttf,
    recovery_s,
    replicate,
    simulate_refresh,
    spare_inputs,
)
from ettflow.ett.simulate_inputs import measure_run
from ettflow.ett.spare_sizing import size_spares

# a start of 2 + 3 + 5 s, 100 s of new data, a checkpoint every 20 s (blocks of 5 s), saves
# blocking 1 s, detection 2 s, a restart 10 s, a ready spare's hand-off 3 s, a spare's start 30 s
COSTS = JobCosts(cold=StartCosts(scheduling_s=2, init_s=3, compile_s=5),
                 warm=StartCosts(scheduling_s=1, init_s=1, compile_s=1), prewarm_s=8, train_s=100,
                 save_blocking_s=1, detect_s=2, restart_s=10, live_recovery_s=3, spare_start_s=30, shutdown_s=4)


def _run(policy: Policy, gpus: int = 2, failures=(53.0,)):
    # failures on the ranks' running clock: 53 s of it is 55 s from the submission (the 2 s of
    # scheduling before the ranks run)
    return compute_run_metrics(simulate_refresh(COSTS, policy, None, gpus, random.Random(0), failure_times=failures))


def test_a_restart_loses_the_work_in_flight_and_pays_its_start_again():
    # 0-10 start; blocks from 10, saves at 30-31 and 51-52; block 8 (52-57) dies at 55, detected
    # at 57; the restart 57-67 (its start's parts); blocks 8-19 from 67 with saves at 87 and 108;
    # shutdown 129-133
    m = _run(Policy(name="restart", live_recovery=False, interval_s=20))
    assert (m.wall_s, m.tts_s, m.nof) == (133.0, 10.0, 1)
    assert m.components == pytest.approx({"effective_training": 100, "wasted_training": 4 + 5, "pt2_compile": 10,
                                          "trainer_init": 6, "scheduling": 4, "shutdown": 4, "unattributed": 0})
    assert m.failures[0].ttr_s == pytest.approx(10.0)  # detection to the next new step: nothing replayed
    assert m.ett_pct == pytest.approx(100 * 100 / 133) and m.capacity_ett_pct == pytest.approx(m.ett_pct)


def test_a_ready_spare_recovers_live_and_its_holding_counts_in_the_capacity_ett():
    # a spare node of one slot held from 0, ready at 30; taken at the detection (57), the hand-off
    # 57-60, its replacement held 57-126 unused; replay from block 8: none (block 8 never finished)
    m = _run(Policy(name="live", live_recovery=True, spares=1, interval_s=20, gpus_per_node=1))
    assert (m.wall_s, m.nof, m.failures[0].ttr_s) == (126.0, 1, pytest.approx(3.0))
    assert (m.held.spare_s, m.held.unused_spare_s) == (57.0 + 69.0, 69.0)
    assert m.capacity_ett_pct == pytest.approx(100 * 100 * 2 / (126 * 2 + 126))
    # with no spare held, one is started at the loss: its 30 s on the critical path, then held
    at_loss = _run(Policy(name="at-loss", live_recovery=True, spares=0, interval_s=20, gpus_per_node=1))
    assert (at_loss.wall_s, at_loss.held.spare_s, at_loss.held.unused_spare_s) == (156.0, 30.0, 0.0)


def test_a_failure_after_a_save_replays_what_was_trained_since():
    m = _run(Policy(name="restart", live_recovery=False, interval_s=20), failures=(45.0,))  # 47 s wall
    # block 7 (46-51) dies at 47; blocks 4-6 (31-46) trained since the save at 30: replayed after
    # the restart (49-59), 15 s of replay + 1 s in flight + 4 saves. The restart's blocks up to its
    # last save are one step record (`ahead`): the replay is part of it (one replayed record)
    assert m.replayed_steps == 1 and m.components["wasted_training"] == pytest.approx(15 + (49 - 46) + 4)


def test_failure_free_intervals_are_one_step_record_and_change_no_number():
    """The intervals before a failure (and before the last save) are one `train_step` and their
    saves; the blocks after are one record each: the same ETT, capETT, components and saves as a
    record per block (the numbers here are the per-block ones: 10 s start, 100 s of blocks of
    5 s, a save of 1 s every 4 blocks)."""
    events = simulate_refresh(COSTS, Policy(name="restart", live_recovery=False, interval_s=20), None, 2,
                              random.Random(0), failure_times=())
    steps = [(e.attrs["cursor_start"], e.attrs["cursor_end"]) for e in events if e.phase == "train_step"]
    saves = [e.info.step for e in events if e.phase == "checkpoint_save_blocking"]
    assert steps == [(0, 16), (16, 17), (17, 18), (18, 19), (19, 20)] and saves == [4, 8, 12, 16]
    m = compute_run_metrics(events)
    assert (m.wall_s, m.ett_pct, m.components["wasted_training"], m.checkpoint_saves) == (
        118.0, 100 / 118 * 100, 4.0, 4)


def test_the_spare_decision_prices_the_simulators_recoveries():
    inputs = spare_inputs(COSTS, world_size=2, wall_s=100.0, rate_per_s=0.0, scripted_failures=1)
    # a ready spare: detection 2 + hand-off 3; none held: the at-loss spare's 30 s start on top
    assert (inputs.ttr_with_s, inputs.ttr_without_s, inputs.replace_s) == (5.0, 35.0, 30.0)
    assert recovery_s(COSTS, live=True, spare_ready=False) == 33.0 == _run(
        Policy(name="at-loss", live_recovery=True, interval_s=20, gpus_per_node=1)).failures[0].ttr_s
    restarts = spare_inputs(COSTS, world_size=2, wall_s=100.0, rate_per_s=0.0, live_at_loss=False)
    assert restarts.ttr_without_s == 2.0 + 10.0  # a placement with no spare device: every rank restarts


@pytest.mark.parametrize(("gpus", "mttf_h", "spares"), [(8, 2.0, 0), (8, 40.0, 0), (64, 8.0, 0),
                                                       (1024, 2.0, 1), (16384, 8.0, 1), (16384, 40.0, 1)])
def test_the_spare_decision_holds_what_the_simulated_refreshes_find_best(gpus, mttf_h, spares):
    """The decision's closed form (`spare_sizing`) is this simulator's expectation: fed the same
    costs, it holds the number of spare nodes (0 or 1) whose replications give the higher capETT."""
    failures, node = constant_mttf(mttf_h, gpus), 8
    runs = [replicate(ASSUMED_COSTS, replace(OPTIMIZED, spares=k, prewarm=False, gpus_per_node=node), failures, gpus,
                      replications=100) for k in (0, 1)]
    best = max((0, 1), key=lambda k: runs[k].cap_ett.mean)
    wall = ASSUMED_COSTS.train_s / (runs[0].ett.mean / 100)  # the expected wall with no spare
    decided = size_spares(spare_inputs(ASSUMED_COSTS, world_size=gpus, wall_s=wall,
                                       rate_per_s=failures.rate_per_s(gpus), slots_per_spare=node))
    assert decided.spares == best == spares, (decided.reason, [r.cap_ett for r in runs])


def test_prewarmed_workers_start_warm_and_hold_their_slots_before_the_run():
    m = _run(Policy(name="warm", live_recovery=False, interval_s=20, prewarm=True), failures=())
    assert (m.tts_s, m.held.pooled_s) == (3.0, 8.0 * 2)  # the warm start; 2 slots x 8 s of prewarm


def test_failure_models_give_their_published_mttfs():
    assert HPCA25.mttf_h(1024) == pytest.approx(7.9) and HPCA25.mttf_h(16384) == pytest.approx(1.8)
    assert 1.8 < HPCA25.mttf_h(4096) < 7.9  # a power law between the two
    assert LLAMA3.mttf_h(16384) == pytest.approx(54 * 24 / 419)  # 3.09 h
    assert LLAMA3.mttf_h(8192) == pytest.approx(2 * LLAMA3.mttf_h(16384))  # a constant rate per GPU
    assert constant_mttf(10.0, 100).rate_per_s(200) == pytest.approx(2 / (10 * 3600))
    with pytest.raises(ValueError):
        HPCA25.mttf_h(0)


def test_drawn_failures_are_seeded_and_grow_with_the_job():
    policy = Policy(name="restart", live_recovery=False, interval_s=20)
    costs = COSTS.__class__(**{**COSTS.__dict__, "train_s": 3600.0})
    one = [compute_run_metrics(simulate_refresh(costs, policy, HPCA25, 16384, random.Random(s))).nof for s in range(30)]
    again = [compute_run_metrics(simulate_refresh(costs, policy, HPCA25, 16384, random.Random(s))).nof
             for s in range(30)]
    small = [compute_run_metrics(simulate_refresh(costs, policy, HPCA25, 8, random.Random(s))).nof for s in range(30)]
    assert one == again and sum(one) > sum(small)


def test_a_measured_run_replayed_gives_its_own_ett():
    """`measure_run` reads a run's costs, policy and failure times back from its events; the
    simulator fed them reproduces it (here a simulated run stands for a measured one; the e2e
    bench test replays real ones)."""
    for policy in (Policy(name="restart", live_recovery=False, interval_s=20),
                   Policy(name="live", live_recovery=True, spares=0, interval_s=20, gpus_per_node=1)):
        events = simulate_refresh(COSTS, policy, None, 2, random.Random(0), failure_times=(55.0,))
        measured = measure_run(events)
        assert measured.failure_times == (55.0,) and measured.policy.live_recovery == policy.live_recovery
        again = compute_run_metrics(simulate_refresh(measured.costs, measured.policy, None, measured.gpus,
                                                     random.Random(0), failure_times=measured.failure_times))
        assert again.ett_pct == pytest.approx(measured.metrics.ett_pct, abs=0.5), policy
        assert again.capacity_ett_pct == pytest.approx(measured.metrics.capacity_ett_pct, abs=0.5), policy


def test_the_command_prints_both_policies_per_gpu_count_and_draws_them(tmp_path, capsys):
    from ettflow.cli import main

    out = tmp_path / "sim.png"
    assert main(["simulate", "--gpus", "1024,16384", "--replications", "4", "--max-spares", "1",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["1024"], ["16384"])]
    assert [r[:2] for r in rows] == [["1024", "baseline"], ["1024", "optimized"], ["16384", "baseline"],
                                     ["16384", "optimized"]], text
    assert "costs: all assumed" in text and "HPCA'25" in text and "capETT peaks at" in text
    assert out.stat().st_size > 1000
    for bad in ("0", "many"):
        with pytest.raises(SystemExit, match="--gpus must be positive integers"):
            main(["simulate", "--gpus", bad])
    assert main(["simulate", "--validate"]) == 2


def test_a_replays_difference_names_the_component_it_comes_from():
    from ettflow.simulate_cli import _most_off

    assert _most_off({"scheduling": 1.0, "wasted_training": 2.0}, {"scheduling": 1.5, "wasted_training": 0.8}) \
        == "wasted_training -1.2 s"
    assert _most_off({"scheduling": 1.0}, {"scheduling": 1.0, "shutdown": 0.25}) == "shutdown +0.2 s"


def test_a_replay_fails_where_the_measured_run_failed_however_its_recoveries_vary():
    """A measured run's failures are replayed on the ranks' running clock: a first recovery
    0.5 s longer than the second (their mean is what the replay takes) leaves the replay 0.25 s
    ahead of the measured run's wall clock, and a last failure 0.1 s before the end of the
    training is still replayed (on the wall clock it fell after the replay's end: issue 41's
    validation lost a failure so on a loaded CI host)."""
    policy = Policy(name="at-loss", live_recovery=True, spares=0, interval_s=20, gpus_per_node=1)
    one = simulate_refresh(COSTS, policy, None, 2, random.Random(0), failure_times=(53.0,))
    # the ranks' running time at the end of its training: the start's init and compile (8 s), its
    # blocks and saves, and the block the failure cut short (from the last record to the failure)
    ran = ("train_step", "checkpoint_save_blocking")
    recorded = {a: sum(e.duration for e in one if e.attempt == a and e.phase in ran) for a in (0, 1)}
    last = 53.0 + recorded[1]
    assert 8.0 + recorded[0] < 53.0 < last
    events = simulate_refresh(COSTS, policy, None, 2, random.Random(0), failure_times=(53.0, last - 0.1))
    assert compute_run_metrics(events).nof == 2
    first_detected = next(e.start for e in events if e.phase == "failure_detected")
    late = [replace(e, start=e.start + 0.5 * (e.start > first_detected),
                    end=e.end + 0.5 * (e.end > first_detected)) for e in events]  # the first recovery 0.5 s longer
    measured = measure_run(late)
    assert measured.failure_times == pytest.approx((53.0, last - 0.1))
    again = compute_run_metrics(simulate_refresh(measured.costs, measured.policy, None, measured.gpus,
                                                 random.Random(0), failure_times=measured.failure_times))
    assert again.nof == 2
    assert again.ett_pct == pytest.approx(measured.metrics.ett_pct, abs=0.5)
