"""The anchor's save never runs beside an async delta still in flight (`trainer/rank/durable_tier`):
the delta's agreement and seal are collectives on the checkpoint group on the manager's thread,
and the anchor's save into host memory runs DCP's own on the loop's thread; interleaved, the
ranks deadlocked (both in an all_gather, both with a broadcast pending). Stepped with a scripted
manager and a delta whose write finishes on another thread."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from ettflow.trainer.data.windows import Cursor
from ettflow.trainer.rank.durable_tier import DurableTier, InFlightDelta


class ScriptedManager:
    """Records, at each anchor call, whether the tier still had a delta in flight."""

    def __init__(self, tier: DurableTier) -> None:
        self.tier, self.calls = tier, []

    def save_to_host(self, step, state):
        self.calls.append(("save_to_host", step, self.tier._delta is None))
        return {"__0_0.distcp": b"x"}, "{}"

    def save(self, step, state):
        self.calls.append(("save", step, self.tier._delta is None))
        return SimpleNamespace(commit_result=lambda: SimpleNamespace(committed=True, path=f"/c/step_{step}"))

    def wait(self):
        self.calls.append(("wait", None, self.tier._delta is None))


class Ledger:
    def __init__(self) -> None:
        self.finished, self.bases = [], []

    def finished_(self, captured, taken, commit, *, rank):
        self.finished.append((captured.step, commit.committed, rank))

    def base_started(self, step):
        self.bases.append(step)


def _tier_with_a_delta_in_flight(write_s: float) -> tuple[DurableTier, ScriptedManager, Ledger, list]:
    ledger, records = Ledger(), []
    deltas = SimpleNamespace(finished=ledger.finished_, base_started=ledger.base_started)
    ctx = SimpleNamespace(rank=1, deltas=deltas, rec=SimpleNamespace(record=lambda phase, *a, **kw: records.append(
        (phase, kw))), set_position=lambda step, cursor: SimpleNamespace(step=step))
    tier = DurableTier(ctx)
    tier.manager = ScriptedManager(tier)
    future: Future = Future()
    commit = SimpleNamespace(committed=True, unsupported=False, bytes=10, path="/c/delta_255", error=None)
    threading.Timer(write_s, lambda: future.set_result((commit, 1.0, 2.0))).start()  # the manager's thread
    tier._delta = InFlightDelta(future, SimpleNamespace(step=255), {})
    return tier, tier.manager, ledger, records


@pytest.mark.parametrize("anchor", ["hand_off_base", "commit_base"])
def test_the_anchor_waits_for_the_delta_in_flight_and_records_it(anchor):
    tier, manager, ledger, records = _tier_with_a_delta_in_flight(write_s=0.2)
    getattr(tier, anchor)(256, Cursor())
    first = next(c for c in manager.calls if c[0] in ("save_to_host", "save"))
    assert first[1] == 256 and first[2], manager.calls  # the delta settled before the anchor's save began
    assert ledger.finished == [(255, True, 1)]  # its outcome is the chain's, as at any other save
    assert [r for r in records if r[0] == "checkpoint_save_background"] == [
        ("checkpoint_save_background", {"step": 255, "kind": "delta", "committed": True, "bytes": 10,
                                        "path": "/c/delta_255", "error": None})]
