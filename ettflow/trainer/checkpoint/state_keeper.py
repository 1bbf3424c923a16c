"""The keeper of a run's in-memory checkpoint copies: it outlives the ranks that saved them.

One keeper per run, started by the driver (`start_keeper`): a Ray actor with no CPU, on the
driver's node, named `ettflow-keeper-<run_id>` so a rank (or a spare) finds it by the run id
(`find_keeper`). It is owned by the driver and dies with it (never detached, never restarted:
a new keeper would hold nothing, and the durable DCP checkpoint covers that case).

The copies live in the Ray object store, as objects the keeper owns. A rank hands its copy to
`store` (the call puts it into the object store, as an object the rank owns); the keeper puts
it again, as its own object, and keeps that reference until the copy is evicted (the newest
`KEEP` per rank stay). Ray keeps an object while its owner lives, so the copy survives the
rank that saved it (the rank's own object goes with the rank). The keeper runs on the driver's
node, so its objects are there: a rank's node may die too; the driver's node may not (the
durable checkpoint covers that). Ray 2.56 removed `ray.put(_owner=...)`, which would have let
the rank put an object the keeper owns in one copy.

A copy is whole, or (`CopyMeta.parent`) a delta on the rank's copy of an earlier step: the rows
touched since, as `delta.capture_delta` takes them for the durable delta checkpoints. A restore
reads the chain (`fetch`), whole copy first; eviction keeps every copy a kept one needs.

`CopyIndex` is the pure bookkeeping (newest copies per rank, their chains, the newest step every
rank can restore);
`StateKeeper` is the actor around it. Metadata is a `memory_copy.CopyMeta` (frozen, with the
copy's checksum), the payload a list of uint8 arrays: nothing else crosses to or from the keeper.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from typing import TypeAlias

    from ray.actor import ActorHandle

    KeeperHandle: TypeAlias = ActorHandle["StateKeeper"]  # a run's keeper, as start_keeper returns it

KEEP = 2  # copies kept per rank: the newest, and the one before it (the newest may be one rank short)
NAME_PREFIX = "ettflow-keeper-"
HAND_OFFS = 8  # the keeper's threads: ranks whose hand-offs run side by side


class KeptMeta(Protocol):
    """What the index reads of a copy's metadata (`memory_copy.CopyMeta` has it)."""

    @property
    def rank(self) -> int: ...

    @property
    def step(self) -> int: ...

    @property
    def world_size(self) -> int: ...


def keeper_name(run_id: str) -> str:
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id must be a non-empty str, got {run_id!r}")
    return f"{NAME_PREFIX}{run_id}"


def pooled_keeper_name(model: str) -> str:
    """The Ray name of a keeper a warm pool starts ahead of `model`'s next run (no run yet: the
    run that takes it names it in its warnings, `ray list actors` shows it)."""
    return f"{NAME_PREFIX}pool-{model or 'model'}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class NamedKeeper:
    """A keeper actor and its Ray name: a run's own (`keeper_name`), or one a warm pool started
    and hands to a run (`pooled_keeper_name`), whose warnings give that name."""

    actor: KeeperHandle
    name: str


@dataclass(kw_only=True)
class CopyIndex:
    """Which copies a keeper holds, by (rank, step); keeps the newest `keep` per rank.

    Entries are (meta, payload); the index never looks into the payload. A copy's world size
    is part of its meta: `latest_common` counts only copies of the world size asked for."""

    keep: int = KEEP
    copies: dict[int, dict[int, tuple[KeptMeta, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1:
            raise ValueError(f"CopyIndex.keep must be an int >= 1, got {self.keep!r}")

    def store(self, meta: KeptMeta, payload: Any) -> list[int]:
        """Add (or replace) the copy of meta's (rank, step); returns the steps evicted: the rank's
        copies of later steps (another timeline), and all but the newest `keep` and the copies
        their chains need (a delta copy keeps its parent, down to its whole copy:
        `delta_chain.needed`)."""
        from ettflow.trainer.checkpoint.delta_chain import needed

        rank, step = meta.rank, meta.step
        mine = self.copies.setdefault(rank, {})
        # a rank's copies come in step order within a timeline; a lower step means it was
        # restored to an earlier one (a durable fallback): its copies past that step belong to
        # the abandoned timeline, and keeping them as "the newest" would evict this one
        stale = [s for s in mine if s > step]
        for old in stale:
            del mine[old]
        mine[step] = (meta, payload)
        kept = needed(self._links(rank).values(), sorted(mine)[-self.keep:])
        older = [s for s in mine if s not in kept]
        for old in older:
            del mine[old]
        return sorted([*stale, *older])

    def _links(self, rank: int) -> dict[int, Any]:
        """The rank's copies as `delta_chain.Link`s, by step."""
        from ettflow.trainer.checkpoint.delta_chain import Link

        out = {}
        for step, (meta, _) in self.copies.get(rank, {}).items():
            parent = getattr(meta, "parent", None)
            out[step] = Link(step=step, kind="base" if parent is None else "delta", parent=parent)
        return out

    def get(self, rank: int, step: int) -> tuple[KeptMeta, Any] | None:
        return self.copies.get(rank, {}).get(step)

    def chain(self, rank: int, step: int, links: dict[int, Any] | None = None) -> list[tuple[KeptMeta, Any]] | None:
        """The copies a restore of rank's `step` reads, whole copy first, then each delta on it
        in order; None when the keeper lacks any of them (`links`: `_links(rank)`, if at hand)."""
        from ettflow.trainer.checkpoint.delta_chain import chain_of

        mine = self.copies.get(rank, {})
        try:
            found = chain_of(self._links(rank) if links is None else links, step)
        except KeyError:
            return None
        return [mine[link.step] for link in found]

    def steps(self, rank: int) -> list[int]:
        return sorted(self.copies.get(rank, {}))

    def latest_common(self, world_size: int) -> int | None:
        """The newest step that every rank 0..world_size-1 can restore (its copy and every copy
        its chain needs held, written by `world_size` ranks); None when there is none."""
        common: set[int] | None = None
        for rank in range(world_size):
            links = self._links(rank)
            held = {s for s, (meta, _) in self.copies.get(rank, {}).items()
                    if meta.world_size == world_size and self.chain(rank, s, links) is not None}
            common = held if common is None else common & held
        return max(common) if common else None

    def inventory(self) -> dict[int, list[int]]:
        """{rank: [steps held, oldest first]}."""
        return {rank: sorted(held) for rank, held in sorted(self.copies.items()) if held}


class StateKeeper:
    """The Ray actor (`start_keeper` builds it): a `CopyIndex` of (meta, [object ref]).

    A threaded actor: the ranks' hand-offs (each a copy into the object store) run side by
    side; the index itself is read and changed under one lock."""

    def __init__(self, keep: int = KEEP) -> None:
        self.index = CopyIndex(keep=keep)
        self._lock = threading.Lock()

    def store(self, meta: KeptMeta, arrays: list[Any], *, corrupt: bool = False) -> list[int]:
        """Keep a copy. `arrays` arrive as read-only views of the object the rank's call put into
        the object store (owned by the rank: it goes when the rank does); the keeper puts them
        again, as an object of its own, and keeps that reference. Returns the evicted steps.
        `corrupt`: the scripted `corrupt` fault (see `corrupt`), applied before the copy is
        visible, so no restore ever sees it intact."""
        import numpy as np
        import ray

        if not isinstance(arrays, list) or not all(isinstance(a, np.ndarray) and a.dtype == np.uint8 for a in arrays):
            raise TypeError("StateKeeper.store: the payload must be a list of uint8 arrays")
        ref = ray.put(_flipped(arrays) if corrupt else arrays)
        with self._lock:
            return self.index.store(meta, [ref])

    def fetch(self, rank: int, step: int) -> list[tuple[KeptMeta, list[Any]]] | None:
        """The chain of rank's copy at step: [(meta, [payload ref]), ...], its whole copy first
        and then each delta on it (one entry: a whole copy); None when the keeper lacks any."""
        with self._lock:
            return self.index.chain(rank, step)

    def steps(self, rank: int) -> list[int]:
        with self._lock:
            return self.index.steps(rank)

    def latest_common(self, world_size: int) -> int | None:
        with self._lock:
            return self.index.latest_common(world_size)

    def inventory(self) -> dict[int, list[int]]:
        with self._lock:
            return self.index.inventory()

    def corrupt(self, rank: int, step: int) -> None:
        """Fault injection for tests (like the scripted faults of `trainer/faults.py`): replace
        the stored bytes of rank's copy at step with the same bytes, one bit flipped in the
        largest array, keeping the metadata and its checksum; restoring it must then fail."""
        import ray

        with self._lock:
            meta, refs = self.index.copies[rank][step]
            self.index.copies[rank][step] = (meta, [ray.put(_flipped(ray.get(refs[0])))])

    def ping(self) -> str:
        return "ok"


def _flipped(arrays: list[Any]) -> list[Any]:
    """A copy of `arrays` with one bit flipped in the middle of the largest (fault injection)."""
    import numpy as np

    out = [np.array(a, copy=True) for a in arrays]
    biggest = max(range(len(out)), key=lambda i: out[i].size)
    out[biggest][out[biggest].size // 2] ^= 1
    return out


def start_keeper(run_id: str | None, *, keep: int = KEEP, wait: bool = True, name: str | None = None) -> KeeperHandle:
    """The driver's call: the run's keeper actor, started on this node (this process owns it;
    an existing keeper of the run is reused; run_id None: a keeper started ahead of a run by the
    warm pool, named `name`, `pooled_keeper_name`). Returns its ActorHandle once it answers (`wait=False`: at once,
    while its process starts; calls to it wait for it).

    Hold the handle for as long as the run may restore from memory: Ray ends a (non-detached)
    actor when the last handle of its owner goes, its name notwithstanding."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    named = {"name": keeper_name(run_id), "get_if_exists": True} if run_id is not None else \
        ({"name": name} if name else {})
    handle = ray.remote(StateKeeper).options(
        **named, num_cpus=0, max_restarts=0, max_concurrency=HAND_OFFS,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
    ).remote(keep)
    if wait:
        ray.get(handle.ping.remote())
    return handle


def find_keeper(run_id: str) -> KeeperHandle:
    """A rank's or a spare's call: the handle of the run's keeper (ValueError: none is running)."""
    import ray

    return ray.get_actor(keeper_name(run_id))
