"""One cold compile of a key at a time (compile/cold_claim.py): who claims, who waits and for
how long, and what a waiter does when the owner saves, fails, dies or takes too long. Two
claims on one folder stand for two processes; a fake clock moves as the waiter sleeps."""

from __future__ import annotations

import json

from ettflow.trainer.compile.cold_claim import ColdClaim, Owner, Turn, take_turn

KEY = "k1"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def claims(tmp_path, clock, *, alive=lambda pid: True):
    owner = ColdClaim(tmp_path, KEY, host="h1", pid=11, clock=clock, alive=alive)
    waiter = ColdClaim(tmp_path, KEY, host="h1", pid=22, clock=clock, alive=alive)
    return owner, waiter


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


def test_an_owner_that_failed_without_an_archive_hands_the_claim_to_the_waiter(tmp_path):
    clock = Clock()
    owner, waiter = claims(tmp_path, clock)
    take_turn(owner, lambda: False, max_wait_s=60)

    def sleep(s: float) -> None:  # the owner's compile raised after 3 s: released, nothing saved
        clock.now += s
        if clock.now >= 1003:
            owner.release()

    turn = take_turn(waiter, lambda: False, max_wait_s=60, sleep=sleep, poll_s=1)
    assert (turn.turn, turn.claimed, turn.waited_s, turn.why) == (Turn.COMPILE, True, 3.0, "h1:11 left no archive")
    assert json.loads(waiter.path.read_text())["pid"] == 22


def test_a_dead_owners_claim_on_this_host_is_broken_at_once(tmp_path):
    clock = Clock()
    owner, _ = claims(tmp_path, clock)
    take_turn(owner, lambda: False, max_wait_s=60)  # then SIGKILLed: the file stays
    waiter = ColdClaim(tmp_path, KEY, host="h1", pid=22, clock=clock, alive=lambda pid: pid != 11)
    turn = take_turn(waiter, lambda: False, max_wait_s=60, sleep=lambda s: None)
    assert (turn.turn, turn.claimed, turn.waited_s) == (Turn.COMPILE, True, 0.0)
    assert json.loads(waiter.path.read_text())["pid"] == 22
    owner.release()  # the dead owner's release (had it come) would not remove the new claim
    assert waiter.path.exists()


def test_another_hosts_claim_is_stale_only_past_the_waits_bound(tmp_path):
    clock = Clock()
    other = ColdClaim(tmp_path, KEY, host="h2", pid=11, clock=clock, alive=lambda pid: False)
    take_turn(other, lambda: False, max_wait_s=60)  # its pid means nothing on h1
    waiter = ColdClaim(tmp_path, KEY, host="h1", pid=22, clock=clock, alive=lambda pid: False)
    clock.now += 30
    assert not waiter.stale(waiter.owner(), 60)
    clock.now += 31
    turn = take_turn(waiter, lambda: False, max_wait_s=60, sleep=lambda s: None)
    assert (turn.turn, turn.claimed) == (Turn.COMPILE, True)


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


def test_a_claim_being_written_is_nobodys_yet_and_never_stale(tmp_path):
    clock = Clock()
    _, waiter = claims(tmp_path, clock, alive=lambda pid: False)
    waiter.path.write_text("")  # created by O_EXCL, its record not written yet
    owner = waiter.owner()
    assert owner is not None and owner.pid == 0 and not waiter.stale(owner, 0)


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
