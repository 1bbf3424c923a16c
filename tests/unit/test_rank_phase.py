"""A rank's phases (`trainer/rank/phase.py`): the moves each call makes, and the ones refused."""

from __future__ import annotations

import pytest

from ettflow.trainer.rank.phase import MOVES, PhaseError, RankLifecycle, RankPhase

IDLE, PREWARMED, TRAINING, PARKED, FINISHED, FAILED = RankPhase


def walk(*moves: tuple[RankPhase, str]) -> RankLifecycle:
    life = RankLifecycle("rank 1")
    for to, call in moves:
        life.enter(to, call)
    return life


def test_a_rank_a_pooled_worker_and_a_spare_each_reach_the_end():
    assert walk((TRAINING, "train"), (FINISHED, "finish")).phase is FINISHED
    assert walk((PREWARMED, "prewarm"), (TRAINING, "train"), (FINISHED, "finish")).phase is FINISHED
    survivor = walk((TRAINING, "train"), (PARKED, "fail"), (TRAINING, "rejoin"), (PARKED, "fail"),
                    (TRAINING, "rejoin"), (FINISHED, "finish"))
    assert survivor.phase is FINISHED
    assert walk((PREWARMED, "prewarm"), (TRAINING, "join"), (FAILED, "fail")).phase is FAILED


@pytest.mark.parametrize(("start", "to", "call"), [
    ((), PARKED, "fail"),                               # nothing ran yet
    ((TRAINING,), TRAINING, "rejoin"),                  # still training
    ((TRAINING, FAILED), TRAINING, "rejoin"),           # closed: nothing kept to rejoin with
    ((TRAINING, FINISHED), TRAINING, "train"),          # finished is final
    ((PREWARMED,), PREWARMED, "prewarm"),               # prewarmed once
    ((TRAINING, PARKED), FINISHED, "finish"),           # a parked rank trains again first
])
def test_a_move_the_phase_does_not_allow_raises_naming_the_call(start, to, call):
    life = walk(*((p, "setup") for p in start))
    before = life.phase
    with pytest.raises(PhaseError, match=f"rank 1 cannot {call}: it is {before.value}") as caught:
        life.enter(to, call)
    assert life.phase is before and caught.value.call == call  # nothing moved


def test_a_call_that_needs_a_phase_says_which():
    life = walk((TRAINING, "train"))
    with pytest.raises(PhaseError, match="cannot join: it is training, and join needs a rank that is prewarmed"):
        life.require("join", PREWARMED)
    life.require("adopt", TRAINING)  # allowed: nothing raised


def test_every_phase_has_its_moves_and_only_the_two_ends_are_final():
    assert set(MOVES) == set(RankPhase)
    assert {p for p, nexts in MOVES.items() if not nexts} == {FINISHED, FAILED}
    # every phase is reachable from IDLE
    seen, todo = {IDLE}, [IDLE]
    while todo:
        for nxt in MOVES[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    assert seen == set(RankPhase)
