"""Delta checkpoint chains (issue 28), pure: the base/delta decision, the restore order, the
fallback past a damaged link, and what retention must keep. Exact values throughout."""

from __future__ import annotations

import pytest

from ettflow.trainer.checkpoint.delta_chain import ChainPolicy, Link, needed, next_kind, restore_chain

BASE = 1000  # a base's bytes


def chain(*steps: int, delta_bytes: int = 100) -> list[Link]:
    """A base at the first step and deltas, each on the one before."""
    out = [Link(step=steps[0], kind="base", bytes=BASE)]
    out += [Link(step=s, kind="delta", parent=p, bytes=delta_bytes) for p, s in zip(steps, steps[1:])]
    return out


def test_a_link_names_its_parent_exactly_when_it_is_a_delta():
    with pytest.raises(ValueError, match="names its parent"):
        Link(step=10, kind="delta")
    with pytest.raises(ValueError, match="names its parent"):
        Link(step=10, kind="base", parent=5)
    with pytest.raises(ValueError, match="later or equal parent"):
        Link(step=10, kind="delta", parent=10)


def test_a_delta_is_taken_until_the_chain_is_worth_a_base():
    policy = ChainPolicy(max_chain_share=0.5, max_chain_length=16)
    links = chain(10, 20, 30, 40)  # 300 bytes of deltas on a 1000-byte base
    assert next_kind(links, 40, 100, anchor=False, policy=policy) == ("delta", "on step 40 (chain of 4 after base 10)")
    kind, why = next_kind(links, 40, 201, anchor=False, policy=policy)  # 501 > 500
    assert kind == "base" and "501 bytes, over 0.5 of its base's 1000" in why
    assert next_kind(links, 40, 10, anchor=True, policy=policy)[0] == "base"  # an anchor is a base
    assert next_kind(links, None, 10, anchor=False, policy=policy)[0] == "base"  # nothing to build on
    assert next_kind(links, 35, 10, anchor=False, policy=policy)[0] == "base"  # the head is not committed
    kind, why = next_kind(links, 40, 1, anchor=False, policy=ChainPolicy(max_chain_length=3))
    assert kind == "base" and "3 deltas" in why
    broken = [link for link in links if link.step != 20]
    kind, why = next_kind(broken, 40, 1, anchor=False, policy=policy)
    assert kind == "base" and "needs step 20" in why


def test_a_restore_reads_the_base_then_its_deltas_in_order():
    plan = restore_chain(chain(10, 20, 30) + chain(40, 50))
    assert [link.step for link in plan.links] == [40, 50] and plan.skipped is None and plan.step == 50
    plan = restore_chain(chain(10, 20, 30))
    assert [(link.step, link.kind) for link in plan.links] == [(10, "base"), (20, "delta"), (30, "delta")]


def test_a_damaged_delta_falls_back_to_the_previous_good_point_and_says_so():
    links = chain(10, 20, 30, 40)
    plan = restore_chain(links, damaged={30: "rank-1.bin sha256 mismatch"})
    assert [link.step for link in plan.links] == [10, 20] and plan.step == 20
    assert plan.skipped == 40 and plan.why == "its chain's step 30 is damaged (rank-1.bin sha256 mismatch)"
    plan = restore_chain(links, damaged={10: "torn"})  # the base: nothing of the chain is usable
    assert plan.links == () and plan.step is None and plan.skipped == 40 and "step 10 is damaged" in plan.why
    # a missing link (deleted, never committed) breaks its chain the same way
    plan = restore_chain([link for link in links if link.step != 20])
    assert [link.step for link in plan.links] == [10]
    assert plan.why == "the chain of step 40 needs step 20, which is not there"
    assert restore_chain([]) == restore_chain([], damaged={}) and restore_chain([]).links == ()


def test_retention_keeps_every_link_a_kept_delta_needs():
    links = chain(10, 20, 30) + chain(40, 50)
    assert needed(links, keep=[50]) == {40, 50}
    assert needed(links, keep=[30, 50]) == {10, 20, 30, 40, 50}
    assert needed(links, keep=[10]) == {10}
    assert needed([link for link in links if link.step != 20], keep=[30]) == {30}  # nothing can mend a gap


def test_a_delta_written_on_a_parent_saved_again_since_is_not_restored():
    """A restart replayed to step 20 and saved it again (digest b2): the old delta of 30,
    written on the first save of 20 (digest b1), is skipped; the new step 20 is restored."""
    links = [Link(step=10, kind="base", bytes=BASE, digest="a"),
             Link(step=20, kind="delta", parent=10, digest="b2", parent_digest="a"),
             Link(step=30, kind="delta", parent=20, digest="c", parent_digest="b1")]
    plan = restore_chain(links)
    assert [link.step for link in plan.links] == [10, 20] and plan.skipped == 30
    assert plan.why == ("the chain of step 30 needs step 20 as its delta of step 30 was written on, "
                        "and step 20 was saved again since")
    kind, why = next_kind(links, 30, 1, anchor=False, policy=ChainPolicy())
    assert kind == "base" and "saved again since" in why
    same = [*links[:2], Link(step=30, kind="delta", parent=20, digest="c", parent_digest="b2")]
    assert restore_chain(same).step == 30
