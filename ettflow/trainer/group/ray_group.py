"""The real worker group: N Ray actors reserved together through a placement group.

One bundle per rank ({CPU: threads} or {CPU, GPU: 1}), so the group starts whole or waits
whole; the wait is the run's scheduling phase. On a GPU placement with live recovery one more
bundle holds the warm spare's device (when the cluster has room for it; else every failure
restarts every rank, and the in-memory tier, which only a live recovery reads, is off). The
actors form their groups (trainer/collectives.py: training on gloo on CPU, nccl on GPU).
Actors never restart on their own (max_restarts=0): the driver decides, and a new attempt
restores from the checkpoint (or a live recovery from the in-memory tier, live_recovery.py).
A rank's outcome is a typed `Failure`, mapped from the exception's type (`classify.py`).
`info` holds each rank's pid and node (a test or an operator can signal a rank by it).
The ranks get the run's config less the scripted faults that already fired (`pending_faults`).

Placement (`trainer/placement.py`): the bundles use the run's strategy (PACK, SPREAD, STRICT_SPREAD).
A restart asks for fewer ranks when the live nodes cannot hold `world_size` and the run allows
it (`min_world_size`); while its placement waits, the live nodes are read again every
`RECHECK_S`, so a node that dies (or comes back) during the wait changes what is asked for.
The wait is bounded by `capacity_wait_s`. A rank whose process died on a node the cluster lists
as dead is the node's failure, with the node named (`classify.on_lost_node`); one the cluster's
pool started, lost after that pool died, is its owner's (`classify.on_lost_owner`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ettflow.ett.failures import Failure, FailureClass, FailureError
from ettflow.ett.spool import SpoolWriter
from ettflow.trainer.checkpoint.state_keeper import NamedKeeper, keeper_name, start_keeper
from ettflow.trainer.classify import failure_from_exception, is_process_loss, on_lost_node, on_lost_owner
from ettflow.trainer.compile.process_cache import has_archive
from ettflow.trainer.config import TrainerConfig
from ettflow.trainer.faults import pending_faults
from ettflow.trainer.group.durable_audit import DurableAudit
from ettflow.trainer.group.restore_choice import choose_restore_point, newest_committed, restart_point
from ettflow.trainer.group.spare_pool import SparePool
from ettflow.trainer.group.stop_request import note_stop, stop_noted
from ettflow.trainer.group.warm_pool import POOL, WarmPool, record_start, service_lost
from ettflow.trainer.placement import SpareBundles, attempt_world_size, ranks_that_fit
from ettflow.trainer.protocol import MEMORY, PollStatus, RankResult, RestorePoint, StartSample, WorkerInfo

if TYPE_CHECKING:
    from ettflow.ett.spare_sizing import SpareDecision, SpareShare
    from ettflow.trainer.checkpoint.state_keeper import KeeperHandle
    from ettflow.trainer.group.pool_service import PoolHandle

log = logging.getLogger("ettflow.trainer")
RECHECK_S = 1.0  # while a placement waits: how often the live nodes are read again
# the warm pool prepares, beside the next run's ranks, its spare and the spare's successor: the
# spare that replaces it after a hand-off is then taken prewarmed from the pool, so a second
# failure soon after the first finds it ready (one started only after the hand-off prepares
# while the ranks train, and is seconds late)
SPARES_AHEAD = 2
SPARE_NOTE = ", one for the spare"
SPARE_WAIT_S = 10.0  # a GPU placement waits this long for its spare's bundle, then starts without it
PARK_TIMEOUT_S = 10.0  # live recovery: how long the survivors of a failure may take to park


@dataclass(frozen=True)
class RayConnection:
    """How this process came to Ray: `joined` a cluster someone keeps running (RAY_ADDRESS:
    `ettflow up`'s head, a cluster's), `started` a local Ray of its own (on the clock of the
    run that needed it), or was `already` connected. `seconds`: what that took."""

    how: Literal["joined", "started", "already"]
    address: str
    seconds: float

    @property
    def started(self) -> bool:
        return self.how == "started"


def ensure_ray(num_cpus: int | None = None) -> RayConnection:
    """Join RAY_ADDRESS when set, else start a local Ray sized for this machine (always a new
    one: `address="local"`, so a cluster someone else started on this host is never joined by
    accident)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return RayConnection("already", _gcs_address(), 0.0)
    address = os.environ.get("RAY_ADDRESS")
    t0 = time.monotonic()
    with _keep_sigterm_handler():
        if address:
            ray.init(address=address, log_to_driver=True)
        else:
            ray.init(address="local", num_cpus=num_cpus or max(os.cpu_count() or 1, 4), include_dashboard=False,
                     log_to_driver=True)
    if address:
        joined = RayConnection("joined", address, time.monotonic() - t0)
        POOL.attach_cluster()  # a cluster that outlives this process: its pool serves every run
        return joined
    global _OWN_LOCAL_RAY
    _OWN_LOCAL_RAY = True
    return RayConnection("started", _gcs_address(), time.monotonic() - t0)


# this process started the Ray it uses (no RAY_ADDRESS): that Ray's GCS and raylet are its
# children, in its process group, and a Prefect worker's stop (a signal to the whole group)
# takes them down with it
_OWN_LOCAL_RAY = False


def local_ray_going() -> bool:
    """Whether this process is being stopped (`stop_request.stop_noted`) together with the local
    Ray it started: any call that needs that Ray's GCS (a placement group's removal, a named
    actor, the nodes) would wait for a GCS that is gone, until the worker's SIGKILL. What needs
    none still runs."""
    return _OWN_LOCAL_RAY and stop_noted()


@contextlib.contextmanager
def _keep_sigterm_handler():
    """`ray.init` replaces the driver's SIGTERM handling: a Python handler that exits, under
    a native one that logs and later aborts the process (a SIGTERM of `ettflow refresh` ended
    its worker by SIGABRT, exit 134, with a bare `SystemExit` in the train task). The handler
    the process had (Prefect's, which raises `TerminationSignal` so the flow run crashes in
    order and the driver preempts its ranks) is put back. Only the main thread can."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _gcs_address() -> str:
    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:  # noqa: BLE001 - only for the record
        return "?"


# The keepers of the runs this process drives, held for the run's life: Ray ends an actor that
# no handle refers to, and each attempt's group is dropped when the attempt ends. With each, its
# Ray name (a pooled keeper's is the pool's, `state_keeper.pooled_keeper_name`).
_KEEPERS: dict[str, NamedKeeper] = {}
# each run's check of its durable tier while the memory tier serves (durable_audit.py): across
# attempts, so a damaged checkpoint is recorded once
_AUDITS: dict[str, DurableAudit] = {}


# how long the run's end (`end_run`: after the devices' release, before the row is archived) waits
# for a check of its durable tier still running; one that outlasts it writes its marker to the
# spool afterwards, where a later `ettflow archive` finds it
AUDIT_JOIN_S = 5.0


def run_audit(config: TrainerConfig, run_id: str, spool_root: Path | str) -> DurableAudit:
    audit = _AUDITS.get(run_id)
    if audit is None:
        audit = _AUDITS[run_id] = DurableAudit(config.checkpoint_dir, spool_root, run_id)
    return audit


def run_keeper(run_id: str, *, pool: WarmPool | None = None) -> KeeperHandle:
    """The run's in-memory checkpoint keeper (started on first use, kept until `end_run`). Its
    process starts beside the ranks' (nothing waits for it here: a rank's first copy does).
    `pool`: take the one that warm pool started ahead of the run, when it has one."""
    named = _KEEPERS.get(run_id)
    if named is not None and not _alive(named.actor):
        # a dead actor's handle given to the ranks fails every restart (issue 42 #1: the pool's
        # service died, and the keeper it had started with it); its copies are lost with it
        log.warning("the run's in-memory checkpoint keeper (actor %s) died: a new one starts; the copies it held "
                    "are lost (a restart restores the durable checkpoint)", keeper_label(run_id))
        named = None
    if named is None:
        named = _KEEPERS[run_id] = (pool.take_keeper(run_id) if pool is not None else None) \
            or NamedKeeper(start_keeper(run_id, wait=False), keeper_name(run_id))
    return named.actor


def keeper_label(run_id: str) -> str:
    """The Ray name of the run's keeper, as a warning gives it (a pooled one's is the pool's)."""
    named = _KEEPERS.get(run_id)
    return named.name if named is not None else keeper_name(run_id)


def _alive(actor) -> bool:
    """Whether `actor` still exists: a busy one that does not answer in time counts as alive
    (the restore point's own query decides what it holds, `_memory_step`)."""
    try:
        ray.get(actor.ping.remote(), timeout=PARK_TIMEOUT_S)
    except RayActorError:
        return False
    except GetTimeoutError:
        return True
    return True


def end_run(run_id: str, pool: WarmPool = POOL, *, spool_root: Path | str | None = None, attempt: int = 0) -> None:
    """Free what a run keeps across its attempts (its in-memory checkpoint keeper); what it took
    from the cluster's pool is stopped, so the pool no longer watches it. With `spool_root`, the
    run's parts of the spares the pool held for its model's training runs are recorded as its
    own (`spare_start`, in `attempt`: capacity held for it, `ett.capacity`)."""
    left = pool.unshare(run_id) if spool_root is not None else None
    if left is not None and left.holds:
        with contextlib.suppress(OSError), SpoolWriter(spool_root, run_id, attempt, -1) as rec:
            for h in left.holds:
                rec.record("spare_start", h.start, h.end, **h.to_attrs())
    pool.forget(run_id)
    named = _KEEPERS.pop(run_id, None)
    audit = _AUDITS.pop(run_id, None)
    if audit is not None:  # its marker belongs in the run's row, archived after this
        audit.join(AUDIT_JOIN_S)
    if named is None or not ray.is_initialized():
        return
    with contextlib.suppress(Exception):
        ray.kill(named.actor, no_restart=True)


def wants_gpu(config: TrainerConfig) -> bool:
    if config.device == "cpu":
        return False
    gpus = ray.cluster_resources().get("GPU", 0)
    if config.device == "cuda" and gpus < config.world_size:
        raise RuntimeError(
            f"device='cuda' needs {config.world_size} GPUs in the Ray cluster, it has {gpus:g}; "
            "use device='auto' or 'cpu', or a smaller world_size"
        )
    return gpus >= config.world_size


def live_nodes() -> dict[str, dict]:
    """The cluster's live nodes by id: {"address", "port" (its raylet's), "resources" (totals)}."""
    return {n["NodeID"]: {"address": n.get("NodeManagerAddress", "?"), "port": n.get("NodeManagerPort"),
                          "resources": dict(n.get("Resources", {}))}
            for n in ray.nodes() if n.get("Alive")}


RAYLET_PROBE_S = 1.0  # how long a listed node's raylet may take to accept a connection


def raylet_refuses(node: dict) -> bool:
    """The node's raylet refuses connections: it is gone though the GCS still lists the node
    (its health checks declare a node dead only after several missed periods, 15 s by Ray's
    default, while its ranks' deaths reach the driver at once). A connection that times out
    is no proof (a loaded host): the node keeps its listing."""
    if not node.get("port"):
        return False
    try:
        with socket.create_connection((node["address"], int(node["port"])), timeout=RAYLET_PROBE_S):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


class RayWorkerGroup:
    def __init__(self, config: TrainerConfig, run_id: str, attempt: int, spool_root: Path | str,
                 *, actor_cls: type, reserve_timeout_s: float | None = None, pool: WarmPool = POOL,
                 next_run_at: Callable[[], float | None] | None = None,
                 spare_share: SpareShare | None = None) -> None:
        """`actor_cls`: the rank's actor class (`trainer.rank.actor.TrainerActor`; passed in: the
        driver's side never imports the rank's); `reserve_timeout_s`: the bound on the
        placement's wait (default: the run's `placement.capacity_wait_s`); `pool`: the warm pool
        ranks, spares and keeper are taken from and a finished run fills (this process's);
        `next_run_at`: asked at the end, when the run's deployment runs next (None: unscheduled).
        `spare_share`: the run's share in its model's spares (`ett.spare_sizing.SpareShare`): on a
        CPU placement of a cluster with a pool, the pool holds the spares the model's training
        runs pay for together and the run none of its own; None: the run holds what it decided."""
        self.config, self.run_id, self.attempt, self.actor_cls = config, run_id, attempt, actor_cls
        self.pool, self.next_run_at, self.spare_share = pool, next_run_at, spare_share
        self.spool_root = str(spool_root)
        self.reserve_timeout_s = config.placement.capacity_wait_s if reserve_timeout_s is None else reserve_timeout_s
        self.world_size = config.world_size  # this attempt's ranks: fewer on an elastic restart
        self.pg = None
        self.released_at: float | None = None  # when teardown gave the devices back (`driver.ReleasingGroup`)
        self.actors: list = []
        self.info: list[WorkerInfo] = []
        self.refs: dict = {}
        self.keeper = None  # the run's in-memory checkpoint keeper (memory_checkpoint)
        self.spares: SparePool | None = None  # live recovery (a spare, on GPU in a bundle of its own)
        self.joining: int | None = None  # the rank a spare took (live recovery)
        self.finished: set[int] = set()  # ranks whose training returned
        # the anchor a finished rank named (rank 0's; with release-before-seal, where the driver seals
        # it): the next run's likely parent, which the pool's workers stage for it (staged_anchor.py)
        self.anchored: str | None = None
        self.preempting = False  # `preempt` was called: the ranks end because they were told to
        self.gpu = False  # the placement holds GPUs (no warm pool; the spare in a bundle)
        self.bundles = SpareBundles.plan(0, spare=False)  # a GPU placement's ranks' and spare's bundles
        # the run's start, measured for the pool's hold rule: when its ranks were asked for, how
        # many came from the pool, when each began its training loop (None: not measured, e.g.
        # a live recovery re-ran the loop)
        self.asked_at: float | None = None
        self.pooled_ranks = 0
        self.owner: PoolHandle | None = None  # the cluster's pool that started ranks of this attempt
        self.cluster_owned: set[int] = set()  # ranks whose process it owns (`owner_cause`)
        self.trained_from: dict[int, float] = {}

    @property
    def placement(self) -> tuple[str, ...]:
        """Each rank's Ray node id, by rank (empty before `reserve`)."""
        return tuple(i.node_id for i in self.info)

    def _wanted(self, bundle: dict) -> int:
        nodes = live_nodes()
        fit = ranks_that_fit([n["resources"] for n in nodes.values()], bundle, self.config.placement.strategy)
        return attempt_world_size(self.config.placement, self.config.world_size, fit, restart=self.attempt > 0)

    def _plan_bundles(self, bundle: dict) -> SpareBundles:
        """The ranks' bundles, and a spare's when this GPU placement keeps one in a bundle of
        its own and the live nodes can hold it beside the ranks."""
        spare = self.gpu and self.config.holds_spare
        if spare and ranks_that_fit([n["resources"] for n in live_nodes().values()], bundle,
                                    self.config.placement.strategy) <= self.world_size:
            log.warning("attempt %d: no room for a GPU spare beside %d ranks: a failure restarts every rank",
                        self.attempt, self.world_size)
            spare = False
        return SpareBundles.plan(self.world_size, spare=spare)

    def _placement_group(self, bundle: dict):
        return placement_group([dict(bundle) for _ in range(self.bundles.total)],
                               strategy=self.config.placement.strategy.value)

    @property
    def recovers_live(self) -> bool:
        """A failure can be recovered live: live recovery is on and a spare has a place."""
        return self.config.switches.live_recovery and (not self.gpu or self.bundles.spare is not None)

    def reserve(self) -> None:
        gpu = self.gpu = wants_gpu(self.config)
        bundle = {"CPU": self.config.threads_per_rank, **({"GPU": 1} if gpu else {})}
        deadline = time.monotonic() + self.reserve_timeout_s
        self.world_size = self._wanted(bundle)
        self.bundles = self._plan_bundles(bundle)
        self.pg = self._placement_group(bundle)
        asked_at = time.monotonic()
        while True:
            left = deadline - time.monotonic()
            try:
                ray.get(self.pg.ready(), timeout=max(min(RECHECK_S, left), 0.0))
                break
            except GetTimeoutError as exc:
                if time.monotonic() >= deadline:
                    remove_placement_group(self.pg)  # nothing waits on: the attempt failed
                    self.pg = None
                    raise FailureError(Failure(
                        failure_class=FailureClass.INFRASTRUCTURE, attempt=self.attempt,
                        reason=f"could not reserve {self.bundles.total} x {bundle} ({self.config.placement.strategy}"
                               f"{SPARE_NOTE if self.bundles.spare is not None else ''}) "
                               f"within {self.reserve_timeout_s:g} s: the Ray cluster's live nodes hold "
                               f"{[n['resources'] for n in live_nodes().values()]}; add capacity, raise "
                               "capacity_wait_s, or allow a smaller restart with min_world_size")) from exc
                wanted = self._wanted(bundle)
                if self.bundles.spare is not None and time.monotonic() - asked_at >= SPARE_WAIT_S:
                    # the spare's device is taken elsewhere: the ranks do not wait for it
                    log.warning("attempt %d: no GPU for a spare within %g s: the ranks start without one (a "
                                "failure restarts every rank)", self.attempt, SPARE_WAIT_S)
                    remove_placement_group(self.pg)
                    self.bundles = SpareBundles.plan(self.world_size, spare=False)
                    self.pg = self._placement_group(bundle)
                elif wanted != self.world_size:  # capacity changed while waiting: ask for what fits now
                    remove_placement_group(self.pg)
                    self.world_size = wanted
                    self.bundles = self._plan_bundles(bundle)
                    self.pg = self._placement_group(bundle)
        config = self.attempt_config()
        remote = ray.remote(self.actor_cls)
        requested_at = time.time()
        # the in-memory tier only where something reads it: a live recovery's restore
        if self.config.switches.memory_checkpoint and self.recovers_live:
            self.keeper = run_keeper(self.run_id, pool=self.pool if self.config.switches.warm_pool else None)
        pooled = self.pool.take(config, self._bundle_nodes(), self.run_id) if not gpu else [None] * self.world_size
        self.actors = [
            pooled[rank][0].actor if pooled[rank] is not None else remote.options(
                num_cpus=self.config.threads_per_rank, num_gpus=1 if gpu else 0, max_restarts=0,
                max_concurrency=2,  # a second thread answers calls while `train` runs
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=self.bundles.of_rank[rank]),
            ).remote(config, self.run_id, self.attempt, rank, self.spool_root, requested_at)
            for rank in range(self.world_size)
        ]
        self.info = ray.get([
            a.adopt.remote(config, self.run_id, self.attempt, rank, self.spool_root) if pooled[rank] is not None
            else a.ready.remote() for rank, a in enumerate(self.actors)])
        self._record_pooled(pooled)
        self.asked_at, self.pooled_ranks = requested_at, sum(p is not None for p in pooled)
        # the cluster's pool that gave ranks, kept: the pool forgets a service that failed a call
        self.owner = self.pool.service if any(p is not None for p in pooled) else None
        self.cluster_owned = {r for r, p in enumerate(pooled) if p is not None} if self.owner is not None else set()
        if self.recovers_live:
            self.spares = SparePool(self.config, self.run_id, self.spool_root, actor_cls=self.actor_cls, pool=self.pool,
                                    bundle=(self.pg, self.bundles.spare) if gpu else None)
            if gpu:  # it holds its device from now: its process starts now (its prewarm later)
                self.spares.start()
            elif self.spare_share is not None:
                self._share_spares()

    def _share_spares(self) -> None:
        """Join the model's training runs in the spares the cluster's pool holds for them."""
        shared = self.pool.share_spares(self.spare_share, self.config, self.spool_root, self.actor_cls)
        if shared is None:
            return
        self.spares.shared = shared
        log.info("attempt %d: the cluster pool holds this model's spares: %s", self.attempt, shared.reason)

    @property
    def shared_spares(self) -> SpareDecision | None:
        """The cluster pool's decision on the spares it holds for the model's training runs,
        this run's share included (None: the run holds its own, as its plan decided). The flow
        records it as the run's `spare_plan`, after the reservation's scheduling: a marker
        recorded during the reservation would end the run's wait before it was over."""
        return self.spares.shared if self.spares is not None else None

    def _bundle_nodes(self) -> list[str | None]:
        """Each bundle's node, by rank (None where Ray does not say)."""
        table = ray.util.placement_group_table(self.pg).get("bundles_to_node_id", {})
        return [table.get(self.bundles.of_rank[rank]) for rank in range(self.world_size)]

    def _record_pooled(self, pooled: list) -> None:
        """The ranks a warm pool started before the run: their start, off the clock."""
        taken = [(rank, p) for rank, p in enumerate(pooled) if p is not None]
        if not taken:
            return
        log.info("attempt %d: ranks %s start from the warm pool", self.attempt, [r for r, _ in taken])
        with SpoolWriter(self.spool_root, self.run_id, self.attempt, -1) as rec:
            now = time.time()
            for rank, (worker, timings) in taken:
                record_start(rec, worker, timings, pooled=True, for_rank=rank, taken_at=now)

    def attempt_config(self) -> TrainerConfig:
        """What the ranks get: the run's config at this attempt's world size, less the scripted
        faults that already fired (each fires once per run) or target a rank it does not have."""
        config = pending_faults(self.config, self.spool_root, self.run_id)
        if self.world_size == config.world_size:
            return config
        return replace(config, world_size=self.world_size,
                       failures=tuple(f for f in config.failures if f.rank < self.world_size))

    def launch(self) -> None:
        addr, port = ray.get(self.actors[0].rendezvous.remote())
        point = self._restart_point()
        self.refs = {a.train.remote(addr, port, self.keeper, point): rank for rank, a in enumerate(self.actors)}
        if self.spares is not None and self.spares.held and self._spare_compiles_warm():
            self.spares.prewarm()  # beside the ranks' init: ready for an early failure
        # (else when training starts: a cold compile of its own beside the ranks' would slow theirs)

    def _spare_compiles_warm(self) -> bool:
        """A spare prewarmed now would find the compile-cache archive (or compiles nothing)."""
        sw = self.config.switches
        return not sw.compile or (sw.compile_cache and has_archive(self.config))

    # ---- live recovery (live_recovery.py) -----------------------------------------------
    def training_started(self) -> None:
        """The attempt trains: the warm spare prepares now, if it does not already."""
        if self.spares is not None and self.spares.held:
            self.spares.prewarm()

    def prepare_live(self, failure: Failure, timeout_s: float = PARK_TIMEOUT_S) -> RestorePoint | None:
        """The restore point when this attempt can be recovered live from `failure` (a single
        rank's process lost on a live node, every other rank parked within `timeout_s`, a spare
        pool and a restore point); None: restart every rank (the reason is logged)."""
        why = self._not_live(failure, timeout_s)
        if why is not None:
            log.info("attempt %d: every rank restarts (no live recovery: %s)", self.attempt, why)
            return None
        memory = self._memory_step()
        durable = newest_committed(self.config.checkpoint_dir)
        point = choose_restore_point(memory, *(durable if durable else (None, None)))
        if point is None:
            log.info("attempt %d: every rank restarts (no live recovery: no in-memory copy, no checkpoint)",
                     self.attempt)
        elif point.source == MEMORY and durable is not None:  # recorded in the attempt the recovery starts
            self._audit_durable(self.attempt + 1, point.step)
        return point

    def _restart_point(self) -> RestorePoint | None:
        """A restart of every rank restores the run's in-memory copies when they are newer than
        its durable checkpoint (the keeper outlives the ranks); None: the durable checkpoint."""
        if self.attempt == 0 or self.keeper is None:
            return None
        durable = newest_committed(self.config.checkpoint_dir)
        point = restart_point(self._memory_step(), durable[0] if durable else None)
        if point is not None:
            log.info("attempt %d: every rank restores the in-memory copy of step %d (the durable checkpoint is %s)",
                     self.attempt, point.step, f"step {durable[0]}" if durable else "none")
            if durable is not None:
                self._audit_durable(self.attempt, point.step)
        return point

    def _audit_durable(self, attempt: int, served_step: int) -> None:
        """A recovery the memory tier serves does not read the durable tier: verify it aside
        (durable_audit.py), once per run for each damaged folder."""
        run_audit(self.config, self.run_id, self.spool_root).start(attempt, served_step)

    def _memory_step(self) -> int | None:
        """The newest step every rank holds in the in-memory tier; None when there is none, or
        when the run's keeper is gone (named in the log: the durable checkpoint is used)."""
        if self.keeper is None:
            return None
        try:
            return ray.get(self.keeper.latest_common.remote(self.world_size), timeout=PARK_TIMEOUT_S)
        except (GetTimeoutError, RayActorError, RayTaskError) as exc:
            log.warning("attempt %d: the run's in-memory checkpoint keeper (actor %s) is gone or not answering "
                        "(%s): the restore point is the durable checkpoint", self.attempt, keeper_label(self.run_id),
                        type(exc).__name__)
            return None

    def _not_live(self, failure: Failure, timeout_s: float) -> str | None:
        """Why `failure` cannot be recovered live (None: it can, as far as the ranks go)."""
        if self.spares is None:
            return ("live recovery is off" if not self.config.switches.live_recovery
                    else "no spare (no room for its GPU bundle)")
        if not is_process_loss(failure) or failure.node is not None or not 0 <= failure.rank < len(self.actors):
            return f"the failure is not one rank's lost process ({failure.summary})"
        survivors = [r for r in range(len(self.actors)) if r != failure.rank]
        # NCCL: a survivor's collective waits for the dead peer until aborted; each interrupt is
        # waited for below, before anything rejoins (a threaded actor's calls are not ordered)
        interrupts = [self.actors[r].interrupt.remote() for r in survivors]
        waiting = [ref for ref, rank in self.refs.items() if rank in survivors]
        done, _ = ray.wait(waiting, num_returns=len(waiting), timeout=timeout_s)
        if len(done) < len(waiting):
            return f"{len(waiting) - len(done)} surviving rank(s) did not stop within {timeout_s:g} s"
        for ref in done:
            self.refs.pop(ref)
            with contextlib.suppress(RayActorError, RayTaskError):
                ray.get(ref)
        with contextlib.suppress(GetTimeoutError, RayActorError, RayTaskError):
            ray.get(interrupts, timeout=timeout_s)
        try:
            parked = ray.get([self.actors[r].parked.remote() for r in survivors], timeout=timeout_s)
        except (GetTimeoutError, RayActorError, RayTaskError) as exc:
            return f"a survivor did not answer: {type(exc).__name__}"
        if not all(parked):
            return f"ranks {[r for r, p in zip(survivors, parked) if not p]} did not keep their state"
        return None

    def hand_off(self, attempt: int, failure: Failure) -> None:
        """The spare (waited for when it is still starting) takes the failed rank's place in
        `attempt`, which runs on this group."""
        assert self.spares is not None
        with contextlib.suppress(Exception):
            ray.kill(self.actors[failure.rank], no_restart=True)
        spare, info = self.spares.take(attempt, self.config.startup_timeout_s)
        self.actors[failure.rank], self.info[failure.rank] = spare, info
        if self.spares.bundle is not None:  # the next spare starts in the bundle the failed rank left
            self.spares.bundle = (self.pg, self.bundles.hand_off(failure.rank))
        self.attempt, self.joining, self.finished, self.anchored = attempt, failure.rank, set(), None
        self.cluster_owned.discard(failure.rank)  # a spare's owner is not tracked: its loss is typed as it is
        self.asked_at = None  # the loop starts again on every rank: not a start the pool can save

    def resume(self, point: RestorePoint) -> None:
        """The survivors rejoin and the spare joins with a new rendezvous, all from `point`;
        a new spare starts in the background."""
        config = self.attempt_config()
        addr, port = ray.get(self.actors[0].rendezvous.remote())
        self.refs = {}
        for r, actor in enumerate(self.actors):
            call = (actor.join.remote(config, self.attempt, r, addr, port, self.keeper, point) if r == self.joining
                    else actor.rejoin.remote(config, self.attempt, addr, port, point))
            self.refs[call] = r
        if self.spares.held:
            self.spares.prewarm()  # the next spare, in the background

    def poll(self, timeout_s: float) -> PollStatus:
        if self.spares is not None:
            self.spares.watch(self.attempt)  # a spare that died while it waited is replaced
        done, _ = ray.wait(list(self.refs), num_returns=len(self.refs), timeout=timeout_s)
        finished: dict[int, RankResult] = {}
        failed: list[Failure] = []
        for ref in done:
            rank = self.refs.pop(ref)
            try:
                finished[rank] = ray.get(ref)
                self.finished.add(rank)
                if finished[rank].anchor:
                    self.anchored = finished[rank].anchor
                if finished[rank].trained_from is not None:
                    self.trained_from[rank] = finished[rank].trained_from
            except (RayActorError, RayTaskError) as exc:  # the process died, or the rank raised
                failed.append(self._on_node(failure_from_exception(exc, rank=rank, attempt=self.attempt)))
        return PollStatus(finished=finished, failed=tuple(failed))

    def _on_node(self, failure: Failure) -> Failure:
        """A lost process whose node the cluster lists as dead, or whose raylet refuses
        connections (`raylet_refuses`: CI saw the rank's death before the GCS's verdict), is the
        node's failure. Not asked once the group was preempted: its ranks end because they were
        told to, and the process's stop may be taking a local Ray's GCS down with it (a worker
        signals the flow's process group), where `ray.nodes()` would wait for a GCS that is gone."""
        if self.preempting or local_ray_going() or not is_process_loss(failure) \
                or not 0 <= failure.rank < len(self.info):
            return failure
        node = self.info[failure.rank].node_id
        listed = live_nodes().get(node)
        if listed is not None and not raylet_refuses(listed):
            return failure
        return on_lost_node(failure, node=node, address=self.info[failure.rank].node_ip)

    def owner_cause(self, failure: Failure) -> Failure:
        """A lost rank the cluster's pool started, after that pool died: the owner's loss
        (`classify.on_lost_owner`): Ray SIGTERMs what a dead actor owned, which the rank takes for
        a preemption. Not asked while the group is being preempted or its local Ray goes."""
        if self.preempting or local_ray_going() or failure.rank not in self.cluster_owned \
                or self.owner is None or not service_lost(self.owner):
            return failure
        return on_lost_owner(failure, owner="the cluster's pool")

    def kill(self, rank: int) -> None:
        info = self.info[rank]
        if info.node_ip == ray.util.get_node_ip_address():
            os.kill(info.pid, signal.SIGKILL)
        else:
            ray.kill(self.actors[rank], no_restart=True)

    def preempt(self) -> None:
        """SIGTERM every rank whose process this node can signal: each ends as preempted
        (preemption.py: the ranks agree at the next step boundary and take an emergency
        checkpoint when the grace allows). A rank on another node gets none: its peers' stop
        ends its attempt, and the durable checkpoint is what restores it."""
        self.preempting = True
        note_stop()
        here = ray.util.get_node_ip_address()
        remote = []
        for rank, info in enumerate(self.info):
            if rank in self.finished:
                continue
            if info.node_ip == here:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(info.pid, signal.SIGTERM)
            else:
                remote.append(rank)
        if remote:
            log.warning("rank(s) %s run on other nodes: no SIGTERM reaches them from here; they stop with their peers",
                        ", ".join(map(str, remote)))

    def teardown(self) -> None:
        # SIGKILL first where the pid is ours to signal: `ray.kill` may deliver SIGTERM, which
        # a rank takes for a preemption (preemption.py), and the group's end is not one
        if local_ray_going():
            # this process is being stopped, and its own local Ray with it (a worker signals the
            # whole process group): a GCS call would wait for a GCS that is gone (30 s, until the
            # worker's SIGKILL). What is ours is killed; the placement group ends with that Ray.
            for info in self.info:
                if info.node_ip == ray.util.get_node_ip_address():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(info.pid, signal.SIGKILL)
            self.actors, self.refs, self.pg = [], {}, None
            self.released_at = time.time()
            return
        for rank, actor in enumerate(self.actors):
            info = self.info[rank] if rank < len(self.info) else None
            if info is not None and info.node_ip == ray.util.get_node_ip_address():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(info.pid, signal.SIGKILL)
            ray.kill(actor, no_restart=True)
        self.actors, self.refs = [], {}
        if self.pg is not None:  # the devices go back first: what follows needs none of them
            remove_placement_group(self.pg)
            self.pg = None
        self.released_at = time.time()
        if self.spares is not None:
            self.spares.close(self.attempt)  # to the warm pool when the process keeps one
        if self.world_size and len(self.finished) == self.world_size:
            # trained to the end: nothing will restore from memory
            end_run(self.run_id, self.pool, spool_root=self.spool_root, attempt=self.attempt)
            if not self.gpu:  # the next run's ranks and spares, prewarmed from now on
                # spares of its own ahead of the next run, unless the cluster's pool holds the model's
                shared = self.spares is not None and self.spares.shared is not None
                spares = SPARES_AHEAD if self.config.holds_spare and not shared else 0
                self.pool.fill(self.config, self.world_size + spares,
                               self.spool_root, self.actor_cls,
                               next_run_at=self.next_run_at() if self.next_run_at is not None else None,
                               start=self.start_sample(), anchor=self.anchored)

    def start_sample(self) -> StartSample | None:
        """This attempt's start, for the pool's hold rule: from asking for the ranks to the last
        beginning its training loop, when every rank started cold or every one came from the
        pool (a mix, or a live recovery, measures neither)."""
        if self.asked_at is None or len(self.trained_from) != self.world_size \
                or self.pooled_ranks not in (0, self.world_size):
            return None
        return StartSample(seconds=max(max(self.trained_from.values()) - self.asked_at, 0.0),
                           pooled=self.pooled_ranks == self.world_size)

