"""The warm pool as a service of the Ray cluster: one named, detached actor per cluster.

A flow run that a Prefect worker starts is a process of its own, and Ray ends the actors a
process owns when it exits: a pool kept by that process would die with each run. So on a
cluster that outlives its runs (`ettflow up`'s head, a team's cluster: the run *joined* it),
the pool is the actor `ettflow-pool` in the namespace `ettflow`, started on first use
(`get_if_exists`), detached: it survives every flow process and ends with the cluster, or on
`ettflow pool stop`. It starts and owns the prewarmed trainer workers and in-memory checkpoint
keepers (their owner is the service, so they outlive the run that asked for them), keyed as
`warm_pool.warm_key` keys them; any run connected to the cluster takes them for its placement.

Its policy (`PoolPolicy`): at most `max_workers` per model (a fill for another shape of the
same model stops the old ones); what it prewarms for a model's next run, and how long it holds
it unclaimed, is a `hold_rule.HoldDecision` (a reaper thread applies it every `reap_every_s`):
when Prefect has the deployment's next run scheduled (the flow reads it, `tasks/schedule.py`)
the pool holds nothing from the release and prewarms *just in time* (the model's measured
prewarm duration, its spread and `margin_s` before the run), so a refresh every 6 hours gets
warm workers without holding them idle for 6 hours; with no schedule it prewarms at once and
holds each ready worker for the *break-even keep-alive*, its share of the start it would save
(at most `max_keep_alive_s`). Either only when it pays: the start the next run's ranks would
save exceeds, in slot-seconds, what the workers are expected to hold (else rule `none`: nothing
prewarmed). The pool measures each model's prewarm (requested -> ready) on its own workers, and
each releasing run brings its own start (`protocol.StartSample`: cold or pooled ranks, measured
by its group). What the pool holds, and since when, what it plans and what it decided to hold
nothing for, is what `status()` lists; a run records what it took in its spool (`spare_start`,
`pooled`, with the time it was taken), off its clock.

What the pool releases that no run took (idle, another shape's fill, a failed prewarm,
`stop`) is held capacity too, for nobody: the pool keeps a ledger line (`ett.capacity.Holding`,
`run_id` None) for each until someone writes them to the warehouse and acknowledges them
(`drain`/`ack`: the next run's release, `ettflow pool stop`). The service journals what it holds
and its unacknowledged lines as they change (`pool_journal.py`, in the home of the process
that started it): when the service is killed, taking its workers and keepers with it, the next
service of that home closes each at the dead one's last beat (`pool_lost`) and adopts its lines,
and the model's next run is told why it starts cold. A whole cluster that dies loses only what
changed since the last beat (one reaper tick).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ettflow.ett.capacity import ORPHANED, SPARE, UNCLAIMED_KEEPER, UNCLAIMED_WORKER, Holding
from ettflow.ett.spare_sizing import (
    SHARED,
    SharedHold,
    SpareDecision,
    SpareShare,
    size_shared_spares,
    split_shared_hold,
)
from ettflow.trainer.config import TrainerConfig
from ettflow.trainer.group.hold_rule import (
    MAX_EXPLORATIONS,
    SAMPLES_KEPT,
    HoldDecision,
    HoldRule,
    PrewarmEstimate,
    StartSaving,
    decide_hold,
)
from ettflow.trainer.group.pool_journal import POOL_LOST, PoolJournal, Recovered
from ettflow.trainer.group.pooled_worker import (
    POOL_RUN_ID,
    STAGE_MAX_BYTES,
    PooledWorker,
    begin_prewarm,
    model_name,
    prewarm_for_next_run,
    probe,
    ranks_first,
    stage_request,
    start_worker,
    stop,
    take_for_nodes,
    warm_key,
)
from ettflow.trainer.protocol import PooledInfo, StageRequest, StartSample

if TYPE_CHECKING:
    from typing import TypeAlias

    from ray.actor import ActorHandle

    from ettflow.trainer.checkpoint.state_keeper import KeeperHandle, NamedKeeper

    PoolHandle: TypeAlias = ActorHandle["PoolService"]  # the cluster's pool, as service() returns it
    OwnerHandle: TypeAlias = ActorHandle["RunOwner"]  # a driving process's liveness probe

log = logging.getLogger("ettflow.trainer")
NAME = "ettflow-pool"
NAMESPACE = "ettflow"
ORPHANS_EVERY_S = 30.0  # how often the reaper asks whether the runs that took workers still live


@dataclass(frozen=True, kw_only=True)
class PoolPolicy:
    """max_workers: prewarmed workers kept per model (ranks and spares of its next run).
    margin_s: a just-in-time prewarm's slack before a scheduled run (beyond the measured
    prewarm and twice its spread), and how long after the scheduled time its unclaimed workers
    are kept. max_keep_alive_s: the longest an unscheduled run's ready worker is held (the
    break-even keep-alive is its share of the start saved, bounded by this). reap_every_s: how often the
    reaper checks (a planned prewarm wakes it on time). max_shared_spares: the most spares held
    for one model's training runs (each only while their summed saving pays for it).
    stage_max_bytes: the largest anchor a next run's worker stages in memory while it prewarms
    (the releasing run's, which that run will likely warm start from: `staged_anchor.py`); 0:
    none staged."""

    max_workers: int = 8
    max_shared_spares: int = 2  # spares held per model for its runs training now (`share_spares`)
    margin_s: float = 30.0
    max_keep_alive_s: float = 600.0
    reap_every_s: float = 2.0
    stage_max_bytes: int = STAGE_MAX_BYTES

    def __post_init__(self) -> None:
        if self.stage_max_bytes < 0:
            raise ValueError(f"stage_max_bytes must be 0 (stage nothing) or more, got {self.stage_max_bytes}")
        if self.max_workers < 0 or self.max_shared_spares < 0:
            raise ValueError(f"max_workers and max_shared_spares must be 0 or more, got {self.max_workers}, "
                             f"{self.max_shared_spares}")
        if self.margin_s < 0 or self.reap_every_s <= 0 or self.max_keep_alive_s < 0:
            raise ValueError(f"margin_s and max_keep_alive_s must be >= 0 and reap_every_s positive, got "
                             f"{self.margin_s}, {self.max_keep_alive_s}, {self.reap_every_s}")


class RunOwner:
    """A tiny actor a flow process creates and owns: Ray ends it when that process exits or
    is killed, which is how the pool learns that a run it gave workers to is gone."""

    def ping(self) -> bool:
        return True


@dataclass
class _Given:
    """Actors the pool started and a run took: the pool still owns them (Ray cannot pass an
    actor's ownership on), so when the run's process dies without stopping them (SIGKILL),
    the pool does, once its `owner` is gone."""

    actor: ActorHandle  # a pooled trainer worker or a keeper
    owner: OwnerHandle
    run_id: str
    model: str
    kind: str  # "worker" or "keeper"
    seen_alive_at: float
    gpus: float = 0.0
    cpus: float = 0.0
    memory_bytes: int | None = None
    name: str = ""  # a keeper's Ray name


@dataclass
class _Keeper:
    actor: KeeperHandle
    requested_at: float
    model: str
    name: str = ""  # its Ray name (`state_keeper.pooled_keeper_name`)
    holding_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class _Sharing:
    """A model's runs training now that share its spares (`share_spares`), and how to start one."""

    shares: dict[str, SpareShare]  # by run id
    owners: dict[str, OwnerHandle | None]  # by run id: the run's process's probe (its death unshares it)
    config: TrainerConfig
    spool_root: str
    actor_cls: type
    decision: SpareDecision | None = None
    # each change of `shares`, oldest first: when, and each run's saving per second from then
    # (what a spare's hold is split by: `spare_sizing.split_shared_hold`)
    log: list[tuple[float, dict[str, float]]] = field(default_factory=list)

    def changed(self, now: float) -> None:
        self.log.append((now, {run: s.saving_per_s for run, s in self.shares.items()}))


@dataclass(frozen=True)
class LeftSharing:
    """What `unshare` answers: the model's decision without the run, and the run's parts of
    the shared spares held while it trained (it records them as its own `spare_start`s)."""

    model: str
    decision: SpareDecision
    holds: tuple[SharedHold, ...]


@dataclass(frozen=True)
class PlannedFill:
    """Workers to prewarm at `hold.start_at` (just in time for the model's next scheduled run)."""

    hold: HoldDecision
    config: TrainerConfig
    count: int
    spool_root: str
    actor_cls: type
    stage: StageRequest | None = None

    @property
    def at(self) -> float:
        return self.hold.start_at


def _add_newest(series: dict, model: object, value: float) -> None:
    """Append a model's newest sample, keeping the last SAMPLES_KEPT (what the hold rule reads)."""
    kept = series.setdefault(model, [])
    kept.append(value)
    del kept[:-SAMPLES_KEPT]


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:10]


def staging_answers(actors: dict[str, Any], timeout_s: float = 5.0) -> dict[str, str]:
    """Each worker's answer on its staging (`TrainerActor.staging_status`), described, by the
    same keys as `actors`; a worker that did not answer within `timeout_s` (busy, or gone) is
    said so."""
    if not actors:
        return {}
    import ray
    from ray.exceptions import RayError

    asked = {key: actor.staging_status.remote() for key, actor in actors.items()}
    done, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=timeout_s)
    answers = {}
    for key, ref in asked.items():
        if ref not in done:
            answers[key] = f"no answer on its staging within {timeout_s:g} s"
            continue
        try:
            status = ray.get(ref)
        except RayError as exc:
            answers[key] = f"no answer on its staging ({type(exc).__name__})"
            continue
        answers[key] = status.describe() if status is not None else "stages nothing"
    return answers


class PoolService:
    """The pool's actor (start it with `service()`); every method runs in the cluster."""

    def __init__(self, policy: PoolPolicy = PoolPolicy(), start: Callable[..., PooledWorker] = start_worker,
                 journal: str | None = None,
                 ask_staging: Callable[[dict[str, Any]], dict[str, str]] | None = None) -> None:
        """`journal`: the file this service writes what it holds to as it changes, and where
        it finds what an earlier service of the same home held when that one died
        (`pool_journal.py`); None: none (what a killed service held is lost to the ledger).
        `ask_staging`: asks workers (their actors by holding id) how their staging stands, for
        `status` (`staging_answers`)."""
        self.policy = policy
        self.ask_staging = ask_staging or staging_answers
        self.entries: list[PooledWorker] = []
        self.keepers: list[_Keeper] = []
        self.ledger: dict[str, Holding] = {}  # released unclaimed, not yet in a warehouse (by holding_id)
        self.planned: dict[str, PlannedFill] = {}  # by model: a fill ahead of its next scheduled run
        self.prewarm_s: dict[str, list[float]] = {}  # by model: its workers' measured prewarms (newest last)
        self.holds: dict[str, HoldDecision] = {}  # by model: the hold its workers are under
        self.gaps: dict[str, list[float]] = {}  # by model: seconds from a release to its next run's take
        self.starts: dict[tuple[str, bool], list[float]] = {}  # by (model, pooled): its runs' measured starts
        self.explored: dict[str, int] = {}  # by model: holds granted to measure a pooled start (`hold_rule`)
        self.released_at: dict[str, float] = {}  # by model: its last run's release (a fill), until a take
        self.given: list[_Given] = []  # taken by runs whose process may die without stopping them
        self.sharing: dict[str, _Sharing] = {}  # by model: its runs training now, sharing its spares
        self.shared_holds: dict[str, list[SharedHold]] = {}  # by run: its parts of shared spares' holds so far
        self._accounted: dict[str, set[str]] = {}  # by a held shared spare's holding id: runs given their part
        self._journal_failed = False
        self._start = start
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._orphans_checked = 0.0
        self.journal = PoolJournal(journal) if journal else None
        self.lost: Recovered | None = None  # an earlier service of this home that died holding things
        self._told: set[str] = set()  # models whose next run was told the pool was lost
        self._recover()
        threading.Thread(target=self._reap_loop, name="ettflow-pool-reaper", daemon=True).start()

    # ---- the journal (pool_journal.py) ---------------------------------------------------
    def _recover(self) -> None:
        """Adopt what the journal's previous service left: its unacknowledged lines, and its
        open holdings closed at its last beat when it died."""
        found = self.journal.recover() if self.journal is not None else None
        if found is None:
            return
        self.ledger.update({h.holding_id: h for h in found.lines})
        if found.lost_at is not None:
            self.lost = found
            log.warning("cluster pool: the previous pool service was lost (it last answered at %s, holding %d "
                        "worker(s) and keeper(s)); their held time is in the ledger as %r", _clock(found.lost_at),
                        found.open_holdings, POOL_LOST)
        self._journal()

    def _journal(self, *, stopped: bool = False) -> None:
        """Rewrite the journal with what the service holds now (a disk that refuses it loses
        only the record of a later death: said once)."""
        if self.journal is None:
            return
        now = time.time()
        with self._lock:
            held = [_worker_line(e, now, POOL_LOST) for e in self.entries] + \
                   [_keeper_line(k, now, POOL_LOST) for k in self.keepers]
            ledger = list(self.ledger.values())
        try:
            self.journal.write(beat=now, open_holdings=held, ledger=ledger, stopped=stopped)
        except OSError as exc:
            if not self._journal_failed:
                log.warning("cluster pool: its journal %s cannot be written (%s): if the pool dies, what it holds "
                            "is not in the ledger", self.journal.path, exc)
            self._journal_failed = True

    def ping(self) -> bool:
        """An answer: the service is alive (`WarmPool.service_lost`)."""
        return True

    def cold_note(self, model: str) -> str | None:
        """Why the model's run found nothing prewarmed, when the reason is that the previous
        service died (once per model); None otherwise."""
        with self._lock:
            if self.lost is None or self.lost.lost_at is None or model in self._told:
                return None
            self._told.add(model)
            return (f"the cluster's pool was lost (its service last answered at {_clock(self.lost.lost_at)}, "
                    f"holding {self.lost.open_holdings} worker(s) and keeper(s)): this run's ranks start cold")

    # ---- filling -------------------------------------------------------------------------
    def decide(self, model: str, next_run_at: float | None, now: float, *, slots: int = 1,
               workers: int = 1) -> HoldDecision:
        """The hold for the model's next run of `slots` ranks, `workers` prewarmed for it
        (`hold_rule.decide_hold`, on its measured prewarms, starts and gaps)."""
        with self._lock:
            estimate = PrewarmEstimate.of(self.prewarm_s.get(model, ()))
            saving = StartSaving.of(self.starts.get((model, False), ()), self.starts.get((model, True), ()))
            gaps = list(self.gaps.get(model, ()))
            explore = self.explored.get(model, 0) < MAX_EXPLORATIONS
        return decide_hold(now, next_run_at, estimate, margin_s=self.policy.margin_s,
                           max_keep_alive_s=self.policy.max_keep_alive_s, gaps=gaps, saving=saving,
                           slots=slots, workers=workers, explore=explore)

    def fill(self, config: TrainerConfig, count: int, spool_root: str, next_run_at: float | None = None,
             now: float | None = None, *, actor_cls: type, start: StartSample | None = None,
             anchor: str | None = None) -> int:
        """Hold `count` workers (at most the policy's bound) of `config`'s shape for the model's
        next run, under the hold the rule decides (`decide`): `next_run_at` (when its
        deployment's next run is scheduled; Prefect knows it) prewarms just in time and holds
        nothing before; None prewarms now, each ready worker kept for the break-even keep-alive.
        The model's workers of another shape are stopped. Returns how many started now.
        `actor_cls`: the rank's actor class the workers are (the caller's: the pool, on the
        driver's side, never imports the rank's). `start`: the releasing run's measured start
        (its ranks cold or pooled), added to the model's before deciding. `anchor`: the releasing
        run's anchor, which the workers for the next run's ranks stage in memory for its warm start (up to
        the policy's `stage_max_bytes`)."""
        now = time.time() if now is None else now
        model = model_name(config)
        if self._stop.is_set():
            return 0  # stopped (`stop`): holds nothing new, its reaper is gone (see `stop`)
        stage = stage_request(anchor, self.policy.stage_max_bytes)
        if start is not None:
            with self._lock:
                _add_newest(self.starts, (model, start.pooled), start.seconds)
        hold = self.decide(model, next_run_at, now, slots=config.world_size,
                           workers=min(count, self.policy.max_workers))
        log.info("cluster pool: %s for %s: %s", hold.rule, model, hold.reason)
        with self._lock:
            if hold.explore:
                self.explored[model] = self.explored.get(model, 0) + 1
            self.planned.pop(model, None)
            self.holds[model] = hold
            self.released_at[model] = now
            if hold.rule is HoldRule.NONE:  # nothing for a run that likely comes later than a hold lasts
                self._drop_model(model, "not_worth_holding", now)
                return 0
            if not hold.starts_now(now):
                self.planned[model] = PlannedFill(hold=hold, config=config, count=count, spool_root=spool_root,
                                                  actor_cls=actor_cls, stage=stage)
                self._drop_model(model, "until_scheduled", now)  # nothing held from the release to the run
                self._wake.set()
                return 0
            return self._fill_now(config, count, spool_root, actor_cls, stage)

    def _fill_now(self, config: TrainerConfig, count: int, spool_root: str, actor_cls: type,
                  stage: StageRequest | None = None) -> int:
        key, model = warm_key(config), model_name(config)
        if self._stop.is_set():
            return 0
        with self._lock:
            self._drop(lambda e: e.model == model and e.key != key and e.rule != SHARED, "reshaped")
            kept = [e for e in self.entries if e.key == key and e.rule != SHARED]
            have = len(kept)
            started = max(min(count, self.policy.max_workers) - have, 0)
            hold = self.holds.get(model)
            new = [self._start(config, POOL_RUN_ID, spool_root, actor_cls=actor_cls) for _ in range(started)]
            prewarm_for_next_run(kept, new, stage, config)
            for worker in new:
                worker.rule = str(hold.rule) if hold is not None else ""
                self.entries.append(worker)
            if config.switches.memory_checkpoint and not self.keepers:
                from ettflow.trainer.checkpoint.state_keeper import pooled_keeper_name, start_keeper

                name = pooled_keeper_name(model)
                self.keepers.append(_Keeper(start_keeper(None, wait=False, name=name), time.time(), model, name))
        self._journal()
        if started:
            log.info("cluster pool: %d worker(s) of model %s starting for its next run", started, model)
        return started

    def wait_ready(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for every worker to be prewarmed; how many are."""
        import ray

        refs = [e.prewarmed for e in self.entries]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        with self._lock:
            return len(self._ready())

    # ---- taking --------------------------------------------------------------------------
    def take(self, config: TrainerConfig, nodes: list[str | None], owner: OwnerHandle | None = None,
             run_id: str = "", *, spare: bool = False) -> list[PooledWorker | None]:
        """For each wanted node (None: any), a prewarmed worker of `config`'s shape there (its
        `timings` read), or None. Taken workers are the caller's to stop; `owner` (the run's
        `RunOwner`): if it dies first, the pool stops them (`reap_orphans`). `spare`: for a lost
        rank, which may take the model's shared spares (never a starting rank: their hold is
        their sharers'), after the next run's workers, and one still prewarming when none is
        ready (nearer ready than one started at the loss; the caller waits for its prewarm)."""
        key, model = warm_key(config), model_name(config)
        now = time.time()
        with self._lock:
            released = self.released_at.pop(model, None)
            if released is not None:  # the gap from the model's last release to this run: its arrivals
                _add_newest(self.gaps, model, max(now - released, 0.0))
            prefer = ranks_first(spare)
            ready = sorted((e for e in self._ready() if e.key == key and (spare or e.rule != SHARED)),
                           key=lambda e: (e.rule == SHARED, prefer(e)))
            if spare:
                ready += [e for e in self.entries if e.key == key and e.rule == SHARED and e.timings is None]
            taken = take_for_nodes(ready, nodes)
            for worker in filter(None, taken):
                self.entries.remove(worker)
                if owner is not None:
                    self.given.append(_Given(worker.actor, owner, run_id, worker.model, "worker", now,
                                             worker.gpus, worker.cpus, worker.rss_bytes))
            shared = [w for w in taken if w is not None and w.rule == SHARED]
            if shared and model in self.sharing:
                for worker in shared:
                    self._account(worker, self.sharing[model], now, used=True)
                self._size_shared(model, now)  # the next one prepares now, for the model's other losses
        self._journal()
        return taken

    def take_keeper(self, owner: OwnerHandle | None = None, run_id: str = "") -> NamedKeeper | None:
        with self._lock:
            if not self.keepers:
                return None
            keeper = self.keepers.pop(0)
            if owner is not None:
                self.given.append(_Given(keeper.actor, owner, run_id, keeper.model, "keeper", time.time(),
                                         name=keeper.name))
        self._journal()
        from ettflow.trainer.checkpoint.state_keeper import NamedKeeper

        return NamedKeeper(keeper.actor, keeper.name)

    def forget(self, run_id: str) -> int:
        """A run stopped what it took (its normal end): nothing of it is the pool's to watch, and
        it shares its model's spares no more (`unshare`: its parts of their holds, which it
        did not take to record, go to the ledger as its lines). A keeper given to the run is
        stopped here all the same: a take the run gave up waiting for (a timeout) finished here
        with a keeper the run never got, and nothing else would stop it (stopping one the run
        stopped already is harmless)."""
        self._unshare_to_ledger(run_id, "not_recorded")
        with self._lock:
            before = len(self.given)
            keepers = [g.actor for g in self.given if g.run_id == run_id and g.kind == "keeper"]
            self.given = [g for g in self.given if g.run_id != run_id]
        if keepers:
            import ray

            for actor in keepers:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
        return before - len(self.given)

    def reap_orphans(self, now: float | None = None, timeout_s: float = 5.0) -> int:
        """Stop what runs took whose process is gone (their `RunOwner` no longer answers), and
        forget what the living still hold; how many were stopped. Their time since the owner
        was last seen is a ledger line (`orphaned`, the run's): held for a run that was dead."""
        import ray
        from ray.exceptions import GetTimeoutError

        with self._lock:
            owners = {id(g.owner): g.owner for g in self.given}
            owners.update({id(o): o for sh in self.sharing.values() for o in sh.owners.values() if o is not None})
        dead = set()
        for key, owner in owners.items():
            try:
                ray.get(owner.ping.remote(), timeout=timeout_s)
            except GetTimeoutError:
                continue  # busy or slow: asked again next time
            except Exception:  # noqa: BLE001 - RayActorError and kin: its process is gone
                dead.add(key)
        now = time.time() if now is None else now
        with self._lock:
            orphans = [g for g in self.given if id(g.owner) in dead]
            for g in self.given:
                if id(g.owner) not in dead:
                    g.seen_alive_at = now
            self.given = [g for g in self.given if id(g.owner) not in dead]
            gone = [run for sh in self.sharing.values() for run, o in sh.owners.items() if id(o) in dead]
            for g in orphans:
                with contextlib.suppress(Exception):
                    ray.kill(g.actor, no_restart=True)
                h = Holding(holding_id=uuid.uuid4().hex, model=g.model, kind=ORPHANED, run_id=g.run_id or None,
                            used=False, requested_at=min(g.seen_alive_at, now), released_at=now,
                            reason="owner_died", slots=1.0 if g.kind == "worker" else 0.0, gpus=g.gpus,
                            cpus=g.cpus, memory_bytes=g.memory_bytes)
                self.ledger[h.holding_id] = h
        for run_id in gone:
            log.warning("cluster pool: run %s's process is gone: it no longer shares its model's spares", run_id)
            self._unshare_to_ledger(run_id, "owner_died", now)
        if orphans:
            log.warning("cluster pool: stopped %d actor(s) of run(s) %s whose process is gone", len(orphans),
                        ", ".join(sorted({g.run_id for g in orphans})))
        return len(orphans)

    # ---- shared spares (ett.spare_sizing.size_shared_spares) -------------------------------
    def share_spares(self, share: SpareShare, config: TrainerConfig, spool_root: str, *, actor_cls: type,
                     owner: OwnerHandle | None = None, now: float | None = None) -> SpareDecision:
        """A run of `config`'s model trains from now and shares its spares: the pool holds the
        spares the model's training runs' summed `share`s pay for (started and prewarmed now, rule
        `spare-shared`), and whichever loses a rank takes one (`take`, after the next run's
        workers); a taken one is replaced while they still pay. Each spare's hold is split among
        the runs sharing it, by their savings (`unshare` gives a run its parts). `owner`: the
        run's process's probe: when it dies without `unshare`, the orphan check unshares it."""
        now = time.time() if now is None else now
        model = model_name(config)
        with self._lock:
            sharing = self.sharing.setdefault(model, _Sharing({}, {}, config, spool_root, actor_cls))
            sharing.shares[share.run_id], sharing.owners[share.run_id] = share, owner
            sharing.config, sharing.spool_root, sharing.actor_cls = config, spool_root, actor_cls
            sharing.changed(now)
            decision = self._size_shared(model, now)
        self._journal()
        return decision

    def unshare(self, run_id: str, now: float | None = None) -> LeftSharing | None:
        """The run stopped training (its end): its parts of the model's shared spares' holds
        so far are its to record, and the spares the model's remaining runs do not pay for are
        released (each remaining run's part in theirs). None when the run shared nothing."""
        now = time.time() if now is None else now
        with self._lock:
            model = next((m for m, sh in self.sharing.items() if run_id in sh.shares), None)
            if model is None:
                return None
            sharing = self.sharing[model]
            for e in [e for e in self.entries if e.model == model and e.rule == SHARED]:
                self._account(e, sharing, now, used=False, only=run_id)  # held on after it left: its part so far
            del sharing.shares[run_id], sharing.owners[run_id]
            sharing.changed(now)
            decision = self._size_shared(model, now)
            holds = tuple(self.shared_holds.pop(run_id, ()))
        self._journal()
        return LeftSharing(model, decision, holds)

    def _unshare_to_ledger(self, run_id: str, reason: str, now: float | None = None) -> None:
        """`unshare` a run that will not record its parts of the shared spares' holds (its
        process died, or it ended without asking): they become its ledger lines."""
        left = self.unshare(run_id, now)
        with self._lock:
            for h in left.holds if left is not None else ():
                line = _shared_line(h, run_id, model=left.model, reason=reason)
                self.ledger[line.holding_id] = line

    def _account(self, e: PooledWorker, sharing: _Sharing, now: float, *, used: bool, only: str | None = None) -> None:
        """Give the runs sharing `e` their parts of its hold up to `now` (the lock held): every
        run not yet given its part, or `only` that one (it leaves while `e` is held on)."""
        done = self._accounted.setdefault(e.holding_id, set())
        parts = split_shared_hold(sharing.log, e.requested_at, now, skip=done)
        for run, spans in parts.items():
            if only is not None and run != only:
                continue
            done.add(run)
            self.shared_holds.setdefault(run, []).extend(
                SharedHold(holding_id=e.holding_id, start=lo, end=hi, slots=share, used=used, cpus=e.cpus * share,
                           gpus=e.gpus * share) for lo, hi, share in spans)
        if only is None:
            del self._accounted[e.holding_id]

    def _size_shared(self, model: str, now: float) -> SpareDecision:
        """Hold what the model's training runs' shares pay for (the lock held)."""
        sharing = self.sharing[model]
        decision = sharing.decision = size_shared_spares(list(sharing.shares.values()),
                                                         max_spares=self.policy.max_shared_spares)
        held = [e for e in self.entries if e.model == model and e.rule == SHARED]
        key = warm_key(sharing.config)
        stale = [e for e in held if e.key != key] + [e for e in held if e.key == key][decision.spares:]
        self._drop(lambda e: any(e is s for s in stale), "does_not_pay", now)
        for _ in range(0 if self._stop.is_set() else decision.spares - (len(held) - len(stale))):
            worker = self._start(sharing.config, POOL_RUN_ID, sharing.spool_root, actor_cls=sharing.actor_cls)
            begin_prewarm(worker)  # a spare joins a live recovery: nothing to stage
            worker.rule = SHARED
            self.entries.append(worker)
        if not sharing.shares:
            del self.sharing[model]
        else:  # the log need not reach back before the oldest spare held
            oldest = min((e.requested_at for e in self.entries if e.model == model and e.rule == SHARED), default=now)
            while len(sharing.log) > 1 and sharing.log[1][0] <= oldest:
                del sharing.log[0]
        log.info("cluster pool: %s: %s", model, decision.reason)
        return decision

    # ---- what it holds -------------------------------------------------------------------
    def status(self) -> list[PooledInfo]:
        with self._lock:
            staging = {e.holding_id: e.actor for e in self.entries if e.staging}
        answers = self.ask_staging(staging)  # asked outside the lock: a busy worker does not hold up a take
        with self._lock:
            self._ready()
            def why(model: str, rule: str = "") -> str:
                if rule == SHARED:
                    shared = self.sharing.get(model)
                    return shared.decision.reason if shared is not None and shared.decision is not None else ""
                hold = self.holds.get(model)
                return hold.reason if hold is not None else ""

            workers = [PooledInfo("worker", e.model, digest(e.key), "ready" if e.timings is not None else "prewarming",
                                  e.requested_at, e.timings.ready_at if e.timings is not None else None, e.node,
                                  rule=e.rule, why=why(e.model, e.rule),
                                  staging=answers.get(e.holding_id, f"asked to stage {e.staging}") if e.staging else "")
                       for e in self.entries]
            return workers + [PooledInfo("keeper", k.model, "-", "ready", k.requested_at, None, None,
                                         actor=k.name)
                              for k in self.keepers] + [
                PooledInfo(f"run's {g.kind}", g.model, g.run_id[:8] or "-", "taken", g.seen_alive_at, None, None,
                           actor=g.name)
                for g in self.given] + [
                PooledInfo("planned", m, digest(warm_key(p.config)), f"{p.count} to prewarm", p.at, None, None,
                           rule=str(p.hold.rule), why=p.hold.reason)
                for m, p in self.planned.items()] + [
                PooledInfo("decided", m, "-", "nothing held", h.start_at, None, None, rule=str(h.rule), why=h.reason)
                for m, h in self.holds.items() if h.rule is HoldRule.NONE] + ([
                PooledInfo("lost", "-", "-", f"{self.lost.open_holdings} closed", self.lost.lost_at, None, None)]
                if self.lost is not None and self.lost.lost_at is not None else [])

    def stop(self) -> int:
        """Stop everything the pool holds; returns how many actors were stopped (their ledger
        lines wait for `drain`). A stopped pool starts nothing again (`fill`, shared spares): its
        reaper ends here, so nothing it started would ever be released. It stays alive only
        while its ledger waits for a warehouse (`ettflow pool stop` kills it once written)."""
        self._stop.set()
        self._wake.set()
        with self._lock:
            self.planned.clear()
            n = len(self.entries) + len(self.keepers)
            self._drop(lambda e: True, "stopped")
            self._drop_keepers(lambda k: True, "stopped")
        self._journal(stopped=True)
        return n

    # ---- the ledger of what nobody took --------------------------------------------------
    def drain(self) -> list[Holding]:
        """The ledger lines not acknowledged yet (they stay until `ack`)."""
        with self._lock:
            return list(self.ledger.values())

    def ack(self, holding_ids: list[str]) -> int:
        """Forget lines a warehouse now holds; how many were forgotten."""
        with self._lock:
            forgotten = sum(self.ledger.pop(h, None) is not None for h in holding_ids)
        self._journal()
        return forgotten

    # ---- internals -----------------------------------------------------------------------
    def _ready(self) -> list[PooledWorker]:
        """The prewarmed workers (timings and node read once; each one's prewarm measured for
        its model's hold rule); a failed one is dropped."""
        failed = probe(self.entries, "cluster pool")
        self._drop(lambda e: any(e is f for f in failed), "failed")
        for e in self.entries:
            if e.timings is not None and not e.measured:
                e.measured = True
                _add_newest(self.prewarm_s, e.model, max(e.timings.ready_at - e.requested_at, 0.0))
        return [e for e in self.entries if e.timings is not None]

    def _drop(self, which, reason: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        for e in [e for e in self.entries if which(e)]:
            self.entries.remove(e)
            stop(e)
            sharing = self.sharing.get(e.model) if e.rule == SHARED else None
            if sharing is not None:  # held for the model's training runs: each gets its part
                self._account(e, sharing, now, used=False)
            else:
                self.ledger[e.holding_id] = _worker_line(e, now, reason)

    def _drop_model(self, model: str, reason: str, now: float) -> None:
        """Release everything held for `model`'s next run (its workers and keepers; not the
        spares its training runs share)."""
        self._drop(lambda e: e.model == model and e.rule != SHARED, reason, now)
        self._drop_keepers(lambda k: k.model == model, reason, now)

    def _drop_keepers(self, which, reason: str, now: float | None = None) -> int:
        import ray

        now = time.time() if now is None else now
        gone = [k for k in self.keepers if which(k)]
        for k in gone:
            self.keepers.remove(k)
            with contextlib.suppress(Exception):
                ray.kill(k.actor, no_restart=True)
            self.ledger[k.holding_id] = _keeper_line(k, now, reason)
        return len(gone)

    def _reap_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                due = min((p.at for p in self.planned.values()), default=None)
            wait = self.policy.reap_every_s if due is None else min(self.policy.reap_every_s,
                                                                     max(due - time.time(), 0.0))
            self._wake.wait(wait)
            self._wake.clear()
            if self._stop.is_set():
                return
            self.start_planned(time.time())
            self.reap(time.time())
            if (self.given or self.sharing) and time.time() - self._orphans_checked > ORPHANS_EVERY_S:
                self._orphans_checked = time.time()
                self.reap_orphans()
            self._journal()  # the beat: a death loses at most one tick of held time to the ledger

    def start_planned(self, now: float) -> int:
        """Start the planned fills that are due; how many workers started."""
        with self._lock:
            due = [m for m, p in self.planned.items() if p.at <= now]
            started = 0
            for model in due:
                plan = self.planned.pop(model)
                started += self._fill_now(plan.config, plan.count, plan.spool_root, plan.actor_cls, plan.stage)
        if due:
            log.info("cluster pool: prewarming %d worker(s) for the next scheduled run of %s", started, ", ".join(due))
        return started

    def reap(self, now: float) -> int:
        """Release what nobody took while its model's hold lasted (`HoldDecision.expired`: the
        keep-alive after it was ready, or the scheduled run's time and margin); a keeper goes
        with its model's last worker. How many were released."""
        with self._lock:
            self._ready()
            old = [e for e in self.entries if e.rule != SHARED and (hold := self.holds.get(e.model)) is not None
                   and hold.expired(now, ready_at=e.timings.ready_at if e.timings is not None else None)]
            self._drop(lambda e: any(e is o for o in old), "expired", now)
            models = {e.model for e in self.entries}
            stale = self._drop_keepers(lambda k: k.model not in models, "expired", now)
        if old or stale:
            log.info("cluster pool: released %d worker(s) and %d keeper(s) nobody took while their hold lasted",
                     len(old), stale)
        return len(old) + stale


def _worker_line(e: PooledWorker, now: float, reason: str) -> Holding:
    """The ledger line of a pooled worker nobody took, released at `now` for `reason`."""
    return Holding(holding_id=e.holding_id, model=e.model, kind=UNCLAIMED_WORKER, run_id=None, used=False,
                   requested_at=e.requested_at, released_at=max(now, e.requested_at), reason=reason,
                   gpus=e.gpus, cpus=e.cpus, memory_bytes=e.rss_bytes, rule=e.rule)


def _shared_line(h: SharedHold, run_id: str, *, model: str, reason: str) -> Holding:
    """The ledger line of a run's part of a shared spare, when the run cannot record it (its
    process died, or did not ask for it)."""
    return Holding(holding_id=f"{h.holding_id}:{run_id}:{h.start:.6f}", model=model, kind=SPARE, run_id=run_id,
                   used=h.used, requested_at=h.start, released_at=h.end, reason=reason, slots=h.slots,
                   gpus=h.gpus, cpus=h.cpus, rule=SHARED)


def _keeper_line(k: _Keeper, now: float, reason: str) -> Holding:
    return Holding(holding_id=k.holding_id, model=k.model, kind=UNCLAIMED_KEEPER, run_id=None, used=False,
                   requested_at=k.requested_at, released_at=max(now, k.requested_at), reason=reason, slots=0.0)


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def drain_ledger(pool: PoolHandle, write: Callable[[list[Holding]], Any], timeout_s: float = 10.0) -> int:
    """Move the pool's unacknowledged ledger lines into a warehouse (`write` them, then `ack`
    them: a writer that fails leaves them in the pool for the next try); how many moved."""
    import ray

    lines = ray.get(pool.drain.remote(), timeout=timeout_s)
    if not lines:
        return 0
    write(lines)
    ray.get(pool.ack.remote([h.holding_id for h in lines]), timeout=timeout_s)
    return len(lines)


def service(*, create: bool = True, policy: PoolPolicy = PoolPolicy(), journal: str | None = None) -> PoolHandle | None:
    """The cluster's pool actor (started when `create` and there is none), or None. `journal`:
    the file a service started here keeps what it holds in (`pool_journal.py`)."""
    import ray

    try:
        return ray.get_actor(NAME, namespace=NAMESPACE)
    except ValueError:
        if not create:
            return None
    return ray.remote(PoolService).options(
        name=NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0, max_restarts=0,
        max_concurrency=8).remote(policy, journal=journal)
