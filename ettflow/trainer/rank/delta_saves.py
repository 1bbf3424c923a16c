"""A rank's delta checkpoints (`switches.delta_checkpoint`): which periodic save is a delta,
the rows touched since the last committed save, and the chain the next delta extends.

    saves = DeltaSaves(dmp, config)           # TorchRec's tracker on the sharded module
    saves.restored(chain)                     # after a restore: the chain read is the head
    kind, why = saves.choose()                # "delta" on the head, or "base" (delta_chain.next_kind)
    saves.base_started(step)                  # a full save began: its rows need no delta
    saves.base_committed(commit)              # ... and committed: it is the head
    commit = saves.save(step, state, group)   # a delta on the head, collective, while the loop waits
    captured, taken = saves.start(step, state)  # or: the blocking part (copies into host memory) ...
    saves.finished(captured, taken, commit)   # ... and once `commit_captured` ran in the background
    rows = saves.memory_rows()                # the rows an in-memory delta copy holds (None: a whole one)
    record = saves.chain_resume()             # what that copy carries for the chain (chain_resume.py)
    saves.resumed(links, rows)                # restored from such a copy: the chain goes on from its link

Invariants: the head is a committed link (a base or delta whose commit every rank saw) or
None, and then the next save is a base; the rows of a delta are every row touched since the
head (`RowLedger`: a failed delta keeps them for the next); after a restore the head is the
restored step (the restore wrote every row, so nothing tracked before it counts), except a
restore from an in-memory copy whose record every rank agreed to resume (`resumed`). A state a
rank cannot save as a delta (`DeltaUnsupported`: a row-wise sharded table) turns deltas off
for the run, on every rank together, said once in the log.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ettflow.trainer.checkpoint.chain_resume import ChainResume
from ettflow.trainer.checkpoint.delta import (
    CapturedDelta,
    DeltaCommit,
    RowLedger,
    capture,
    commit_captured,
    commit_digest,
    enable_tracker,
    touched_rows,
)
from ettflow.trainer.checkpoint.delta_chain import Kind, Link, chain_of, next_kind
from ettflow.trainer.checkpoint.layout import folder_bytes

if TYPE_CHECKING:
    from ettflow.trainer.checkpoint import CommitResult, TrainState
    from ettflow.trainer.checkpoint.catalog import Chain
    from ettflow.trainer.config import TrainerConfig

log = logging.getLogger("ettflow.trainer")


class DeltaSaves:
    def __init__(self, dmp: Any, config: TrainerConfig, *, tracker: Any = None) -> None:
        """`tracker`: TorchRec's delta tracker to read (None: enabled on `dmp` here)."""
        self.tracker = tracker if tracker is not None else enable_tracker(dmp)
        self.ledger = RowLedger()
        self.policy = config.delta_policy
        self.root = Path(config.checkpoint_dir)
        self.links: list[Link] = []
        self.head: Link | None = None
        self.off: str | None = None  # why deltas are off for this run (None: on)
        self._pending_base: int | None = None
        self._in_flight: dict | None = None  # the rows of a delta captured and not yet finished
        # the in-memory tier's own ledger, fed by the same tracker: the rows touched since the
        # rank's last in-memory copy (None: not known since a restore, so the next copy is whole)
        self._memory: RowLedger | None = None

    def restored(self, chain: Chain | None) -> None:
        """The state was just restored from `chain` (None: from anything else: a warm start, the
        in-memory tier, a resharded base): the next save builds on it, or is a base; the next
        in-memory copy is whole."""
        self._drop_tracked()
        self._memory, self._in_flight, self._pending_base = None, None, None
        self.links, self.head = [], None
        if chain is None or chain.base is None:
            return
        self.links = [Link(step=chain.base.step, kind="base", bytes=folder_bytes(chain.base.path),
                           digest=commit_digest(chain.base.path))]
        self.links += [Link(step=d.step, kind="delta", parent=d.parent, bytes=d.bytes, digest=d.digest,
                            parent_digest=d.parent_digest) for d in chain.deltas]
        self.head = self.links[-1]

    def choose(self) -> tuple[Kind, str]:
        """Whether the next periodic save is a delta or a base, and why."""
        if self.off is not None:
            return "base", self.off
        last = self.links[-1].bytes if self.links and self.links[-1].kind == "delta" else 0
        return next_kind(self.links, self.head.step if self.head else None, last, anchor=False, policy=self.policy)

    def base_started(self, step: int) -> None:
        """A full save of `step` began: every row touched so far is in it. Until it commits
        there is no head (a base that fails leaves the next save a base too)."""
        self._drop_tracked()
        self.head, self._pending_base = None, step

    def base_committed(self, commit: CommitResult) -> None:
        """A full save ended (from the checkpoint manager's thread): committed, it is the head."""
        if commit.step != self._pending_base or not commit.committed or commit.path is None:
            return
        link = Link(step=commit.step, kind="base", bytes=commit.nbytes or 0, digest=commit_digest(commit.path))
        self.links = [*(x for x in self.links if x.step != commit.step), link]
        self.head, self._pending_base = link, None

    def save(self, step: int, state: TrainState, group: Any) -> DeltaCommit:
        """The delta of `step` on the head, every rank together (`group`: the checkpoint group),
        while the caller waits."""
        captured, taken = self.start(step, state)
        return self.finished(captured, taken, commit_captured(self.root, captured, group), rank=group.rank)

    def start(self, step: int, state: TrainState) -> tuple[CapturedDelta, dict]:
        """The blocking part of the delta of `step` on the head (`delta.capture`), and the rows it
        holds: they leave the ledger now (rows touched from here on go to the next save) and
        come back to it when the delta does not commit (`finished`). Not collective."""
        assert self.head is not None, "a delta needs a committed head: choose() says when"
        taken = self.durable_rows()
        self.ledger.committed()
        self._in_flight = taken
        return capture(state, step=step, parent=self.head.step, parent_digest=self.head.digest,
                       touched=taken), taken

    def finished(self, captured: CapturedDelta, taken: dict, commit: DeltaCommit, *, rank: int) -> DeltaCommit:
        """`commit` of `captured` ended (the same outcome on every rank): committed, the delta is
        the head; else its rows go back to the ledger, and a state that cannot be a delta turns
        deltas off for the run."""
        self._in_flight = None
        if commit.committed:
            link = Link(step=captured.step, kind="delta", parent=captured.parent, bytes=commit.bytes,
                        digest=commit.digest, parent_digest=captured.parent_digest)
            self.links = [*(x for x in self.links if x.step != captured.step), link]
            self.head = link
            return commit
        self.ledger.add(taken)
        if commit.unsupported:
            self.off = f"delta checkpoints are off for this run: {commit.error}"
            if rank == 0:
                log.warning("%s; every checkpoint is a full save", self.off)
        return commit

    def memory_rows(self) -> dict | None:
        """The rows touched since the rank's last in-memory copy, for the copy taken now (then
        the ledger starts again: a copy whose hand-off fails makes the tier take a whole one);
        None when they are not known (the first copy, after a restore, deltas off)."""
        self._drain()
        if self.off is not None or self._memory is None:
            self._memory = RowLedger()
            return None
        out = self._memory.rows()
        self._memory.committed()
        return out

    def chain_resume(self) -> ChainResume | None:
        """What an in-memory copy taken now carries so that a restore of it can go on with the
        durable chain (`chain_resume.py`): the link the durable saves count from (the settled
        head, or the base whose save began last) and every row touched since it (the ledger's,
        and a delta's still being written). None: nothing to go on from (no save yet, deltas off)."""
        if self.off is not None:
            return None
        if self._pending_base is not None:
            links: tuple[Link, ...] = (Link(step=self._pending_base, kind="base"),)
        elif self.head is not None:
            links = tuple(chain_of({x.step: x for x in self.links}, self.head.step))
        else:
            return None
        since = RowLedger()
        since.add(self.durable_rows())
        since.add(self._in_flight or {})
        return ChainResume.of(links, since.rows())

    def resumed(self, links: tuple[Link, ...], rows: dict) -> None:
        """The state was just restored from an in-memory copy whose record (`chain_resume`, found
        on disk by every rank) says the durable chain goes on from `links`' last link: the next
        save may be a delta on it, holding `rows` (touched between that link and the copy) and
        every row touched from now on. The next in-memory copy is whole."""
        self._drop_tracked()
        self._memory, self._in_flight, self._pending_base = None, None, None
        self.links, self.head = list(links), links[-1]
        self.ledger.add({fqn: torch.as_tensor(ids, dtype=torch.int64) for fqn, ids in rows.items()})

    def durable_rows(self) -> dict:
        """The rows touched since the last committed durable save (kept until a delta of them
        commits)."""
        self._drain()
        return self.ledger.rows()

    def _drain(self) -> None:
        """Read the tracker (which forgets what it gave) into BOTH ledgers: the durable saves'
        and the in-memory tier's each keep every row since their own last save, whoever read."""
        rows = touched_rows(self.tracker)
        self.ledger.add(rows)
        if self._memory is not None:
            self._memory.add(rows)

    def _drop_tracked(self) -> None:
        self._drain()
        self.ledger.committed()

