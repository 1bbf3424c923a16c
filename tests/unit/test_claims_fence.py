"""The training run's claims fence (`tasks.claims_fence`), stepped with a scripted heartbeat,
scripted warehouse answers and a fake clock: what it asks, when, and what it raises."""

from __future__ import annotations

import pickle
import threading

import pytest

from ettflow.ett.heartbeat import Lapse
from ettflow.ett.lineage import ClaimsLost
from ettflow.tasks.claims_fence import ClaimsFence
from ettflow.trainer.group.stop_request import RunWithdrawn


class Beat:
    def __init__(self) -> None:
        self.lapse: Lapse | None = None

    def clear(self, lapse: Lapse) -> None:
        if self.lapse == lapse:
            self.lapse = None


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def info(self, msg, *args) -> None:
        self.lines.append(("info", msg % args))

    def warning(self, msg, *args) -> None:
        self.lines.append(("warning", msg % args))


def fence(answers: list, **kw):
    """A fence over a scripted heartbeat whose warehouse gives `answers` in turn (None or a
    `ClaimsLost` is returned, another exception raised), each question run at once; returns
    (fence, beat, clock, asked, log)."""
    beat, clock, asked, log = Beat(), [0.0], [], Log()

    def holds():
        asked.append(clock[0])
        answer = answers.pop(0)
        if isinstance(answer, BaseException) and not isinstance(answer, ClaimsLost):
            raise answer
        return answer

    return ClaimsFence(beat, holds, log=log, clock=lambda: clock[0], retry_s=5.0, settle_s=30.0,
                       ask=lambda question: question(), **kw), beat, clock, asked, log


def lost() -> ClaimsLost:
    return ClaimsLost("dlrm", "A", recorded=None, holder="B", windows=("w1", "w2"))


def polls(f, clock, until: float, every: float = 0.25) -> None:
    while clock[0] < until:
        f.check()
        clock[0] += every


def test_no_lapse_asks_nothing():
    f, _beat, clock, asked, log = fence([])
    polls(f, clock, 100.0)
    assert asked == [] and log.lines == []


def test_a_lapse_is_cleared_only_by_a_held_asked_past_the_settle_time():
    """The refresh that found the run dead may still be archiving it when the run resumes: a
    "held" right away proves nothing, so the fence asks every 5 s and clears the lapse on the
    first "held" asked 30 s after it saw the lapse."""
    f, beat, clock, asked, log = fence([None] * 7)
    beat.lapse = Lapse(10.0, 31.5)
    polls(f, clock, 40.0)
    assert asked == [0.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0] and beat.lapse is None
    assert log.lines == [("info", "this run's heartbeat lapsed for 21.5 s (its process stood still); it still holds "
                                  "its claims: training goes on")]


def test_claims_taken_while_the_fence_settles_withdraw_the_run_with_the_claims_lost():
    why = lost()
    f, beat, clock, asked, log = fence([None, None, why])
    beat.lapse = Lapse(10.0, 31.5)
    with pytest.raises(RunWithdrawn) as raised:
        polls(f, clock, 40.0)
    assert asked == [0.0, 5.0, 10.0] and raised.value.cause is why
    again = pickle.loads(pickle.dumps(raised.value))  # a Prefect state's data may be pickled
    assert (type(again.cause), again.cause.holder, str(again)) == (ClaimsLost, "B", str(raised.value))
    assert "stood still 21.5 s and lost its claims" in str(raised.value) and "run B holds windows w1..w2 now" in str(
        raised.value)
    assert [level for level, _ in log.lines] == ["warning"] and "taken for dead" in log.lines[0][1]


def test_a_lapse_extended_while_it_settles_settles_anew():
    f, beat, clock, asked, _log = fence([None] * 11)
    beat.lapse = Lapse(10.0, 31.5)
    polls(f, clock, 20.0)
    beat.lapse = Lapse(10.0, 60.0)  # stood still again before the fence cleared the first
    polls(f, clock, 80.0)
    # cleared by the "held" asked 30 s after the extension was seen (at 20), not 30 s after the first
    assert asked == [0.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 35.0, 40.0, 45.0, 50.0] and beat.lapse is None


@pytest.mark.parametrize("error", [OSError("connection refused"), RuntimeError("the Secret block's API is down")])
def test_no_answer_lets_training_go_on_and_it_is_asked_again_later(error):
    """An outage, or any other error of the question (a Secret block's API, a migration): the
    ranks train on, the fence asks again, the publish's own fence decides in the end."""
    why = lost()
    f, beat, clock, asked, log = fence([error, error, why],
                                       describe=lambda exc: f"{type(exc).__name__}: {exc} (scrubbed)")
    beat.lapse = Lapse(10.0, 31.5)
    with pytest.raises(RunWithdrawn):
        polls(f, clock, 40.0)
    assert asked == [0.0, 5.0, 10.0]
    warnings = [line for level, line in log.lines if level == "warning"]
    assert len(warnings) == 2 and f"cannot be asked now ({type(error).__name__}: {error} (scrubbed))" in warnings[0]


def test_the_question_runs_beside_the_polls_and_its_answer_is_acted_on_at_a_later_one():
    """A slow warehouse never holds the driver's poll: each poll returns at once while the
    question is out, and no second one is asked meanwhile."""
    release, answered = threading.Event(), threading.Event()
    beat, clock, asked = Beat(), [0.0], []

    def holds():
        asked.append(clock[0])
        release.wait(10)
        return lost()

    def ask(question):
        def run():
            question()
            answered.set()
        threading.Thread(target=run, daemon=True).start()

    f = ClaimsFence(beat, holds, log=Log(), clock=lambda: clock[0], retry_s=5.0, ask=ask)
    beat.lapse = Lapse(10.0, 31.5)
    polls(f, clock, 20.0)  # 80 polls while the answer is out
    assert len(asked) == 1
    release.set()
    assert answered.wait(10)
    with pytest.raises(RunWithdrawn):
        f.check()


def test_after_training_a_lapse_is_asked_at_once_and_lost_claims_stop_the_publish():
    """Ranks that finished while the process stood still leave no poll after the lapse: the train
    task asks once more, waiting, before the anchor goes on to be published."""
    why = lost()
    f, beat, _clock, asked, _log = fence([why])
    f.after_training()  # no lapse: nothing asked
    assert asked == []
    beat.lapse = Lapse(10.0, 31.5)
    with pytest.raises(ClaimsLost) as raised:
        f.after_training()
    assert raised.value is why
    for answer in (None, OSError("connection refused")):  # held, or no answer: the publish's fence decides
        f, beat, _clock, asked, log = fence([answer])
        beat.lapse = Lapse(10.0, 31.5)
        f.after_training()
        assert len(asked) == 1 and beat.lapse is not None
    assert "cannot be asked now (OSError: connection refused); the publish decides" in log.lines[-1][1]


def test_a_held_counts_by_when_it_was_asked_not_when_it_came_back():
    """A "held" asked 25 s after the lapse was seen says nothing of the 5 s after it, even when it
    comes back past the settle time: only one asked 30 s after clears the lapse."""
    beat, clock, log, pending = Beat(), [0.0], Log(), []
    f = ClaimsFence(beat, lambda: None, log=log, clock=lambda: clock[0], retry_s=25.0, settle_s=30.0,
                    ask=pending.append)
    beat.lapse = Lapse(10.0, 31.5)
    f.check()  # asked at 0
    pending.pop()()
    clock[0] = 25.0
    f.check()  # acts on the answer asked at 0; asks again at 25
    clock[0] = 31.0
    pending.pop()()  # the answer asked at 25 comes back at 31
    f.check()
    assert beat.lapse is not None
    clock[0] = 50.0
    f.check()  # asked at 50
    pending.pop()()
    f.check()
    assert beat.lapse is None


def test_a_question_that_cannot_start_is_no_answer_and_the_next_one_is_asked():
    beat, clock, log, tries = Beat(), [0.0], Log(), []

    def ask(question):
        tries.append(clock[0])
        if len(tries) == 1:
            raise RuntimeError("can't start new thread")
        question()

    f = ClaimsFence(beat, lost, log=log, clock=lambda: clock[0], retry_s=5.0, ask=ask)
    beat.lapse = Lapse(10.0, 31.5)
    f.check()  # no thread: no answer, training goes on
    assert "cannot be asked now (the question could not start: RuntimeError: can't start new thread)" in \
        log.lines[0][1]
    clock[0] = 5.0
    with pytest.raises(RunWithdrawn):
        f.check()
    assert tries == [0.0, 5.0]
