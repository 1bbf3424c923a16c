"""Failures as types: the exception -> Failure mapping, the default policy's table, the train
task's retry decision, and the fail_at items (numbered, once per run). Pure: no cluster."""

from __future__ import annotations

import errno
import pickle
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from ray.exceptions import ActorDiedError, RayTaskError

from ettflow.ett.event_attrs import FailureAttrs
from ettflow.ett.events import marker
from ettflow.ett.failures import Failure, FailureClass, FailureError
from ettflow.tasks.trainer import _retry_training
from ettflow.trainer.classify import STORAGE_ADVICE, failure_from_exception
from ettflow.trainer.config import FAIL_AT_GRAMMAR, FAULT_KINDS, FailAt, TrainerConfig
from ettflow.trainer.data.schema import DataError, criteo_schema
from ettflow.trainer.faults import InjectedFailure, due, fired_faults, pending
from ettflow.trainer.group.driver import TrainingFailed
from ettflow.trainer.group.failure_policy import DefaultFailurePolicy, FailureDecision, failure_counts

C = FailureClass
RESTART, RAISE = FailureDecision.RESTART, FailureDecision.RAISE


def f(klass: FailureClass, step: int | None = None, attempt: int = 0) -> Failure:
    return Failure(failure_class=klass, rank=0, attempt=attempt, step=step, reason="r")


def from_ray(cause: BaseException) -> BaseException:
    """What `ray.get` raises when the rank's `train` raised `cause`."""
    return RayTaskError("TrainerActor.train", "Traceback ...", cause).as_instanceof_cause()


# ---- exception -> Failure, by type --------------------------------------------------------

def test_a_dead_process_is_infrastructure():
    failure = failure_from_exception(ActorDiedError(), rank=1, attempt=2)
    assert (failure.failure_class, failure.rank, failure.attempt, failure.secondary) == (C.INFRASTRUCTURE, 1, 2, False)


def test_a_typed_cause_keeps_its_failure():
    typed = Failure(failure_class=C.NUMERICS, rank=1, step=7, reason="non-finite loss")
    failure = failure_from_exception(from_ray(FailureError(typed)), rank=1, attempt=3)
    assert failure == Failure(failure_class=C.NUMERICS, rank=1, attempt=3, step=7, reason="non-finite loss")


def test_bad_data_is_data_with_its_file():
    failure = failure_from_exception(from_ray(DataError("/d/w1/part-0.parquet", "int_3", "is not numeric")), rank=0)
    assert failure.failure_class is C.DATA and failure.path == "/d/w1/part-0.parquet"
    assert "int_3" in failure.reason


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EROFS])
def test_a_full_or_broken_disk_is_storage_with_its_path(code):
    failure = failure_from_exception(from_ray(OSError(code, "disk trouble", "/ckpt/step-10/0.distcp")), rank=1)
    assert failure.failure_class is C.STORAGE and failure.path == "/ckpt/step-10/0.distcp"
    assert "/ckpt/step-10/0.distcp" in failure.summary  # the path is in the message too
    # which fault, by name, and what to do about it
    assert errno.errorcode[code] in failure.reason and STORAGE_ADVICE[code] in failure.reason


@pytest.mark.parametrize("error", [dist.DistBackendError, dist.DistNetworkError, dist.DistError])
def test_a_lost_peer_is_secondary_infrastructure(error):
    failure = failure_from_exception(from_ray(error("connection reset")), rank=0)
    assert failure.failure_class is C.INFRASTRUCTURE and failure.secondary


@pytest.mark.parametrize("exc", [ValueError("bad row"), OSError(errno.ENOENT, "missing", "x"),
                                 RuntimeError("Connection closed by peer")])
def test_anything_else_is_user(exc):
    assert failure_from_exception(from_ray(exc), rank=0).failure_class is C.USER


def test_a_stopped_process_is_preemption_never_a_user_bug():
    """A stop of the process outside the driver (a SIGTERM of `ettflow refresh` during init or
    publishing, Ctrl-C, an exit) is classed by what stopped it (`classify.stop_signal`): a
    preemption, never the `user` class an unknown BaseException would fall to."""
    from prefect.exceptions import TerminationSignal

    from ettflow.trainer.classify import stop_signal

    stops = {TerminationSignal(signal=15): "SIGTERM", TerminationSignal(signal=2): "SIGINT",
             KeyboardInterrupt(): "SIGINT", SystemExit(1): "exit", TerminationSignal(signal=999): "signal 999"}
    for exc, name in stops.items():
        assert stop_signal(exc) == name
        failure = failure_from_exception(exc, attempt=1)
        assert (failure.failure_class, failure.rank, failure.attempt) == (C.PREEMPTION, -1, 1)
        assert f"stopped ({name})" in failure.reason
    # an error that happens to carry a `signal` attribute (an Exception) is an error, not a stop
    carrying = ValueError("bad row")
    carrying.signal = 15
    assert stop_signal(carrying) is None and failure_from_exception(carrying).failure_class is C.USER
    assert stop_signal(TerminationSignal(signal=True)) is None  # a flag, not a signal number


def test_a_task_error_of_the_cluster_is_infrastructure():
    assert failure_from_exception(ConnectionError("ray is gone")).failure_class is C.INFRASTRUCTURE
    assert failure_from_exception(InjectedFailure(f(C.USER, step=3))).step == 3


def test_failures_survive_pickling():
    typed = Failure(failure_class=C.STORAGE, rank=1, path="/x", secondary=True)
    assert pickle.loads(pickle.dumps(FailureError(typed))).failure == typed
    exc = pickle.loads(pickle.dumps(TrainingFailed("r1", [typed], RAISE, "why")))
    assert (exc.failures, exc.decision, exc.why) == ([typed], RAISE, "why")
    assert FailureAttrs.parse(typed.to_attrs()).failure() == typed


# ---- the default policy --------------------------------------------------------------------

@pytest.mark.parametrize(("klass", "decision"), [
    (C.INFRASTRUCTURE, RESTART), (C.PREEMPTION, RESTART), (C.STORAGE, RESTART), (C.ORCHESTRATOR, RESTART),
    (C.USER, RESTART), (C.NUMERICS, RESTART), (C.DATA, RAISE), (C.PUBLISH, RAISE),
])
def test_policy_table_for_a_first_failure(klass, decision):
    assert DefaultFailurePolicy(max_failures=3).decide(f(klass, step=5), []) is decision


@pytest.mark.parametrize("klass", [C.INFRASTRUCTURE, C.PREEMPTION, C.STORAGE, C.ORCHESTRATOR])
def test_restartable_classes_restart_until_the_budget_is_spent(klass):
    policy = DefaultFailurePolicy(max_failures=2)
    assert policy.decide(f(klass, 9), [f(klass, 3), f(klass, 6)]) is RAISE  # the third of a budget of 2
    assert policy.decide(f(klass, 9), [f(klass, 3)]) is RESTART
    assert policy.decide(f(klass, 3), [f(klass, 3)]) is RESTART  # the same step does not matter for them
    assert DefaultFailurePolicy(max_failures=0).decide(f(klass, 1), []) is RAISE


@pytest.mark.parametrize("klass", [C.USER, C.NUMERICS])
def test_user_and_numerics_are_retried_once_without_progress(klass):
    policy = DefaultFailurePolicy(max_failures=10)
    assert policy.decide(f(klass, 5), [f(klass, 5)]) is RAISE  # the same step again
    assert policy.decide(f(klass, 4), [f(klass, 5)]) is RAISE  # before making progress past it
    assert policy.decide(f(klass, 6), [f(klass, 5)]) is RESTART  # the run progressed past step 5
    assert policy.decide(f(klass, None), [f(klass, None)]) is RAISE  # unknown steps: no progress known
    # an infrastructure failure at step 8 in between shows the run progressed past step 5
    assert policy.decide(f(klass, 5), [f(klass, 5), f(C.INFRASTRUCTURE, 8)]) is RESTART
    other = C.NUMERICS if klass is C.USER else C.USER
    assert policy.decide(f(klass, 5), [f(other, 5)]) is RESTART  # another class: its own first retry


def test_policy_explains_its_rule():
    policy = DefaultFailurePolicy(max_failures=1)
    assert policy.explain(f(C.INFRASTRUCTURE), [f(C.USER)]) == "2 failures exceed the budget of 1"
    with pytest.raises(ValueError, match="max_failures"):
        DefaultFailurePolicy(max_failures=-1)
    assert failure_counts([f(C.USER), f(C.INFRASTRUCTURE), f(C.USER)]) == "user x2, infrastructure x1"


# ---- the train task's retry ------------------------------------------------------------------

def state_raising(exc: BaseException) -> SimpleNamespace:
    def result():
        raise exc
    return SimpleNamespace(result=result)


def test_the_train_task_retries_only_when_the_policy_restarts():
    restart = TrainingFailed("r1", [f(C.INFRASTRUCTURE)], RESTART, "restart")
    stop = TrainingFailed("r1", [f(C.INFRASTRUCTURE)] * 4, RAISE, "4 failures exceed the budget of 3")
    assert _retry_training(None, None, state_raising(restart))
    assert not _retry_training(None, None, state_raising(stop))
    assert not _retry_training(None, None, state_raising(KeyboardInterrupt()))
    assert not _retry_training(None, None, SimpleNamespace(result=lambda: None))


# ---- fail_at ----------------------------------------------------------------------------------

def test_fail_at_items_are_numbered_and_apply_to_any_attempt(tmp_path):
    cfg = TrainerConfig(data_root=str(tmp_path), schema=criteo_schema(10), work_dir=str(tmp_path / "w"),
                        failures=(FailAt.parse("kill:rank=1:step=4"), FailAt.parse("hang:step=8:attempt=2")))
    first, second = cfg.failures
    assert (first.index, first.attempt, second.index, second.attempt) == (0, None, 1, 2)
    assert due(cfg.failures, attempt=5, rank=1, step=4) is first
    assert due(cfg.failures, attempt=1, rank=0, step=8) is None and due(cfg.failures, attempt=2, rank=0, step=8)
    assert pending(cfg.failures, {0}) == (second,)


def test_fired_items_are_read_from_their_markers():
    kill, nan = FailAt(kind="kill", rank=1, step=4, index=0), FailAt(kind="nan", rank=0, step=9, index=1)
    events = [
        marker("failure", run_id="r", attempt=0, rank=1, at=1.0, failure_class="infrastructure", failed_rank=1,
               step=4, injected=True, fault_index=0),
        # the numerics check records the nan fault's marker, without the index: matched by class, rank, step
        marker("failure", run_id="r", attempt=1, rank=0, at=2.0, failure_class="numerics", failed_rank=0,
               step=9, injected=True),
    ]
    assert fired_faults([kill, nan], events[:1]) == {0}
    assert fired_faults([kill, nan], events) == {0, 1}


def test_the_grammar_names_every_kind_and_field():
    for word in (*FAULT_KINDS, "publish", "rank=", "step=", "after_s=", "attempt=", "times="):
        assert word in FAIL_AT_GRAMMAR
    with pytest.raises(ValueError, match="unknown field 'when'"):
        FailAt.parse("kill:when=3")
    with pytest.raises(ValueError, match="step must be a number"):
        FailAt.parse("kill:step=x")
