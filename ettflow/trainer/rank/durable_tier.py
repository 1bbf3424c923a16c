"""The durable tier of a rank: committed checkpoint folders (DCP), a base and, with
`switches.delta_checkpoint`, the deltas on it (`delta_saves.py`); the last tier of every
restore ladder (`tiers.py`), and the only one a start (own checkpoint, warm start, elastic
restart) or an anchor reads and writes.

A save records `checkpoint_save_blocking` (what the loop waits for; attrs `mode`, and with
deltas `kind`, `bytes`, `parent`) and `checkpoint_save_background` (the write that overlaps
training). A restore reads the run's newest restorable chain: its base, then each delta in
order, each verified before it is read; anchors and warm starts read and write bases only.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from ettflow.ett.checkpoint_tier import CheckpointTier, RestoreSource
from ettflow.trainer.checkpoint import CheckpointConfig, CheckpointInfo, CheckpointManager, CommitResult, SaveResult
from ettflow.trainer.checkpoint.config import RefusedCheckpointError
from ettflow.trainer.checkpoint.delta import CapturedDelta, DeltaCommit, DeltaInfo, apply_chain, commit_captured
from ettflow.trainer.checkpoint.fingerprint import state_fingerprint
from ettflow.trainer.checkpoint.latest import checked_scan, mark_fallbacks
from ettflow.trainer.checkpoint.layout import parse_name
from ettflow.trainer.checkpoint.results import RestoreResult
from ettflow.trainer.checkpoint.staged_anchor import StagedAnchor
from ettflow.trainer.data.windows import Cursor
from ettflow.trainer.protocol import MEMORY, RestorePoint
from ettflow.trainer.rank.numerics import refuse_nonfinite
from ettflow.trainer.rank.restore_report import ChainRead, RestoreReport
from ettflow.trainer.rank.tiers import TierContext, TierMiss

log = logging.getLogger("ettflow.trainer")


@dataclass(frozen=True)
class InFlightDelta:
    """An async delta: its background write and commit (with when it ran), what it captured, and
    the rows it holds (back to the ledger when it does not commit)."""

    future: Future[tuple[DeltaCommit, float, float]]
    captured: CapturedDelta
    taken: dict


class DurableTier:
    kind = CheckpointTier.DURABLE

    def __init__(self, ctx: TierContext) -> None:
        self.ctx = ctx
        self.manager: CheckpointManager | None = None
        self._delta: InFlightDelta | None = None  # an async delta's write and commit, not waited for yet

    # ---- the tier interface ---------------------------------------------------------------
    def bind(self) -> None:
        """A checkpoint manager on the context's checkpoint group (a new one after a live recovery)."""
        if self.manager is not None:
            self.manager.close()
        cfg = self.ctx.config
        self.manager = CheckpointManager(
            CheckpointConfig(root=cfg.checkpoint_dir, mode="async" if cfg.switches.async_checkpoint else "sync",
                             keep_last=cfg.keep_checkpoints),
            process_group=self.ctx.groups.checkpoint.pg, on_commit=self._on_commit, async_staging=self.async_staging,
        )

    @property
    def async_staging(self) -> bool:
        """Stage a save in the background, waited for before the next backward (`before_update`):
        with an accelerator (a DMA into pinned buffers overlaps the forward). On a CPU host the
        copy holds the Python lock, so staging in the background only moves it into the next
        step (measured: `ettflow.bench.save_blocking`): there the save copies while it blocks."""
        return self.ctx.config.switches.async_checkpoint and torch.accelerator.is_available()

    def save(self, step: int, cursor: Cursor | None, *, loss: float | None = None,
             since: float | None = None) -> float:
        """A periodic (or emergency) checkpoint; returns the seconds the loop was blocked, from
        the call (`since`: from the end of what the loop recorded last): the finite check is
        part of it. Refused (a numerics failure) when `loss` or a dense parameter is not finite."""
        called = time.time() if since is None else min(since, time.time())
        self.check_finite(step, loss=loss, action=f"checkpoint at step {step}")
        deltas = self.ctx.deltas
        if deltas is not None:
            self.manager.wait()  # a base in flight commits first: it may be the head a delta names
            self.settle_delta()  # and so does a delta
            kind, why = deltas.choose()
            if kind == "delta":
                return self._save_delta(step, cursor, called)
            log.debug("checkpoint of step %d is a base: %s", step, why)
        result = self.save_base(step, cursor)
        start = min(called, result.blocking_start)
        self.ctx.rec.record("checkpoint_save_blocking", start, result.blocking_end,
                            step=step, mode=result.mode, waited_previous_s=result.waited_previous_s,
                            **({"kind": "base"} if deltas is not None else {}))
        return result.blocking_end - start

    def before_update(self) -> None:
        """The background staging of the last save must be done before a step changes the
        parameters; its wait is that save's blocking (recorded as `checkpoint_save_blocking`)."""
        if self.manager is None:
            return
        staged = self.manager.wait_staged()
        if staged is not None and staged.waited_s > 0:
            self.ctx.rec.record("checkpoint_save_blocking", staged.start, staged.end, sync=False, step=staged.step,
                                staging_wait=True)

    def wait(self) -> None:
        """The last save committed (on every rank: the commit is collective)."""
        if self.manager is not None:
            self.manager.wait()
            self.settle_delta()

    def settle_delta(self) -> None:
        """Wait for the async delta in flight, if any: its outcome becomes the chain's
        (`DeltaSaves.finished`), its write is recorded as `checkpoint_save_background`; raises
        CheckpointError when it did not commit (as a failed async base does at `wait`). A state
        that cannot be a delta turns deltas off: the next save is a base."""
        flight, self._delta = self._delta, None
        if flight is None:
            return
        commit, started, ended = flight.future.result()
        deltas = self.ctx.deltas
        assert deltas is not None
        deltas.finished(flight.captured, flight.taken, commit, rank=self.ctx.rank)
        self.ctx.rec.record("checkpoint_save_background", started, ended, step=flight.captured.step, kind="delta",
                            committed=commit.committed, bytes=commit.bytes,
                            path=str(commit.path) if commit.path else None, error=commit.error)
        if not commit.committed and not commit.unsupported:
            raise commit.failure()  # storage (errno, path) when a full disk or I/O error is behind it

    def latest_step(self) -> int | None:
        """The newest step of the run's restorable chain at this world size (a disk scan)."""
        chain = checked_scan(self.ctx.config).chain(self.ctx.config.world_size)
        if chain.base is None:
            return None
        return chain.deltas[-1].step if chain.deltas else chain.base.step

    def restore(self, point: RestorePoint) -> RestoreReport:
        """The durable state for `point`: the checkpoint it names when that is a base, else (a
        memory point sent here, a delta) the run's newest restorable chain."""
        if point.source is MEMORY or point.path is None or not is_base(point.path):
            return self._restore_newest_chain()
        try:
            return self.restore_own(point.path)
        except RefusedCheckpointError as exc:
            return self._restore_verified_instead(point, exc)

    def _restore_newest_chain(self) -> RestoreReport:
        """The run's newest restorable chain (the scan verifies every link; every rank reads the
        same folder, so they agree). A damaged link it skipped is recorded as a restart records
        it (`checkpoint_fallback`, rank 0), never skipped silently (issue 42 #5)."""
        world = self.ctx.config.world_size
        found = checked_scan(self.ctx.config)  # warns of each folder it skips, the damaged one's file named
        chain = found.chain(world)
        if chain.base is None:
            raise TierMiss("the run has no durable checkpoint")
        if self.ctx.rank == 0:
            mark_fallbacks(self.ctx.rec, found, world)
        try:
            return self.restore_own(chain.base.path, chain.deltas)
        except RefusedCheckpointError as exc:
            raise TierMiss(f"its newest restorable checkpoint {chain.base.path} failed its check: {exc}") from exc

    def _restore_verified_instead(self, point: RestorePoint, exc: RefusedCheckpointError) -> RestoreReport:
        """The checkpoint `point` names failed its check (every rank refuses it together,
        `CheckpointManager.load`): every rank restores the newest chain that verifies (the scan
        reads the same folder on every rank, so they agree), with the damage recorded as a full
        restart records it, never a failure of the code (issue 42 #3)."""
        world = self.ctx.config.world_size
        found = checked_scan(self.ctx.config)  # warns of each folder it skips, the damaged one's file named
        chain = found.chain(world)
        if chain.base is None:
            raise TierMiss(f"{point.path} failed its check ({exc}) and no older checkpoint verifies") from exc
        log.warning("live recovery: checkpoint step %d failed its check: every rank restores step %d",
                    point.step, chain.step)
        if self.ctx.rank == 0:
            mark_fallbacks(self.ctx.rec, found, world)
        return self.restore_own(chain.base.path, chain.deltas)

    def background_s(self) -> float | None:
        return 0.0  # a durable save's background write is recorded, never waited for by an interval choice

    def abandon(self) -> None:
        """A peer failed: the save in flight can never commit (its group is gone); drop it
        without waiting on the group (`bind` builds a new manager)."""
        self._delta = None  # its rows are in no committed link: the restore point says what is trained again
        if self.manager is not None:
            try:
                self.manager.close()
            except Exception as exc:  # noqa: BLE001 - expected: the save's collective lost its peer
                log.info("checkpoint save in flight abandoned after a peer's failure: %s", exc)
            self.manager = None

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()

    # ---- what only the durable tier does --------------------------------------------------
    def check_finite(self, step: int, *, loss: float | None, action: str) -> None:
        """Raise (and record) a numerics failure unless the last loss and the dense parameters
        are finite; `action` names what is refused ("checkpoint at step 10")."""
        refuse_nonfinite(self.ctx.rec, self.ctx.dense_named, rank=self.ctx.rank, step=step, loss=loss, action=action)

    def save_base(self, step: int, cursor: Cursor | None) -> SaveResult:
        """A full save (a base): periodic, emergency or anchor."""
        assert self.manager is not None
        state = self.ctx.set_position(step, cursor)
        if self.ctx.deltas is not None:
            self.ctx.deltas.base_started(step)
        return self.manager.save(step, state)

    def hand_off_base(self, step: int, cursor: Cursor) -> tuple[dict[str, bytes], str]:
        """A base of `step` saved into host memory (the anchor handed off before the release):
        this rank's files and its cursor (JSON); the driver writes and commits them. An async
        delta still in flight commits first: its agreement and seal are collectives on the
        checkpoint group, on the manager's thread, and DCP's save into memory runs its own on
        this one; interleaved, the ranks deadlocked (a delta of the step before the last, seen
        in the bench's optimized job after two live recoveries)."""
        assert self.manager is not None
        self.settle_delta()
        return self.manager.save_to_host(step, self.ctx.set_position(step, cursor))

    def commit_base(self, step: int, cursor: Cursor) -> Path:
        """A base of `step`, committed before this returns (the anchor's checkpoint); an async
        delta in flight is settled first (its outcome recorded, as at any other save)."""
        self.settle_delta()
        result = self.save_base(step, cursor)
        self.manager.wait()
        commit = result.commit_result()
        if not commit.committed:
            raise RuntimeError(f"the anchor checkpoint at step {step} did not commit: {commit.error}")
        return Path(commit.path)

    def restore_own(self, base: CheckpointInfo | Path | str, deltas: tuple[DeltaInfo, ...] = ()) -> RestoreReport:
        """One of the run's own chains: its base, then its deltas in order (each verified before
        it is read), so the state equals a full checkpoint of the chain's last step; the delta
        saves build on it."""
        restored, read = self._load_chain(base, deltas)
        return RestoreReport(source=RestoreSource.OWN, step=self.ctx.train_state.step,
                             path=str(restored.checkpoint.path), chain=read)

    def restore_resharded(self, own: CheckpointInfo, cursor: Cursor) -> RestoreReport:
        """The run's own checkpoint written by another number of ranks (an elastic restart):
        weights and optimizer state resharded by DCP, the step, and `cursor` (common to its ranks)."""
        assert self.manager is not None
        cfg = self.ctx.config
        restored = self.manager.load_parent(self.ctx.train_state, own)  # weights only, resharded
        log.info("restored %s (step %d of %d ranks) on %d ranks", restored.checkpoint.path, own.step,
                 own.world_size, cfg.world_size)
        return RestoreReport(source=RestoreSource.OWN, step=own.step, path=str(restored.checkpoint.path),
                             cursor=cursor.as_tuple(), resharded_from=own.world_size, world_size=cfg.world_size)

    def warm_start(self, parent: Path, *, staged: StagedAnchor | None = None) -> RestoreReport:
        """The parent refresh's anchor: model and optimizer state (the step and cursor start over);
        `staged`: its copy this process staged in memory (`staged_anchor.py`), read instead of the disk."""
        assert self.manager is not None
        restored = self.manager.load_parent(self.ctx.train_state, parent, staged=staged)
        got = restored.checkpoint
        fingerprint = state_fingerprint(self.ctx.train_state.model.state_dict())
        log.info("warm start from %s (step %d of %d ranks)", got.path, got.step, got.world_size)
        return RestoreReport(source=RestoreSource.PARENT, path=str(got.path), parent_step=got.step,
                             parent_world_size=got.world_size, world_size=self.ctx.config.world_size,
                             fingerprint=fingerprint)

    def _load_chain(self, base: CheckpointInfo | Path | str, deltas: tuple[DeltaInfo, ...]
                    ) -> tuple[RestoreResult, ChainRead | None]:
        assert self.manager is not None and self.ctx.train_state is not None
        restored = self.manager.load(self.ctx.train_state, base)
        rows = apply_chain(self.ctx.train_state, [d.path for d in deltas], self.ctx.rank) if deltas else 0
        if self.ctx.deltas is not None:
            from ettflow.trainer.checkpoint.catalog import Chain

            self.ctx.deltas.restored(Chain(base=restored.checkpoint, deltas=tuple(deltas)))
        if not deltas:
            log.info("restored %s (step %d)", restored.checkpoint.path, restored.checkpoint.step)
            return restored, None
        log.info("restored %s (step %d) and %d delta(s) on it, to step %d", restored.checkpoint.path,
                 restored.checkpoint.step, len(deltas), self.ctx.train_state.step)
        return restored, ChainRead(base_step=restored.checkpoint.step, deltas=tuple(d.step for d in deltas),
                                   rows=rows)

    def _save_delta(self, step: int, cursor: Cursor, called: float) -> float:
        """A delta checkpoint of `step` on the last committed one. With `async_checkpoint` the loop
        waits only for the capture into host memory; the write, the ranks' agreement and the seal
        run on the manager's background thread (after any base in flight: a delta commits only
        after its parent), settled at the next save or `wait`. Otherwise it is written while
        the loop waits; raises CheckpointError when it did not commit."""
        deltas = self.ctx.deltas
        assert self.manager is not None and deltas is not None
        state = self.ctx.set_position(step, cursor)
        parent = deltas.head.step if deltas.head else None
        if self.manager.is_async:
            captured, taken = deltas.start(step, state)
            root, group = deltas.root, self.manager.group

            def write() -> tuple[DeltaCommit, float, float]:
                started = time.time()
                return commit_captured(root, captured, group), started, time.time()

            self._delta = InFlightDelta(self.manager.background(write), captured, taken)
            end = time.time()
            self.ctx.rec.record("checkpoint_save_blocking", called, end, step=step, mode="async", kind="delta",
                                parent=parent)
            return end - called
        commit = deltas.save(step, state, self.manager.group)
        end = time.time()
        if not commit.committed and not commit.unsupported:
            raise commit.failure()
        if not commit.committed:  # deltas are off from now on: this save is a base after all
            return self.save(step, cursor, since=called)
        self.ctx.rec.record("checkpoint_save_blocking", called, end, step=step, mode="delta", kind="delta",
                            parent=parent, bytes=commit.bytes, path=str(commit.path))
        return end - called

    def _on_commit(self, result: CommitResult) -> None:
        if self.ctx.deltas is not None:
            self.ctx.deltas.base_committed(result)
        if result.background_end > result.background_start:
            self.ctx.rec.record("checkpoint_save_background", result.background_start, result.background_end,
                                step=result.step, committed=result.committed, bytes=result.nbytes,
                                path=str(result.path) if result.path else None, error=result.error)


def is_base(path: str | Path) -> bool:
    """Whether a checkpoint folder's name is a full checkpoint's (`step_<n>`), not a delta's."""
    return parse_name(Path(path).name) is not None
