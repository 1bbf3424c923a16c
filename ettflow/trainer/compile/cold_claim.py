"""One cold compile of a key at a time: the processes that miss the same archive at once (a run's
ranks on one host, a spare beside them, runs of one model sharing the cache's root) would each
compile the same graphs cold, on the same CPUs. The first to claim the key compiles and saves its
archive; the others wait for it, restore it and compile warm.

    claim, turn, hit = turn_after_miss(cache, restored, max_wait_s=...)  # after a restore's miss
    COMPILE: compile cold (claimed: save, then `release`); RESTORE: another's archive was
    restored (`hit`), compile warm

A rank takes its turn in its pt2_compile stage (`rank/compile_plugin.py`), a spare or pooled
worker in its prewarm (`rank/spare.py`). A miss whose cause another's archive would meet too (an
untrusted root or archive) takes no turn: each process compiles, as before.

The claim is a file beside the archives (`pt2-<key>.compiling`, made with O_EXCL) naming its owner
(host, pid, when, a token). The owner removes it once its archive is saved, or when its compile
failed; a waiter looks for the archive only when the claim is gone, since the archive's
manifest is written after the archive itself (`archive.pack`). A claim whose owner is gone
(a SIGKILLed rank: its pid is not alive on this host; on another host, older than the wait's
bound) is broken and the waiter claims the key. A waiter never waits past `max_wait_s`: then
it compiles cold itself, as it would have without the claim.

Breaking a dead owner's claim races with another waiter breaking it: the worst case is two
processes compiling cold, which is what every process did before (each archive is written
atomically, the newer kept).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
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


class Turn(Enum):
    COMPILE = "compile"  # compile cold: claimed (save, then release), or no turn came in time
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
    """The claim on one key's cold compile under the archive root `root`."""

    def __init__(self, root: Path, key: str, *, host: str | None = None, pid: int | None = None,
                 clock: Callable[[], float] = time.time, alive: Callable[[int], bool] = pid_alive) -> None:
        self.path = Path(root) / f"pt2-{key}{SUFFIX}"
        self.host, self.pid = host or socket.gethostname(), pid if pid is not None else os.getpid()
        self.clock, self.alive = clock, alive
        self.mine: Owner | None = None

    def try_claim(self) -> bool:
        make_private_dir(self.path.parent)
        owner = Owner(self.host, self.pid, self.clock(), secrets.token_hex(8))
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(owner), f)
        self.mine = owner
        return True

    def owner(self) -> Owner | None:
        """The claim's owner; None when there is no claim. A claim being written (empty, or
        half a record) reads as owned by nobody known yet: `Owner` with pid 0, never stale."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            return Owner(**json.loads(text))
        except (ValueError, TypeError):
            return Owner(host="", pid=0, since=self.clock(), token="")

    def stale(self, owner: Owner, max_age_s: float) -> bool:
        """Its owner is gone: a dead pid on this host, or (another host's) older than `max_age_s`."""
        if owner.pid == 0:
            return False
        if owner.host == self.host:
            return not self.alive(owner.pid)
        return self.clock() - owner.since > max_age_s

    def break_claim(self, owner: Owner) -> None:
        """Remove `owner`'s claim (it is gone), if it is still the one there."""
        if self.owner() == owner:
            self.path.unlink(missing_ok=True)

    def release(self) -> None:
        """Remove this process's claim (its archive saved, or its compile failed)."""
        if self.mine is not None and self.owner() == self.mine:
            self.path.unlink(missing_ok=True)
        self.mine = None


def take_turn(claim: ColdClaim, archive_ready: Callable[[], bool], *, max_wait_s: float,
              sleep: Callable[[float], None] = time.sleep, poll_s: float = POLL_S) -> ColdTurn:
    """Claim the key's cold compile, or wait for the owner's archive (see the module docstring).
    `archive_ready`: whether the key's archive is there now (read only while no claim exists)."""
    t0 = claim.clock()
    waited_for: str | None = None
    while True:
        waited = claim.clock() - t0
        if claim.try_claim():
            if archive_ready():  # saved since this process's restore missed (by the owner it waited for)
                claim.release()
                return ColdTurn(Turn.RESTORE, waited_s=waited, owner=waited_for, why="its archive was saved")
            why = "first to miss" if waited_for is None else f"{waited_for} left no archive"
            return ColdTurn(Turn.COMPILE, claimed=True, waited_s=waited, owner=waited_for, why=why)
        owner = claim.owner()
        if owner is None:  # released between two looks
            if archive_ready():
                return ColdTurn(Turn.RESTORE, waited_s=waited, owner=waited_for, why="its archive was saved")
            continue
        if owner.pid:
            waited_for = owner.name()
        if claim.stale(owner, max_wait_s):
            claim.break_claim(owner)
            continue
        if waited >= max_wait_s:
            return ColdTurn(Turn.COMPILE, waited_s=waited, owner=waited_for,
                            why=f"no archive within {max_wait_s:.0f} s: compiled beside its owner")
        sleep(poll_s)


def turn_after_miss(cache: CompileCache, restored: RestoreResult, *,
                    max_wait_s: float) -> tuple[ColdClaim | None, ColdTurn | None, bool]:
    """For a process whose restore missed: its turn at the key's cold compile, and whether it then
    restored another's archive (a hit). Release the claim after compiling and saving, in a
    `finally` (a failed compile hands the turn on). No turn (None, None, False) where another's
    archive would be refused as well (an untrusted root or archive: each process compiles)."""
    from .cache import RestoreMiss

    if restored.miss not in (RestoreMiss.NO_ARCHIVE, RestoreMiss.UNVERIFIED, RestoreMiss.UNREADABLE):
        return None, None, False
    claim = ColdClaim(cache.config.root, cache.key)
    seen_mtime = _mtime(restored.path)  # the archive it refused, if any

    def new_archive() -> bool:
        found = archive.find_archive(cache.config.root, cache.key)
        return found is not None and _mtime(found) != seen_mtime

    turn = take_turn(claim, new_archive, max_wait_s=max_wait_s)
    hit = turn.turn is Turn.RESTORE and cache.restore().hit  # a miss here: compile cold after all
    return claim, turn, hit


def _mtime(path: Path | None) -> int | None:
    try:
        return path.stat().st_mtime_ns if path is not None else None
    except OSError:
        return None
