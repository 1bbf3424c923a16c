"""One cold compile of a key at a time: the processes that miss the same archive at once (a run's
ranks on one host, a spare beside them, runs of one model sharing the cache's root) would each
compile the same graphs cold, on the same CPUs. The first to claim the key compiles and saves its
archive; the others wait for it, restore it and compile warm.

    claim, turn, hit = turn_after_miss(cache, restored, max_wait_s=...)  # after a restore's miss
    COMPILE: compile cold (claimed: save, then `release`); RESTORE: another's archive was
    restored (`hit`), compile warm

A rank takes its turn in its pt2_compile stage (`rank/compile_plugin.py`), a spare or pooled
worker in its prewarm (`rank/spare.py`). A miss whose cause another's archive would meet too (an
untrusted root or archive), or a claim that cannot be written (a read-only root), takes no turn:
each process compiles, as before.

The claim is a file beside the archives (`pt2-<key>.compiling`), linked into place whole (never
seen half written), naming its owner (host, pid, when, a token). While it compiles, the owner
touches it every `HEARTBEAT_S`; it removes it once its archive is saved, or when its compile
failed. A waiter looks for the archive only when the claim is gone, since the archive's manifest
is written after the archive itself (`archive.pack`). The owner's liveness decides how long a
waiter waits, not a share of its budget: a waiter of a live owner waits until the owner releases
(the owner's compile is bounded by its own watchdog, and a cold compile started later would end
later). A claim is stale when its owner is gone: its pid is dead on this host, or the claim was
not touched for `STALE_S` (a SIGKILLed or stopped owner, on any host); a stale claim is broken
and the waiter claims the key. An owner that released without an archive (its save was skipped:
too large, no space; or its compile failed) leaves its waiters to compile cold each, unclaimed,
as before: a second claimant would fail the same way while the rest waited. `max_wait_s` is a
last bound only (a live owner that never releases): then the waiter compiles cold itself.

Breaking a stale claim races with another waiter breaking it: the worst case is two processes
compiling cold, which is what every process did before.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from . import archive
from .trust import make_private_dir

if TYPE_CHECKING:
    from .cache import CompileCache, RestoreResult

SUFFIX = ".compiling"
POLL_S = 0.25
HEARTBEAT_S = 5.0  # the owner touches its claim this often while it compiles
STALE_S = 30.0  # a claim not touched for this long has no live owner


class Turn(Enum):
    COMPILE = "compile"  # compile cold: claimed (save, then release), or unclaimed (see `ColdTurn.why`)
    RESTORE = "restore"  # another process's archive is there: restore it, compile warm


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    since: float
    token: str

    def name(self) -> str:
        return f"{self.host}:{self.pid}"


@dataclass(frozen=True)
class ColdTurn:
    """What `take_turn` decided, and why: the pt2_compile stage's attributes (`to_attrs`)."""

    turn: Turn
    claimed: bool = False  # this process holds the claim (it saves, then releases)
    waited_s: float = 0.0
    owner: str | None = None  # the claim's owner this process waited for
    why: str = ""
    orphaned: bool = False  # the owner released without an archive: each compiles, rank 0 saves

    def to_attrs(self) -> dict[str, object]:
        return {"cold_turn": self.turn.value, "cold_claimed": self.claimed, "cold_waited_s": round(self.waited_s, 3),
                **({"cold_owner": self.owner} if self.owner else {}), "cold_why": self.why}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class ColdClaim:
    """The claim on one key's cold compile under the archive root `root`. `heartbeat_s`: how often
    the owner touches it (None: never, for tests that move the clock themselves)."""

    def __init__(self, root: Path, key: str, *, host: str | None = None, pid: int | None = None,
                 clock: Callable[[], float] = time.time, alive: Callable[[int], bool] = pid_alive,
                 heartbeat_s: float | None = HEARTBEAT_S) -> None:
        self.path = Path(root) / f"pt2-{key}{SUFFIX}"
        self.host, self.pid = host or socket.gethostname(), pid if pid is not None else os.getpid()
        self.clock, self.alive, self.heartbeat_s = clock, alive, heartbeat_s
        self.mine: Owner | None = None
        self._stop = threading.Event()

    def try_claim(self) -> bool:
        """Take the claim (True), or find it taken. Raises OSError where the root is not writable."""
        make_private_dir(self.path.parent)
        owner = Owner(self.host, self.pid, self.clock(), secrets.token_hex(8))
        tmp = self.path.with_name(f".{self.path.name}.{owner.token}.tmp")
        tmp.write_text(json.dumps(asdict(owner)))
        try:
            os.link(tmp, self.path)  # whole or not at all; fails when the claim exists
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        self.touch()
        self.mine = owner
        if self.heartbeat_s:
            self._stop.clear()
            threading.Thread(target=self._beat, name="ettflow-cold-claim", daemon=True).start()
        return True

    def touch(self) -> None:
        now = self.clock()
        os.utime(self.path, (now, now))

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                if self.owner() != self.mine:  # broken as stale meanwhile: not ours to keep fresh
                    return
                self.touch()
            except OSError:
                return

    def owner(self) -> Owner | None:
        """The claim's owner; None when there is no claim. An unreadable record (not ettflow's, or
        damaged) reads as an owner with pid 0, judged by its age alone."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            return Owner(**json.loads(text))
        except (ValueError, TypeError):
            return Owner(host="", pid=0, since=0.0, token="")

    def stale(self, owner: Owner) -> bool:
        """Its owner is gone: a dead pid on this host, or the claim not touched for `STALE_S`."""
        if owner.host == self.host and owner.pid and not self.alive(owner.pid):
            return True
        try:
            touched = self.path.stat().st_mtime
        except FileNotFoundError:
            return False  # released meanwhile: the next look sees it
        return self.clock() - touched > STALE_S

    def break_claim(self, owner: Owner) -> None:
        """Remove `owner`'s claim (it is gone), if it is still the one there."""
        if self.owner() == owner:
            self.path.unlink(missing_ok=True)

    def release(self) -> None:
        """Remove this process's claim (its archive saved, or its compile failed)."""
        self._stop.set()
        if self.mine is not None and self.owner() == self.mine:
            self.path.unlink(missing_ok=True)
        self.mine = None


def take_turn(claim: ColdClaim, archive_ready: Callable[[], bool], *, max_wait_s: float,
              sleep: Callable[[float], None] = time.sleep, poll_s: float = POLL_S) -> ColdTurn:
    """Claim the key's cold compile, or wait for the owner's archive (see the module docstring).
    `archive_ready`: whether the key has an archive this process's restore did not refuse (read
    only while no claim exists)."""
    t0 = claim.clock()
    waited_for: str | None = None
    broke = False  # this process broke a gone owner's claim (then it claims the key itself)
    while True:
        waited = claim.clock() - t0
        if claim.try_claim():
            if archive_ready():  # saved since this process's restore missed (by the owner it waited for)
                claim.release()
                return ColdTurn(Turn.RESTORE, waited_s=waited, owner=waited_for, why="its archive was saved")
            if waited_for is not None and not broke:
                claim.release()  # the owner released with no archive: a second claimant would fail alike
                return ColdTurn(Turn.COMPILE, waited_s=waited, owner=waited_for, orphaned=True,
                                why=f"{waited_for} left no archive: compiled beside the others")
            why = "first to miss" if waited_for is None else f"{waited_for} was gone: claimed its key"
            return ColdTurn(Turn.COMPILE, claimed=True, waited_s=waited, owner=waited_for, why=why)
        owner = claim.owner()
        if owner is not None:
            if owner.pid:
                waited_for = owner.name()
            if claim.stale(owner):
                claim.break_claim(owner)
                broke = True
                continue
            broke = False  # a live owner's claim (another waiter's, after the break)
        if waited >= max_wait_s:
            return ColdTurn(Turn.COMPILE, waited_s=waited, owner=waited_for,
                            why=f"no archive within {max_wait_s:.0f} s: compiled beside its owner")
        sleep(poll_s)


def turn_after_miss(cache: CompileCache, restored: RestoreResult, *,
                    max_wait_s: float) -> tuple[ColdClaim | None, ColdTurn | None, bool]:
    """For a process whose restore missed: its turn at the key's cold compile, and whether it then
    restored another's archive (a hit). Release the claim after compiling and saving, in a
    `finally` (a failed compile hands the turn on). No turn (None, None, False) where another's
    archive would be refused as well (an untrusted root or archive: each process compiles), or
    where the claim cannot be written (the root is read-only: the save would be skipped too)."""
    from .cache import RestoreMiss

    if restored.miss not in (RestoreMiss.NO_ARCHIVE, RestoreMiss.UNVERIFIED, RestoreMiss.UNREADABLE):
        return None, None, False
    claim = ColdClaim(cache.config.root, cache.key)
    refused = restored.path, _mtime(restored.path)

    def archive_ready() -> bool:
        found = archive.find_archive(cache.config.root, cache.key)
        if found is None:
            return False
        if (found, _mtime(found)) != refused:
            return True
        try:  # the same file: refused mid-save (before its manifest was written) verifies now
            archive.verify(found)
        except (archive.ArchiveUnverified, OSError):
            return False
        return True

    try:
        turn = take_turn(claim, archive_ready, max_wait_s=max_wait_s)
    except OSError:
        claim.release()
        return None, None, False
    hit = turn.turn is Turn.RESTORE and cache.restore().hit  # a miss here: compile cold after all
    return claim, turn, hit


def _mtime(path: Path | None) -> int | None:
    try:
        return path.stat().st_mtime_ns if path is not None else None
    except OSError:
        return None
