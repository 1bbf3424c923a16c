"""The restore ladder over a rank's checkpoint tiers (`trainer/rank/tiers.climb`), stepped with
scripted tiers and a scripted agreement: which tier serves, what every rank agrees on, which
miss the report carries, and that every rank makes the same collective calls."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from ettflow.ett.checkpoint_tier import CheckpointTier, RestoreSource
from ettflow.trainer.protocol import RestorePoint
from ettflow.trainer.rank.restore_report import RestoreReport
from ettflow.trainer.rank.tiers import RESTORE_ORDER, NoTierHolds, TierMiss, climb

MEMORY, DURABLE = CheckpointTier.MEMORY, CheckpointTier.DURABLE


@dataclass
class ScriptedTier:
    """A tier whose restore answers from a script: a report, or a TierMiss with this reason."""

    kind: CheckpointTier
    miss: str | None = None
    asked: list[int] = field(default_factory=list)

    def restore(self, point: RestorePoint) -> RestoreReport:
        self.asked.append(point.step)
        if self.miss is not None:
            raise TierMiss(self.miss)
        source = RestoreSource.MEMORY if self.kind is MEMORY else RestoreSource.OWN
        return RestoreReport(source=source, step=point.step, path=None if self.kind is MEMORY else "/c/step_8")


class Agreement:
    """The control group's all_ok for one rank: the peers' answers are scripted per call."""

    def __init__(self, peers_ok: list[bool]) -> None:
        self.peers_ok, self.calls = list(peers_ok), []

    def __call__(self, mine: bool) -> bool:
        self.calls.append(mine)
        peers = self.peers_ok.pop(0)
        return mine and peers


def test_the_tiers_are_ordered_fastest_restore_first_with_durable_last():
    assert RESTORE_ORDER == (MEMORY, DURABLE)


def test_a_memory_point_every_rank_holds_is_restored_from_memory():
    memory, durable = ScriptedTier(MEMORY), ScriptedTier(DURABLE)
    agree = Agreement([True])
    report = climb([memory, durable], RestorePoint(step=12, source=MEMORY), agree)
    assert report.source is RestoreSource.MEMORY and report.step == 12
    assert report.point == RestorePoint(step=12, source=MEMORY) and report.memory_problem is None
    assert memory.asked == [12] and durable.asked == [] and agree.calls == [True]


def test_a_peers_missing_copy_sends_every_rank_to_the_durable_tier():
    memory, durable = ScriptedTier(MEMORY), ScriptedTier(DURABLE)
    agree = Agreement([False, True])  # this rank's copy is fine, a peer's is not
    report = climb([memory, durable], RestorePoint(step=12, source=MEMORY), agree)
    assert report.source is RestoreSource.OWN and report.path == "/c/step_8"
    assert report.memory_problem == "a peer's copy failed its check"
    assert agree.calls == [True, True]


def test_this_ranks_own_miss_is_the_reason_the_report_gives():
    memory, durable = ScriptedTier(MEMORY, miss="checksum mismatch at step 12"), ScriptedTier(DURABLE)
    report = climb([memory, durable], RestorePoint(step=12, source=MEMORY), Agreement([False, True]))
    assert report.source is RestoreSource.OWN and report.memory_problem == "checksum mismatch at step 12"


def test_a_rank_without_the_memory_tier_still_takes_part_in_its_agreement():
    """Every rank makes the same collective calls whatever tiers it has: one all_ok per rung."""
    durable = ScriptedTier(DURABLE)
    agree = Agreement([True, True])
    report = climb([durable], RestorePoint(step=12, source=MEMORY), agree)
    assert agree.calls == [False, True]
    assert report.source is RestoreSource.OWN and report.memory_problem == "this rank has no memory tier"


def test_a_durable_point_never_reads_memory():
    memory, durable = ScriptedTier(MEMORY), ScriptedTier(DURABLE)
    agree = Agreement([True])
    report = climb([memory, durable], RestorePoint(step=8, source=DURABLE, path="/c/step_8"), agree)
    assert report.source is RestoreSource.OWN and memory.asked == [] and agree.calls == [True]


def test_no_tier_holding_the_point_names_every_miss():
    memory = ScriptedTier(MEMORY, miss="the keeper died")
    durable = ScriptedTier(DURABLE, miss="the run has no durable checkpoint")
    with pytest.raises(NoTierHolds) as raised:
        climb([memory, durable], RestorePoint(step=3, source=MEMORY), Agreement([False, False]))
    assert raised.value.problems == ((MEMORY, "the keeper died"), (DURABLE, "the run has no durable checkpoint"))
    assert "step 3" in str(raised.value) and "the keeper died" in str(raised.value)
