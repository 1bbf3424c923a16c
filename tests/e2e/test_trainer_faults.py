"""Faults on the real trainer (2 Ray actors, gloo, TorchRec, DCP), tiny sizes, each run ending
bitwise at the parameters of the uninterrupted reference run (`clean_run`, e2e/conftest.py):

- live recovery: a SIGKILLed rank is replaced by a warm spare while rank 0 keeps its process and
  compiled step, restored from the in-memory tier; a second kill comes before the new spare is
  ready; a damaged in-memory copy sends every rank to the durable checkpoint;
- detection: a hang in pt2_compile and one at step 0 are found by the phase watchdog within
  their bounds (not by gloo's timeout);
- preemption: an external SIGTERM and a scripted one are recorded as preemption, stop both
  ranks at one step boundary with an emergency checkpoint, and each restart resumes exactly.

Detection times are measured from the spool (failure_detected - failure) and printed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ettflow.ett.spool import read_spool
from ettflow.trainer.checkpoint.anchor import read_anchor
from ettflow.trainer.checkpoint.verify import verify
from ettflow.trainer.config import FailAt
from ettflow.trainer.group.driver import TrainingDriver
from ettflow.trainer.group.ray_group import RayWorkerGroup, end_run
from ettflow.trainer.rank.actor import TrainerActor

from helpers.trainer_runs import STEPS, assert_same_parameters, at_step, beat_pid, by, config, drive

pytestmark = [pytest.mark.slow]

SLACK_S = 10.0  # polling, a loaded 2-core machine; gloo's timeout (the old detector) was 300 s
# the hang test's compile bound: above a real warm compile on a loaded 2-core CI host (15.1 s seen
# for the restart's compile when the suite's other worker was busy: a false hang), below gloo's 300 s
COMPILE_BOUND_S = 30.0


def kept_groups(cfg, run_id: str, spool: Path):
    """A group factory for the driver that keeps every group it makes (a test signals their
    processes): (factory, the groups so far)."""
    groups: list[RayWorkerGroup] = []

    def factory(attempt: int) -> RayWorkerGroup:
        groups.append(RayWorkerGroup(cfg, run_id, attempt, spool, actor_cls=TrainerActor))
        return groups[-1]

    return factory, groups


def signal_when(find_pid: Callable[[], int | None], sig: int, *, every_s: float,
                timeout_s: float = 300.0) -> tuple[threading.Thread, list[int]]:
    """A started thread that sends `sig` once to the process `find_pid()` names, as soon as it
    names one (asked every `every_s`, for up to `timeout_s`); and the list of pids signalled."""
    sent: list[int] = []

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not sent:
            pid = find_pid()
            if pid is not None:
                os.kill(pid, sig)
                sent.append(pid)
            time.sleep(every_s)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread, sent


def restore_step(events, attempt: int) -> int:
    (restore,) = by(events, "checkpoint_restore", rank=0, attempt=attempt)
    return restore.attrs["step"]


# ---- live recovery (trainer/rank/live_recovery.py): survivors keep running, a warm spare joins ----

def test_sigkills_are_recovered_live_by_spares_the_second_before_its_spare_is_ready(trainer_world, compile_cache,
                                                                                    clean_run, tmp_path):
    """Rank 1 is killed at step 8, and again at step 9 of the attempt that recovered it, while
    the spare that replaces the first spare may still be starting; then rank 0 is killed
    between the anchor checkpoint's commit and its `anchor.json`, and recovered live too."""
    cfg = config(trainer_world, "live", compile_cache, failures=(
        FailAt(kind="kill", rank=1, step=8), FailAt(kind="kill", rank=1, step=9, attempt=1),
        FailAt.parse("kill:rank=0:phase=anchor_commit"))).with_switches(release_before_seal=False)  # ranks write it
    result, events, m = drive(trainer_world, cfg, "live")
    assert result.attempts == 4 and m.nof == 3
    assert [f.failure_class for f in m.failures] == ["infrastructure"] * 3
    # the last recovery restored the committed final checkpoint: it is the anchor, with its cursor
    (last,) = by(events, "checkpoint_restore", rank=0, attempt=3)
    assert last.attrs["step"] == STEPS and by(events, "train_step", attempt=3) == []
    marker, uninterrupted = read_anchor(result.rank0.anchor), read_anchor(clean_run[0].rank0.anchor)
    assert marker["step"] == STEPS and marker["cursor"] == uninterrupted["cursor"] is not None
    m.check_partition()
    # rank 0 kept its process and its compiled step throughout; rank 1 is a new process each time
    pids = [beat_pid(trainer_world, "live", attempt, 0) for attempt in (0, 1, 2)]
    # (CI saw rank 0 restarted at the first recovery once: the hand-offs and failures say why if it recurs)
    assert len(set(pids)) == 1, (pids, [(e.attempt, e.attrs) for e in events if e.phase == "spare_handoff"],
                                 [f.summary for f in result.failures])
    assert len({beat_pid(trainer_world, "live", attempt, 1) for attempt in (0, 1, 2)}) == 3
    assert by(events, "pt2_compile", attempt=1) == by(events, "pt2_compile", attempt=2) == []
    stats = result.rank0.compile.stats  # its one frame traced, or loaded from the session's archive
    assert stats.recompiles == 0 and stats.frames_compiled + stats.frames_loaded == 1
    # each time a spare took rank 1; every rank rebuilt its group and module and restored
    handoffs = sorted(by(events, "spare_handoff"), key=lambda e: e.attempt)
    assert [(h.attempt, h.attrs["rank"]) for h in handoffs] == [(1, 1), (2, 1), (3, 0)]
    assert [e.attrs.get("spare") for e in by(events, "preproc_creation", rank=1, attempt=1)] == [True]
    for rank in (0, 1):
        for phase in ("process_group_rebuild", "module_reshard"):
            assert len(by(events, phase, rank=rank, attempt=1)) == 1, (phase, rank)
        (restore,) = by(events, "checkpoint_restore", rank=rank, attempt=1)
        assert restore.attrs["source"] == "memory" and restore.attrs["step"] <= 8  # the in-memory tier
    assert by(events, "device_init", attempt=1) == []  # no process started on the critical path
    # the second hand-off waited for the spare that started after the first one
    starts = sorted(by(events, "spare_start"), key=lambda e: e.start)
    assert len(starts) >= 2 and starts[1].start >= handoffs[0].start and starts[1].end <= handoffs[1].end + 1e-6
    # replayed only what each kill lost since the restored copy, trained every batch once
    assert m.replayed_steps == 2 * (8 - restore_step(events, 1)) + 2 * (9 - restore_step(events, 2))
    assert m.effective_steps == 2 * STEPS
    assert_same_parameters(result.rank0.anchor, clean_run[0].rank0.anchor, tmp_path)


# ---- the anchor handed off in host memory, sealed by the driver after the release (group/anchor_seal.py) ----

# the driver in a process of its own, on the session's Ray cluster, so that its scripted SIGKILL ends only it
SEAL_KILLED = """
import sys
import ray
sys.path.insert(0, sys.argv[1])
ray.init(address=sys.argv[2])
from pathlib import Path
from ettflow.trainer.config import FailAt
from helpers.trainer_runs import config, drive
world = Path(sys.argv[3])
faults = tuple(FailAt.parse(spec) for spec in sys.argv[5:])
drive(world, config(world, "seal-kill", Path(sys.argv[4]), failures=faults), "seal-kill")
"""
SEAL_FAULTS = (FailAt.parse("kill:rank=1:phase=anchor_commit"), FailAt.parse("kill:phase=anchor_seal"))


def test_deaths_after_the_anchor_hand_off_leave_no_anchor_and_the_retry_loses_no_window(
        trainer_world, compile_cache, clean_run, tmp_path):
    """The ranks hand the anchor off in host memory. Rank 1 dies right after handing off its
    part: a live recovery (a spare, the in-memory copies) trains what it lost and hands off
    again. Then the devices are released and the driver's process is SIGKILLed with the
    anchor half written. Nothing is committed or marked (publishing has nothing to read, the
    watermark cannot advance); the retry (the flow's next try) restores the last durable
    checkpoint, trains what the kill lost and seals the anchor: the uninterrupted run's
    parameters, every batch trained once."""
    import ray

    tests, spool = Path(__file__).resolve().parents[1], trainer_world / "spool"
    done = subprocess.run([sys.executable, "-c", SEAL_KILLED, str(tests), ray.get_runtime_context().gcs_address,
                           str(trainer_world), str(compile_cache), *(f.spec for f in SEAL_FAULTS)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    root = trainer_world / "seal-kill" / "checkpoints"
    assert not list(root.glob("step_*/anchor.json")) and not (root / f"step_{STEPS:010d}").exists()
    events = read_spool(spool, "seal-kill").events
    # attempt 0: rank 1 died with its part handed off; attempt 1 recovered it live and handed off again
    (lost,) = by(events, "failure", attempt=0)
    assert lost.rank == 1 and lost.attrs["reason"] == f"injected kill of rank 1 in anchor_commit at step {STEPS}"
    assert [h.attrs["rank"] for h in by(events, "spare_handoff", attempt=1)] == [1]
    assert all(e.attrs["handed_off"] for e in by(events, "anchor_checkpoint", attempt=1))
    # then the devices were released, and the driver killed while it wrote the anchor
    (shutdown,) = by(events, "shutdown", attempt=1)
    (killed,) = by(events, "failure", attempt=1)
    assert killed.rank == -1 and killed.attrs["reason"] == "injected kill of the driver in anchor_seal"
    assert shutdown.end <= killed.start and by(events, "anchor_seal") == []
    # the retry: a new driver for the run, as the flow's next try of its train task
    cfg = config(trainer_world, "seal-kill", compile_cache, failures=SEAL_FAULTS)
    try:
        result = TrainingDriver(cfg, "seal-kill", spool, lambda a: RayWorkerGroup(
            cfg, "seal-kill", a, spool, actor_cls=TrainerActor)).run(first_attempt=2)
    finally:
        end_run("seal-kill")
    events = read_spool(spool, "seal-kill").events
    (restore,) = by(events, "checkpoint_restore", rank=0, attempt=2)
    assert restore.attrs["step"] == 20  # the last periodic save (every 5 steps) of the 24
    (sealed,) = by(events, "anchor_seal", attempt=2)
    assert sealed.attrs["step"] == STEPS and sealed.attrs["path"] == result.rank0.anchor
    assert verify(Path(result.rank0.anchor)).step == STEPS and read_anchor(result.rank0.anchor)["step"] == STEPS
    assert sorted({e.attrs["step"] for e in by(events, "train_step", attempt=2)}) == list(range(20, STEPS))
    assert result.unfired == ()  # both faults fired, once each
    assert_same_parameters(result.rank0.anchor, clean_run[0].rank0.anchor, tmp_path)


# the SIGSTOP of the stall case (issue 26 #3); the 30 s case: ETTFLOW_TEST_STOP_S=30 pytest -s -k spare_that_dies
STOP_S = float(os.environ.get("ETTFLOW_TEST_STOP_S", "6"))


def stop_at_step(world: Path, run_id: str, rank: int, step: int, stop_s: float) -> tuple[threading.Thread, list]:
    """A started thread that SIGSTOPs `rank` of attempt 0 once its heartbeat says it reached
    `step`, and SIGCONTs it `stop_s` later; and the list it fills with (stopped at, resumed at)."""

    def pause(beat) -> tuple[float, float]:
        os.kill(beat.pid, signal.SIGSTOP)
        stopped = time.time()
        time.sleep(stop_s)
        os.kill(beat.pid, signal.SIGCONT)
        return stopped, time.time()

    return at_step(world, run_id, rank, step, pause)


def test_a_spare_that_dies_while_it_waits_is_replaced_before_it_is_needed(trainer_world, compile_cache, clean_run,
                                                                           tmp_path):
    """The waiting spare is SIGKILLed once it answered (the OOM killer's choice, say), while the
    ranks train; the group's poll notices, records its hold (`lost`) and starts another, which
    takes rank 1's place when rank 1 is killed at step 16: still a live recovery.
    Before that, rank 0's process is SIGSTOPped for `STOP_S` at step 6 (issue 26 #3): the stall is
    wasted training owned by the host (its process did not run), never effective training."""
    cfg = config(trainer_world, "spare-lost", compile_cache, failures=(FailAt(kind="kill", rank=1, step=16),),
                 eval_batches=0)
    factory, groups = kept_groups(cfg, "spare-lost", trainer_world / "spool")

    def waiting_spare() -> int | None:
        spares = groups[0].spares if groups else None
        return spares.spare_pid if spares is not None else None

    killer, killed = signal_when(waiting_spare, signal.SIGKILL, every_s=0.05)
    stopper, stopped = stop_at_step(trainer_world, "spare-lost", 0, 6, STOP_S)
    result, events, m = drive(trainer_world, cfg, "spare-lost", group_factory=factory)
    killer.join()
    stopper.join()
    assert killed, "the spare never answered a ping"
    # the stall: about STOP_S of host stall (rank 0's heartbeat saw its process stopped), and no
    # effective training inside it (before: the stopped step counted whole)
    assert stopped and any(e.duration > STOP_S - 1 for e in by(events, "process_paused", rank=0))
    clean_effective = clean_run[2].components["effective_training"]
    print(f"stopped {STOP_S:g} s: host stall {m.exposed('host_stall'):.2f} s, "
          f"step stall {m.exposed('step_stall'):.2f} s, effective training "
          f"{m.components['effective_training']:.2f} s (uninterrupted run: {clean_effective:.2f} s)")
    # the stop is host stall, measured as long as it lasted: rank 0's pause over the stop (host stall
    # is the ranks' pauses). Its sum with step stall was bounded before: a loaded host's slow steps
    # are step stall, and CI saw 2.3 s of it beside a 6.1 s host stall
    from ettflow.ett.timeline import partition, union_length

    (stop, resume), = stopped
    over = union_length((e.start, e.end) for e in by(events, "process_paused", rank=0)
                        if e.start < resume and e.end > stop)
    assert STOP_S - 1 < over < resume - stop + 1.0 and m.exposed("host_stall") > STOP_S - 1.5, (over, m.phases)
    # no effective training while the process was stopped (beyond the expected part of the step
    # in flight: tens of ms). Compared with the clean run's total instead, a loaded host's slower
    # steps (the spare's compile beside them) failed it: 4.2 s against 1.0 s, the stall excluded
    inside = union_length((max(iv.start, stop), min(iv.end, resume)) for iv in partition(events).effective
                          if iv.end > stop and iv.start < resume)
    assert inside < 0.5, inside
    assert result.attempts == 2 and m.nof == 1 and len(groups) == 1  # recovered live: no second group
    lost = [e for e in by(events, "spare_start") if e.attrs.get("lost")]
    assert len(lost) == 1 and lost[0].attrs["used"] is False
    (handoff,) = by(events, "spare_handoff")
    assert handoff.attrs["handed"] and handoff.attrs["rank"] == 1
    used = [e for e in by(events, "spare_start") if e.attrs.get("used")]
    assert len(used) == 1 and used[0].start >= lost[0].end - 1e-6  # the replacement took the place
    for rank in (0, 1):
        (restore,) = by(events, "checkpoint_restore", rank=rank, attempt=1)
        assert restore.attrs["source"] == "memory"
    assert m.effective_steps == 2 * STEPS
    assert_same_parameters(result.rank0.anchor, clean_run[0].rank0.anchor, tmp_path)


def test_two_runs_training_at_once_share_the_cluster_pools_spare_and_each_records_its_part(
        trainer_world, compile_cache, clean_run, tmp_path):
    """Issue 40 #2: two runs of one model train at once on a cluster whose pool holds the
    model's spares; their summed saving pays one (`PoolPolicy.max_shared_spares` 1 here). Run A
    loses rank 1 at step 10 and takes the pool's spare (live, rule `spare-shared`); the pool
    prepares the next. Each run records its part of every shared spare's hold, split by their
    savings (A 3 : B 1), as its own capacity; the pool keeps none of it for nobody."""
    import ray

    from ettflow.ett.spare_sizing import SHARED, SpareShare
    from ettflow.trainer.group.pool_service import PoolPolicy, PoolService
    from ettflow.trainer.group.warm_pool import POOL

    spool = trainer_world / "spool"
    service = ray.remote(PoolService).options(num_cpus=0, max_restarts=0, max_concurrency=8).remote(
        PoolPolicy(max_shared_spares=1))
    POOL.close()
    POOL.service, POOL.keeping = service, False
    shares = {"share-a": SpareShare(run_id="share-a", saving_per_s=3.0, failures_per_s=0.1),
              "share-b": SpareShare(run_id="share-b", saving_per_s=1.0, failures_per_s=0.01)}
    faults = {"share-a": (FailAt(kind="kill", rank=1, step=10),), "share-b": ()}
    outcomes: dict[str, object] = {}

    def train(run_id: str) -> None:
        cfg = config(trainer_world, run_id, compile_cache, failures=faults[run_id], eval_batches=0, spares=0)
        try:
            outcomes[run_id] = drive(trainer_world, cfg, run_id, group_factory=lambda a: RayWorkerGroup(
                cfg, run_id, a, spool, actor_cls=TrainerActor, pool=POOL, spare_share=shares[run_id]))
        except BaseException as exc:  # noqa: BLE001 - the main thread reports it
            outcomes[run_id] = exc

    threads = [threading.Thread(target=train, args=(run_id,)) for run_id in shares]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        left = ray.get(service.status.remote())
        unclaimed = ray.get(service.drain.remote())
    finally:
        POOL.close()
        ray.kill(service, no_restart=True)
    for run_id, outcome in outcomes.items():
        assert not isinstance(outcome, BaseException), f"{run_id}: {outcome!r}"
    assert sorted(outcomes) == sorted(shares)
    (result_a, events_a, m_a), (_, events_b, m_b) = outcomes["share-a"], outcomes["share-b"]
    # A recovered live on the pool's spare: one group, no restart of its other rank
    assert result_a.attempts == 2 and m_a.nof == 1 and m_b.nof == 0
    (used,) = [e for e in by(events_a, "spare_start") if e.attrs.get("used") and e.attrs.get("for_rank") is None
               and e.duration == 0]
    assert used.attrs["rule"] == SHARED and used.attrs["pooled"], used.attrs
    (restore,) = by(events_a, "checkpoint_restore", rank=1, attempt=1)
    assert restore.attrs["source"] == "memory"
    # each run's parts: fractions of one spare, A's 3/4 and B's 1/4 while both trained (alone: all)
    for name, events, own, m in (("A", events_a, 0.75, m_a), ("B", events_b, 0.25, m_b)):
        parts = [e for e in by(events, "spare_start") if e.attrs.get("rule") == SHARED and e.duration > 0]
        print(f"\nrun {name}: ETT {m.ett_pct:.1f}%, capETT {m.capacity_ett_pct:.1f}%; its parts of the shared "
              f"spares: " + ", ".join(f"{e.attrs['slots']:g} x {e.duration:.2f} s"
                                      f"{' (used)' if e.attrs['used'] else ''}" for e in parts))
        assert parts and {e.attrs["slots"] for e in parts} <= {own, 1.0}, [e.attrs for e in parts]
        assert own in {e.attrs["slots"] for e in parts}
    assert any(e.attrs["used"] for e in by(events_a, "spare_start") if e.attrs.get("rule") == SHARED
               and e.duration > 0)  # the spare A took: its hold up to the take, A's and B's parts
    # what the spares held is the runs': in their capacity-inclusive ETT, nothing left for nobody
    assert m_a.held.spare_s > 0 and m_b.held.spare_s > 0 and m_b.capacity_ett_pct < m_b.ett_pct
    assert [h for h in unclaimed if h.rule == SHARED] == [] and [s for s in left if s.rule == SHARED] == []
    assert_same_parameters(result_a.rank0.anchor, clean_run[0].rank0.anchor, tmp_path)


def test_a_corrupt_in_memory_copy_falls_back_to_the_durable_checkpoint(trainer_world, compile_cache, clean_run,
                                                                       tmp_path):
    # rank 1's in-memory copies are damaged from step 6 on; it is killed at step 11, while the
    # durable save of step 10 may still be in flight (nothing torn may ever be restored)
    cfg = config(trainer_world, "live-corrupt", compile_cache, failures=(FailAt(kind="corrupt", rank=1, step=6),
                                                                       FailAt(kind="kill", rank=1, step=11)))
    result, events, m = drive(trainer_world, cfg, "live-corrupt")
    assert result.attempts == 2 and m.nof == 1
    for rank in (0, 1):
        (restore,) = by(events, "checkpoint_restore", rank=rank, attempt=1)
        assert restore.attrs["source"] == "own" and restore.attrs["step"] in (5, 10)  # the durable one
        # a committed folder (the restore verified every file's checksum before reading it), never the
        # step-10 save the kill interrupted
        assert Path(restore.attrs["path"]).name == f"step_{restore.attrs['step']:010d}"
        assert restore.attrs["memory_problem"]
    assert_same_parameters(result.rank0.anchor, clean_run[0].rank0.anchor, tmp_path)


# ---- detection: the phase watchdog ------------------------------------------------------------

def detection_s(events, attempt: int) -> float:
    (fault,) = by(events, "failure", attempt=attempt)
    (detected,) = by(events, "failure_detected", attempt=attempt)
    return detected.start - fault.start


def test_hangs_in_compile_and_at_a_step_are_detected_within_their_bounds_and_restart_from_memory(
        trainer_world, compile_cache):
    """Rank 1 hangs in pt2_compile (bound COMPILE_BOUND_S) in attempt 0, then at step 12 (bound
    3 s) in the attempt that restarted every rank (a hang is never recovered live). The second
    restart restores the in-memory copies, newer than the durable checkpoint (issue 26 #9: the
    keeper outlives the ranks); the hang's wait is the hang's, not work lost in flight."""
    cfg = config(trainer_world, "hangs", compile_cache, failures=(
        FailAt.parse("hang:rank=1:phase=pt2_compile"), FailAt.parse("hang:rank=1:step=12")),
        compile_timeout_s=COMPILE_BOUND_S, step_timeout_s=3.0, eval_batches=0, checkpoint_every_steps=20,
        memory_every_steps=4)  # copies at 4, 8, 12: chosen from their cost, a loaded host's chose none by 12
    result, events, m = drive(trainer_world, cfg, "hangs")
    compile_hang, step_hang = result.failures
    assert result.attempts == 3 and m.nof == 2
    assert [f.failure_class for f in m.failures] == ["infrastructure", "infrastructure"]
    assert compile_hang.rank == 1 and compile_hang.reason.startswith("rank 1 hung in pt2_compile for ")
    assert by(events, "train_step", attempt=0) == []  # attempt 0 never trained
    # CI once saw step None here (the message now shows the whole failure)
    assert (step_hang.rank, step_hang.step) == (1, 12), step_hang
    assert step_hang.reason.startswith("rank 1 hung in train_step for "), step_hang
    took = detection_s(events, 0), detection_s(events, 1)
    print(f"\nhang in pt2_compile: detected {took[0]:.2f} s after it began (bound {COMPILE_BOUND_S:g} s); "
          f"at step 12: {took[1]:.2f} s (bound 3 s)")
    assert took[0] <= COMPILE_BOUND_S + SLACK_S and took[1] <= 3.0 + SLACK_S
    # the watchdog times the bound from the step's start in the rank's heartbeat; the hang's span runs
    # from the attempt's last finished activity in the spool to the detection: two clocks, a few ms
    # apart on a loaded host (2.995 s seen)
    assert m.exposed("hang") >= 3.0 - 0.05 and m.exposed("lost_in_flight") == 0
    # no durable checkpoint before step 20: the restart restored the newest step both ranks copied
    copied = [{e.attrs["step"] for e in by(events, "memory_save_blocking", rank=r, attempt=1)} for r in (0, 1)]
    newest = max(copied[0] & copied[1])
    for rank in (0, 1):
        (restore,) = by(events, "checkpoint_restore", rank=rank, attempt=2)
        assert (restore.attrs["source"], restore.attrs["step"]) == ("memory", newest), restore.attrs
    print(f"restart restored the in-memory copy of step {newest} (copies at {sorted(copied[0])})")
    assert newest == 12 and m.replayed_steps == 0
    assert result.rank0.final_step == STEPS
    m.check_partition()


# ---- preemption --------------------------------------------------------------------------------

def test_an_external_and_a_scripted_sigterm_take_emergency_checkpoints_and_resume_exactly(
        trainer_world, compile_cache, clean_run, tmp_path):
    """Rank 1 gets a real SIGTERM (what a scheduler sends) once it trained 4 steps of attempt 0,
    and a scripted preemption at step 18 (in attempt 1: fail_at fires in whichever attempt
    reaches its step)."""
    cfg = config(trainer_world, "preempt", compile_cache, failures=(FailAt.parse("preempt:rank=1:step=18"),),
                 eval_batches=0)
    spool = trainer_world / "spool"
    factory, groups = kept_groups(cfg, "preempt", spool)

    def rank_1_after_4_steps() -> int | None:
        try:
            steps = [e for e in read_spool(spool, "preempt", phases=frozenset({"train_step"})).events
                     if e.attempt == 0 and e.rank == 1]
        except FileNotFoundError:
            return None
        return groups[0].info[1].pid if len(steps) >= 4 else None

    killer, sent = signal_when(rank_1_after_4_steps, signal.SIGTERM, every_s=0.02)
    result, events, m = drive(trainer_world, cfg, "preempt", group_factory=factory)
    killer.join()
    assert sent, "rank 1 never trained 4 steps"
    assert result.attempts == 3 and m.nof == 2
    assert [f.failure_class for f in m.failures] == ["preemption", "preemption"]
    assert [(f.rank, f.injected) for f in result.failures] == [(1, False), (1, True)]
    saved = []
    for attempt, failure in enumerate(result.failures):
        (marker,) = by(events, "failure", attempt=attempt)
        step = marker.attrs["step"]
        assert marker.rank == 1 and step == failure.step
        # the emergency checkpoint, or the periodic save (every 5 steps) of this very step, committed before
        # the ranks reported (the marker names the checkpoint the stop leaves either way)
        assert marker.attrs["emergency_checkpoint"] == step
        assert step in {e.attrs["step"] for e in by(events, "checkpoint_save_blocking", attempt=attempt)}
        assert restore_step(events, attempt + 1) == step  # the restart resumed at the emergency checkpoint
        saved.append(step)
        print(f"\npreemption at step {step}: detected {detection_s(events, attempt):.2f} s after SIGTERM "
              f"(emergency checkpoint included)")
    assert saved[0] >= 4 and saved[1] == 18
    assert m.replayed_steps == 0 and m.effective_steps == 2 * STEPS  # nothing lost, nothing replayed
    m.check_partition()
    assert_same_parameters(result.rank0.anchor, clean_run[0].rank0.anchor, tmp_path)


# ---- delta checkpoints (issue 28) ------------------------------------------------------------

def damage_when_committed(folder: Path, part: str) -> tuple[threading.Thread, list[int]]:
    """A started thread that flips one byte in the middle of `folder/part` as soon as `folder`
    is committed (its size kept, so only the checksum can tell); the list gets 1 when it did."""
    done: list[int] = []

    def watch() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not done:
            if (folder / "COMMITTED").is_file():
                data = bytearray((folder / part).read_bytes())
                data[len(data) // 2] ^= 0xFF
                (folder / part).write_bytes(bytes(data))
                done.append(1)
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread, done


@pytest.mark.timeout(900)  # three attempts; run alone, the session's compile cache and clean run come first
def test_a_rank_killed_mid_delta_chain_restores_base_and_deltas_and_a_damaged_delta_falls_back(
        trainer_world, compile_cache, clean_run, tmp_path):
    """Delta checkpoints on the real trainer, every restart from the durable chain (live recovery
    and the in-memory tier off). Saves every 5 steps: a base at 5, deltas at 10 and 15; rank 1 is
    SIGKILLed at step 17 and the restart restores base 5 + deltas 10, 15. Delta 20 (attempt 1) is
    damaged once it commits and rank 1 is killed at step 22: the restart refuses it, falls back to
    step 15 and says so (`checkpoint_fallback`), and writes delta 20 anew. The anchor (a base) equals
    the uninterrupted run's bitwise, and retention kept every link the kept steps need."""
    from ettflow.trainer.checkpoint.catalog import scan

    cfg = config(trainer_world, "delta-chain", compile_cache, eval_batches=0, delta_max_chain_share=100.0,
                 failures=(FailAt.parse("kill:rank=1:step=17"), FailAt.parse("kill:rank=1:step=22:attempt=1")),
                 # synchronous saves: a background delta 20 may still be writing when step 22's kill lands (CI saw
                 # attempt 1's delta 20 left uncommitted, and attempt 2's own delta 20 damaged instead); background
                 # deltas on the real trainer: the next test's durable ones, and unit/test_delta_saves_rows.py
                 ).with_switches(delta_checkpoint=True, live_recovery=False, memory_checkpoint=False,
                                 async_checkpoint=False)
    damager, damaged = damage_when_committed(cfg.checkpoint_dir / "delta_0000000020", "rank-1.bin")
    result, events, m = drive(trainer_world, cfg, "delta-chain")
    damager.join(timeout=1)
    assert damaged, "delta 20 never committed"
    assert result.attempts == 3 and m.nof == 2
    kinds = {(e.attempt, e.attrs["step"]): e.attrs.get("kind") for e in by(events, "checkpoint_save_blocking", rank=0)}
    assert kinds == {(0, 5): "base", (0, 10): "delta", (0, 15): "delta", (1, 20): "delta", (2, 20): "delta"}, kinds
    for attempt in (1, 2):
        for rank in (0, 1):
            (restore,) = by(events, "checkpoint_restore", rank=rank, attempt=attempt)
            assert (restore.attrs["step"], restore.attrs["base_step"], restore.attrs["deltas"]) == (15, 5, [10, 15])
            assert restore.attrs["delta_rows"] > 0
    (fallback,) = [e for e in events if e.phase == "checkpoint_fallback"]
    assert (fallback.attempt, fallback.attrs["damaged_step"], fallback.attrs["restored_step"]) == (2, 20, 15)
    assert "rank-1.bin" in fallback.attrs["reason"] and fallback.attrs["file"] == "rank-1.bin"
    # what each kill lost is what each rank recorded past the restored step 15: the killed rank up
    # to the step before its kill; its peer finished that step too, but may be torn down before it
    # records it (CI, on a loaded host: 17 replayed steps where both had recorded would give 18)
    lost = {(a, r): [e.attrs["step"] for e in by(events, "train_step", rank=r, attempt=a) if e.attrs["step"] >= 15]
            for a in (0, 1) for r in (0, 1)}
    assert max(lost[0, 1]) == 16 and max(lost[0, 0]) in (15, 16), lost
    assert max(lost[1, 1]) == 21 and max(lost[1, 0]) in (20, 21), lost
    assert all(sorted(s) == list(range(15, max(s) + 1)) for s in lost.values()), lost
    assert m.replayed_steps == sum(map(len, lost.values())) and m.effective_steps == 2 * STEPS
    m.check_partition()
    assert_same_parameters(result.rank0.anchor, clean_run[0].rank0.anchor, tmp_path)
    # the anchor is a base; the chain of the newest delta (20, rewritten whole) is kept entire
    found = scan(cfg.checkpoint_dir)
    assert [c.step for c in found.committed] == [5, STEPS] and [d.step for d in found.deltas] == [10, 15, 20]
    assert found.damaged_deltas == () and found.chain(2).step == STEPS


@pytest.mark.timeout(900)
def test_live_recovery_restores_in_memory_delta_copies_base_and_deltas(trainer_world, compile_cache, clean_run,
                                                                       tmp_path):
    """Issue 28, the in-memory tier: with delta checkpoints on, an in-memory copy every 2 steps
    is a whole copy, then deltas on it (the rows touched since, handed to the keeper alone).
    Rank 1 is SIGKILLed at step 9: the spare restores rank 1's chain from the keeper and rank 0
    its own, whole copy then deltas; the first copy after the recovery is whole again, and the
    durable chain goes on (issue 44): the copies of step 8 name base 5 and the rows touched since,
    so the save at 10 is a delta on 5, not a second base. Then rank 1's copies are damaged from
    step 12 and it is killed at 17: every rank restores the durable chain, base 5 + deltas 10 and
    15 (delta 10 holds rows touched before the recovery, delta 15 every row since 10 although the
    memory copies at 12 and 14 read the same tracker). The anchor equals the uninterrupted run's
    bitwise."""
    cfg = config(trainer_world, "live-delta", compile_cache, eval_batches=0, memory_every_steps=2,
                 delta_max_chain_share=100.0, failures=(FailAt(kind="kill", rank=1, step=9),
                                                        FailAt(kind="corrupt", rank=1, step=12),
                                                        FailAt(kind="kill", rank=1, step=17)),
                 ).with_switches(delta_checkpoint=True)
    result, events, m = drive(trainer_world, cfg, "live-delta")
    assert result.attempts == 3 and m.nof == 2
    for rank in (0, 1):
        copies = sorted(by(events, "memory_save_blocking", rank=rank, attempt=0), key=lambda e: e.attrs["step"])
        kinds = [e.attrs["kind"] for e in copies]
        assert kinds[0] == "base" and "delta" in kinds, kinds
        sizes = {e.attrs["kind"]: e.attrs["bytes"] for e in by(events, "memory_save_background", rank=rank,
                                                               attempt=0) if e.attrs["ok"]}
        assert 0 < sizes["delta"] < sizes["base"], sizes  # the rows that changed, not the tables
        (restore,) = by(events, "checkpoint_restore", rank=rank, attempt=1)
        assert restore.attrs["source"] == "memory" and restore.attrs["memory_deltas"] >= 1, restore.attrs
        assert restore.attrs["step"] == 8 and restore.attrs["chain_resumed"] == 5, restore.attrs
        saves = {e.attrs["step"]: e.attrs.get("kind") for e in by(events, "checkpoint_save_blocking", rank=rank)}
        assert [saves.get(step) for step in (5, 10, 15, 20)] == ["base", "delta", "delta", "delta"], saves
        after = sorted(by(events, "memory_save_blocking", rank=rank, attempt=1), key=lambda e: e.attrs["step"])
        assert after and after[0].attrs["kind"] == "base"  # nothing tracked before the restore counts
        (durable,) = by(events, "checkpoint_restore", rank=rank, attempt=2)
        assert durable.attrs["source"] == "own" and durable.attrs["memory_problem"], durable.attrs
        assert (durable.attrs["step"], durable.attrs["base_step"], durable.attrs["deltas"]) == (15, 5, [10, 15])
    assert [(h.attempt, h.attrs["rank"]) for h in by(events, "spare_handoff")] == [(1, 1), (2, 1)]
    assert m.effective_steps == 2 * STEPS
    m.check_partition()
    assert_same_parameters(result.rank0.anchor, clean_run[0].rank0.anchor, tmp_path)
    first = by(events, "checkpoint_restore", rank=1, attempt=1)[0]
    print(f"\nin-memory copies, rank 1: whole {sizes['base']:,} bytes, delta {sizes['delta']:,} bytes; the spare "
          f"restored a whole copy and {first.attrs['memory_deltas']} delta(s)")
