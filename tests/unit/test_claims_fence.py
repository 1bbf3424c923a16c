"""The training run's claims fence (`tasks.claims_fence`), stepped with a scripted heartbeat,
a scripted warehouse answer and a fake clock: what it asks, when, and what it raises."""

from __future__ import annotations

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


class Outage(OSError):
    pass


def fence(answers: list):
    """A fence over a scripted heartbeat whose warehouse gives `answers` in turn (None or a
    `ClaimsLost` is returned, another exception raised); returns (fence, beat, clock, asked, log)."""
    beat, clock, asked, log = Beat(), [0.0], [], Log()

    def holds():
        asked.append(clock[0])
        answer = answers.pop(0)
        if isinstance(answer, BaseException) and not isinstance(answer, ClaimsLost):
            raise answer
        return answer

    return ClaimsFence(beat, holds, outages=(Outage,), log=log, clock=lambda: clock[0], retry_s=5.0), beat, clock, \
        asked, log


def lost() -> ClaimsLost:
    return ClaimsLost("dlrm", "A", recorded=None, holder="B", windows=("w1", "w2"))


def test_no_lapse_asks_nothing():
    f, _beat, _clock, asked, log = fence([])
    for _ in range(100):
        f.check()
    assert asked == [] and log.lines == []


def test_a_lapse_with_the_claims_still_held_is_cleared_and_training_goes_on():
    f, beat, _clock, asked, log = fence([None])
    beat.lapse = Lapse(10.0, 31.5)
    f.check()
    f.check()
    assert asked == [0.0] and beat.lapse is None
    assert log.lines == [("info", "this run's heartbeat lapsed for 21.5 s (its process stood still); it still holds "
                                  "its claims: training goes on")]


def test_a_lapse_that_cost_the_claims_withdraws_the_run_with_the_claims_lost():
    why = lost()
    f, beat, _clock, asked, log = fence([why])
    beat.lapse = Lapse(10.0, 31.5)
    with pytest.raises(RunWithdrawn) as raised:
        f.check()
    assert raised.value.cause is why and "stood still 21.5 s and lost its claims" in str(raised.value)
    assert "run B holds windows w1..w2 now" in str(raised.value)
    assert [level for level, _ in log.lines] == ["warning"] and "taken for dead" in log.lines[0][1]


def test_an_unreachable_warehouse_lets_training_go_on_and_is_asked_again_later():
    why = lost()
    f, beat, clock, asked, log = fence([Outage("connection refused"), Outage("connection refused"), why])
    beat.lapse = Lapse(10.0, 31.5)
    f.check()  # asked at 0: unreachable
    clock[0] = 4.9
    f.check()  # not asked again before retry_s
    clock[0] = 5.0
    f.check()  # asked: still unreachable
    clock[0] = 10.0
    with pytest.raises(RunWithdrawn):
        f.check()
    assert asked == [0.0, 5.0, 10.0] and beat.lapse is not None
    warnings = [line for level, line in log.lines if level == "warning"]
    # the outage told once, then the withdrawal
    assert len(warnings) == 2 and "cannot be asked now (Outage: connection refused)" in warnings[0]


def test_an_error_that_is_no_outage_is_raised():
    f, beat, _clock, _asked, _log = fence([ValueError("a bug")])
    beat.lapse = Lapse(10.0, 31.5)
    with pytest.raises(ValueError, match="a bug"):
        f.check()
