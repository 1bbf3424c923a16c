"""What a checkpoint root holds: committed checkpoints, and the problems found beside them.

`scan` decides what a restart may restore: it verifies every `step_<n>` folder (marker,
manifest, size and sha256 of every file) and reports each one that fails (with the path, the
file and why), each `.tmp` folder a save left uncommitted, and each half-deleted `.trash`
folder. Only verified checkpoints are in `committed`, so a damaged one is never chosen; each
problem names the step restored instead (`CheckpointProblem.fallback`).

`prune` keeps the newest `keep_last` committed checkpoints and deletes what is older.
`remove_uncommitted` deletes `.tmp` and `.trash` folders left by a crash or a full disk
(at the next start, never a committed folder). All assume one job writes to a root, and
`prune` and `remove_uncommitted` that no save is in flight.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ettflow.trainer.checkpoint.config import TornCheckpointError
from ettflow.trainer.checkpoint.layout import parse_name, remove_tree
from ettflow.trainer.checkpoint.verify import CheckpointInfo, verify

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
        kind = parse_name(self.path.name)
        return kind is not None and kind[1] == "final"

    def __str__(self) -> str:
        instead = f"restoring step {self.fallback}" if self.fallback is not None else "no checkpoint to restore"
        return f"checkpoint step {self.step} ({self.path}): {self.reason}: skipped, {instead}"


@dataclass(frozen=True, kw_only=True)
class CheckpointScan:
    committed: tuple[CheckpointInfo, ...]  # verified, oldest first
    problems: tuple[CheckpointProblem, ...]

    @property
    def latest(self) -> CheckpointInfo | None:
        return self.committed[-1] if self.committed else None


def scan(root: Path) -> CheckpointScan:
    """The verified checkpoints under `root` and the problems beside them (reads every byte
    of every committed checkpoint; unpickles nothing)."""
    root = Path(root)
    committed: list[CheckpointInfo] = []
    found: list[tuple[Path, int, str, str | None]] = []
    if not root.is_dir():
        return CheckpointScan(committed=(), problems=())
    for child in sorted(root.iterdir()):
        parsed = parse_name(child.name)
        if parsed is None or not child.is_dir():
            continue
        step, kind = parsed
        if kind == "tmp":
            found.append((child, step, "incomplete: the save never committed (it crashed or is still writing)", None))
        elif kind == "trash":
            found.append((child, step, "left over from an interrupted delete", None))
        else:
            try:
                committed.append(verify(child))
            except TornCheckpointError as e:
                found.append((child, step, e.reason, e.file))
    committed.sort(key=lambda info: info.step)
    fallback = committed[-1].step if committed else None
    problems = tuple(
        CheckpointProblem(path=path, step=step, reason=reason, file=file, fallback=fallback)
        for path, step, reason, file in found
    )
    return CheckpointScan(committed=tuple(committed), problems=problems)


def remove_uncommitted(root: Path) -> list[Path]:
    """Delete the `.tmp` folders of saves that never committed and half-deleted `.trash`
    folders under `root` (never a committed `step_<n>`); logs each (debug). Call it at a start,
    before any save of this job is in flight."""
    root = Path(root)
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for child in sorted(root.iterdir()):
        parsed = parse_name(child.name)
        if parsed is None or parsed[1] == "final" or not child.is_dir():
            continue
        why = "a save that never committed" if parsed[1] == "tmp" else "an interrupted delete"
        # routine after a kill (the failure itself is reported where it is detected): not on the console
        log.debug("checkpoint cleanup: removing %s, left by %s", child, why)
        remove_tree(child)
        removed.append(child)
    return removed


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete committed checkpoints older than the newest `keep_last`, uncommitted `.tmp` and
    `.trash` folders, and torn folders older than the oldest kept checkpoint. Torn folders
    newer than that stay (reported by `scan`) for an operator to inspect."""
    found = scan(root)
    kept = found.committed[-keep_last:]
    oldest_kept = kept[0].step if kept else None
    doomed = [(info.path, f"older than the newest {keep_last} kept") for info in found.committed[:-keep_last]]
    for problem in found.problems:
        folder_kind = parse_name(problem.path.name)
        is_final = folder_kind is not None and folder_kind[1] == "final"
        older = oldest_kept is not None and problem.step is not None and problem.step < oldest_kept
        if not is_final or older:
            doomed.append((problem.path, f"{problem.reason}{'; older than the oldest kept' if is_final else ''}"))
    for path, why in doomed:
        log.info("checkpoint prune: deleting %s (%s)", path, why)
        remove_tree(path)
    return [path for path, _ in doomed]
