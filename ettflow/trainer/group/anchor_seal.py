"""The anchor written, sealed and marked by the driver, after the ranks released their devices.

With `Switches.release_before_seal` every rank ends its run by serializing its part of the
final checkpoint into host memory (`checkpoint/host_writer.py`) and returning it with its
result (`protocol.AnchorHandOff`); the group is torn down, and only then does the driver, a
CPU process, write the files into `step_<n>.tmp` (each fsynced), commit the folder exactly as a
rank 0 commits a periodic save (`commit.commit_folder`: sha256 of every file, manifest,
COMMITTED, rename, verify, prune) and write `anchor.json` last. Publishing, the watermark and
the lineage read the anchor only after that: the driver returns once it is sealed.

A failed try (the disk full, an I/O error) is retried from the host copy, which the driver
still holds (`SEAL_TRIES`); a try that cannot succeed fails the attempt (class `storage`), so
the failure policy restarts it from the run's last durable checkpoint: nothing is published
and no window is lost. A death of the driver between the release and the seal is the death of
the refresh's process: its flow run crashes, and the retry restarts from the last durable
checkpoint (or, killed after the commit and before the marker, anchors the committed folder
without training again, `Checkpointing.save_anchor`). The scripted fault `kill:phase=anchor_seal`
(half the files written) fires in the driver's process here (`fault`); `kill:phase=anchor_commit`
is a rank's death with its part handed off, before the release.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ettflow.trainer.checkpoint.anchor import write_anchor
from ettflow.trainer.checkpoint.commit import commit_folder
from ettflow.trainer.checkpoint.layout import fsync_dir, remove_tree, tmp_dir
from ettflow.trainer.config import ANCHOR_SEAL
from ettflow.trainer.protocol import AnchorHandOff

SEAL_TRIES = 2  # the first write, and one more from the host copy
SEALED_UNMARKED = "sealed_unmarked"  # the fault hook's point between the commit and anchor.json (tests)


class HandOffError(ValueError):
    """The ranks' hand-offs do not make one checkpoint (a rank missing, steps or folders that
    differ, no marker from rank 0): a bug, never retried."""


@dataclass(frozen=True, kw_only=True)
class SealedAnchor:
    path: Path
    step: int
    nbytes: int


def check_handoffs(handoffs: Sequence[AnchorHandOff]) -> list[AnchorHandOff]:
    """The hand-offs by rank, checked to be one checkpoint's parts."""
    if not handoffs:
        raise HandOffError("no rank handed off an anchor")
    parts = sorted(handoffs, key=lambda h: h.rank)
    world = parts[0].world_size
    if [h.rank for h in parts] != list(range(world)):
        raise HandOffError(f"the anchor needs ranks 0..{world - 1}, got hand-offs of ranks {[h.rank for h in parts]}")
    if len({(h.step, h.root, h.world_size) for h in parts}) != 1:
        raise HandOffError("the ranks handed off parts of different checkpoints: "
                           + ", ".join(f"rank {h.rank}: step {h.step} of {h.root}" for h in parts))
    if parts[0].anchor is None:
        raise HandOffError("rank 0 handed off no anchor marker")
    names = [name for h in parts for name, _ in h.files]
    if len(names) != len(set(names)) or any(Path(n).name != n or n in (".", "..") for n in names):
        raise HandOffError(f"the hand-offs' file names are not one folder's: {sorted(names)}")
    return parts


def seal_anchor(handoffs: Sequence[AnchorHandOff], *, keep_last: int,
                fault: Callable[[str], None] = lambda phase: None) -> SealedAnchor:
    """Write the ranks' hand-offs into one folder, commit it and mark it the anchor. Raises
    OSError or CheckpointError when the disk fails (nothing committed is left torn: the
    folder is removed), `HandOffError` when the parts do not fit. `fault(phase)`: the
    scripted faults' hook, called half-way through the files and between commit and marker."""
    parts = check_handoffs(handoffs)
    first = parts[0]
    root, step = Path(first.root), first.step
    tmp = tmp_dir(root, step)
    if tmp.exists():  # a try that failed before
        remove_tree(tmp)
    tmp.mkdir(parents=True)
    files = [(name, data) for h in parts for name, data in h.files]
    try:
        for i, (name, data) in enumerate(files):
            if i == len(files) // 2:
                fault(ANCHOR_SEAL)
            with open(tmp / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        fsync_dir(tmp)
    except BaseException:
        remove_tree(tmp)
        raise
    final, nbytes = commit_folder(tmp, root, step=step, world_size=first.world_size,
                                  cursors=[json.loads(h.cursor) for h in parts], keep_last=keep_last)
    fault(SEALED_UNMARKED)
    assert first.anchor is not None  # check_handoffs
    write_anchor(final, first.anchor)
    return SealedAnchor(path=final, step=step, nbytes=nbytes)
