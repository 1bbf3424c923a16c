"""The in-memory tier of a rank: a copy of its state in host memory, handed to the run's keeper
(`checkpoint/state_keeper.py`), which outlives the rank; the first tier of the restore ladder
(`tiers.py`) when the run has a keeper and `switches.memory_checkpoint` is on.

A save records `memory_save_blocking` (the host copy the loop waits for; with deltas `kind`)
and, from the background thread, `memory_save_background` (checksum and hand-off; attrs
`bytes`, `ok`, `kind`, `error`). A restore reads this rank's own host copy when it holds the
step, else the keeper's; a missing, damaged or misfitting copy is a `TierMiss`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ettflow.ett.checkpoint_tier import CheckpointTier, RestoreSource
from ettflow.trainer.checkpoint.memory_tier import MemoryCopyError, MemorySaveResult, MemoryTier
from ettflow.trainer.data.windows import Cursor
from ettflow.trainer.protocol import RestorePoint
from ettflow.trainer.rank.restore_report import RestoreReport
from ettflow.trainer.rank.tiers import TierContext, TierMiss

if TYPE_CHECKING:
    from ettflow.trainer.checkpoint.chain_resume import ChainResume
    from ettflow.trainer.checkpoint.state_keeper import KeeperHandle


class HostMemoryTier:
    kind = CheckpointTier.MEMORY

    def __init__(self, ctx: TierContext, keeper: KeeperHandle) -> None:
        self.ctx = ctx
        cfg = ctx.config
        self.copies = MemoryTier(keeper, ctx.rank, cfg.world_size, on_done=self._on_done,
                                 policy=cfg.delta_policy if cfg.switches.delta_checkpoint else None)
        self._background: list[float] = []  # seconds, each copy's background part
        self.resume: ChainResume | None = None  # the last restored copy's record for the durable chain

    def bind(self) -> None:
        """Nothing to rebuild: the copies and the keeper outlive a live recovery."""

    def save(self, step: int, cursor: Cursor | None, *, loss: float | None = None,
             since: float | None = None) -> float:
        """A copy of the state at `step`; returns the seconds the loop was blocked (from `since`
        when given: the end of what the loop recorded last). `loss` is not checked here: a
        copy is only restored into a run whose durable saves check it."""
        t0 = time.time() if since is None else min(since, time.time())
        state = self.ctx.set_position(step, cursor)
        deltas = self.ctx.deltas
        touched = deltas.memory_rows() if deltas is not None else None
        self.copies.save(step, state, touched=touched, resume=deltas.chain_resume() if deltas is not None else None)
        t1 = time.time()
        self.ctx.rec.record("memory_save_blocking", t0, t1, sync=False, step=step,
                            **({"kind": self.copies.last_kind} if self.copies.policy is not None else {}))
        return t1 - t0

    def before_update(self) -> None:
        """A copy is taken while the loop waits: nothing is staged past it."""

    def wait(self) -> None:
        self.copies.wait()

    def latest_step(self) -> int | None:
        """The step of this rank's own host copy (the keeper may hold older ones too)."""
        return self.copies.local_step

    def restore(self, point: RestorePoint) -> RestoreReport:
        try:
            read = self.copies.restore(self.ctx.train_state, point.step)
        except MemoryCopyError as exc:
            raise TierMiss(str(exc)) from exc
        if self.ctx.deltas is not None:
            self.ctx.deltas.restored(None)  # the next save is a base, unless every rank resumes the chain:
        self.resume = read["resume"]  # `Checkpointing.resume_chain` decides, all ranks together
        return RestoreReport(source=RestoreSource.MEMORY, step=point.step, memory_deltas=read["deltas"])

    def background_s(self) -> float | None:
        """The longest background part (checksum + hand-off) of this rank's copies so far (0:
        none); None while one is still in flight (its time is not known yet, and waiting for it
        would stop training)."""
        if self.copies.in_flight:
            return None
        self.copies.wait()
        return max(self._background, default=0.0)

    def corrupt(self) -> None:
        """The scripted `corrupt` fault: from now on this rank's copies are corrupted as the keeper
        stores them (their checksums kept), so a restore from them must fail."""
        self.copies.corrupt_copies = True

    def abandon(self) -> None:
        self.copies.wait()  # a hand-off does not depend on the peers: it finishes

    def close(self) -> None:
        self.copies.close()

    def _on_done(self, result: MemorySaveResult) -> None:
        self._background.append(result.end - result.start)
        self.ctx.rec.record("memory_save_background", result.start, result.end, step=result.step,
                            bytes=result.nbytes, ok=result.ok, kind=result.kind,
                            **({"error": result.error[:300]} if result.error else {}))
