"""What a checkpoint root holds: committed checkpoints, and the problems found beside them.

`scan` decides what a restart may restore: it verifies every `step_<n>` folder (marker,
manifest, size and sha256 of every file) and reports each one that fails (with the path, the
file and why), each `.tmp` folder a save left uncommitted, and each half-deleted `.trash`
folder. Only verified checkpoints are in `committed`, so a damaged one is never chosen; each
problem names the step restored instead (`CheckpointProblem.fallback`).

Delta checkpoints (`delta_<n>` folders, `delta.py`) are verified the same way; `chain`
is what a restore reads: the newest step whose base and deltas are all there and whole
(`delta_chain.restore_chain`), with the newest step it could not restore and why.

`prune` keeps the newest `keep_last` restorable steps (bases or deltas) and every link their
chains need (`delta_chain.needed`), and deletes what is older. `remove_uncommitted` deletes
`.tmp` and `.trash` folders left by a crash or a full disk (at the next start, never a
committed folder). All assume one job writes to a root, and `prune` and
`remove_uncommitted` that no save is in flight.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ettflow.trainer.checkpoint.config import TornCheckpointError
from ettflow.trainer.checkpoint.delta_chain import Link, needed, restore_chain
from ettflow.trainer.checkpoint.layout import COMMITTED, parse_delta_name, parse_name, remove_tree
from ettflow.trainer.checkpoint.verify import CheckpointInfo, verify

if TYPE_CHECKING:
    from ettflow.trainer.checkpoint.delta import DeltaInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class CheckpointProblem:
    """A folder under the root that must not be restored, and why.

    file: the file that failed verification (relative to the folder), when one did.
    fallback: the step a restore uses instead (the newest verified checkpoint), None when
        there is none and training starts from scratch.
    """

    path: Path
    step: int | None
    reason: str
    file: str | None = None
    fallback: int | None = None

    @property
    def damaged(self) -> bool:
        """A final (committed-looking) folder that failed verification: damage, not a save a
        kill cut short (`.tmp`) or a delete left half-done (`.trash`)."""
        kind = parse_name(self.path.name) or parse_delta_name(self.path.name)
        return kind is not None and kind[1] == "final"

    def __str__(self) -> str:
        instead = f"restoring step {self.fallback}" if self.fallback is not None else "no checkpoint to restore"
        return f"checkpoint step {self.step} ({self.path}): {self.reason}: skipped, {instead}"


@dataclass(frozen=True, kw_only=True)
class Chain:
    """What a restore reads: a base and the deltas on it, in order (none: the base alone; no
    base: nothing to restore), and the newest step that could not be restored and why."""

    base: CheckpointInfo | None
    deltas: tuple[DeltaInfo, ...] = ()
    skipped: int | None = None
    why: str = ""

    @property
    def step(self) -> int | None:
        return self.deltas[-1].step if self.deltas else (self.base.step if self.base else None)

    @property
    def cursors(self) -> tuple[Any, ...]:
        """Every rank's data cursor at `step` (the last link's)."""
        return self.deltas[-1].cursors if self.deltas else (self.base.cursors if self.base else ())


@dataclass(frozen=True, kw_only=True)
class CheckpointScan:
    committed: tuple[CheckpointInfo, ...]  # verified, oldest first
    problems: tuple[CheckpointProblem, ...]
    deltas: tuple[DeltaInfo, ...] = ()  # verified deltas, oldest first
    damaged_deltas: tuple[tuple[int, str], ...] = ()  # (step, why) of each delta that failed verification

    @property
    def latest(self) -> CheckpointInfo | None:
        """The newest verified base (a full checkpoint)."""
        return self.committed[-1] if self.committed else None

    def links(self) -> list[Link]:
        """The chain links of what is committed; a base and a delta of one step (an anchor saved
        where a delta was): the base comes last, so a step's lookup finds it."""
        return [*(Link(step=d.step, kind="delta", parent=d.parent, bytes=d.bytes, digest=d.digest,
                       parent_digest=d.parent_digest) for d in self.deltas),
                *(Link(step=c.step, kind="base", digest=_digest(c.path)) for c in self.committed)]

    def chain(self, world_size: int | None = None) -> Chain:
        """The newest restorable step and what a restore reads for it. `world_size`: deltas
        hold each rank's own shards, so those written by another number of ranks are not
        used (their base is, resharded)."""
        deltas = [d for d in self.deltas if world_size is None or d.world_size == world_size]
        usable = CheckpointScan(committed=self.committed, problems=(), deltas=tuple(deltas))
        plan = restore_chain(usable.links(), damaged=dict(self.damaged_deltas))
        if not plan.links:
            return Chain(base=None, skipped=plan.skipped, why=plan.why)
        bases = {c.step: c for c in self.committed}
        by_step = {d.step: d for d in deltas}
        return Chain(base=bases[plan.links[0].step], deltas=tuple(by_step[link.step] for link in plan.links[1:]),
                     skipped=plan.skipped, why=plan.why)


def _digest(folder: Path) -> str:
    try:
        return (folder / COMMITTED).read_text().strip()
    except OSError:
        return ""


def scan(root: Path) -> CheckpointScan:
    """The verified checkpoints under `root` and the problems beside them (reads every byte
    of every committed checkpoint; unpickles nothing)."""
    root = Path(root)
    committed: list[CheckpointInfo] = []
    deltas: list[DeltaInfo] = []
    damaged: list[tuple[int, str]] = []
    found: list[tuple[Path, int, str, str | None]] = []
    if not root.is_dir():
        return CheckpointScan(committed=(), problems=())
    for child in sorted(root.iterdir()):
        parsed, is_delta = parse_name(child.name), False
        if parsed is None:
            parsed, is_delta = parse_delta_name(child.name), True
        if parsed is None or not child.is_dir():
            continue
        step, kind = parsed
        if kind == "tmp":
            found.append((child, step, "incomplete: the save never committed (it crashed or is still writing)", None))
        elif kind == "trash":
            found.append((child, step, "left over from an interrupted delete", None))
        else:
            try:
                if is_delta:
                    from ettflow.trainer.checkpoint.delta import verify_delta  # torch: only when there are deltas

                    deltas.append(verify_delta(child))
                else:
                    committed.append(verify(child))
            except TornCheckpointError as e:
                found.append((child, step, e.reason, e.file))
                if is_delta:
                    damaged.append((step, e.reason))
    committed.sort(key=lambda info: info.step)
    deltas.sort(key=lambda info: info.step)
    done = CheckpointScan(committed=tuple(committed), problems=(), deltas=tuple(deltas),
                          damaged_deltas=tuple(damaged))
    fallback = done.chain().step
    problems = tuple(
        CheckpointProblem(path=path, step=step, reason=reason, file=file, fallback=fallback)
        for path, step, reason, file in found
    )
    return CheckpointScan(committed=done.committed, problems=problems, deltas=done.deltas,
                          damaged_deltas=done.damaged_deltas)


def remove_uncommitted(root: Path) -> list[Path]:
    """Delete the `.tmp` folders of saves that never committed and half-deleted `.trash`
    folders under `root` (never a committed `step_<n>`); logs each (debug). Call it at a start,
    before any save of this job is in flight."""
    root = Path(root)
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for child in sorted(root.iterdir()):
        parsed = parse_name(child.name) or parse_delta_name(child.name)
        if parsed is None or parsed[1] == "final" or not child.is_dir():
            continue
        why = "a save that never committed" if parsed[1] == "tmp" else "an interrupted delete"
        # routine after a kill (the failure itself is reported where it is detected): not on the console
        log.debug("checkpoint cleanup: removing %s, left by %s", child, why)
        remove_tree(child)
        removed.append(child)
    return removed


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete committed checkpoints and deltas that neither are among the newest `keep_last`
    restorable steps nor are needed by one (a kept delta keeps its parent, down to its base),
    uncommitted `.tmp` and `.trash` folders, and torn folders older than the oldest kept
    checkpoint. Torn folders newer than that stay (reported by `scan`) for an operator to inspect."""
    found = scan(root)
    links = found.links()
    restorable = sorted(step for step in {link.step for link in links}
                        if restore_chain([lnk for lnk in links if lnk.step <= step]).step == step)
    keep = needed(links, restorable[-keep_last:])
    oldest_kept = min(keep, default=None)
    doomed = [(info.path, f"not among the newest {keep_last} kept nor needed by one")
              for info in (*found.committed, *found.deltas) if info.step not in keep]
    for problem in found.problems:
        folder_kind = parse_name(problem.path.name) or parse_delta_name(problem.path.name)
        is_final = folder_kind is not None and folder_kind[1] == "final"
        older = oldest_kept is not None and problem.step is not None and problem.step < oldest_kept
        if not is_final or older:
            doomed.append((problem.path, f"{problem.reason}{'; older than the oldest kept' if is_final else ''}"))
    for path, why in doomed:
        log.info("checkpoint prune: deleting %s (%s)", path, why)
        remove_tree(path)
    return [path for path, _ in doomed]
