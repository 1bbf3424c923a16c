"""CheckpointManager: save (sync or async), commit, keep the last K, and restore.

    ckpt_group = dist.new_group(backend="gloo")           # every rank, same order
    manager = CheckpointManager(CheckpointConfig(root=..., mode="async", keep_last=3),
                                process_group=ckpt_group)
    result = manager.save(step, train_state)   # blocks for the copy into host memory only
    ...                                         # training continues while it writes
    manager.wait()                              # or: the next save waits for this one
    manager.restore_latest(fresh_train_state)   # newest committed, verified checkpoint

With `async_staging=True` (async mode), `save` does not wait for the copy either: it hands
the state to the stager's thread and returns. The copy must end before anything it reads is
mutated, so the loop calls `wait_staged()` right before the next backward pass (the fused
sparse optimizer updates parameters inside backward, the dense one at `step()`); what that
call waits is part of the save's blocking:

    result = manager.save(step, train_state)   # the hand-off
    loss = forward(next_batch)                  # overlaps the copy (reads parameters only)
    staged = manager.wait_staged()              # StagingWait, or None when nothing was staged
    loss.backward(); optimizer.step()           # safe: the saved copy is complete

Before backward is late enough for the trainer's fused Adagrad (fbgemm EXACT_ADAGRAD reads
its state in forward, writes it in backward). Fused optimizers with a second moment (Adam,
LAMB, ...) increment the TBE's `iter` buffer in forward: with those, wait before the sparse
forward instead.

A save writes `step_<n>.tmp` with DCP. In async mode the manager's stager (DCP's
DefaultStager, see `staging.py`: its host buffers are reused from one save to the next)
copies the state into host memory and `dcp.save` writes the copy on the manager's own
thread. When DCP has finished on every rank, rank 0 checks the files, hashes every one of
them (sha256), seals the folder (manifest + COMMITTED) and renames it to `step_<n>`: only then can
a restart use it. It then deletes checkpoints beyond the newest `keep_last`, and tells every
rank the outcome. A save that fails is never committed: rank 0 removes its `.tmp` folder, and
a failure of the storage (ENOSPC, EIO) is raised as `CheckpointStorageError`, an OSError with
the errno and the path. `.tmp` folders a crash left behind are removed when the next
manager starts.

A restore verifies the checkpoint first (every file's sha256, `.metadata` included), and
only then lets DCP read it, through `reading.py` (no code runs from the folder).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from ettflow.trainer.checkpoint.catalog import CheckpointScan, remove_uncommitted, scan
from ettflow.trainer.checkpoint.commit import commit_folder
from ettflow.trainer.checkpoint.config import (
    CheckpointConfig,
    CheckpointError,
    CheckpointStorageError,
    RefusedCheckpointError,
)
from ettflow.trainer.checkpoint.group import CheckpointGroup
from ettflow.trainer.checkpoint.host_writer import HostWriter
from ettflow.trainer.checkpoint.layout import remove_tree, tmp_dir
from ettflow.trainer.checkpoint.reading import SafeFileSystemReader, SafeLoadPlanner
from ettflow.trainer.checkpoint.results import CommitResult, RestoreResult, SaveResult, StagingWait
from ettflow.trainer.checkpoint.save_errors import Outcome, Report, describe, failure_report, save_error
from ettflow.trainer.checkpoint.staged_anchor import StagedAnchor, StagedReader
from ettflow.trainer.checkpoint.staging import make_stager
from ettflow.trainer.checkpoint.state import TrainState
from ettflow.trainer.checkpoint.verify import CheckpointInfo, verify

T = TypeVar("T")
log = logging.getLogger(__name__)


def _write(staged: dict[str, Any] | Future[dict[str, Any]], kwargs: dict[str, Any]) -> None:
    """DCP's write of a staged state dict, on the manager's thread: what `dcp.async_save`'s
    thread does, without the thread `async_save` starts for every save (about 2 ms of each
    save's blocking here). With async staging it first waits for the copy."""
    dcp.save(staged.result() if isinstance(staged, Future) else staged, **kwargs)


class CheckpointManager:
    """Saves and restores `TrainState`s under `config.root` (see the module docstring).

    process_group: the group for checkpoint collectives; required in async mode when
        torch.distributed is initialized (see `group.py`), optional in sync mode.
    on_commit: called with each CommitResult as a save finishes (from the background
        thread in async mode), e.g. to record the `checkpoint_save_background` phase.
    async_staging: (async mode) `save` returns before the copy into host memory is done;
        the caller must call `wait_staged()` before it mutates any saved tensor (see the
        module docstring). Off: `save` returns after the copy, and nothing is to be waited.
    Failures of a save are raised as CheckpointError by `save` (sync mode), or by the
    next `wait`/`save` call after it failed (async mode); CheckpointStorageError (also an
    OSError, with errno and path) when the storage failed.
    Starting a manager removes the `.tmp`/`.trash` folders a crash left under the root (rank
    0, before any save of this job; committed checkpoints are never touched): so no rank may
    save before rank 0's manager has started (a collective between them, as a run's restore
    and training steps are; not a barrier here, which every caller, a live recovery's rebind
    included, would have to reach in the same order as its other collectives).
    """

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        process_group: dist.ProcessGroup | None = None,
        on_commit: Callable[[CommitResult], None] | None = None,
        async_staging: bool = False,
    ) -> None:
        if async_staging and config.mode != "async":
            raise ValueError("async_staging needs CheckpointConfig(mode='async'): a sync save writes in place")
        self.config = config
        self.group = CheckpointGroup(process_group, mode=config.mode)
        self._on_commit = on_commit
        self._async = config.mode == "async"
        self.async_staging = async_staging
        self._stager = make_stager(async_staging=async_staging) if self._async else None
        self._executor = ThreadPoolExecutor(1, "ettflow-ckpt") if self._async else None
        self._pending: SaveResult | None = None
        self._staging: tuple[int, Future] | None = None  # (step, its copy) until wait_staged
        self._closed = False
        Path(config.root).mkdir(parents=True, exist_ok=True)
        if self.group.rank == 0:
            remove_uncommitted(Path(config.root))

    # -- saving -------------------------------------------------------------------------

    def save(self, step: int, state: TrainState) -> SaveResult:
        if self._closed:
            raise CheckpointError("CheckpointManager.save after close(): build a new manager")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        start = time.time()
        self.wait()
        waited = time.time() - start
        tmp = tmp_dir(self.config.root, step)
        cursor = state.cursor_json()
        state_dict = state.to_state_dict(step=step, rank=self.group.rank)
        try:
            tmp.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise save_error(f"checkpoint of step {step}: cannot create {tmp}: {e}", e, tmp) from e
        writer = FileSystemWriter(str(tmp))
        kwargs: dict[str, Any] = {
            "storage_writer": writer,
            "process_group": self.group.pg,
            "no_dist": not self.group.distributed,
        }
        future: Future[CommitResult]
        staging: Future | None = None
        if self._async:
            try:  # a dict once copied, or (async staging) a Future of it, the copy still running
                staged = self._stager.stage(state_dict)
            except Exception as e:  # noqa: BLE001 - the copy failed on this rank
                self._discard(tmp)
                raise save_error(f"checkpoint of step {step}: DCP staging failed: {describe(e)}", e, tmp) from e
            staging = staged if isinstance(staged, Future) else None
            if staging is not None:
                self._staging = (step, staging)
            end = time.time()
            future = self._executor.submit(self._finish, step, tmp, cursor, partial(_write, staged, kwargs), end)
        else:
            try:
                dcp.save(state_dict, **kwargs)
            except CheckpointException as e:  # a BaseException: would escape `except Exception`
                self._discard(tmp)  # DCP raised on every rank: no rank is still writing
                raise save_error(f"checkpoint of step {step}: DCP write failed: {describe(e)}", e, tmp) from e
            commit = self._finish(step, tmp, cursor, None, start)
            end = commit.background_end  # sync: nothing runs in the background
            future = Future()
            future.set_result(commit)
        result = SaveResult(
            step=step,
            mode=self.config.mode,
            blocking_start=start,
            blocking_end=end,
            waited_previous_s=waited,
            staged_async=staging is not None,
            commit_future=future,
            staging_future=staging,
        )
        self._pending = result
        if not self._async:
            self.wait()
        return result

    def save_to_host(self, step: int, state: TrainState) -> tuple[dict[str, bytes], str]:
        """The state of `step` saved by DCP into this process's memory, not to disk
        (`host_writer.py`; collective, as `save`): this rank's files by name and its cursor
        (JSON). The pending save commits first. The files, written into one folder with every
        other rank's, are the folder `save` would have written; `commit_folder` commits it."""
        if self._closed:
            raise CheckpointError("CheckpointManager.save_to_host after close(): build a new manager")
        self.wait()
        writer = HostWriter(step)
        try:
            dcp.save(state.to_state_dict(step=step, rank=self.group.rank), storage_writer=writer,
                     process_group=self.group.pg, no_dist=not self.group.distributed)
        except CheckpointException as e:  # a BaseException: would escape `except Exception`
            raise CheckpointError(f"checkpoint of step {step} into host memory failed: {describe(e)}") from e
        return dict(writer.files), state.cursor_json()

    @property
    def is_async(self) -> bool:
        """Saves write and commit on the manager's background thread (`mode="async"`)."""
        return self._async

    def background(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the manager's background thread, after every save already handed to it
        (one thing at a time, in the order given: the checkpoint group's collectives of a save
        and of `fn` never interleave). Async mode only."""
        if self._executor is None or self._closed:
            raise CheckpointError("background work needs an open CheckpointManager in async mode")
        return self._executor.submit(fn)

    def wait_staged(self) -> StagingWait | None:
        """With async staging: wait until the last save's copy into host memory is complete,
        after which the saved tensors may be mutated; returns when and how long it waited
        (part of that save's blocking), None when no staged copy was pending (sync staging,
        no save since the last call, or `wait` already finished the save). A failed copy is
        not raised here: the save fails with it, reported by `wait`/the next `save`.

        Call it before every backward pass and optimizer step (cheap when nothing is pending)."""
        pending, self._staging = self._staging, None
        if pending is None:
            return None
        step, copy = pending
        start = time.time()
        try:
            copy.result()
        except Exception:  # noqa: BLE001 - the write fails with it; reported by wait()
            log.debug("staging of step %d failed (reported with the save)", step, exc_info=True)
        return StagingWait(step=step, start=start, end=time.time())

    def wait(self) -> CommitResult | None:
        """Finish the pending save; returns its CommitResult (None if there was none) and
        raises CheckpointError if it failed (it is not retried)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        outcome = pending.commit_result()
        self._staging = None  # the write waited for the copy: nothing is left to wait for
        if not outcome.committed:
            message = f"checkpoint of step {outcome.step} failed: {outcome.error}"
            if outcome.errno is not None:
                raise CheckpointStorageError(outcome.errno, message, outcome.error_path or "")
            raise CheckpointError(message)
        return outcome

    def _discard(self, tmp: Path) -> None:
        """Rank 0: remove the `.tmp` folder of a save that failed on every rank (frees the
        space a full disk needs back; never a committed folder)."""
        if self.group.rank != 0:
            return
        try:
            remove_tree(tmp)
        except OSError as e:
            log.warning("could not remove %s after a failed save (the next start will): %s", tmp, e)

    def _finish(self, step: int, tmp: Path, cursor: str, write: Callable[[], None] | None,
                start: float) -> CommitResult:
        """On every rank: DCP's write, then rank 0 verifies, seals, commits and prunes.

        `write` runs DCP's write (None in sync mode, where it already ran and the background
        span is empty); `start` is when the background part began."""
        try:
            report: Report = (None, None, None, cursor)
            if write is not None:
                try:
                    write()
                except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported to every rank below
                    why = f"DCP write failed on rank {self.group.rank}: {describe(e)}"
                    report = failure_report(why, e, tmp, cursor)
            reports = self.group.all_gather(report)
            outcome: Outcome = (None, None, None, None, None)
            if self.group.rank == 0:
                outcome = self._commit(step, tmp, reports)
            path, nbytes, error, errno, error_path = self.group.broadcast_from_first(outcome)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - a failed save must not kill the thread
            error, errno, error_path, _ = failure_report(f"rank {self.group.rank}: {describe(e)}", e, tmp, cursor)
            path, nbytes = None, None
        end = time.time()
        result = CommitResult(
            step=step,
            committed=path is not None,
            path=Path(path) if path else None,
            nbytes=nbytes,
            background_start=start if write is not None else end,
            background_end=end,
            error=error,
            errno=errno,
            error_path=error_path,
        )
        if error:  # raised by wait() (and recorded by on_commit); a peer's death fails it on purpose
            log.debug("checkpoint of step %d failed (reported by wait()): %s", step, error)
        if self._on_commit is not None:
            try:
                self._on_commit(result)
            except Exception:  # the callback's bug must not fail the save
                log.exception("checkpoint on_commit callback failed for step %d", step)
        return result

    def _commit(self, step: int, tmp: Path, reports: list[Report]) -> Outcome:
        """Rank 0, once every rank's DCP write ended: hash, seal and publish the folder.

        Returns (committed path, bytes, None, None, None) or (None, None, why it failed,
        errno, path); a failed save's folder is removed, so nothing torn looks committed."""
        failed = [r for r in reports if r[0]]
        if failed:
            self._discard(tmp)
            errno, path = next(((r[1], r[2]) for r in failed if r[1] is not None), (None, str(tmp)))
            return None, None, "; ".join(r[0] for r in failed), errno, path
        try:
            final, nbytes = commit_folder(tmp, Path(self.config.root), step=step, world_size=self.group.world_size,
                                          cursors=[json.loads(r[3]) for r in reports], keep_last=self.config.keep_last)
        except Exception as e:  # noqa: BLE001 - becomes the save's error on every rank
            error, errno, path, _ = failure_report(f"commit of {tmp} failed: {describe(e)}", e, tmp, "")
            return None, None, error, errno, path
        return str(final), nbytes, None, None, None

    # -- finding and restoring ----------------------------------------------------------

    def scan(self) -> CheckpointScan:
        """Committed, verified checkpoints and the problems (torn, partial) found beside them."""
        found = scan(self.config.root)
        for problem in found.problems:  # names the file that failed and the step used instead
            log.warning("%s", problem)
        return found

    def latest(self) -> CheckpointInfo | None:
        """The newest committed, verified checkpoint; torn or partial ones are logged."""
        return self.scan().latest

    def load(self, state: TrainState, path: Path | str | CheckpointInfo) -> RestoreResult:
        """Restore `state` (a freshly built model and optimizer) from a committed checkpoint.

        In this order: `verify` on every rank (the sha256 of every file, `.metadata`
        included, against the sealed manifest), refusing the checkpoint if any rank found a
        problem; only then is `.metadata` parsed (`reading.read_dcp_metadata`, which builds
        no type a DCP metadata file does not hold) and the data read by DCP through
        `SafeFileSystemReader` and `SafeLoadPlanner` (tensors and plain values only). A
        tampered file is refused before anything reads it.

        Collective: every rank calls it with the same path."""
        start = time.time()
        info, template = self._read(path, lambda saved: state.load_template(rank=self.group.rank, saved=saved),
                                    same_world=True)
        state.apply(template, rank=self.group.rank)
        return RestoreResult(checkpoint=info, start=start, end=time.time())

    def load_parent(self, state: TrainState, path: Path | str | CheckpointInfo, *,
                    staged: StagedAnchor | None = None) -> RestoreResult:
        """Warm start: restore only the model and optimizer state of `path` (another run's
        committed checkpoint, e.g. the parent refresh's anchor) into `state`, verified as in
        `load`. The parent may have had another world size: DCP reads every shard the new
        sharding plan asks for from whichever rank file holds it (resharding). Step, data
        cursor and RNG state (the per-rank `rank_<r>_*` keys) are not read: the new run
        starts at step 0 with a fresh cursor over its own windows, and `state.step` and
        `state.cursor` are left as they are.

        `staged`: `path` staged in this process's memory, its files already checked against
        its manifest and its seal still the one staged (`staged_anchor.py`): read from there, not
        the disk (another rank may read the disk: both are the sealed bytes).

        Collective: every rank calls it with the same path."""
        start = time.time()
        info, template = self._read(path, lambda saved: state.weights_template(), same_world=False, staged=staged)
        state.apply_weights(template)
        return RestoreResult(checkpoint=info, start=start, end=time.time())

    def _read(self, path: Path | str | CheckpointInfo, template_of: Callable[[Mapping[str, Any]], dict[str, Any]],
              *, same_world: bool, staged: StagedAnchor | None = None) -> tuple[CheckpointInfo, dict[str, Any]]:
        """Verify `path` on every rank, build the template from its DCP metadata and let DCP
        load into it (see `load`); every rank refuses together, none hangs in DCP. `staged`:
        this rank's checked copy of `path` in memory (its verify was the staging's)."""
        self._wait_quietly()
        path = Path(path.path if isinstance(path, CheckpointInfo) else path)
        try:
            info, problem = (staged.info if staged is not None else verify(path)), None
        except CheckpointError as e:
            info, problem = None, str(e)
        problems = [p for p in self.group.all_gather(problem) if p]
        if problems:
            raise RefusedCheckpointError(f"refusing to restore {path}: {problems[0]}")
        if same_world and info.world_size != self.group.world_size:
            raise CheckpointError(
                f"{path} was written by {info.world_size} ranks, this job has "
                f"{self.group.world_size}: per-rank data cursors and RNG state cannot be "
                "mapped; restore with the same number of ranks"
            )
        reader = SafeFileSystemReader(str(path)) if staged is None else StagedReader(staged)  # after verify
        try:
            saved = reader.read_metadata().state_dict_metadata
            template: dict[str, Any] = dict(template_of(saved))
            problem = None
        except CheckpointError as e:
            problem = str(e)
        problems = [p for p in self.group.all_gather(problem) if p]  # every rank refuses, none hangs in DCP
        if problems:
            raise RefusedCheckpointError(f"refusing to restore {path}: {problems[0]}")
        try:
            dcp.load(
                template,
                storage_reader=reader,
                # keep ShardedTensors without local shards (tables on other ranks) in the
                # template; flattening exists for FSDP's nested ShardedTensors, not TorchRec's
                planner=SafeLoadPlanner(flatten_sharded_tensors=False),
                process_group=self.group.pg,
                no_dist=not self.group.distributed,
            )
        except CheckpointException as e:  # a BaseException: would escape `except Exception`
            raise CheckpointError(f"restoring {path} failed: {describe(e)}") from e
        return info, template

    def restore_latest(self, state: TrainState) -> RestoreResult | None:
        """Restore from the newest committed checkpoint rank 0 finds; None if there is none.

        Collective: every rank calls it."""
        chosen = None
        if self.group.rank == 0:
            latest = self.latest()
            chosen = str(latest.path) if latest else None
        chosen = self.group.broadcast_from_first(chosen)
        return None if chosen is None else self.load(state, chosen)

    # -- lifetime -----------------------------------------------------------------------

    def _wait_quietly(self) -> None:
        try:
            self.wait()
        except CheckpointError as e:
            log.error("%s", e)

    def close(self) -> None:
        """Finish the pending save (raising if it failed) and release the staging buffers."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
            if self._executor is not None:
                self._executor.shutdown(wait=True)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
