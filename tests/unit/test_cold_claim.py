"""One cold compile of a key at a time (compile/cold_claim.py): who claims, who waits and for
how long, and what a waiter does when the owner saves, fails, dies or takes too long. Two
claims on one folder stand for two processes; a fake clock moves as the waiter sleeps."""

from __future__ import annotations

import json

from ettflow.trainer.compile.cold_claim import STALE_S, ColdClaim, Owner, Turn, take_turn

KEY = "k1"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def claims(tmp_path, clock, *, alive=lambda pid: True):
    owner = ColdClaim(tmp_path, KEY, host="h1", pid=11, clock=clock, alive=alive, heartbeat_s=None)
    waiter = ColdClaim(tmp_path, KEY, host="h1", pid=22, clock=clock, alive=alive, heartbeat_s=None)
    return owner, waiter


def ticking(clock, every=None):
    """A waiter's sleep: the clock moves; `every(now)` runs at each look (the owner's doings)."""
    def sleep(s: float) -> None:
        clock.now += s
        if every is not None:
            every(clock.now)
    return sleep


def test_the_first_to_miss_claims_and_compiles_and_its_release_leaves_nothing(tmp_path):
    clock = Clock()
    owner, _ = claims(tmp_path, clock)
    turn = take_turn(owner, lambda: False, max_wait_s=60)
    assert (turn.turn, turn.claimed, turn.waited_s, turn.why) == (Turn.COMPILE, True, 0.0, "first to miss")
    assert json.loads(owner.path.read_text())["pid"] == 11 and owner.path.name == f"pt2-{KEY}.compiling"
    owner.release()
    assert not owner.path.exists()


def test_a_waiter_restores_the_owners_archive_once_it_is_saved_and_released(tmp_path):
    clock = Clock()
    owner, waiter = claims(tmp_path, clock)
    take_turn(owner, lambda: False, max_wait_s=60)
    saved = []

    def sleep(s: float) -> None:  # the owner compiles for 12 s, saves, releases
        clock.now += s
        if clock.now >= 1012 and not saved:
            saved.append(True)
            owner.release()

    turn = take_turn(waiter, lambda: bool(saved), max_wait_s=60, sleep=sleep, poll_s=0.5)
    assert (turn.turn, turn.claimed, turn.waited_s, turn.owner) == (Turn.RESTORE, False, 12.0, "h1:11")
    assert turn.to_attrs() == {"cold_turn": "restore", "cold_claimed": False, "cold_waited_s": 12.0,
                               "cold_owner": "h1:11", "cold_why": "its archive was saved"}
    assert not waiter.path.exists()  # the waiter's claim, taken to look, was given back


def test_an_archive_saved_before_the_turn_is_restored_without_waiting(tmp_path):
    clock = Clock()
    _, late = claims(tmp_path, clock)
    turn = take_turn(late, lambda: True, max_wait_s=60)
    assert (turn.turn, turn.claimed, turn.waited_s) == (Turn.RESTORE, False, 0.0)
    assert not late.path.exists()


def test_an_owner_that_released_without_an_archive_leaves_each_waiter_to_compile_unclaimed(tmp_path):
    """Its save was skipped (too large, no space) or its compile failed: a second claimant would
    fail alike while the rest waited again, so each waiter compiles, rank 0 saves (`orphaned`)."""
    clock = Clock()
    owner, waiter = claims(tmp_path, clock)
    take_turn(owner, lambda: False, max_wait_s=60)
    turn = take_turn(waiter, lambda: False, max_wait_s=60, poll_s=1,
                     sleep=ticking(clock, lambda now: now >= 1003 and owner.release()))
    assert (turn.turn, turn.claimed, turn.orphaned, turn.waited_s) == (Turn.COMPILE, False, True, 3.0)
    assert turn.why == "h1:11 left no archive: compiled beside the others"
    assert not waiter.path.exists()


def test_two_waiters_both_restore_the_owners_archive(tmp_path):
    clock = Clock()
    owner, first = claims(tmp_path, clock)
    second = ColdClaim(tmp_path, KEY, host="h1", pid=33, clock=clock, heartbeat_s=None)
    take_turn(owner, lambda: False, max_wait_s=60)
    saved = []

    def owner_saves(now: float) -> None:
        if now >= 1010 and not saved:
            saved.append(True)
            owner.release()

    a = take_turn(first, lambda: bool(saved), max_wait_s=60, sleep=ticking(clock, owner_saves), poll_s=1)
    b = take_turn(second, lambda: bool(saved), max_wait_s=60, sleep=ticking(clock), poll_s=1)
    assert (a.turn, b.turn, a.claimed, b.claimed) == (Turn.RESTORE, Turn.RESTORE, False, False)
    assert not owner.path.exists()


def test_a_long_compile_keeps_its_claim_by_touching_it(tmp_path):
    """Past STALE_S a live owner's claim still holds while the owner touches it (its heartbeat);
    the waiter waits on (a cold compile it started later would end later)."""
    clock = Clock()
    owner, waiter = claims(tmp_path, clock)
    take_turn(owner, lambda: False, max_wait_s=600)
    saved = []

    def owner_compiles(now: float) -> None:
        owner.touch()  # the heartbeat, every look here
        if now >= 1000 + 3 * STALE_S and not saved:
            saved.append(True)
            owner.release()

    turn = take_turn(waiter, lambda: bool(saved), max_wait_s=600, sleep=ticking(clock, owner_compiles), poll_s=1)
    assert (turn.turn, turn.waited_s) == (Turn.RESTORE, 3 * STALE_S)


def test_the_owners_heartbeat_touches_its_claim_until_released(tmp_path):
    import os
    import time

    claim = ColdClaim(tmp_path, KEY, heartbeat_s=0.05)
    assert claim.try_claim()
    os.utime(claim.path, (1.0, 1.0))
    deadline = time.monotonic() + 10
    while claim.path.stat().st_mtime < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert claim.path.stat().st_mtime > 2  # touched again by its thread
    claim.release()
    assert not claim.path.exists()


def test_a_dead_owners_claim_on_this_host_is_broken_at_once(tmp_path):
    clock = Clock()
    owner, _ = claims(tmp_path, clock)
    take_turn(owner, lambda: False, max_wait_s=60)  # then SIGKILLed: the file stays
    waiter = ColdClaim(tmp_path, KEY, host="h1", pid=22, clock=clock, alive=lambda pid: pid != 11, heartbeat_s=None)
    turn = take_turn(waiter, lambda: False, max_wait_s=60, sleep=ticking(clock))
    assert (turn.turn, turn.claimed, turn.waited_s) == (Turn.COMPILE, True, 0.0)
    assert turn.why == "h1:11 was gone: claimed its key"
    assert json.loads(waiter.path.read_text())["pid"] == 22
    owner.release()  # the dead owner's release (had it come) would not remove the new claim
    assert waiter.path.exists()


def test_a_claim_untouched_for_stale_s_is_broken_whatever_its_host(tmp_path):
    """Another host's owner (its pid means nothing here), SIGKILLed or stopped: its claim is no
    longer touched, and is stale STALE_S after the last touch."""
    clock = Clock()
    other = ColdClaim(tmp_path, KEY, host="h2", pid=11, clock=clock, alive=lambda pid: False, heartbeat_s=None)
    take_turn(other, lambda: False, max_wait_s=600)
    waiter = ColdClaim(tmp_path, KEY, host="h1", pid=22, clock=clock, alive=lambda pid: False, heartbeat_s=None)
    turn = take_turn(waiter, lambda: False, max_wait_s=600, sleep=ticking(clock), poll_s=1)
    assert (turn.turn, turn.claimed, turn.owner) == (Turn.COMPILE, True, "h2:11")
    assert STALE_S < turn.waited_s <= STALE_S + 1


def test_a_waiter_compiles_cold_itself_past_its_bound_and_leaves_the_owners_claim(tmp_path):
    clock = Clock()
    owner, waiter = claims(tmp_path, clock)
    take_turn(owner, lambda: False, max_wait_s=60)

    def sleep(s: float) -> None:
        clock.now += s

    turn = take_turn(waiter, lambda: False, max_wait_s=20, sleep=sleep, poll_s=1)
    assert (turn.turn, turn.claimed, turn.waited_s) == (Turn.COMPILE, False, 20.0)
    assert turn.why == "no archive within 20 s: compiled beside its owner"
    waiter.release()  # holds nothing: the owner's claim stays
    assert Owner(**json.loads(owner.path.read_text())).pid == 11


def test_an_unreadable_claim_is_judged_by_its_age(tmp_path):
    clock = Clock()
    _, waiter = claims(tmp_path, clock, alive=lambda pid: False)
    waiter.path.write_text("not a claim")
    import os

    os.utime(waiter.path, (clock.now, clock.now))
    owner = waiter.owner()
    assert owner is not None and owner.pid == 0 and not waiter.stale(owner)
    clock.now += STALE_S + 1
    assert waiter.stale(owner)


def test_a_miss_takes_a_turn_only_where_anothers_archive_could_be_restored(tmp_path):
    """An untrusted root or archive would refuse the owner's archive too: no claim, no wait (each
    process compiles, as before); a missing or damaged archive takes a turn."""
    from dataclasses import asdict

    from ettflow.trainer.compile import CompileCache, CompileCacheConfig
    from ettflow.trainer.compile.cache import RestoreMiss, RestoreResult
    from ettflow.trainer.compile.cold_claim import turn_after_miss
    from ettflow.trainer.compile.probe_cold_warm import DenseSize

    cache = CompileCache(CompileCacheConfig(root=tmp_path, model=asdict(DenseSize(batch=8, sparse=2, dim=4,
                                                                                  dense_arch=(4,), over_arch=(4, 1)))))
    untrusted = RestoreResult(hit=False, miss=RestoreMiss.UNTRUSTED, reason="writable by others")
    assert turn_after_miss(cache, untrusted, max_wait_s=60) == (None, None, False)
    assert not list(tmp_path.glob("*.compiling"))
    claim, turn, hit = turn_after_miss(cache, RestoreResult(hit=False, miss=RestoreMiss.NO_ARCHIVE), max_wait_s=60)
    assert (turn.turn, turn.claimed, hit) == (Turn.COMPILE, True, False)
    assert claim.path == tmp_path / f"pt2-{cache.key}.compiling" and claim.path.exists()
    claim.release()
    assert not claim.path.exists()


def test_a_root_where_no_claim_can_be_written_takes_no_turn(tmp_path):
    """A claim that cannot be written (here the root is a file) is not an error of the compile:
    the process compiles as before (its save is skipped the same way, and says why)."""
    from dataclasses import asdict

    from ettflow.trainer.compile import CompileCache, CompileCacheConfig
    from ettflow.trainer.compile.cache import RestoreMiss, RestoreResult
    from ettflow.trainer.compile.cold_claim import turn_after_miss
    from ettflow.trainer.compile.probe_cold_warm import DenseSize

    (tmp_path / "root").write_text("")
    cache = CompileCache(CompileCacheConfig(root=tmp_path / "root", model=asdict(DenseSize(
        batch=8, sparse=2, dim=4, dense_arch=(4,), over_arch=(4, 1)))))
    assert turn_after_miss(cache, RestoreResult(hit=False, miss=RestoreMiss.NO_ARCHIVE), max_wait_s=60) \
        == (None, None, False)
