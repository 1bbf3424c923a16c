"""The in-memory checkpoint tier's pure parts (memory_copy.py, state_keeper.py), on a plain
torch model, no processes: what a copy holds, the in-place restore and its refusals, the reused
host buffers, checksums, the keeper's bookkeeping. (A MemoryTier against a real keeper:
tests/integration/test_memory_tier.py; the project's sharded DLRM in Ray actors:
tests/e2e/test_memory_tier_ranks.py.)"""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest
import torch

from ettflow.trainer.checkpoint import CheckpointError
from ettflow.trainer.checkpoint.memory_copy import (
    RANK_STATE,
    RNG_TORCH,
    CopyMeta,
    HostCopy,
    apply,
    byte_view,
    checksum,
    layout_of,
    local_tensors,
    tensors_of,
)
from ettflow.trainer.checkpoint.memory_tier import MemoryCopyError
from ettflow.trainer.checkpoint.state_keeper import CopyIndex, keeper_name

from helpers.plain_model import plain_state, plain_step
from helpers.state_fingerprint import fingerprint


def test_a_copy_restores_in_place_bitwise_and_refuses_what_does_not_fit():
    state = plain_state()
    for s in range(2):
        plain_step(state, s)
    saved = fingerprint(state)
    host = HostCopy().capture(local_tensors(state, step=2, rank=0))
    assert sorted(n for n in host if not n.startswith("model/")) == [
        "optim/dense/state/0/exp_avg", "optim/dense/state/0/exp_avg_sq", "optim/dense/state/0/step",
        "optim/dense/state/1/exp_avg", "optim/dense/state/1/exp_avg_sq", "optim/dense/state/1/step",
        "optim/dense/state/2/exp_avg", "optim/dense/state/2/exp_avg_sq", "optim/dense/state/2/step",
        "optim/dense/state/3/exp_avg", "optim/dense/state/3/exp_avg_sq", "optim/dense/state/3/step",
        RNG_TORCH, RANK_STATE]
    params = [id(p) for p in state.model.parameters()]
    moments = [id(v) for s in state.optimizers["dense"].state.values() for v in s.values()]
    for s in range(2, 5):
        plain_step(state, s)
    assert fingerprint(state) != saved

    assert apply(state, host, rank=0) == (2, {"row": 4})
    assert fingerprint(state) == saved and (state.step, state.cursor) == (2, {"row": 4})
    assert [id(p) for p in state.model.parameters()] == params  # in place: the same objects
    assert [id(v) for s in state.optimizers["dense"].state.values() for v in s.values()] == moments

    # into a fresh model (Adam has no moments yet): the lazy state is made, then filled
    fresh = plain_state()
    apply(fresh, host, rank=0)
    assert fingerprint(fresh) == saved

    # shapes, dtypes and names must match exactly; a refused copy changes nothing
    for other, why in ((plain_state(width=5), "model/0.weight: copy has float32 [3, 4], model has float32 [5, 4]"),
                       (plain_state(dtype=torch.float64), "model/0.bias: copy has float32 [3], model has float64 [3]")):
        plain_step(other, 0)  # its optimizer state exists (a refusal may create a fresh model's lazy state)
        before = fingerprint(other)
        with pytest.raises(MemoryCopyError, match=rf"rank 1: the in-memory copy does not fit .*{re.escape(why)}"):
            apply(other, host, rank=1)
        assert fingerprint(other) == before
    with pytest.raises(MemoryCopyError,
                       match="missing model/1.bias; unexpected model/x; missing rank/state; rank/state must hold"):
        apply(fresh, {**{k: v for k, v in host.items() if k not in ("model/1.bias", RANK_STATE)},
                      "model/x": torch.zeros(1)}, rank=0)
    assert issubclass(MemoryCopyError, CheckpointError)


def test_host_buffers_are_reused_and_the_checksum_covers_bytes_layout_and_metadata():
    state = plain_state()
    plain_step(state, 0)
    copier = HostCopy()
    first = copier.capture(local_tensors(state, step=1, rank=0))
    pointers = {n: t.data_ptr() for n, t in first.items() if n != RANK_STATE}  # JSON text: its length varies
    plain_step(state, 1)
    second = copier.capture(local_tensors(state, step=2, rank=0))
    assert {n: t.data_ptr() for n, t in second.items() if n != RANK_STATE} == pointers
    assert torch.equal(second["model/0.weight"], state.model[0].weight)

    layout = layout_of(second)
    arrays = [byte_view(t) for t in second.values()]
    meta = CopyMeta(step=2, rank=0, world_size=1, cursor={"row": 4}, nbytes=sum(a.size for a in arrays),
                    layout=layout).with_checksum(arrays)
    assert CopyMeta.from_json(meta.to_json()) == meta
    meta.verify(arrays)
    assert {n: torch.equal(t, second[n]) for n, t in tensors_of(layout, arrays).items()} == dict.fromkeys(second, True)
    damaged = [a.copy() for a in arrays]
    damaged[0][5] ^= 1
    with pytest.raises(MemoryCopyError, match="in-memory copy of rank 0 at step 2 is damaged: checksum"):
        meta.verify(damaged)
    renamed = (("model/other", *layout[0][1:]), *layout[1:])
    assert checksum(renamed, arrays, meta.signed()) != meta.checksum
    # the metadata a restore applies beside the tensors is covered too: a delta's optimizer param
    # groups (applied as they are), its parent, the world size, the cursor
    groups = {"dense": [{"lr": 0.01, "betas": [0.9, 0.999]}]}
    delta = replace(meta, step=3, parent=2, delta=groups).with_checksum(arrays)
    assert CopyMeta.from_json(delta.to_json()) == delta
    delta.verify(arrays)
    for changed in ({"delta": {"dense": [{"lr": 10.0, "betas": [0.9, 0.999]}]}}, {"parent": 1}, {"world_size": 2},
                    {"cursor": {"row": 5}}):
        with pytest.raises(MemoryCopyError, match="at step 3 is damaged: checksum"):
            replace(delta, **changed).verify(arrays)
    with pytest.raises(MemoryCopyError, match="malformed copy metadata"):
        CopyMeta.from_json({**meta.to_json(), "layout": [["x", "float32"]]})
    with pytest.raises(MemoryCopyError, match="unknown dtype 'pickle'"):
        tensors_of((("x", "pickle", (1,)),), [np.zeros(4, np.uint8)])


def _meta(rank: int, step: int, world_size: int = 2) -> CopyMeta:
    return CopyMeta(step=step, rank=rank, world_size=world_size, cursor={}, nbytes=0, layout=())


def test_the_keeper_index_keeps_the_newest_two_per_rank_and_finds_the_newest_common_step():
    index = CopyIndex()
    assert index.latest_common(2) is None
    assert index.store(_meta(0, 10), "a") == [] and index.store(_meta(1, 10), "b") == []
    assert index.store(_meta(0, 20), "c") == [] and index.latest_common(2) == 10  # rank 1 has no 20 yet
    assert index.store(_meta(0, 30), "d") == [10]
    assert index.inventory() == {0: [20, 30], 1: [10]} and index.latest_common(2) is None
    assert index.store(_meta(1, 20), "e") == [] and index.latest_common(2) == 20
    assert index.store(_meta(1, 30), "f") == [10] and index.latest_common(2) == 30
    assert index.latest_common(1) is None  # copies of 2 ranks do not restore a 1-rank job
    index.store(_meta(0, 40, world_size=1), "g")
    assert index.latest_common(1) == 40 and index.latest_common(2) == 30
    assert index.get(1, 30) == (_meta(1, 30), "f") and index.get(1, 10) is None
    assert keeper_name("r1") == "ettflow-keeper-r1"
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        CopyIndex(keep=0)


def _delta(rank: int, step: int, parent: int) -> CopyMeta:
    return CopyMeta(step=step, rank=rank, world_size=2, cursor={}, nbytes=0, layout=(), parent=parent,
                    delta={"param_groups": {}, "sparse": "sparse"})


def test_the_keeper_index_keeps_the_chains_of_delta_copies_and_restores_only_whole_ones():
    """Issue 28: a delta copy keeps its parent (down to its whole copy) however old; a step
    counts for `latest_common` only when every rank holds its whole chain."""
    index = CopyIndex()
    index.store(_meta(0, 2), "b0")
    assert index.store(_delta(0, 4, 2), "d4") == [] and index.store(_delta(0, 6, 4), "d6") == []
    assert index.store(_delta(0, 8, 6), "d8") == []  # 2 is the base 8 needs: nothing goes
    assert index.inventory() == {0: [2, 4, 6, 8]}
    assert [p for _, p in index.chain(0, 8)] == ["b0", "d4", "d6", "d8"] and index.chain(0, 3) is None
    assert index.store(_meta(0, 10), "b10") == []  # 6 and 8 are the newest two with 10
    assert index.store(_delta(0, 12, 10), "d12") == [2, 4, 6, 8]  # a new base: the old chain goes
    assert index.inventory() == {0: [10, 12]}
    # rank 1 holds a delta whose parent it never got (a failed hand-off): not restorable
    index.store(_meta(1, 10), "r10")
    index.store(_delta(1, 12, 11), "r12")
    assert index.chain(1, 12) is None and index.latest_common(2) == 10
    index.store(_delta(1, 14, 10), "r14")
    index.store(_delta(0, 14, 12), "d14")
    assert index.latest_common(2) == 14 and [p for _, p in index.chain(1, 14)] == ["r10", "r14"]
    with pytest.raises(MemoryCopyError, match="a delta copy names an earlier parent"):
        CopyMeta(step=4, rank=0, world_size=1, cursor={}, nbytes=0, layout=(), parent=4, delta={})
    with pytest.raises(MemoryCopyError, match="a delta copy names an earlier parent"):
        CopyMeta(step=4, rank=0, world_size=1, cursor={}, nbytes=0, layout=(), parent=2)
    assert CopyMeta.from_json(_delta(0, 4, 2).to_json()) == _delta(0, 4, 2)


def test_a_copy_of_an_earlier_step_is_a_new_timeline_and_the_later_copies_go():
    """After a durable fallback the ranks copy an earlier step again: that copy is kept (not
    evicted as older than the abandoned timeline's newest two), the later copies go, and the
    deltas on it chain to it."""
    index = CopyIndex()
    index.store(_meta(0, 10), "b10")
    for step in (12, 14, 16, 18):
        index.store(_delta(0, step, step - 2), f"d{step}")
    assert index.store(_meta(0, 15), "b15") == [16, 18]  # (14's chain: the newest two are 14 and 15)
    assert index.inventory() == {0: [10, 12, 14, 15]}
    assert index.store(_delta(0, 16, 15), "n16") == [10, 12, 14]
    assert [p for _, p in index.chain(0, 16)] == ["b15", "n16"]
    index.store(_meta(1, 15), "r15")
    index.store(_delta(1, 16, 15), "r16")
    assert index.latest_common(2) == 16
