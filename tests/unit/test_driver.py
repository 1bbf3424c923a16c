"""The driver's loop, stepped with a scripted group and no cluster: failures are scripted,
and the lost time they cause is read back exactly from the spool. Failures are typed values
and the policy's decisions are enums: the tests assert on those, not on messages."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ettflow.ett.capacity import held_by_model, holdings_of_run
from ettflow.ett.failures import Failure, FailureClass
from ettflow.ett.run_metrics import compute_run_metrics
from ettflow.ett.spool import SpoolWriter, read_spool
from ettflow.tasks.lease import HeldGroup
from ettflow.tasks.run_spool import RunRecorder
from ettflow.trainer.checkpoint.anchor import AnchorInfo
from ettflow.trainer.classify import on_lost_owner, primary_failure
from ettflow.trainer.collectives import Groups
from ettflow.trainer.config import FailAt, TrainerConfig
from ettflow.trainer.data.schema import criteo_schema
from ettflow.trainer.faults import due, pending_faults, record_fired
from ettflow.trainer.group.driver import TrainingDriver, TrainingFailed
from ettflow.trainer.group.failure_policy import FailureDecision
from ettflow.trainer.group.pooled_worker import PooledWorker, record_start
from ettflow.trainer.model_config import ModelConfig
from ettflow.trainer.placement import SpareBundles
from ettflow.trainer.protocol import MEMORY, AnchorHandOff, PollStatus, PrewarmTimings, RestorePoint
from ettflow.trainer.rank_heartbeat import TRAINING, RankBeat, beat_file, read_beat, write_beat

from helpers.group_ops import RecordingOps
from helpers.rank_results import finished

INFRA, USER, DATA = FailureClass.INFRASTRUCTURE, FailureClass.USER, FailureClass.DATA


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def died(rank: int) -> Failure:
    return Failure(failure_class=INFRA, rank=rank, reason=f"rank {rank}: process died", detail="SIGKILL")


class ScriptedGroup:
    """Each poll advances the clock one second; each rank trains one step per poll (written
    to the spool like a real rank, with its step) until its script says finish, die, raise or
    hang. Each rank's heartbeat says it trains since its last step's end, like a real rank's
    (a hung rank's thread beats on, its phase's start unchanged). Scripted faults (`fail_at`)
    fire as in a real rank: the run's config less the items that fired (`pending_faults`),
    each recorded with its index when it fires. With `run.restore_step` set, a restart resumes
    every rank from that checkpointed step."""

    def __init__(self, run, attempt: int, script: dict) -> None:
        self.run, self.attempt, self.script = run, attempt, script
        self.polls = 0
        self.killed: list[int] = []
        self.hung: set[int] = set()
        self.torn_down = False
        self.preempted: dict[int, int] | None = None  # after `preempt`: steps each rank still trains
        self.writers = {}
        self.training_since: dict[int, float] = {}
        self.faults = pending_faults(run.config, run.spool, run.run_id).failures

    def reserve(self) -> None:
        self.run.clock.t += 2.0  # queueing for the placement

    def launch(self) -> None:
        self.writers = {r: SpoolWriter(self.run.spool, self.run.run_id, self.attempt, r)
                        for r in range(self.run.config.world_size)}
        if self.attempt > 0 and self.run.restore_step is not None:
            for rank, w in self.writers.items():
                self.run.cursor[rank] = self.run.restore_step
                w.record("checkpoint_restore", self.run.clock.t, self.run.clock.t, step=self.run.restore_step)

    def poll(self, timeout_s: float):
        self.polls += 1
        t0 = self.run.clock.t
        self.run.clock.t += 1.0
        done, failed = {}, []
        if self.script.get(("driver", self.polls)) == "stop":
            raise Stopped()  # the driver's own process is told to stop (e.g. Prefect's TerminationSignal)
        for rank, w in self.writers.items():
            action = self.script.get((rank, self.polls), "step")
            if self.preempted is not None and rank not in self.killed:  # SIGTERM: a save, then the marker
                steps_left = self.preempted.get(rank, 0)
                if steps_left > 0:  # this rank still finishes its step before the agreed boundary
                    self.preempted[rank] -= 1
                    action = "step"
                else:
                    w.record("checkpoint_save_blocking", t0, t0 + 0.25, step=self.run.cursor[rank], emergency=True)
                    w.mark("failure", t0 + 0.25, failure_class="preemption", rank=rank,
                           reason=f"rank {rank}: SIGTERM: preempted", emergency_checkpoint=True)
                    self.killed.append(rank)
                    failed.append(Failure(failure_class=FailureClass.PREEMPTION, rank=rank, reason="preempted"))
                    continue
            cursor = self.run.cursor[rank]
            fault = due(self.faults, attempt=self.attempt, rank=rank, step=cursor) if action == "step" else None
            if rank in self.killed:
                failed.append(died(rank))
            elif rank in self.hung:
                self.keep_beating(rank)
                continue
            elif fault is not None:
                record_fired(fault, w, rank=rank, step=cursor, at=t0)
                self.faults = tuple(f for f in self.faults if f is not fault)
                if fault.kind == "kill":
                    self.killed.append(rank)
                    failed.append(died(rank))
                elif fault.kind == "raise":
                    failed.append(Failure(failure_class=USER, rank=rank, reason="injected", injected=True))
                else:
                    self.hung.add(rank)
            elif action == "step":
                w.record("train_step", t0, t0 + 1.0, step=cursor, cursor_start=cursor, cursor_end=cursor + 1)
                self.run.cursor[rank] += 1
                self.beat(rank, since=t0 + 1.0)
            elif action == "step-unwritten":  # trained, its record still in the rank's lazy buffer
                self.run.cursor[rank] += 1
                self.beat(rank, since=t0 + 1.0)
            elif action == "finish":
                done[rank] = finished(rank, at=t0, attempt=self.attempt)
            elif action == "finish-handing-off":  # its part of the anchor in host memory, for the driver
                done[rank] = replace(finished(rank, at=t0, attempt=self.attempt), anchor_handoff=AnchorHandOff(
                    rank=rank, step=self.run.cursor[rank], world_size=self.run.config.world_size,
                    root=str(self.run.anchor_root), files=((f"__{rank}_0.distcp", b"x"),), cursor="{}",
                    anchor=AnchorInfo(run_id=self.run.run_id, step=self.run.cursor[rank], model=ModelConfig(),
                                      schema=criteo_schema(10)) if rank == 0 else None))
            elif action == "die":
                failed.append(died(rank))
            elif action == "raise":
                failed.append(Failure(failure_class=USER, rank=rank, reason=f"rank {rank}: ValueError: bad row"))
            elif action == "peer-lost":
                failed.append(Failure(failure_class=INFRA, rank=rank, reason="peer lost", secondary=True))
            elif action == "bad-data":
                failed.append(Failure(failure_class=DATA, rank=rank, path="x.parquet",
                                      reason=f"rank {rank}: x.parquet: column 'cat_1' is not integer"))
            elif action == "hang":  # no step, no outcome; its thread beats on
                self.keep_beating(rank)
        return PollStatus(finished=done, failed=tuple(failed))

    def beat(self, rank: int, *, since: float) -> None:
        started = self.training_since.setdefault(rank, since - 1.0)
        write_beat(beat_file(self.run.spool, self.run.run_id, self.attempt, rank),
                   RankBeat(rank=rank, pid=0, beat=since, phases={TRAINING: since}, training_since=started,
                            step=self.run.cursor[rank]))

    def keep_beating(self, rank: int) -> None:
        """The rank's heartbeat thread writes its unchanged state at the poll's time."""
        path = beat_file(self.run.spool, self.run.run_id, self.attempt, rank)
        if (last := read_beat(path)) is not None:
            write_beat(path, replace(last, beat=self.run.clock.t))

    def kill(self, rank: int) -> None:
        self.killed.append(rank)

    def preempt(self) -> None:
        # rank 1 is mid-step: it finishes that one before the ranks agree to stop
        self.preempted = {0: 0, 1: 1}

    def teardown(self) -> None:
        self.torn_down = True
        self.run.clock.t += 0.5


class Stopped(BaseException):
    """A stop signal as Prefect raises it in the flow's main thread (`TerminationSignal`)."""

    signal = 15


class Run:
    def __init__(self, tmp_path, scripts: list[dict], *, restore_step: int | None = None,
                 group_cls: type[ScriptedGroup] = ScriptedGroup, **cfg) -> None:
        data = tmp_path / "data"
        data.mkdir(exist_ok=True)
        self.config = TrainerConfig(data_root=str(data), schema=criteo_schema(10), work_dir=str(tmp_path / "w"),
                                    world_size=2, **cfg)
        self.spool, self.run_id = tmp_path / "spool", "r1"
        self.clock = Clock()
        self.cursor = {0: 0, 1: 0}
        self.restore_step = restore_step
        self.scripts = scripts
        self.group_cls = group_cls
        self.anchor_root = tmp_path / "w" / "checkpoints"  # where a handed-off anchor is sealed
        self.groups: list[ScriptedGroup] = []

    def factory(self, attempt: int) -> ScriptedGroup:
        group = self.group_cls(self, attempt, self.scripts[attempt])
        self.groups.append(group)
        return group

    def driver(self, **kw) -> TrainingDriver:
        return TrainingDriver(self.config, self.run_id, self.spool, self.factory, poll_s=0, grace_s=0,
                              clock=self.clock, **kw)

    def drive(self, **kw):
        return self.driver().run(submitted_at=self.clock.t, **kw)

    def metrics(self):
        return compute_run_metrics(read_spool(self.spool, self.run_id).events)

    def markers(self, phase: str):
        return [e for e in read_spool(self.spool, self.run_id).events if e.phase == phase]


def finish_at(poll: int) -> dict:
    return {(0, poll): "finish", (1, poll): "finish"}


def test_clean_run_is_one_attempt(tmp_path):
    run = Run(tmp_path, [finish_at(4)])
    result = run.drive()
    assert result.attempts == 1 and result.failures == [] and set(result.ranks) == {0, 1}
    m = run.metrics()
    # submitted at 1000, scheduled 1000-1002, steps 1002-1005; the ranks end at 1005, the
    # driver sees it after its poll (1006) and releases the group by 1006.5
    assert (m.wall_s, m.tts_s, m.nof) == (6.5, 2.0, 0)
    assert m.components["effective_training"] == 3 and m.components["scheduling"] == 2
    assert m.components["shutdown"] == 1.5 and run.groups[0].torn_down


class ReleasingScriptedGroup(ScriptedGroup):
    """A teardown that gives the devices back, then spends 3 s on the pool's work for the next run."""

    released_at: float | None = None

    def teardown(self) -> None:
        super().teardown()
        self.released_at = self.run.clock.t
        self.run.clock.t += 3.0


def test_the_shutdown_ends_when_the_devices_are_released_not_after_the_pools_work(tmp_path):
    run = Run(tmp_path, [finish_at(4)], group_cls=ReleasingScriptedGroup)
    run.drive()
    (shutdown,) = run.markers("shutdown")
    assert (shutdown.start, shutdown.end) == (1005.0, 1006.5)  # released at 1006.5; the fill ran to 1009.5
    m = run.metrics()
    assert m.wall_s == 6.5 and m.components["shutdown"] == 1.5


def test_an_anchor_the_driver_cannot_write_is_retried_from_the_host_copy_then_restarts_the_attempt(tmp_path):
    run = Run(tmp_path, [{(0, 3): "finish-handing-off", (1, 3): "finish-handing-off"}, finish_at(3)])
    run.anchor_root.parent.mkdir(parents=True)
    run.anchor_root.write_text("a file where the checkpoint folder should be")  # every write fails (ENOTDIR)
    result = run.drive()
    assert result.attempts == 2 and [f.failure_class for f in result.failures] == [FailureClass.STORAGE]
    assert "could not be written from the host copy (2 tries)" in result.failures[0].reason
    (seal,) = run.markers("anchor_seal")
    assert seal.attempt == 0 and seal.attrs["failed"] and seal.attrs["tries"] == 2
    # the ranks ended at 1004 (their third step's poll), the devices were released by 1005.5, then the seal
    (shutdown0, _) = sorted(run.markers("shutdown"), key=lambda e: e.attempt)
    assert (shutdown0.start, shutdown0.end) == (1004.0, 1005.5) and seal.start >= shutdown0.end
    assert run.metrics().nof == 1


def test_killed_rank_is_detected_and_the_group_restarted(tmp_path):
    # attempt 0: rank 1 dies on the 3rd poll; attempt 1 replays from cursor 1 and finishes
    run = Run(tmp_path, [{(1, 3): "die"}, finish_at(4)])
    result = run.drive()
    (failure,) = result.failures
    assert result.attempts == 2 and run.groups[0].torn_down
    # typed: the class, the rank, the attempt, and the step it was at (two steps done)
    assert (failure.failure_class, failure.rank, failure.attempt, failure.step) == (INFRA, 1, 0, 2)
    (detected,) = run.markers("failure_detected")
    assert detected.info.failure(detected.attempt) == failure  # the marker is the failure
    m = run.metrics()
    assert m.nof == 1 and m.failures[0].failure_class == "infrastructure"
    # the 3rd poll of attempt 0 runs 1004 -> 1005 and reports the death: detected at 1005;
    # recovery: teardown 0.5 s, queueing 2 s, then rank 0 trains new data at once
    assert m.failures[0].detected_at == 1005.0 and m.failures[0].ttr_s == 2.5
    assert m.exposed("lost_in_flight") == 0  # rank 1's last step ended when the fault was seen


def test_a_dead_ranks_step_is_its_heartbeats_when_its_last_steps_never_reached_the_spool(tmp_path):
    # rank 1 trains steps 0 and 1 (its beat says so; a dead process's lazy writes are lost), then dies
    run = Run(tmp_path, [{(1, 1): "step-unwritten", (1, 2): "step-unwritten", (1, 3): "die"}, finish_at(4)])
    (failure,) = run.drive().failures
    assert (failure.rank, failure.step) == (1, 2)


def test_a_stop_of_the_drivers_process_preempts_every_rank_and_is_one_failure(tmp_path):
    """Issue 26 #4: SIGTERM of `ettflow refresh` reaches the driver as a stop signal in its
    poll. It preempts the ranks (each saves and marks its preemption), waits for them, records
    the run's one failure (`preemption`, its own process's stop) and lets the stop go on."""
    run = Run(tmp_path, [{("driver", 4): "stop"}])
    with pytest.raises(Stopped):
        run.drive()
    (group,) = run.groups
    assert group.preempted == {0: 0, 1: 0} and not group.torn_down  # the lease's holder releases the devices
    # polls 1-3 trained 3 steps; the stop came in poll 4 (1005 -> 1006): detected at 1006; poll 5
    # (1006 -> 1007): rank 0 saves and ends, rank 1 trains its last step; poll 6: rank 1 saves and ends
    saves = [(e.rank, e.attrs["step"], e.start) for e in run.markers("checkpoint_save_blocking")]
    assert saves == [(0, 3, 1006.0), (1, 4, 1007.0)]
    (detected,) = run.markers("failure_detected")
    assert (detected.start, detected.attrs["failure_class"], detected.attrs["process_stopped"]) == (
        1006.0, "preemption", True)
    assert "stopped (SIGTERM)" in detected.attrs["reason"]
    m = run.metrics()
    assert m.nof == 1 and [f.failure_class for f in m.failures] == ["preemption"]
    assert RunRecorder(run.spool, run.run_id).failures()[0].failure_class is FailureClass.PREEMPTION


def test_user_errors_spend_the_budget_and_the_message_counts_them(tmp_path):
    # a user error at step 1, then one before any step of the restart: no progress -> RAISE,
    # and with a budget of 1 the second failure is past it anyway
    run = Run(tmp_path, [{(0, 2): "raise"}, {(0, 1): "raise"}], max_failures=1)
    with pytest.raises(TrainingFailed) as caught:
        run.drive()
    exc = caught.value
    assert exc.decision is FailureDecision.RAISE and [f.failure_class for f in exc.failures] == [USER, USER]
    assert [f.step for f in exc.failures] == [1, None] and [f.attempt for f in exc.failures] == [0, 1]
    assert str(exc).startswith("run r1 stopped after 2 failures (user x2): 2 failures exceed the budget of 1")
    m = run.metrics()
    assert m.nof == 2 and {f.failure_class for f in m.failures} == {"user"}


def test_message_counts_every_failure_by_class(tmp_path):
    run = Run(tmp_path, [{(1, 2): "die"}, {(0, 2): "die"}, {(0, 3): "raise"}], max_failures=2)
    with pytest.raises(TrainingFailed) as caught:
        run.drive()
    assert [f.failure_class for f in caught.value.failures] == [INFRA, INFRA, USER]
    assert str(caught.value).startswith("run r1 stopped after 3 failures (infrastructure x2, user x1): ")


def test_user_error_at_the_same_step_is_retried_once(tmp_path):
    # every restart resumes from the checkpoint at step 0; rank 0 raises at step 2 each time
    run = Run(tmp_path, [{(0, 3): "raise"}, {(0, 3): "raise"}, finish_at(8)], restore_step=0, max_failures=5)
    with pytest.raises(TrainingFailed) as caught:
        run.drive()
    exc = caught.value
    assert len(run.groups) == 2  # one retry from the previous checkpoint, then stop
    assert [(f.failure_class, f.step) for f in exc.failures] == [(USER, 2), (USER, 2)]
    assert exc.decision is FailureDecision.RAISE and "no progress past step 2" in exc.why


def test_user_error_after_progress_is_retried_again(tmp_path):
    # the second user error happens past the first one's step: the run progressed, restart
    run = Run(tmp_path, [{(0, 3): "raise"}, {(0, 5): "raise"}, finish_at(3)], restore_step=0, max_failures=5)
    result = run.drive()
    assert result.attempts == 3 and [(f.failure_class, f.step) for f in result.failures] == [(USER, 2), (USER, 4)]


def test_bad_data_stops_at_once(tmp_path):
    run = Run(tmp_path, [{(0, 1): "bad-data", (1, 1): "bad-data"}, finish_at(1)])
    with pytest.raises(TrainingFailed) as caught:
        run.drive()
    exc = caught.value
    assert len(run.groups) == 1  # never retried
    assert exc.decision is FailureDecision.RAISE and exc.failure.failure_class is DATA
    assert exc.failure.path == "x.parquet" and "x.parquet: column 'cat_1'" in str(exc)  # says which file


def test_a_dead_process_is_the_cause_not_its_peers_lost_collective(tmp_path):
    # rank 0 reports a lost peer first; rank 1's death arrives in the grace period: infrastructure, rank 1
    run = Run(tmp_path, [{(0, 2): "peer-lost", (1, 3): "die"}, finish_at(2)])
    driver = TrainingDriver(run.config, run.run_id, run.spool, run.factory, poll_s=0, grace_s=5, clock=run.clock)
    result = driver.run(submitted_at=run.clock.t)
    (failure,) = result.failures
    assert (failure.failure_class, failure.rank, failure.secondary) == (INFRA, 1, False)


def test_primary_failure_prefers_the_dead_process():
    lost = Failure(failure_class=INFRA, rank=0, reason="peer lost", secondary=True)
    bug = Failure(failure_class=USER, rank=0, reason="ValueError")
    assert primary_failure([lost, died(1)]) == died(1)
    assert primary_failure([lost, bug]) == bug  # a lost peer is never the cause when one is known
    assert primary_failure([bug, died(1)]) == died(1)
    assert primary_failure([lost]) == lost
    ended = on_lost_owner(Failure(failure_class=FailureClass.PREEMPTION, rank=0, reason="SIGTERM"),
                          owner="the cluster's pool")
    assert primary_failure([died(1), ended]) == ended  # what the ranks said of their end is its consequence
    with pytest.raises(ValueError, match="only a lost process"):
        on_lost_owner(bug, owner="the cluster's pool")


class OwnedScriptedGroup(ScriptedGroup):
    """Ranks whose processes the cluster's pool owns: `owner-gone` is Ray ending a rank whose
    owner died (a SIGTERM the rank takes for a preemption: its marker, its typed outcome).
    `owner_dead`: whether the pool is gone when the driver asks."""

    owner_dead = True
    asked: list[Failure] = []

    def poll(self, timeout_s: float):
        t0 = self.run.clock.t
        status = super().poll(timeout_s)
        failed = list(status.failed)
        for rank in [r for r in self.writers if self.script.get((r, self.polls)) == "owner-gone"]:
            self.writers[rank].mark("failure", t0 + 0.25, failure_class="preemption", failed_rank=rank,
                                    reason=f"rank {rank}: SIGTERM: preempted")
            self.killed.append(rank)
            failed.append(Failure(failure_class=FailureClass.PREEMPTION, rank=rank, reason=f"rank {rank}: preempted"))
        return PollStatus(finished=status.finished, failed=tuple(failed))

    def owner_cause(self, failure: Failure) -> Failure:
        self.asked.append(failure)
        return on_lost_owner(failure, owner="the cluster's pool") if self.owner_dead else failure


def held(run, attempt: int, script: dict) -> HeldGroup:
    """The group as the flow's train task hands it to the driver: inside its lease's wrapper."""
    return HeldGroup(OwnedScriptedGroup(run, attempt, script), attempt, run.config.world_size, hold=False)


@pytest.mark.parametrize("owner_dead,group_cls", [(True, OwnedScriptedGroup), (False, OwnedScriptedGroup),
                                                  (True, held)])
def test_a_rank_ended_with_its_lost_owner_is_the_owners_infrastructure_failure_not_a_preemption(
        tmp_path, monkeypatch, owner_dead, group_cls):
    """The cluster's pool that started rank 0 dies: Ray SIGTERMs the rank, which marks a
    preemption. The driver asks the group (through the lease's wrapper too), which finds the
    owner gone: the attempt's failure, its detection marker and the run's metrics say
    infrastructure (the owner's loss), never a preemption. With the owner alive, a SIGTERM is
    the preemption it says."""
    monkeypatch.setattr(OwnedScriptedGroup, "owner_dead", owner_dead)
    monkeypatch.setattr(OwnedScriptedGroup, "asked", [])
    run = Run(tmp_path, [{(0, 3): "owner-gone"}, finish_at(3)], group_cls=group_cls)
    result = run.drive()
    (failure,) = result.failures
    assert [(f.rank, f.failure_class) for f in OwnedScriptedGroup.asked] == [(0, FailureClass.PREEMPTION)]
    (detected,) = run.markers("failure_detected")
    m = run.metrics()
    if owner_dead:
        assert (failure.failure_class, failure.rank, failure.owner_lost) == (INFRA, 0, True)
        assert failure.reason == "rank 0: its process was ended with its owner, the cluster's pool, which was lost"
        assert detected.info.owner_lost and detected.attrs["failure_class"] == "infrastructure"
        assert [(f.failure_class, f.reason) for f in m.failures] == [("infrastructure", failure.reason)]
    else:
        assert (failure.failure_class, failure.owner_lost) == (FailureClass.PREEMPTION, False)
        assert not detected.info.owner_lost
        assert [f.failure_class for f in m.failures] == ["preemption"]


def test_hang_is_caught_by_the_step_watchdog(tmp_path):
    script = {(1, p): "hang" for p in range(3, 100)}
    run = Run(tmp_path, [script, finish_at(2)], step_timeout_s=5.0)
    result = run.drive()
    (failure,) = result.failures
    assert result.attempts == 2 and (failure.failure_class, failure.rank, failure.step) == (INFRA, 1, 2)
    assert failure.reason.startswith("rank 1 hung in train_step for ")
    m = run.metrics()
    # rank 1's last step ended at 1004; the watchdog fires when more than 5 s passed
    assert m.failures[0].detected_at > 1009.0 and m.failures[0].detected_at <= 1010.0


def test_timed_sigkill_is_sent_by_the_driver(tmp_path):
    run = Run(tmp_path, [{}, finish_at(2)], failures=(FailAt(kind="kill", rank=1, after_s=2.0),))
    run.scripts[0] = {}  # would train forever without the kill
    result = run.drive()
    assert run.groups[0].killed == [1] and result.attempts == 2 and run.groups[1].killed == []
    (injected,) = run.markers("failure")
    assert injected.attrs["injected"] and injected.attrs["failed_rank"] == 1 and injected.attrs["fault_index"] == 0


def test_fail_at_items_fire_once_each_in_whichever_attempt(tmp_path):
    # kills at steps 4, 8, 12, 16; every restart resumes from step 0 and replays the steps
    # whose fault already fired without firing it again: four failures, then the run ends
    kills = tuple(FailAt(kind="kill", rank=1, step=s) for s in (4, 8, 12, 16))
    run = Run(tmp_path, [{}, {}, {}, {}, finish_at(20)], restore_step=0, failures=kills, max_failures=4)
    result = run.drive()
    assert result.attempts == 5 and [f.failure_class for f in result.failures] == [INFRA] * 4
    assert [(f.attempt, f.step) for f in result.failures] == [(0, 4), (1, 8), (2, 12), (3, 16)]
    fired = run.markers("failure")
    assert [(e.attempt, e.attrs["fault_index"], e.attrs["step"]) for e in fired] == [
        (0, 0, 4), (1, 1, 8), (2, 2, 12), (3, 3, 16)]
    assert run.metrics().nof == 4


def test_a_scripted_fault_the_run_never_reaches_is_reported(tmp_path):
    # the kill at step 2 fires; the one at step 50 and the one for attempt 3 never do: the run
    # finishes in 2 attempts and says so (a marker each, and the result), not a silent pass
    faults = (FailAt(kind="kill", rank=1, step=2), FailAt(kind="raise", rank=0, step=50),
              FailAt(kind="kill", rank=1, step=1, attempt=3))
    run = Run(tmp_path, [{}, finish_at(4)], restore_step=0, failures=faults)
    result = run.drive()
    assert result.attempts == 2 and [f.spec for f in result.unfired] == ["raise:rank=0:step=50",
                                                                        "kill:rank=1:step=1:attempt=3"]
    unfired = run.markers("fault_unfired")
    assert [(e.attempt, e.attrs["fault_index"], e.attrs["spec"]) for e in unfired] == [
        (1, 1, "raise:rank=0:step=50"), (1, 2, "kill:rank=1:step=1:attempt=3")]
    assert run.metrics().nof == 1  # markers: no time, no failure
    (tmp_path / "clean").mkdir()
    clean = Run(tmp_path / "clean", [finish_at(3)])
    assert clean.drive().unfired == () and clean.markers("fault_unfired") == []


def test_fail_at_attempt_restricts_an_item(tmp_path):
    # the kill at step 2 waits for attempt 1: attempt 0 passes step 2, then fails otherwise
    run = Run(tmp_path, [{(0, 5): "die"}, {}, finish_at(6)], restore_step=0,
              failures=(FailAt(kind="kill", rank=1, step=2, attempt=1),))
    result = run.drive()
    assert [(f.attempt, f.rank, f.step) for f in result.failures] == [(0, 0, 4), (1, 1, 2)]
    assert [e.attempt for e in run.markers("failure")] == [1]


def test_a_task_retry_shares_the_run_budget(tmp_path):
    # budget 2: attempt 0 dies (1); the driver's process fails in attempt 1 and the task
    # records it (2); the task's retry starts at attempt 2 and counts both: its first failure
    # (3) exceeds the budget instead of starting a fresh one
    run = Run(tmp_path, [{(1, 2): "die"}, None, {(1, 2): "die"}, finish_at(3)], max_failures=2)

    def factory(attempt: int):
        if attempt == 1:
            raise ConnectionError("lost the Ray cluster")
        return run.factory(attempt)

    driver = TrainingDriver(run.config, run.run_id, run.spool, factory, poll_s=0, grace_s=0, clock=run.clock)
    with pytest.raises(ConnectionError) as crashed:
        driver.run(submitted_at=run.clock.t)
    recorded = RunRecorder(run.spool, run.run_id).record_task_failure(1, crashed.value, task="train", at=run.clock.t)
    assert recorded is not None and recorded.failure_class is INFRA  # typed from the exception
    prior = RunRecorder(run.spool, run.run_id).failures()
    assert [(f.attempt, f.failure_class) for f in prior] == [(0, INFRA), (1, INFRA)]

    retry = run.driver()
    with pytest.raises(TrainingFailed) as caught:
        retry.run(first_attempt=RunRecorder(run.spool, run.run_id).next_attempt(), prior_failures=prior)
    exc = caught.value
    assert exc.decision is FailureDecision.RAISE and len(exc.failures) == 3 and len(run.groups) == 2
    assert [f.attempt for f in exc.failures] == [0, 1, 2] and "3 failures exceed the budget of 2" in exc.why

class LiveScriptedGroup(ScriptedGroup):
    """A scripted group that recovers live (trainer/rank/live_recovery.py): the survivors park, the
    spare hand-off takes 0.5 s, then every rank records `process_group_rebuild` (0.25 s),
    `module_reshard` (0.25 s) and an instant in-memory restore of `run.restore_step`, and the
    same group goes on with the next attempt's script."""

    def __init__(self, run, attempt: int, script: dict) -> None:
        super().__init__(run, attempt, script)
        self.spare_asked_at: float | None = None
        self.recoveries: list[tuple[int, int, int]] = []  # (attempt, failed rank, restore step)
        self.live = True

    def training_started(self) -> None:
        if self.spare_asked_at is None:
            self.spare_asked_at = self.run.clock.t

    def prepare_live(self, failure):
        if not self.live or self.run.restore_step is None:
            return None
        return RestorePoint(step=self.run.restore_step, source=MEMORY)

    def hand_off(self, attempt, failure) -> None:
        self.run.clock.t += 0.5  # the spare takes the failed rank
        self.attempt, self.failed_rank = attempt, failure.rank

    def resume(self, point) -> None:
        attempt = self.attempt
        self.polls, self.script = 0, self.run.scripts[attempt]
        self.killed, self.hung, self.training_since = [], set(), {}
        self.faults = pending_faults(self.run.config, self.run.spool, self.run.run_id).failures
        self.writers = {r: SpoolWriter(self.run.spool, self.run.run_id, attempt, r)
                        for r in range(self.run.config.world_size)}
        t = self.run.clock.t
        for rank, w in self.writers.items():
            w.record("process_group_rebuild", t, t + 0.25)
            w.record("module_reshard", t + 0.25, t + 0.5)
            w.record("checkpoint_restore", t + 0.5, t + 0.5, source="memory", step=point.step)
            self.run.cursor[rank] = point.step
        self.run.clock.t += 0.5
        self.recoveries.append((attempt, self.failed_rank, point.step))


def drive_live(run: Run, group_class: type[LiveScriptedGroup]) -> tuple:
    """Drive `run` with groups of `group_class`; returns the result and every group made."""
    groups: list[LiveScriptedGroup] = []

    def factory(attempt: int) -> LiveScriptedGroup:
        groups.append(group_class(run, attempt, run.scripts[attempt]))
        return groups[-1]

    driver = TrainingDriver(run.config, run.run_id, run.spool, factory, poll_s=0, grace_s=0, clock=run.clock)
    return driver.run(submitted_at=run.clock.t), groups


def test_live_recovery_keeps_the_group_and_records_its_phases(tmp_path):
    # rank 1 dies on the 3rd poll (after steps 0 and 1; rank 0 also trained step 2); the same
    # group recovers live from the in-memory copy of step 1 and finishes
    run = Run(tmp_path, [{(1, 3): "die"}, finish_at(3)], restore_step=1)
    result, groups = drive_live(run, LiveScriptedGroup)
    (group,) = groups  # no second group: nothing was torn down and reserved again
    assert result.attempts == 2 and group.recoveries == [(1, 1, 1)]
    assert group.spare_asked_at == 1003.0  # the spare is asked for once training runs, not before
    (failure,) = result.failures
    assert (failure.failure_class, failure.rank, failure.step) == (INFRA, 1, 2)
    (shutdown,) = [e for e in run.markers("shutdown") if e.attrs.get("failed")]
    assert (shutdown.start, shutdown.end, shutdown.attrs["live"]) == (1005.0, 1005.0, True)
    (handoff,) = run.markers("spare_handoff")
    assert (handoff.attempt, handoff.start, handoff.end, handoff.attrs["rank"]) == (1, 1005.0, 1005.5, 1)
    m = run.metrics()
    # detected at 1005: hand-off 0.5 s (scheduling), rebuild + reshard 0.5 s (trainer init),
    # step 1 replayed 1006-1007 by both ranks; step 2 at 1007-1008 is new data for rank 1
    assert m.exposed("spare_handoff") == 0.5
    assert m.exposed("process_group_rebuild") == 0.25 and m.exposed("module_reshard") == 0.25
    assert m.nof == 1 and m.failures[0].ttr_s == 2.0


def test_no_spare_restarts_every_rank(tmp_path):
    # the hand-off fails (no spare could start): the group is torn down and a new one reserved
    run = Run(tmp_path, [{(1, 3): "die"}, finish_at(3)], restore_step=1)

    class NoSpare(LiveScriptedGroup):
        def hand_off(self, attempt, failure) -> None:
            self.run.clock.t += 0.5
            raise RuntimeError("no warm spare within 240 s")

    result, groups = drive_live(run, NoSpare)
    assert result.attempts == 2 and len(groups) == 2 and groups[0].torn_down
    (handoff,) = run.markers("spare_handoff")
    # the failed hand-off (0.5 s) and the kept group's teardown (0.5 s), then the new group queues 2 s
    assert (handoff.start, handoff.end, handoff.attrs["handed"]) == (1005.0, 1006.0, False)
    (scheduling,) = [e for e in run.markers("scheduling") if e.attempt == 1]
    assert (scheduling.start, scheduling.end) == (1006.0, 1008.0)


class GpuLiveGroup(LiveScriptedGroup):
    """A GPU placement's live recovery, scripted on the real pieces: ranks 0 and 1 in bundles 0
    and 1 and the spare holding a device in bundle 2 from the placement on (`SpareBundles`);
    each rank's groups formed for CUDA (NCCL) through recording ops (`Groups`, no GPU). At a
    failure the driver has the survivors interrupted (their NCCL communicators aborted), the
    spare takes the failed rank's place (the next spare's bundle is the one the failed rank
    left) and its hold is recorded as `SparePool.take` records it (`record_start` of a worker
    holding one GPU and four CPUs); on resume every survivor tears its groups down (no second
    abort) and forms new ones, and the spare forms its first."""

    def __init__(self, run, attempt: int, script: dict) -> None:
        super().__init__(run, attempt, script)
        self.bundles = SpareBundles.plan(2, spare=True)
        self.ops = {r: RecordingOps() for r in (0, 1)}
        self.groups: dict[int, Groups] = {}
        self.next_spare_bundles: list[int] = []
        self.spare: PooledWorker | None = None

    def form(self, rank: int) -> Groups:
        return Groups.form(torch.device("cuda"), init_method="tcp://head:1", rank=rank, world_size=2, timeout_s=60,
                           ops=self.ops[rank])

    def reserve(self) -> None:
        super().reserve()
        self.spare = PooledWorker(actor=None, prewarmed=None, requested_at=self.run.clock.t, key="k",
                                  model="dlrm", gpus=1.0, cpus=4.0)  # started with the placement

    def launch(self) -> None:
        super().launch()
        self.groups = {r: self.form(r) for r in (0, 1)}

    def prepare_live(self, failure):
        for rank, groups in self.groups.items():
            if rank != failure.rank:
                groups.interrupt()
        return super().prepare_live(failure)

    def hand_off(self, attempt, failure) -> None:
        super().hand_off(attempt, failure)
        timings = PrewarmTimings(build_s=0.2, compile_s=0.3, cache_hit=True, footers_s=0.0, ready_at=1003.0)
        with SpoolWriter(self.run.spool, self.run.run_id, attempt, -1) as rec:
            record_start(rec, self.spare, timings, pooled=False, used=True, taken_at=self.run.clock.t)
        self.next_spare_bundles.append(self.bundles.hand_off(failure.rank))
        self.ops[failure.rank] = RecordingOps()  # the spare's own process
        del self.groups[failure.rank]

    def resume(self, point) -> None:
        for rank in (0, 1):
            if rank in self.groups:
                self.groups[rank].teardown(failed=True)
            self.groups[rank] = self.form(rank)
        super().resume(point)


def test_a_gpu_placement_recovers_live_with_a_spare_holding_its_own_device(tmp_path):
    run = Run(tmp_path, [{(1, 3): "die"}, finish_at(3)], restore_step=1)
    result, (group,) = drive_live(run, GpuLiveGroup)
    assert result.attempts == 2 and group.recoveries == [(1, 1, 1)]
    # the spare took bundle 2 for rank 1; the next spare starts in bundle 1, the device rank 1 left
    assert group.bundles.of_rank == [0, 2] and group.next_spare_bundles == [1] and group.bundles.total == 3
    nccl = [("init", "nccl"), ("new_group", "gloo"), ("new_group", "gloo")]
    # the survivor: formed, aborted at the failure, destroyed, formed again; the spare: formed once
    assert group.ops[0].calls == nccl + [("abort", "nccl-world"), ("destroy",)] + nccl
    assert group.ops[1].calls == nccl
    (restore,) = [e for e in run.markers("checkpoint_restore") if e.rank == 0]
    assert (restore.attrs["source"], restore.attrs["step"]) == ("memory", 1)
    # the ledger: the spare held one GPU and four CPUs from the placement (1002) until it took rank 1 (1005.5)
    events = read_spool(run.spool, run.run_id).events
    (held,) = holdings_of_run(run.run_id, "dlrm", events, 1000.0, run.clock.t)
    assert (held.kind, held.used, held.reason, held.gpus, held.held_s) == ("spare", True, "replaced_rank", 1.0, 3.5)
    (by_model,) = held_by_model([held])
    assert (by_model.gpu_s, by_model.cpu_s, by_model.slot_s, by_model.unused_slot_s) == (3.5, 14.0, 3.5, 0.0)


def test_a_stop_an_operator_asked_for_is_no_failure(tmp_path):
    """Issue 42 #6: a cancel (Prefect's worker stops the flow's process after the operator asked)
    preempts the ranks as a preemption does, but it is the operator's action: an
    `operator_stop` marker first, the ranks' preemption markers after it are the stop's, no
    failure in NoF, the failure budget or the history."""
    run = Run(tmp_path, [{("driver", 4): "stop"}])
    with pytest.raises(Stopped):
        run.driver(stop_cause=lambda: "cancelled by an operator (Prefect state Cancelling)").run(
            submitted_at=run.clock.t)
    (group,) = run.groups
    assert group.preempted == {0: 0, 1: 0}  # the ranks still take their emergency checkpoints
    saves = [(e.rank, e.attrs["step"], e.start) for e in run.markers("checkpoint_save_blocking")]
    assert saves == [(0, 3, 1006.0), (1, 4, 1007.0)]
    (stop,) = run.markers("operator_stop")
    assert (stop.start, stop.attrs["reason"]) == (1006.0, "cancelled by an operator (Prefect state Cancelling) "
                                                          "(SIGTERM)")
    assert not run.markers("failure_detected") and len(run.markers("failure")) == 2  # the ranks' own, after it
    m = run.metrics()
    assert m.nof == 0 and m.effective_steps == 3 + 4  # rank 0: 3 steps; rank 1: 3 and the one it was in
    assert RunRecorder(run.spool, run.run_id).failures() == []
    # a task that sees the stop afterwards records nothing either
    assert RunRecorder(run.spool, run.run_id).record_task_failure(0, Stopped(), task="train", at=1010.0) is None
    # and a stop_cause that cannot answer leaves it a preemption, as before
    (tmp_path / "b").mkdir()
    other = Run(tmp_path / "b", [{("driver", 4): "stop"}])

    def broken() -> str | None:
        raise RuntimeError("no Prefect API")

    with pytest.raises(Stopped):
        other.driver(stop_cause=broken).run(submitted_at=other.clock.t)
    assert other.metrics().nof == 1 and not other.markers("operator_stop")


def test_a_run_withdrawn_at_a_poll_stops_its_ranks_at_once_with_no_failure_and_nothing_saved(tmp_path):
    """A stop check that raises `RunWithdrawn` (the run was taken for dead while its process stood
    still and another refresh has its windows: `tasks.claims_fence`): the ranks are torn down at
    that poll, with no emergency checkpoint and no failure of their own; the time to their
    release is the attempt's shutdown; the withdrawal goes on to the caller. Also when the ranks
    had finished meanwhile: their anchor is not sealed."""
    from ettflow.trainer.group.stop_request import RunWithdrawn

    cause = RuntimeError("claims lost")
    for script, name, steps in (({}, "training", 4),
                                ({(0, 4): "finish-handing-off", (1, 4): "finish-handing-off"}, "done", 3)):
        (tmp_path / name).mkdir()
        run = Run(tmp_path / name, [script], group_cls=ReleasingScriptedGroup)

        def check(run=run) -> None:
            if run.groups and run.groups[0].polls == 4:
                raise RunWithdrawn("stood still and lost its claims", cause=cause)

        with pytest.raises(RunWithdrawn) as raised:
            run.driver(stop_check=check).run(submitted_at=run.clock.t)
        assert raised.value.cause is cause
        (group,) = run.groups
        assert group.torn_down and group.preempted is None  # no SIGTERM: nothing saved
        assert not run.markers("checkpoint_save_blocking") and not run.markers("anchor_seal")
        assert not run.markers("failure_detected") and not run.markers("failure")
        # polls 1-3 trained 3 steps (1002 -> 1005); poll 4 (1005 -> 1006: a fourth step, or the ranks'
        # end) found the run withdrawn: torn down by 1006.5 (released), the pool's work after is off its clock
        (shutdown,) = run.markers("shutdown")
        assert (shutdown.start, shutdown.end, shutdown.attrs["withdrawn"], shutdown.attrs["failed"]) == (
            1006.0, 1006.5, True, False)
        m = run.metrics()
        assert m.nof == 0 and m.effective_steps == 2 * steps and m.components["shutdown"] == 0.5
        assert RunRecorder(run.spool, run.run_id).failures() == []
