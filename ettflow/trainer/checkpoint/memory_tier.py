"""The in-memory checkpoint tier: each rank's state copied to host memory that outlives the rank.

    keeper = start_keeper(run_id)                        # the driver, once per run (state_keeper.py)
    tier = MemoryTier(find_keeper(run_id), rank, world_size, on_done=record)   # each rank
    blocked_s = tier.save(step, train_state)             # one host copy; the rest runs in the background
    ...
    step = ray.get(keeper.latest_common.remote(world_size))   # the newest step every rank has
    tier.restore(train_state, step)                      # a survivor: its own copy, in place
    tier.restore(train_state, step, source_rank=1)       # a spare in rank 1's place: rank 1's copy

`save` copies the rank's tensors (`memory_copy.local_tensors`) into reused host buffers and
returns the seconds it blocked. One background thread then computes the copy's checksum and
hands it to the keeper; the next save waits for that hand-off, as CheckpointManager waits for
its previous write, and `on_done` gets a `MemorySaveResult` (the `memory_save_background`
phase). A failed hand-off (the keeper is gone) is reported there with ok=False and logged: the
memory tier is an optimization, the durable checkpoint stays the guarantee.

With a chain policy (`policy`, the trainer's `delta_policy` with `switches.delta_checkpoint`),
a copy may be a delta on the rank's previous one (`save(..., touched=rows)`): the rows looked up
since, with their optimizer state, the dense state whole and the rank's step, cursor and RNG,
as the durable delta checkpoints take them (`delta.capture_delta`). It is taken into fresh
host tensors (the whole copy's buffers stay as they are) and handed to the keeper alone, so its
checksum and hand-off cost the rows that changed, not the tables. A whole copy is taken when
the rows are not known (after a restore), the keeper missed the previous copy (its hand-off
failed), or the chain reaches the policy's length or share of the whole copy's bytes
(`delta_chain.next_kind`). A restore reads the chain: the whole copy, then each delta in order,
every checksum verified first.

`restore` uses the rank's own host copy when it holds `step`, else the keeper's copy of
`source_rank`; it verifies the checksum and copies in place (`memory_copy.apply`). A copy that
is missing, damaged or does not fit raises `MemoryCopyError` (a CheckpointError), and the
caller restores the durable DCP checkpoint, with a warning.

Where the copies live: in the Ray object store, as objects the keeper owns (state_keeper.py).
The rank's background thread hands the copy to the keeper (the call puts it into the object
store once), and the keeper puts it again as its own object, on the driver's node, keeping only
the reference and the metadata. Its cost beside the durable saves (blocking, background,
restore) is measured by `ettflow/bench/memory_tier.py`; BENCHMARKS.md has the numbers.
The options it was chosen over:
- the rank's own object (`ray.put` in the rank): one copy, but Ray frees an object when its
  owner dies, which is the case the tier exists for; `ray.put(_owner=keeper)`, which gave the
  keeper the rank's object in one copy, was removed in Ray 2.56;
- the keeper holding the bytes in its heap: the same two copies at save time (its hand-off
  took 0.146 s and 0.248 s in two runs), and a third at every restore (out of the heap into
  the object store again);
- peer replication (each rank holds a peer's copy): every save crosses the training network,
  a restore needs that peer alive, the pairing must be rebuilt whenever the group changes, and
  with 2 ranks one death leaves a single copy of each, inside the survivor;
- a file in /dev/shm the rank maps: one copy, but it outlives everything, a SIGKILLed driver
  included (host memory leaks until someone deletes it), and only that node can read it.
What survives what: a rank process's death, SIGKILL included, and its node's (the keeper owns
the object, on the driver's node); not the driver's death (the keeper dies with it, and the
durable checkpoint covers it). A hand-off still in flight when the rank dies is lost: the
keeper holds the rank's previous copy, and `latest_common` names a step every rank has.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ettflow.trainer.checkpoint.delta import DeltaUnsupported, apply_delta, apply_own, capture_delta, own_tensors
from ettflow.trainer.checkpoint.delta_chain import ChainPolicy, Link, next_kind
from ettflow.trainer.checkpoint.memory_copy import (
    CopyMeta,
    HostCopy,
    MemoryCopyError,
    apply,
    byte_view,
    layout_of,
    local_tensors,
    tensors_of,
)
from ettflow.trainer.checkpoint.state import TrainState

if TYPE_CHECKING:
    from ettflow.trainer.checkpoint.chain_resume import ChainResume
    from ettflow.trainer.checkpoint.state_keeper import KeeperHandle

__all__ = ["MemoryCopyError", "MemorySaveResult", "MemoryTier", "apply", "local_tensors"]
log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class MemorySaveResult:
    """The background part of a memory save (`memory_save_background`): checksum and hand-off.

    start/end: epoch seconds; ok: the keeper holds the copy; error: why not (ok False)."""

    step: int
    rank: int
    nbytes: int
    start: float
    end: float
    ok: bool
    checksum: str | None = None
    error: str | None = None
    kind: str = "base"  # "delta": a delta copy on the rank's previous one

    @property
    def background_s(self) -> float:
        return self.end - self.start


class MemoryTier:
    """A rank's side of the in-memory tier (see the module docstring).

    keeper: the run's StateKeeper handle (`state_keeper.find_keeper(run_id)`).
    on_done: called with each MemorySaveResult, from the background thread."""

    def __init__(self, keeper: KeeperHandle, rank: int, world_size: int, *,
                 on_done: Callable[[MemorySaveResult], None] | None = None, policy: ChainPolicy | None = None) -> None:
        for name, value in (("rank", rank), ("world_size", world_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"MemoryTier {name} must be an int >= 0, got {value!r}")
        if not rank < world_size:
            raise ValueError(f"MemoryTier rank {rank} is not below world_size {world_size}")
        self.keeper, self.rank, self.world_size = keeper, rank, world_size
        self._on_done = on_done
        self._host = HostCopy(pin=torch.accelerator.is_available())
        # this rank's newest copy and the copies it applies to: a whole copy (in _host), then
        # each delta on it, in order (empty: none)
        self._chain: list[tuple[CopyMeta, dict[str, torch.Tensor]]] = []
        self.policy = policy  # when a copy may be a delta (`save(..., touched=...)`); None: whole copies only
        self._keeper_has_head = False  # the keeper holds the newest copy: a delta may build on it
        self._executor = ThreadPoolExecutor(1, "ettflow-memory")
        self._pending: Future[MemorySaveResult] | None = None
        self._closed = False
        self.corrupt_copies = False  # the scripted `corrupt` fault: the keeper stores this rank's copies damaged

    @property
    def local_step(self) -> int | None:
        """The step of this rank's own host copy (None: none yet)."""
        return self._chain[-1][0].step if self._chain else None

    @property
    def last_kind(self) -> str | None:
        """"delta" or "base" (a whole copy): what the newest copy is (None: none yet)."""
        return None if not self._chain else ("delta" if self._chain[-1][0].parent is not None else "base")

    def save(self, step: int, train_state: TrainState, *, touched: Mapping[str, torch.Tensor] | None = None,
             resume: ChainResume | None = None) -> float:
        """Copy the rank's state at `step` into host memory; returns the seconds the caller was
        blocked (finishing the previous hand-off, then the copy). `touched` (table FQN -> the
        rows looked up since this rank's previous copy, `delta.touched_rows`; None: not known):
        the copy may be a delta on the previous one (`policy`; see `_kind`). `resume`: what the
        durable chain goes on from when this copy is restored (`chain_resume.py`), kept beside it."""
        if self._closed:
            raise MemoryCopyError("MemoryTier.save after close()")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        start = time.perf_counter()
        self.wait()
        cursor = json.loads(train_state.cursor_json())
        if self._kind(step, touched) == "delta":
            try:
                meta, host = self._capture_delta(step, train_state, touched or {}, cursor)
                meta = replace(meta, resume=resume)
            except DeltaUnsupported as exc:
                log.warning("in-memory copies are whole from now on (rank %d): %s", self.rank, exc)
                self.policy = None
            else:
                self._chain.append((meta, host))
                self._pending = self._executor.submit(self._hand_off, meta, host)
                return time.perf_counter() - start
        tensors = local_tensors(train_state, step=step, rank=self.rank)
        self._chain = []  # the buffers are being overwritten
        host = self._host.capture(tensors)
        meta = CopyMeta(step=step, rank=self.rank, world_size=self.world_size, cursor=cursor,
                        nbytes=sum(t.nbytes for t in host.values()), layout=layout_of(host), resume=resume)
        self._chain = [(meta, host)]
        self._pending = self._executor.submit(self._hand_off, meta, host)
        return time.perf_counter() - start

    def _kind(self, step: int, touched: Mapping[str, torch.Tensor] | None) -> str:
        """A delta when the rows touched since the previous copy are known, that copy is this
        rank's newest and the keeper holds it (a failed hand-off breaks the keeper's chain), and
        the chain policy allows another delta (`delta_chain.next_kind`, on the chain's bytes)."""
        if touched is None or self.policy is None or not self._chain or not self._keeper_has_head \
                or self._chain[-1][0].step >= step:
            return "base"
        links = [Link(step=m.step, kind="base" if m.parent is None else "delta", parent=m.parent, bytes=m.nbytes)
                 for m, _ in self._chain]
        last = links[-1].bytes if links[-1].kind == "delta" else 0
        kind, _ = next_kind(links, links[-1].step, last, anchor=False, policy=self.policy)
        return kind

    def _capture_delta(self, step: int, train_state: TrainState, touched: Mapping[str, torch.Tensor],
                       cursor: dict) -> tuple[CopyMeta, dict[str, torch.Tensor]]:
        """The delta copy of `step` on the chain's newest: the touched rows of every table with
        their optimizer state, the dense state whole, and the rank's step, cursor and RNG
        (`delta.capture_delta`, `own_tensors`), in host memory."""
        tensors, delta_meta = capture_delta(train_state.model, train_state.optimizers, touched)
        tensors.update(own_tensors(train_state, step))
        host = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        meta = CopyMeta(step=step, rank=self.rank, world_size=self.world_size, cursor=cursor,
                        nbytes=sum(t.nbytes for t in host.values()), layout=layout_of(host),
                        parent=self._chain[-1][0].step, delta=delta_meta)
        return meta, host

    def _hand_off(self, meta: CopyMeta, host: dict[str, torch.Tensor]) -> MemorySaveResult:
        """Background: checksum, then the hand-off (the keeper keeps an object of its own)."""
        import ray

        start = time.time()
        arrays = [byte_view(t) for t in host.values()]
        meta = meta.with_checksum(arrays)
        try:
            evicted = ray.get(self.keeper.store.remote(meta, arrays, corrupt=self.corrupt_copies))
            ok = meta.step not in evicted  # (a keeper that dropped it at once holds no head to build on)
            error = None if ok else f"the keeper evicted the copy of step {meta.step} as it stored it"
        except Exception as e:  # noqa: BLE001 - the keeper is gone or refused: reported, not raised
            ok, error = False, f"{type(e).__name__}: {e}"
            from ray.exceptions import RayActorError

            gone = ("the run's in-memory checkpoint keeper is gone (its actor died): a failure restores from the "
                    "durable checkpoint; " if isinstance(e, RayActorError) else "")
            log.warning("%sin-memory copy of rank %d at step %d not handed to the keeper: %s",
                        gone, self.rank, meta.step, error)
        result = MemorySaveResult(step=meta.step, rank=self.rank, nbytes=meta.nbytes, start=start, end=time.time(),
                                  ok=ok, checksum=meta.checksum, error=error,
                                  kind="base" if meta.parent is None else "delta")
        if self._on_done is not None:
            try:
                self._on_done(result)
            except Exception:  # the callback's bug must not fail the save
                log.exception("memory tier on_done callback failed for step %d", meta.step)
        return result

    @property
    def in_flight(self) -> bool:
        """A hand-off is still running in the background."""
        return self._pending is not None and not self._pending.done()

    def wait(self) -> MemorySaveResult | None:
        """Finish the pending hand-off; returns its result (None if there was none). A failed
        hand-off is not raised: its result has ok=False."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        result = pending.result()
        for i, (meta, host) in enumerate(self._chain):
            if meta.step == result.step:
                self._chain[i] = (replace(meta, checksum=result.checksum), host)
        self._keeper_has_head = result.ok and bool(self._chain) and self._chain[-1][0].step == result.step
        return result

    def latest_common(self) -> int | None:
        """The newest step the keeper holds for every rank of this world size."""
        import ray

        return ray.get(self.keeper.latest_common.remote(self.world_size))

    def restore(self, train_state: TrainState, step: int, *, source_rank: int | None = None) -> dict[str, Any]:
        """Restore `train_state` in place from the copy of `source_rank` (default: this rank)
        at `step`: this rank's host copy when it holds it, else the keeper's. Raises
        MemoryCopyError when the copy is missing, damaged or does not fit. Returns what was
        restored: {"where": "local"|"keeper", "source_rank", "step", "cursor", "nbytes",
        "deltas", "fetch_s", "verify_s", "apply_s", "resume"} (`resume`: the copy's record for
        the durable chain, or None)."""
        source = self.rank if source_rank is None else source_rank
        self.wait()
        start = time.perf_counter()
        if source == self.rank and self._chain and self._chain[-1][0].step == step:
            where = "local"
            chain = [(meta, [byte_view(t) for t in host.values()]) for meta, host in self._chain]
        else:
            where, chain = "keeper", self._fetch(source, step)
        fetched = time.perf_counter()
        for meta, arrays in chain:  # every copy checked before anything is applied
            meta.verify(arrays)
        (first, _), (meta, _) = chain[0], chain[-1]
        if meta.world_size != self.world_size or meta.rank != source or meta.step != step or first.parent is not None:
            raise MemoryCopyError(f"the copy asked for (rank {source} of {self.world_size}, step {step}) is "
                                  f"rank {meta.rank} of {meta.world_size}, step {meta.step}"
                                  + (" on a delta, not a whole copy" if first.parent is not None else ""))
        verified = time.perf_counter()
        restored_step, cursor = apply(train_state, tensors_of(first.layout, chain[0][1]), rank=self.rank)
        for meta, arrays in chain[1:]:
            # copies: a dense optimizer's load_state_dict keeps the tensors it is given, and these
            # are the copy's own bytes (the keeper's read-only objects, this rank's chain)
            tensors = {k: v.clone() for k, v in tensors_of(meta.layout, arrays).items()}
            try:
                apply_delta(train_state.model, train_state.optimizers, tensors, meta.delta or {})
                apply_own(train_state, tensors)
            except Exception as exc:  # noqa: BLE001 - any misfit: every rank restores the durable checkpoint
                raise MemoryCopyError(f"the delta copy of rank {source} at step {meta.step} does not fit this "
                                      f"model: {type(exc).__name__}: {exc}") from exc
            restored_step, cursor = train_state.step, train_state.cursor
        return {"where": where, "source_rank": source, "step": restored_step, "cursor": cursor,
                "nbytes": sum(m.nbytes for m, _ in chain), "deltas": len(chain) - 1, "fetch_s": fetched - start,
                "verify_s": verified - fetched, "apply_s": time.perf_counter() - verified,
                "resume": chain[-1][0].resume}

    def _fetch(self, rank: int, step: int) -> list[tuple[CopyMeta, list[np.ndarray]]]:
        import ray
        from ray.exceptions import RayError

        try:
            found = ray.get(self.keeper.fetch.remote(rank, step))
            if found is None:
                held = ray.get(self.keeper.steps.remote(rank))
                raise MemoryCopyError(f"the keeper holds no copy of rank {rank} at step {step} (it holds steps "
                                      f"{held}), or not every copy its chain of deltas needs")
            chain = [(meta, ray.get(refs[0])) for meta, refs in found]
        except RayError as e:  # the keeper died, or the copy's node did
            raise MemoryCopyError(f"the in-memory copy of rank {rank} at step {step} is unreachable: "
                                  f"{type(e).__name__}: {e}") from e
        for meta, arrays in chain:
            if not isinstance(arrays, list) or not all(isinstance(a, np.ndarray) and a.dtype == np.uint8
                                                       for a in arrays):
                raise MemoryCopyError(f"the keeper's copy of rank {rank} at step {step} is not a list of uint8 arrays")
            if not isinstance(meta, CopyMeta):
                raise MemoryCopyError(f"the keeper's copy of rank {rank} at step {step} has no CopyMeta "
                                      f"({type(meta).__name__})")
        return chain

    def close(self) -> None:
        """Finish the pending hand-off and free the host buffers (the keeper keeps its copies)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self._chain, self._host.buffers = [], {}

    def __enter__(self) -> MemoryTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
