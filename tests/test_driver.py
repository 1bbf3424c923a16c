"""The driver's loop, stepped with a scripted group and no cluster: failures are scripted,
and the lost time they cause is read back exactly from the spool."""

from __future__ import annotations

import pytest

from ettflow.ett.run_metrics import compute_run_metrics
from ettflow.ett.spool import SpoolWriter, read_spool
from ettflow.trainer.config import FailAt, TrainerConfig
from ettflow.trainer.data.schema import criteo_schema
from ettflow.trainer.driver import RankFailure, TrainingDriver, TrainingFailed, classify


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class ScriptedGroup:
    """Each poll advances the clock one second; each rank trains one step per poll (written
    to the spool like a real rank) until its script says finish, die, raise or hang."""

    def __init__(self, run, attempt: int, script: dict) -> None:
        self.run, self.attempt, self.script = run, attempt, script
        self.polls = 0
        self.killed: list[int] = []
        self.torn_down = False
        self.writers = {}

    def reserve(self) -> None:
        self.run.clock.t += 2.0  # queueing for the placement

    def launch(self) -> None:
        self.writers = {r: SpoolWriter(self.run.spool, self.run.run_id, self.attempt, r)
                        for r in range(self.run.config.world_size)}

    def poll(self, timeout_s: float):
        self.polls += 1
        t0 = self.run.clock.t
        self.run.clock.t += 1.0
        done, failed = {}, []
        for rank, w in self.writers.items():
            action = self.script.get((rank, self.polls), "step")
            if rank in self.killed:
                failed.append(RankFailure(rank, died=True, error="SIGKILL"))
            elif action == "step":
                cursor = self.run.cursor[rank]
                w.record("train_step", t0, t0 + 1.0, cursor_start=cursor, cursor_end=cursor + 1)
                self.run.cursor[rank] += 1
            elif action == "finish":
                done[rank] = {"finished_at": t0}
            elif action == "die":
                failed.append(RankFailure(rank, died=True, error="SIGKILL"))
            elif action == "raise":
                failed.append(RankFailure(rank, died=False, error="ValueError: bad row", user_error=True))
            elif action == "bad-data":
                failed.append(RankFailure(rank, died=False, error="x.parquet: column 'cat_1' ...", fatal=True))
            # "hang": no step, no outcome
        return done, failed

    def kill(self, rank: int) -> None:
        self.killed.append(rank)

    def teardown(self) -> None:
        self.torn_down = True
        self.run.clock.t += 0.5


class Run:
    def __init__(self, tmp_path, scripts: list[dict], **cfg) -> None:
        data = tmp_path / "data"
        data.mkdir(exist_ok=True)
        self.config = TrainerConfig(data_root=str(data), schema=criteo_schema(10), work_dir=str(tmp_path / "w"),
                                    world_size=2, **cfg)
        self.spool, self.run_id = tmp_path / "spool", "r1"
        self.clock = Clock()
        self.cursor = {0: 0, 1: 0}
        self.scripts = scripts
        self.groups: list[ScriptedGroup] = []

    def factory(self, attempt: int) -> ScriptedGroup:
        group = ScriptedGroup(self, attempt, self.scripts[attempt])
        self.groups.append(group)
        return group

    def drive(self):
        driver = TrainingDriver(self.config, self.run_id, self.spool, self.factory, poll_s=0, grace_s=0,
                                clock=self.clock)
        return driver.run(submitted_at=self.clock.t)

    def metrics(self):
        return compute_run_metrics(read_spool(self.spool, self.run_id).events)


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


def test_killed_rank_is_detected_and_the_group_restarted(tmp_path):
    # attempt 0: rank 1 dies on the 3rd poll; attempt 1 replays from cursor 1 and finishes
    run = Run(tmp_path, [{(1, 3): "die"}, finish_at(4)])
    result = run.drive()
    assert result.attempts == 2 and [f["failure_class"] for f in result.failures] == ["infrastructure"]
    assert "rank 1 process died" in result.failures[0]["reason"] and run.groups[0].torn_down
    m = run.metrics()
    assert m.nof == 1 and m.failures[0].failure_class == "infrastructure"
    # the 3rd poll of attempt 0 runs 1004 -> 1005 and reports the death: detected at 1005;
    # recovery: teardown 0.5 s, queueing 2 s, then rank 0 trains new data at once
    assert m.failures[0].detected_at == 1005.0 and m.failures[0].ttr_s == 2.5
    assert m.exposed("lost_in_flight") == 0  # rank 1's last step ended when the fault was seen


def test_user_error_is_classified_and_budget_enforced(tmp_path):
    run = Run(tmp_path, [{(0, 2): "raise"}, {(0, 1): "raise"}], max_failures=1)
    with pytest.raises(TrainingFailed, match=r"2 failures exceed the budget of 1 .*ValueError: bad row"):
        run.drive()
    m = run.metrics()
    assert m.nof == 2 and {f.failure_class for f in m.failures} == {"user"}


def test_bad_data_stops_at_once(tmp_path):
    run = Run(tmp_path, [{(0, 1): "bad-data", (1, 1): "bad-data"}, finish_at(1)])
    with pytest.raises(TrainingFailed, match=r"stopped: .*x.parquet: column 'cat_1'"):
        run.drive()
    assert len(run.groups) == 1  # never retried


def test_hang_is_caught_by_the_step_watchdog(tmp_path):
    script = {(1, p): "hang" for p in range(3, 100)}
    run = Run(tmp_path, [script, finish_at(2)], watchdog_s=5.0)
    result = run.drive()
    assert result.attempts == 2 and "hang" in result.failures[0]["reason"]
    m = run.metrics()
    # rank 1's last step ended at 1004; the watchdog fires when more than 5 s passed
    assert m.failures[0].detected_at > 1009.0 and m.failures[0].detected_at <= 1010.0


def test_timed_sigkill_is_sent_by_the_driver(tmp_path):
    run = Run(tmp_path, [{}, finish_at(2)], failures=(FailAt(kind="kill", rank=1, after_s=2.0),))
    run.scripts[0] = {}  # would train forever without the kill
    result = run.drive()
    assert run.groups[0].killed == [1] and result.attempts == 2
    events = read_spool(run.spool, run.run_id).events
    injected = [e for e in events if e.phase == "failure"]
    assert len(injected) == 1 and injected[0].attrs["injected"] and injected[0].attrs["failed_rank"] == 1


def test_classify_prefers_the_dead_process():
    failures = [RankFailure(0, died=False, error="gloo: connection reset"), RankFailure(1, died=True, error="SIGKILL")]
    assert classify(failures) == ("infrastructure", "rank 1 process died: SIGKILL", 1)
    assert classify([RankFailure(0, died=False, error="ValueError", user_error=True)])[0] == "user"


def test_in_trainer_publish_holds_the_devices(tmp_path):
    run = Run(tmp_path, [finish_at(4)])

    def publish(ranks):
        run.clock.t += 3.0
        return "snapshot"

    driver = TrainingDriver(run.config, run.run_id, run.spool, run.factory, poll_s=0, grace_s=0, clock=run.clock,
                            before_release=publish)
    driver.run(submitted_at=run.clock.t)
    m = run.metrics()
    assert driver.released_with == "snapshot" and m.raw("publish") == 3.0
    assert m.components["shutdown"] == 1.5 + 3.0  # the release waited for publishing
