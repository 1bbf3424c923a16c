"""What a checkpoint root holds: committed checkpoints, and the problems found beside them.

`scan` verifies every `step_<n>` folder and reports each one that is torn (with the path
and why), each `.tmp` folder a save left uncommitted, and each half-deleted `.trash` folder.
`prune` keeps the newest `keep_last` committed checkpoints and deletes what is older. Both
assume one job writes to a root, and `prune` that no save is in flight.
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
    """A folder under the root that must not be restored, and why."""

    path: Path
    step: int | None
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass(frozen=True, kw_only=True)
class CheckpointScan:
    committed: tuple[CheckpointInfo, ...]  # verified, oldest first
    problems: tuple[CheckpointProblem, ...]

    @property
    def latest(self) -> CheckpointInfo | None:
        return self.committed[-1] if self.committed else None


def scan(root: Path) -> CheckpointScan:
    root = Path(root)
    committed: list[CheckpointInfo] = []
    problems: list[CheckpointProblem] = []
    if not root.is_dir():
        return CheckpointScan(committed=(), problems=())
    for child in sorted(root.iterdir()):
        parsed = parse_name(child.name)
        if parsed is None or not child.is_dir():
            continue
        step, kind = parsed
        if kind == "tmp":
            reason = "incomplete: the save never committed (it crashed or is still writing)"
            problems.append(CheckpointProblem(path=child, step=step, reason=reason))
        elif kind == "trash":
            reason = "left over from an interrupted delete"
            problems.append(CheckpointProblem(path=child, step=step, reason=reason))
        else:
            try:
                committed.append(verify(child))
            except TornCheckpointError as e:
                problems.append(CheckpointProblem(path=child, step=step, reason=e.reason))
    committed.sort(key=lambda info: info.step)
    return CheckpointScan(committed=tuple(committed), problems=tuple(problems))


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete committed checkpoints older than the newest `keep_last`, uncommitted `.tmp` and
    `.trash` folders, and torn folders older than the oldest kept checkpoint. Torn folders
    newer than that stay (reported by `scan`) for an operator to inspect."""
    found = scan(root)
    kept = found.committed[-keep_last:]
    oldest_kept = kept[0].step if kept else None
    doomed = [info.path for info in found.committed[:-keep_last]]
    for problem in found.problems:
        folder_kind = parse_name(problem.path.name)
        is_final = folder_kind is not None and folder_kind[1] == "final"
        older = oldest_kept is not None and problem.step is not None and problem.step < oldest_kept
        if not is_final or older:
            doomed.append(problem.path)
    for path in doomed:
        log.info("checkpoint prune: deleting %s", path)
        remove_tree(path)
    return doomed
